"""Packing: row planning against its invariants, and packed logprobs against one-by-one ones."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from trainer_helpers import make_samples

from asyncgrpo.config.trainer import LoraConfig
from asyncgrpo.trainer.attention import VARLEN_SDPA
from asyncgrpo.trainer.model import load_policy, row_logprobs
from asyncgrpo.trainer.packing import build_row, pack_samples, plan_rows


def test_plan_rows_token_budget_invariants():
    lengths = [7, 3, 9, 1, 4, 4, 10, 2, 6, 5, 8, 3]
    rows = plan_rows(lengths, token_budget=12)
    flat = sorted(i for row in rows for i in row)
    assert flat == list(range(len(lengths)))  # every sample exactly once
    assert all(sum(lengths[i] for i in row) <= 12 for row in rows)
    assert all(row == sorted(row) for row in rows)
    # First-fit decreasing is never worse than ceil(total / budget) + a few; here it is optimal.
    assert len(rows) == math.ceil(sum(lengths) / 12)


def test_plan_rows_matches_naive_first_fit_decreasing():
    import random

    rng = random.Random(1)
    for _ in range(50):
        lengths = [rng.randint(1, 30) for _ in range(rng.randint(1, 40))]
        budget = rng.randint(30, 80)
        # Naive reference: sort by length (ties by index), try every open row in order.
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        ref: list[list[int]] = []
        for i in order:
            placed = False
            for row in ref:
                if sum(lengths[j] for j in row) + lengths[i] <= budget:
                    row.append(i)
                    placed = True
                    break
            if not placed:
                ref.append([i])
        assert plan_rows(lengths, token_budget=budget) == [sorted(r) for r in ref]


def test_plan_rows_oversized_sample_gets_own_row(caplog):
    rows = plan_rows([5, 20, 3], token_budget=10)
    assert [1] in rows
    assert sorted(i for r in rows for i in r) == [0, 1, 2]
    assert "exceeds token_budget" in caplog.text


def test_plan_rows_by_count_and_one_per_row():
    lengths = [5, 1, 4, 2, 3, 6]
    rows = plan_rows(lengths, num_rows=3)
    assert len(rows) == 3
    assert sorted(i for r in rows for i in r) == list(range(6))
    assert sorted(sum(lengths[i] for i in r) for r in rows) == [7, 7, 7]
    assert plan_rows(lengths) == [[i] for i in range(6)]
    assert len(plan_rows([1, 2], num_rows=5)) == 2


def test_build_row_alignment_matches_naive():
    samples = [
        dataclasses.replace(s, version=10 + i) for i, s in enumerate(make_samples(5, seed=3))
    ]
    row = build_row(samples, [0, 2, 4])
    pos = 0
    for k, i in enumerate([0, 2, 4]):
        s = samples[i]
        assert row.cu_seqlens[k] == pos
        for j, tok in enumerate(s.prompt_ids):
            assert row.input_ids[pos] == tok
            assert row.position_ids[pos] == j
            assert not row.completion_mask[pos]
            assert row.advantages[pos] == 0
            pos += 1
        for j, tok in enumerate(s.completion_ids):
            assert row.input_ids[pos] == tok
            assert row.position_ids[pos] == len(s.prompt_ids) + j
            assert row.completion_mask[pos]
            assert row.behaviour_logprobs[pos] == pytest.approx(s.logprobs[j])
            assert row.advantages[pos] == pytest.approx(s.advantage)
            pos += 1
        span = slice(row.cu_seqlens[k], pos)
        assert row.versions[span].tolist() == [s.version] * (pos - row.cu_seqlens[k])
        assert row.sequence_ids[span].tolist() == [k] * (pos - row.cu_seqlens[k])
    assert pos == row.num_tokens
    assert row.num_completion_tokens == sum(len(samples[i].completion_ids) for i in [0, 2, 4])
    assert row.sample_indices == [0, 2, 4]


def _naive_logprobs(model, sample, with_entropy=False):
    """One sample alone, plain causal forward, token by token."""
    ids = torch.tensor([sample.prompt_ids + sample.completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
    out, entropies = [], []
    p = len(sample.prompt_ids)
    for j, tok in enumerate(sample.completion_ids):
        lp = torch.log_softmax(logits[p + j - 1] / sample.temperature, dim=-1)
        out.append(float(lp[tok]))
        entropies.append(float(-(lp.exp() * lp).sum()))
    if with_entropy:
        return out, entropies
    return out


@pytest.fixture(scope="module", params=[VARLEN_SDPA, "sdpa", "eager"])
def policy(request, tiny_model_dir):
    torch.manual_seed(0)
    model = load_policy(
        tiny_model_dir,
        LoraConfig(r=4, alpha=8.0),
        dtype="float32",
        device="cpu",
        attn_implementation=request.param,
    )
    with torch.no_grad():  # a non-zero adapter, so LoRA takes part in the comparison
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model.eval()
    return model


def test_packed_logprobs_equal_unpacked(policy):
    samples = make_samples(10, seed=7, temperature=0.7)
    rows = pack_samples(samples, token_budget=64)
    assert any(len(r.seq_lens) > 2 for r in rows)
    for row in rows:
        with torch.no_grad():
            logp, entropy = row_logprobs(policy, row)
        assert logp.shape == entropy.shape == (row.num_completion_tokens,)
        naive = [_naive_logprobs(policy, samples[i], with_entropy=True) for i in row.sample_indices]
        expected = [x for lp, _ in naive for x in lp]
        expected_entropy = [x for _, ent in naive for x in ent]
        assert torch.allclose(logp, torch.tensor(expected), atol=1e-5, rtol=0)
        assert torch.allclose(entropy, torch.tensor(expected_entropy), atol=1e-5, rtol=0)


def test_comparison_detects_cross_sample_attention(policy):
    """Sanity check of the test above: a row that forgets its sample boundaries lets samples mix.

    sdpa/eager read the boundaries from the position restarts, the varlen kernels from
    ``seq_lens``; both are erased.
    """
    samples = make_samples(4, seed=8)
    row = build_row(samples, [0, 1, 2, 3])
    row.position_ids = torch.arange(row.num_tokens)
    row.seq_lens = [row.num_tokens]
    with torch.no_grad():
        logp, _ = row_logprobs(policy, row)
    expected = [x for i in row.sample_indices for x in _naive_logprobs(policy, samples[i])]
    assert (logp - torch.tensor(expected)).abs().max() > 1e-3
