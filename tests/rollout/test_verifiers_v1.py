"""verifiers 0.4 (``verifiers.v1``) environments with a scripted policy (the real-vLLM run is
in tests/run/test_training_v1.py): verifiers' own harness program, interception server and MCP
tool server play the episode; every turn's prompt is the previous turn's ids plus the model's
plus the new messages rendered once; the task's rewards score it; an environment that raises,
hangs or misbehaves costs its group (EpisodeError); what asyncgrpo cannot run is refused up
front with one line. Needs verifiers 0.4 installed (a venv of its own:
docs/environments.md, "verifiers 0.4"); skipped beside verifiers 0.1.10."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip(
    "verifiers.v1", reason="verifiers 0.4 is not here: these tests run under make test-vf4"
)

from asyncgrpo.config.rollout import GenerationConfig
from asyncgrpo.errors import ConfigError, EpisodeError
from asyncgrpo.rollout.dataset import Prompt, encode_prompt, load_tokenizer
from asyncgrpo.rollout.environment import ChatContinuation, load_environment
from asyncgrpo.rollout.policy import Turn
from asyncgrpo.testing.envs import calculator_tasks

PACKAGE = Path(__file__).resolve().parents[2] / "examples" / "envs" / "vf_v1_calculator"
DIGITS = PACKAGE.parent / "vf_v1_digits"
LOCAL = {"agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}}
HERE = {"agent": {"harness": {"id": "asyncgrpo-chat"}, "runtime": {"type": "subprocess"}}}


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    importable(PACKAGE)
    return load_tokenizer(tiny_model)


def importable(directory: Path) -> None:
    """Modules in ``directory`` importable here and in the tool servers verifiers starts
    (``python -m MODULE``), as ``pip install -e`` of the package would make them."""
    sys.path.insert(0, str(directory))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(directory), os.environ.get("PYTHONPATH")) if p
    )


def load(tokenizer: Any, args: dict[str, Any], name: str = "vf-v1-calculator", **ours: Any) -> Any:
    gen = GenerationConfig(num_generations=2, max_completion_length=8)
    return load_environment(
        {"verifiers": name, "args": args},
        {"max_episode_tokens": 400, **ours},
        tokenizer=tokenizer,
        generation=gen,
    )


class Scripted:
    """Says the given texts in turn (token ids ending in the end-of-turn token), echoing each
    prompt as vLLM does; one script per episode, told apart by the prompt's first turn."""

    model = "tiny-v0"

    def __init__(self, tokenizer: Any, texts: list[str], delay_s: float = 0.0) -> None:
        self.tokenizer, self.texts, self.delay_s = tokenizer, texts, delay_s
        self.prompts: list[list[int]] = []
        self.sessions: set[str | None] = set()
        self.turn_of: dict[int, int] = {}

    async def complete(self, prompt_ids: Any, *, session: str | None = None, **_: Any) -> list:
        await anyio.sleep(self.delay_s)
        ids = list(prompt_ids)
        # the turns before: the distinct earlier prompts this one extends
        k = len({tuple(p) for p in self.prompts if len(p) < len(ids) and ids[: len(p)] == p})
        self.prompts.append(ids)
        self.sessions.add(session)
        text = self.texts[min(k, len(self.texts) - 1)]
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        return [Turn(list(prompt_ids), ids, [-0.5] * len(ids), 7, text, "stop")]


def task_of(row: dict[str, Any]) -> Prompt:
    extra = {k: v for k, v in row.items() if k != "prompt"}
    return Prompt(index=3, epoch=0, prompt=row["prompt"], prompt_ids=[0], extra=extra)


async def play(env: Any, task: Prompt, policy: Scripted, g: int) -> list:
    async with env.running():
        return await env.group(task, policy, g)


