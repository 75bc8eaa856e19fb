"""verifiers 0.4 (``verifiers.v1``) environments: loading by taskset id, and what asyncgrpo
cannot run refused up front with one line. Needs verifiers 0.4 installed (a venv of its own:
docs/environments.md, "verifiers 0.4"); skipped beside verifiers 0.1.10."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verifiers.v1")

from asyncgrpo.errors import ConfigError
from asyncgrpo.rollout.config import GenerationConfig
from asyncgrpo.rollout.dataset import Prompt, load_tokenizer
from asyncgrpo.rollout.environment import load_environment
from asyncgrpo.testing.envs import calculator_tasks

PACKAGE = Path(__file__).resolve().parents[2] / "examples" / "envs" / "vf_v1_calculator"
LOCAL = {"agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}}


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    sys.path.insert(0, str(PACKAGE))  # as `pip install -e` of the package would
    return load_tokenizer(tiny_model)


def load(tokenizer: Any, args: dict[str, Any]) -> Any:
    gen = GenerationConfig(num_generations=2, max_completion_length=8)
    return load_environment({"verifiers": "vf-v1-calculator", "args": args},
                            {"max_episode_tokens": 400}, tokenizer=tokenizer, generation=gen)  # fmt: skip


def test_a_local_v1_environment_loads_and_its_rows_become_tasks(tokenizer: Any) -> None:
    from asyncgrpo.rollout.verifiers_v1_env import VerifiersV1Env

    env = load(tokenizer, LOCAL)
    assert isinstance(env, VerifiersV1Env)
    row = calculator_tasks(1, seed=3)[0]
    extra = {k: v for k, v in row.items() if k != "prompt"}
    task = env.task(Prompt(index=5, epoch=0, prompt=row["prompt"], prompt_ids=[0], extra=extra))
    assert task.data.answer == row["answer"] and task.data.idx == 5


def test_sandboxes_and_container_harnesses_are_refused_in_one_line(tokenizer: Any) -> None:
    cases = [
        ({}, r"'prime' runtime \(a sandbox\).*runtime.type: subprocess"),
        ({"agent": {"runtime": {"type": "docker"}}}, r"'docker' runtime"),
        ({"agent": {"harness": {"id": "codex"}, "runtime": {"type": "subprocess"}}},
         r"harness 'codex' needs a container"),
        ({"agent": {"colour": 1}}, r"ValidationError"),
    ]  # fmt: skip
    for args, match in cases:
        with pytest.raises(ConfigError, match=match) as info:
            load(tokenizer, args)
        assert "\n" not in str(info.value)
