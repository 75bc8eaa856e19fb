"""The arithmetic test model (``asyncgrpo.testing.arithmetic``): its problems, a reduced build
(the full build's code path, seconds of training) loading in transformers, PEFT and a vLLM
replica, its chat template, and the math reward on its answers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import anyio
import pytest

from asyncgrpo.testing import arithmetic as A
from asyncgrpo.testing.model_cache import DONE

REDUCED = A.REDUCED


@pytest.fixture(scope="module")
def reduced_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache holding the reduced build, made once through the CLI's code path."""
    cache = tmp_path_factory.mktemp("arith-cache")
    A.cached_arithmetic_model(cache, REDUCED, log=lambda _: None)
    return cache


@pytest.fixture(scope="module")
def reduced_model(reduced_cache: Path) -> Path:
    return A.cached_arithmetic_model(reduced_cache, REDUCED, log=lambda _: None)


def test_held_out_problems_never_reach_training() -> None:
    held = A.heldout_rows(40)
    train = A.train_rows(4000)
    assert len(held) == 40 * len(A.LEVELS) and {r["level"] for r in held} == set(A.LEVELS)
    # the computation, whatever the wording: digits and operation of the prompt
    numbers = lambda r: tuple(  # noqa: E731
        "".join(c if c.isdigit() or c in "+-*" else " " for c in r["prompt"][0]["content"]).split()
    )
    assert not {numbers(r) for r in held} & {numbers(r) for r in train}
    swapped = {(b, op, a) for a, op, b in map(numbers, held)}  # 47 + 85 holds out 85 + 47
    assert not swapped & {numbers(r) for r in train}
    assert len({numbers(r) for r in held}) == len(held)  # no problem twice
    rng = A.random.Random(0)
    corpus = A.draw_problems(rng, 5000, held_out=False)
    assert not any(p.held_out for p in corpus)
    assert {p.level for p in corpus} == set(A.LEVELS)
    assert all(p.answer >= 0 for p in corpus)  # no negative differences
    assert A.heldout_rows(40) == held and A.train_rows(4000) == train  # deterministic


def test_the_working_is_right_without_slips_and_consistent_with_them() -> None:
    """Column by column, units first; a slip is one step off by one, and the rest of the
    working (carries, the boxed result) follows from what was written."""
    assert A.worked(A.Problem(47, "+", 85, "add2")) == "7+5+0=12 4+8+1=13 \\boxed{132}"
    assert A.worked(A.Problem(347, "*", 8, "mul3")) == "7*8+0=56 4*8+5=37 3*8+3=27 \\boxed{2776}"
    rng = A.random.Random(0)
    for p in A.draw_problems(rng, 300, held_out=False):
        assert A.final_answer(A.worked(p)) == str(p.answer)
        text = A.worked(p, rng, slip=0.5)
        steps = text.split()[:-1]
        carry, digits = 0, []
        for step in steps:
            x, op, y, c, pair = re.fullmatch(r"(\d)([+*])(\d)\+(\d)=(\d\d)", step).groups()
            assert op == p.op and int(c) == carry  # the carry written before
            exact = int(x) * int(y) + carry if p.op == "*" else int(x) + int(y) + carry
            assert abs(int(pair) - exact) <= 1
            carry, digits = int(pair[0]), [pair[1], *digits]
        assert A.final_answer(text) == str(int(str(carry) + "".join(digits)))