@pytest.mark.parametrize("args", [LOCAL, HERE], ids=["null-program", "asyncgrpo-chat"])
def test_a_tool_episode_is_token_exact_and_scored_by_the_task(
    tokenizer: Any, args: dict[str, Any]
) -> None:
    """verifiers' null harness as its program per episode, and the same chat loop played in
    process (asyncgrpo-chat): the same turns, tokens and rewards."""
    row = calculator_tasks(1, seed=6)[0]
    a, b = row["a"], row["b"]
    call = f'<tool_call>\n{{"name": "calculator_tools_add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
    policy = Scripted(tokenizer, [call, f"it is {a + b}"])
    env = load(tokenizer, args)
    episodes = anyio.run(play, env, task_of(row), policy, 2)

    assert len(episodes) == 2 and len(policy.prompts) == 4
    chat = ChatContinuation(tokenizer)
    for ep in episodes:
        assert ep.prompt_ids == encode_prompt(tokenizer, row["prompt"]) and ep.model_turns == 2
        said = [*tokenizer.encode(call, add_special_tokens=False), tokenizer.eos_token_id]
        result = [{"role": "tool", "content": str(a + b), "tool_call_id": "call_0"}]
        tool_ids = chat.ids(result, after=Turn([], said, [], 7, call, "stop"))
        second = ep.prompt_ids + said + tool_ids
        assert second in policy.prompts  # turn 2 = turn 1 + the model's ids + the tool's, once
        last = [
            *tokenizer.encode(f"it is {a + b}", add_special_tokens=False),
            tokenizer.eos_token_id,
        ]
        assert ep.prompt_ids + ep.completion_ids == second + last
        assert ep.completion_mask == [True] * len(said) + [False] * len(tool_ids) + [True] * len(
            last
        )
        assert ep.reward == pytest.approx({"correct_sum": 1.0, "digits": 0.5 * 2 / 6})
        assert ep.completion[1]["content"] == str(a + b)  # the MCP tool server's answer
    assert len(policy.sessions) == 1  # one X-Session-ID for the group's turns


def test_a_single_turn_episode_is_one_model_call_scored_by_the_rubric(tokenizer: Any) -> None:
    """The demo's digits task as a v1 taskset (examples/envs/vf_v1_digits) under the in-process
    harness: one model call on the prompt rendered once, the reward digit_fraction of the reply;
    a group of 8 takes well under a second here (a program per episode: seconds each)."""
    from asyncgrpo.testing.rewards import digit_fraction

    importable(DIGITS)
    policy = Scripted(tokenizer, ["12 ab 34"])
    env = load(tokenizer, HERE, name="vf-v1-digits")
    task = Prompt(index=0, epoch=0, prompt="pick a number", prompt_ids=[0], extra={})
    episodes = anyio.run(play, env, task, policy, 8)

    assert len(episodes) == 8 and len(policy.prompts) == 8
    prompt = encode_prompt(tokenizer, [{"role": "user", "content": "pick a number"}])
    said = [*tokenizer.encode("12 ab 34", add_special_tokens=False), tokenizer.eos_token_id]
    for ep in episodes:
        assert ep.prompt_ids == prompt and ep.completion_ids == said and ep.model_turns == 1
        assert ep.completion_mask == [True] * len(said)
        assert ep.reward == pytest.approx({"digits": digit_fraction([None], ["12 ab 34"])[0]})


BROKEN = """
import asyncio
from collections.abc import Iterable

import verifiers.v1 as vf

__all__ = ["BrokenTaskset"]


class Data(vf.TaskData):
    mode: str = ""


class Tools(vf.Toolset[vf.ToolsetConfig, vf.State]):
    @vf.tool
    async def wait(self) -> str:
        \"\"\"Wait a long time.\"\"\"
        await asyncio.sleep(600)
        return "done"


class BrokenTask(vf.Task[Data, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [Tools(vf.ToolsetConfig())]

    @vf.reward
    async def judged(self, task: Data) -> float:
        if task.mode == "raise":
            raise RuntimeError("the judge is down")
        return 1.0


class BrokenTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
    def load(self) -> Iterable[BrokenTask]:
        yield BrokenTask(Data(prompt="hi"), self.config.task)


if __name__ == "__main__":
    Tools.run()
"""


@pytest.mark.parametrize("args", [LOCAL, HERE], ids=["null-program", "asyncgrpo-chat"])
def test_an_environment_that_raises_or_hangs_costs_its_group(
    tokenizer: Any, tmp_path: Path, args: dict[str, Any]
) -> None:
    (tmp_path / "vf_broken_env.py").write_text(textwrap.dedent(BROKEN))
    importable(tmp_path)
    row = {"prompt": [{"role": "user", "content": "hi"}], "mode": "raise"}
    env = load(tokenizer, args, name="vf-broken-env", episode_timeout_s=20)
    with pytest.raises(EpisodeError, match="the judge is down"):
        anyio.run(play, env, task_of(row), Scripted(tokenizer, ["ok"]), 2)

    hang = '<tool_call>{"name": "tools_wait", "arguments": {}}</tool_call>'
    env = load(tokenizer, args, name="vf-broken-env", episode_timeout_s=3)
    row["mode"] = "hang"
    with pytest.raises(EpisodeError, match="ran past episode_timeout_s=3"):
        anyio.run(play, env, task_of(row), Scripted(tokenizer, [hang]), 2)


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
        (
            {"agent": {"harness": {"id": "codex"}, "runtime": {"type": "subprocess"}}},
            r"harness 'codex' needs a container",
        ),
        ({"agent": {"colour": 1}}, r"ValidationError"),
    ]
    for args, match in cases:
        with pytest.raises(ConfigError, match=match) as info:
            load(tokenizer, args)
        assert "\n" not in str(info.value)
