"""verifiers environments through asyncgrpo's environment interface, with a scripted policy
(the real-vLLM run is in tests/run/test_training_multiturn.py): every turn's prompt is the previous
turn's ids plus the environment's new messages, never the conversation re-rendered; the rubric
scores the group; configuration mistakes are one-line errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncgrpo.config.rollout import GenerationConfig, RolloutConfig
from asyncgrpo.errors import ConfigError
from asyncgrpo.rollout.dataset import Prompt, encode_prompt, load_tokenizer
from asyncgrpo.rollout.environment import ChatContinuation, load_environment
from asyncgrpo.rollout.policy import Turn
from asyncgrpo.rollout.verifiers_env import VerifiersEnv, parse_tool_calls
from asyncgrpo.testing.envs import calculator_tasks

VF = "asyncgrpo.testing.vf_calculator"


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return load_tokenizer(tiny_model)


class Scripted:
    """A policy that says the given texts in turn (as token ids ending in the end-of-turn
    token), echoing each prompt as vLLM does."""

    model = "tiny-v0"

    def __init__(self, tokenizer: Any, texts: list[str]) -> None:
        self.tokenizer, self.texts = tokenizer, texts
        self.prompts: list[list[int]] = []
        self.sessions: set[str | None] = set()

    async def complete(
        self, prompt_ids: Any, *, session: str | None = None, **_: Any
    ) -> list[Turn]:
        text = self.texts[len(self.prompts) % len(self.texts)]
        self.prompts.append(list(prompt_ids))
        self.sessions.add(session)
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        return [Turn(list(prompt_ids), ids, [-0.5] * len(ids), 7, text, "stop")]


def task(row: dict[str, Any]) -> Prompt:
    extra = {k: v for k, v in row.items() if k != "prompt"}
    return Prompt(index=3, epoch=0, prompt=row["prompt"], prompt_ids=[0], extra=extra)


def env(tokenizer: Any, **args: Any) -> VerifiersEnv:
    gen = GenerationConfig(num_generations=2, max_completion_length=16)
    made = load_environment(
        {"verifiers": VF, "args": args},
        {"max_episode_tokens": 400},
        tokenizer=tokenizer,
        generation=gen,
    )
    assert isinstance(made, VerifiersEnv)
    return made


def test_parse_tool_calls() -> None:
    call = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    text = f"x <tool_call>\n{call}\n</tool_call> <tool_call>no</tool_call>"
    function = {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert parse_tool_calls(text) == [{"id": "call_0", "type": "function", "function": function}]
    assert parse_tool_calls("add 1 2") == []


def test_a_multi_turn_episode_is_token_exact_and_scored_by_the_rubric(tokenizer: Any) -> None:
    row = calculator_tasks(1, seed=5)[0]
    vf_env = env(tokenizer, kind="multi", max_turns=3)
    policy = Scripted(tokenizer, ["cat", "1 2", row["answer"]])
    episodes = anyio.run(vf_env.group, task(row), policy, 2)

    assert len(episodes) == 2 and len(policy.prompts) == 6
    ep = episodes[0]
    assert ep.prompt_ids == encode_prompt(tokenizer, row["prompt"]) and ep.model_turns == 3
    # each turn's prompt is exactly the previous one's plus the model's ids plus the user's text
    chat = ChatContinuation(tokenizer)
    again = [{"role": "user", "content": "say the sum again, digits only"}]
    ids = list(ep.prompt_ids)
    for k, text in enumerate(["cat", "1 2", row["answer"]]):
        assert ids in policy.prompts
        said = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
        ids += said
        if k < 2:
            ids += chat.ids(again, after=Turn([], said, [], 7, text, "stop"))
    assert ep.prompt_ids + ep.completion_ids == ids
    assert ep.completion_mask is not None and ep.versions is not None
    assert sum(ep.completion_mask) == sum(1 for lp in ep.logprobs if lp == -0.5)
    assert set(ep.versions) == {7}
    assert ep.reward == pytest.approx(1.0 + 0.5)  # the sum, all digits
    assert [m["role"] for m in ep.completion] == ["assistant", "user"] * 2 + ["assistant"]
    assert len(policy.sessions) == 1  # one X-Session-ID for the group's turns


def test_a_tool_call_runs_the_tool_and_its_result_is_environment_tokens(tokenizer: Any) -> None:
    row = calculator_tasks(1, seed=6)[0]
    a, b = row["a"], row["b"]
    call = f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
    policy = Scripted(tokenizer, [call, f"it is {a + b}"])
    (ep,) = anyio.run(env(tokenizer, kind="tool").group, task(row), policy, 1)
    assert ep.model_turns == 2
    assert ep.completion[1] == {"role": "tool", "content": str(a + b), "tool_call_id": "call_0"}
    assert ep.completion[0]["tool_calls"][0]["function"]["name"] == "add"
    env_text = tokenizer.decode(
        [t for t, m in zip(ep.completion_ids, ep.completion_mask or [], strict=True) if not m]
    )
    assert str(a + b) in env_text
    assert ep.reward is not None and ep.reward > 1.0
    assert "add" in tokenizer.decode(ep.prompt_ids)  # the tool is in the first prompt


def test_configuration_mistakes_are_one_line_errors(tokenizer: Any) -> None:
    gen = GenerationConfig(num_generations=2)
    cases = [
        ({"verifiers": "no-such-env-x"}, "no_such_env_x.*is not installed"),
        ({"verifiers": VF, "args": {"kind": "chess"}}, "kind='chess'"),
        ({"verifiers": VF, "args": {"colour": 1}}, "colour"),
    ]
    for path, match in cases:
        with pytest.raises(ConfigError, match=match):
            load_environment(path, None, tokenizer=tokenizer, generation=gen)
    with pytest.raises(ConfigError, match="is a verifiers class"):
        load_environment("verifiers.envs:SingleTurnEnv", None, tokenizer=tokenizer, generation=gen)
    for bad in ({"verifier": VF}, {"verifiers": 3}, {"verifiers": VF, "args": [1]}):
        with pytest.raises(ConfigError, match=r"\{verifiers: NAME"):
            RolloutConfig(environment=bad)


def test_an_environment_that_rewrites_history_is_refused(tokenizer: Any) -> None:
    """A later turn whose conversation differs from what the model saw cannot be continued
    token-exactly: the run stops naming the environment, it is not trained on."""
    import verifiers as vf

    class Rewriting(vf.MultiTurnEnv):
        async def env_response(self, messages: Any, state: Any, **_: Any) -> Any:
            messages[-1]["content"] = "something the model did not say"
            return [{"role": "user", "content": "again"}]

    vf_env = env(tokenizer, kind="multi")
    vf_env.env = Rewriting(dataset=vf_env.env.dataset, rubric=vf_env.env.rubric, max_turns=3)
    policy = Scripted(tokenizer, ["12"])
    with pytest.raises(ExceptionGroup) as info:  # from the group's task group
        anyio.run(vf_env.group, task(calculator_tasks(1)[0]), policy, 1)
    assert info.group_contains(ConfigError, match="changed earlier messages")
    assert len(policy.prompts) == 1
