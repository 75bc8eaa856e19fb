"""A verifiers 0.4 environment in a process and venv of its own (rollout.environment.python),
played from the trainer's venv, which cannot hold it (it holds verifiers 0.1.10; the package
the test builds declares verifiers>=0.4): verifiers' harness, interception server and MCP tool
server run there; every model call comes here and is answered token-exactly; the episode's
rewards come back; an environment that raises or hangs costs its group.

Needs the verifiers 0.4 venv (``make install-vf4``: .venv-vf4, or ASYNCGRPO_VF4_PYTHON)."""

from __future__ import annotations

import os
import signal
import textwrap
from importlib.metadata import version
from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncgrpo.config.rollout import GenerationConfig
from asyncgrpo.errors import ConfigError, EpisodeError
from asyncgrpo.rollout.dataset import Prompt, encode_prompt, load_tokenizer
from asyncgrpo.rollout.environment import ChatContinuation, load_environment
from asyncgrpo.rollout.policy import Turn
from asyncgrpo.rollout.verifiers_remote import RemoteV1Env
from asyncgrpo.testing.envs import calculator_tasks

ROOT = Path(__file__).resolve().parents[2]
PYTHON = os.environ.get("ASYNCGRPO_VF4_PYTHON") or str(ROOT / ".venv-vf4" / "bin" / "python")
LOCAL = {"agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}}
HERE = {"agent": {"harness": {"id": "asyncgrpo-chat"}, "runtime": {"type": "subprocess"}}}

pytestmark = pytest.mark.skipif(
    not os.access(PYTHON, os.X_OK), reason=f"no verifiers 0.4 venv at {PYTHON} (make install-vf4)"
)

PACKAGE = """
[project]
name = "vf-remote-calculator"
version = "0.1.0"
dependencies = ["verifiers>=0.4,<0.5"]
"""


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return load_tokenizer(tiny_model)


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local environment package the trainer's venv cannot hold, importable in the
    environment process (and the tool servers it starts) through PYTHONPATH."""
    root = tmp_path_factory.mktemp("vf-remote")
    (root / "pyproject.toml").write_text(PACKAGE)
    source = ROOT / "examples" / "envs" / "vf_v1_calculator" / "vf_v1_calculator.py"
    (root / "vf_remote_calculator.py").write_text(source.read_text())
    (root / "vf_remote_broken.py").write_text(textwrap.dedent(BROKEN))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(root), os.environ.get("PYTHONPATH")) if p
    )
    return root


def remote(tokenizer: Any, name: str, args: dict[str, Any], **ours: Any) -> RemoteV1Env:
    gen = GenerationConfig(num_generations=2, max_completion_length=8)
    env = load_environment(
        {"verifiers": name, "args": args, "python": PYTHON},
        {"max_episode_tokens": 400, **ours},
        tokenizer=tokenizer,
        generation=gen,
    )
    assert isinstance(env, RemoteV1Env)
    return env


class Scripted:
    """Says the given texts in turn, echoing each prompt as vLLM does."""

    model = "tiny-v0"

    def __init__(self, tokenizer: Any, texts: list[str]) -> None:
        self.tokenizer, self.texts = tokenizer, texts
        self.prompts: list[list[int]] = []

    async def complete(self, prompt_ids: Any, **_: Any) -> list[Turn]:
        ids = list(prompt_ids)
        k = len({tuple(p) for p in self.prompts if len(p) < len(ids) and ids[: len(p)] == p})
        self.prompts.append(ids)
        text = self.texts[min(k, len(self.texts) - 1)]
        said = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        return [Turn(ids, said, [-0.5] * len(said), 7, text, "stop")]


async def play(env: RemoteV1Env, row: dict[str, Any], policy: Scripted, g: int) -> list:
    extra = {k: v for k, v in row.items() if k != "prompt"}
    task = Prompt(index=3, epoch=0, prompt=row["prompt"], prompt_ids=[0], extra=extra)
    async with env.running():
        return await env.group(task, policy, g)


def test_the_trainers_venv_cannot_hold_the_package() -> None:
    assert int(version("verifiers").split(".")[1]) < 4, "this venv has verifiers 0.4 itself"


@pytest.mark.parametrize("args", [LOCAL, HERE], ids=["null-program", "asyncgrpo-chat"])
def test_a_tool_episode_from_its_own_venv_is_token_exact(
    tokenizer: Any, package: Path, args: dict[str, Any]
) -> None:
    row = calculator_tasks(1, seed=6)[0]
    a, b = row["a"], row["b"]
    call = f'<tool_call>{{"name": "calculator_tools_add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'
    policy = Scripted(tokenizer, [call, f"it is {a + b}"])
    env = remote(tokenizer, "vf-remote-calculator", args)
    episodes = anyio.run(play, env, row, policy, 2)
    assert len(episodes) == 2 and len(policy.prompts) == 4
    said = [*tokenizer.encode(call, add_special_tokens=False), tokenizer.eos_token_id]
    result = [{"role": "tool", "content": str(a + b), "tool_call_id": "call_0"}]
    tool_ids = ChatContinuation(tokenizer).ids(result, after=Turn([], said, [], 7, call, "stop"))
    for ep in episodes:
        assert ep.prompt_ids == encode_prompt(tokenizer, row["prompt"]) and ep.model_turns == 2
        assert ep.prompt_ids + said + tool_ids in policy.prompts
        assert sum(ep.completion_mask or []) == len(said) + len(ep.completion_ids) - len(
            said
        ) - len(tool_ids)
        assert ep.reward == pytest.approx({"correct_sum": 1.0, "digits": 0.5 * 2 / 6})


BROKEN = '''
import asyncio
from collections.abc import Iterable

import verifiers.v1 as vf

__all__ = ["BrokenTaskset"]


class Data(vf.TaskData):
    mode: str = ""


class Tools(vf.Toolset[vf.ToolsetConfig, vf.State]):
    @vf.tool
    async def wait(self) -> str:
        """Wait a long time."""
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
'''


def test_a_remote_environment_that_raises_or_hangs_costs_its_group(
    tokenizer: Any, package: Path
) -> None:
    row = {"prompt": [{"role": "user", "content": "hi"}], "mode": "raise"}
    env = remote(tokenizer, "vf-remote-broken", LOCAL, episode_timeout_s=20)
    with pytest.raises(EpisodeError, match="the judge is down"):
        anyio.run(play, env, row, Scripted(tokenizer, ["ok"]), 2)
    hang = '<tool_call>{"name": "tools_wait", "arguments": {}}</tool_call>'
    env = remote(tokenizer, "vf-remote-broken", LOCAL, episode_timeout_s=3)
    with pytest.raises(EpisodeError, match="ran past episode_timeout_s=3"):
        anyio.run(play, env, {**row, "mode": "hang"}, Scripted(tokenizer, [hang]), 2)


def test_refusals_and_load_errors_come_back_as_one_line(tokenizer: Any, package: Path) -> None:
    for args, match in [({}, r"'prime' runtime \(a sandbox\)"), (LOCAL, "not found")]:
        name = "vf-remote-calculator" if args == {} else "vf-no-such-env"
        with pytest.raises(ConfigError, match=match) as info:
            anyio.run(
                play,
                remote(tokenizer, name, args),
                calculator_tasks(1)[0],
                Scripted(tokenizer, ["x"]),
                1,
            )
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="not an executable file"):
        load_environment(
            {"verifiers": "x", "python": "/no/such/python"},
            None,
            tokenizer=tokenizer,
            generation=GenerationConfig(),
        )


def test_an_environment_process_that_dies_stops_the_run(tokenizer: Any, package: Path) -> None:
    from asyncgrpo.errors import LaunchError

    env = remote(tokenizer, "vf-remote-calculator", LOCAL)
    row = calculator_tasks(1)[0]
    extra = {k: v for k, v in row.items() if k != "prompt"}
    task = Prompt(index=0, epoch=0, prompt=row["prompt"], prompt_ids=[0], extra=extra)

    async def main() -> None:
        async with env.running():
            assert env._process is not None
            os.killpg(env._process.pid, signal.SIGKILL)  # the process this test started
            await env._process.wait()
            await anyio.sleep(0.2)  # its stdout closes; the reader notices
            await env.group(task, Scripted(tokenizer, ["x"]), 2)

    with pytest.raises(ExceptionGroup) as info:  # from the group's task group
        anyio.run(main)
    assert info.group_contains(LaunchError, match=r"environment process exited \(status -9\)")
