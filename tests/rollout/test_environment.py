"""Environments' pure parts: the episode builder, the chat continuation, loading, rewards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncgrpo.config.rollout import GenerationConfig
from asyncgrpo.errors import ConfigError, ReplicaError
from asyncgrpo.rollout.dataset import Prompt, load_tokenizer
from asyncgrpo.rollout.environment import (
    ChatContinuation,
    SingleTurnEnv,
    Trajectory,
    combine_reward,
    load_environment,
)
from asyncgrpo.rollout.policy import Turn
from asyncgrpo.testing.envs import CalculatorEnv, calculator_tasks


def turn(prompt: list[int], ids: list[int], version: int, lp: float = -1.0) -> Turn:
    return Turn(prompt, ids, [lp] * len(ids), version, "t", "stop")


def test_trajectory_masks_versions_and_logprobs_align() -> None:
    traj = Trajectory([1, 2])
    traj.add_turn(turn([1, 2], [10, 11], version=3, lp=-0.5))
    traj.add_env([20, 21, 22])
    traj.add_turn(turn([1, 2, 10, 11, 20, 21, 22], [12], version=4, lp=-0.25))
    e = traj.episode("text")
    assert e.prompt_ids == [1, 2]
    assert e.completion_ids == [10, 11, 20, 21, 22, 12]
    assert e.completion_mask == [True, True, False, False, False, True]
    assert e.logprobs == [-0.5, -0.5, 0.0, 0.0, 0.0, -0.25]
    assert e.versions == [3, 3, 3, 3, 3, 4]
    assert (e.version, e.model_turns) == (3, 2)


def test_trajectory_refuses_a_turn_for_other_prompt_ids() -> None:
    traj = Trajectory([1, 2])
    traj.add_turn(turn([1, 2], [10], version=0))
    traj.add_env([20])
    with pytest.raises(ReplicaError, match="differs from the 4 sent"):
        traj.add_turn(turn([1, 2, 10, 21], [11], version=0))  # the server re-tokenised


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return load_tokenizer(tiny_model)


def test_chat_continuation_follows_the_template(tokenizer: Any) -> None:
    chat = ChatContinuation(tokenizer)
    msg = [{"role": "tool", "content": "42"}]
    after_eos = chat.text(msg, ended_with="<|im_end|>")
    assert after_eos == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    # A turn cut by max_tokens has no end-of-turn token yet: the continuation closes it.
    assert chat.text(msg).startswith("<|im_end|>\n<|im_start|>tool")
    eos = tokenizer.eos_token_id
    ids = chat.ids(msg, after=turn([1], [5, eos], 0))
    assert tokenizer.decode(ids) == after_eos
    assert chat.ids(msg, after=turn([1], [5, 6], 0))[0] == eos
    cut = Turn([1], [5, eos], [-1.0, -1.0], 0, "t", "length")  # ended by max_tokens
    assert chat.ids(msg, after=cut)[0] == eos


def test_chat_continuation_refuses_a_template_that_rewrites_history(tokenizer: Any) -> None:
    class Rewriting:
        chat_template = "x"
        eos_token_id, eos_token = 0, "<e>"

        def apply_chat_template(self, messages: Any, **kw: Any) -> str:
            return f"{len(messages)}:" + "".join(m["content"] for m in messages)

    with pytest.raises(ConfigError, match="not append-only"):
        ChatContinuation(Rewriting()).text([{"role": "user", "content": "a"}])

    class NoTemplate:
        chat_template = None

    with pytest.raises(ConfigError, match=r"no chat template|has none"):
        ChatContinuation(NoTemplate())


def test_load_environment(tokenizer: Any) -> None:
    gen = GenerationConfig(num_generations=2)
    assert isinstance(load_environment(None, None, tokenizer=None, generation=gen), SingleTurnEnv)
    env = load_environment(
        "asyncgrpo.testing.envs:CalculatorEnv",
        {"max_turns": 2},
        tokenizer=tokenizer,
        generation=gen,
    )
    assert isinstance(env, CalculatorEnv) and env.max_turns == 2
    cases = [
        (None, {"max_turns": 2}, "without rollout.environment"),
        ("no_such_module_x:Env", None, "cannot import"),
        ("asyncgrpo.testing.envs:Nope", None, "no attribute"),
        ("asyncgrpo.testing.envs:calculator_tasks", None, "not an asyncgrpo Environment"),
        ("asyncgrpo.testing.envs:CalculatorEnv", {"max_turnz": 2}, "max_turnz"),
        ("asyncgrpo.testing.envs:CalculatorEnv", {"max_turns": 0}, "max_turns=0"),
    ]
    for path, args, match in cases:
        with pytest.raises(ConfigError, match=match):
            load_environment(path, args, tokenizer=tokenizer, generation=gen)


def test_combine_reward() -> None:
    assert combine_reward(0.5) == (0.5, {})
    assert combine_reward({"a": 0.5, "b": 0.25}) == (0.75, {"a": 0.5, "b": 0.25})


def test_calculator_env_protocol_and_reward(tokenizer: Any) -> None:
    env = CalculatorEnv(tokenizer=tokenizer, generation=GenerationConfig(num_generations=2))
    row = calculator_tasks(1, seed=3)[0]
    task = Prompt(
        index=0, epoch=0, prompt=row["prompt"], prompt_ids=[1], extra={"a": row["a"], "b": row["b"]}
    )
    total = row["a"] + row["b"]

    async def play(*turns: str) -> tuple[list[Any], Any]:
        state = await env.setup(task)
        messages: list[Any] = []
        replies = []
        for text in turns:
            messages.append({"role": "assistant", "content": text})
            reply = await env.env_response(task, messages, state)
            replies.append(reply)
            messages += reply or []
        return replies, await env.reward(task, messages, state)

    replies, reward = anyio.run(play, "cat dog", "add", f"it is {total}")
    assert replies[0][0]["role"] == "user" and replies[1] == [
        {"role": "tool", "content": str(total)}
    ]
    assert replies[2] is None and reward == {"tool_call": 0.5, "answer": 1.0}
    _, reward = anyio.run(play, "add", "12 x")
    assert reward == {"tool_call": 0.5, "answer": pytest.approx(0.5 * 2 / 3)}
    _, reward = anyio.run(play, "cat", "dog")
    assert reward == {"tool_call": 0.0, "answer": 0.0}