def test_reduced_build_loads_in_transformers_and_peft_with_its_chat_template(
    reduced_model: Path,
) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(reduced_model)
    assert config.model_type == "qwen2" and config.hidden_size // config.num_attention_heads == 64
    tok = AutoTokenizer.from_pretrained(reduced_model)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 47 + 85?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert text == A.chat_prompt("What is 47 + 85?")
    assert text == "<|im_start|>user\nWhat is 47 + 85?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.tokenize("1234") == ["1", "2", "3", "4"]  # a digit is a token
    answer = A.worked(A.Problem(47, "+", 85, "add2"))
    ids = tok(text + answer + tok.eos_token, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text + answer + "<|im_end|>" and max(ids) < config.vocab_size
    model = AutoModelForCausalLM.from_pretrained(reduced_model)
    peft = get_peft_model(model, LoraConfig(r=1, lora_alpha=2, target_modules="all-linear"))
    assert peft.num_parameters(only_trainable=True) > 0
    import torch

    out = peft(input_ids=torch.tensor([ids])).logits
    assert out.shape == (1, len(ids), config.vocab_size) and torch.isfinite(out).all()
    build = json.loads((reduced_model / "build.json").read_text())
    assert build["settings"]["steps"] == REDUCED.steps
    assert 0 <= build["heldout_greedy"]["all"] <= 1 and set(build["heldout_t1"]) >= set(A.LEVELS)
    rows = [json.loads(line) for line in (reduced_model / "heldout.jsonl").read_text().splitlines()]
    assert len(rows) == REDUCED.heldout_per_level * len(A.LEVELS)
    assert all(set(r) == {"prompt", "answer", "level"} for r in rows)


@pytest.mark.anyio
async def test_the_math_reward_scores_right_wrong_and_unparseable_answers() -> None:
    from asyncgrpo.rewards.math import math_reward

    right = A.worked(A.Problem(47, "+", 85, "add2"))
    wrong = "7+5+0=12 4+8+1=14 \\boxed{142}"
    completions = [right, wrong, "7+5+0=12 4+8+1=13 \\boxed{", "7+5+0=12 4+8", "\\boxed{0132}"]
    rewards = await math_reward(["What is 47 + 85?"] * 5, completions, answer=["132"] * 5)
    assert rewards == [1.0, 0.0, 0.0, 0.0, 1.0]


@pytest.mark.vllm
@pytest.mark.anyio
async def test_a_vllm_replica_serves_the_reduced_build_with_a_lora_adapter(
    reduced_model: Path, tmp_path: Path
) -> None:
    """One replica of its own (another model than the shared fleet's): greedy tokens and their
    logprobs under a LoRA adapter equal transformers + PEFT's."""
    from asyncgrpo.serve import launch_replicas
    from asyncgrpo.testing import make_lora_adapter, reference_logprobs, tiny_serve_config
    from asyncgrpo.vllm.client import VLLMClient

    adapter = make_lora_adapter(reduced_model, tmp_path / "adapter", seed=1)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(reduced_model)
    prompt = tok(
        tok.apply_chat_template(
            [{"role": "user", "content": "What is 47 + 85?"}],
            add_generation_prompt=True,
            tokenize=False,
        ),
        add_special_tokens=False,
    )["input_ids"]
    config = tiny_serve_config(
        reduced_model, replicas=1, max_model_len=256, log_dir=str(tmp_path / "logs")
    )
    async with launch_replicas(config) as replicas, VLLMClient(replicas[0].url) as client:
        await client.load_lora_adapter("arith", str(adapter))
        body = await client.completions(
            {
                "model": "arith",
                "prompt": prompt,
                "max_tokens": 12,
                "temperature": 1.0,
                "logprobs": 0,
                "return_token_ids": True,
                "seed": 0,
            }
        )
    choice = body["choices"][0]
    tokens, served = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    assert len(tokens) == len(served) > 0
    ours = await anyio.to_thread.run_sync(
        lambda: reference_logprobs(reduced_model, adapter, prompt, tokens)
    )
    assert max(abs(a - b) for a, b in zip(ours, served, strict=True)) < 1e-4
    base = await anyio.to_thread.run_sync(
        lambda: reference_logprobs(reduced_model, None, prompt, tokens)
    )
    assert max(abs(a - b) for a, b in zip(base, served, strict=True)) > 1e-3  # the adapter served


def test_the_cli_copies_the_checkout_s_cached_build(
    reduced_cache: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``python -m asyncgrpo.testing.arithmetic --reduced DIR``: the build already in the cache
    (the same settings and source) is copied, not made again; DIR is replaced whole."""
    monkeypatch.setenv("ASYNCGRPO_TEST_CACHE", str(reduced_cache))
    out = tmp_path / "model"
    out.mkdir()
    (out / "stale.txt").write_text("from an older build")
    entries = sorted(reduced_cache.iterdir())
    A.main(["--reduced", str(out)])
    printed = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert printed["model"] == str(out) and 0 <= printed["heldout_t1"] <= 1
    assert sorted(reduced_cache.iterdir()) == entries  # nothing built
    (cached,) = (d for d in entries if not d.name.startswith("."))
    assert (out / "model.safetensors").read_bytes() == (cached / "model.safetensors").read_bytes()
    assert not (out / "stale.txt").exists() and not (out / DONE).exists()
