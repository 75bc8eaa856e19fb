"""The engine's packed forward_backward against one datum at a time, on the tiny model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from asyncgrpo.tinker.engine import Engine, LoraSpec
from asyncgrpo.tinker.wire import FwdBwdRequest, WireDatum

LENGTHS = (5, 17, 1, 9, 12, 3)  # different lengths, one of a single token
TOL = 1e-5


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Engine:
    engine = Engine(tiny_model, dtype="float32", lora_alpha=8.0)
    engine.create("c", LoraSpec(rank=4, seed=0, train_mlp=True, train_attn=True))
    # a LoRA B of zeros would leave the adapter out of the forward: give it weight to test
    with torch.no_grad():
        for p in engine._clients["c"].params:
            p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
    return engine


def _data(vocab: int) -> list[WireDatum]:
    rng = np.random.default_rng(0)
    return [
        WireDatum(
            tokens=rng.integers(0, vocab, n),
            inputs={
                "target_tokens": rng.integers(0, vocab, n),
                "logprobs": -rng.uniform(1, 5, n).astype(np.float32),
                "advantages": rng.uniform(-1, 1, n).astype(np.float32),
            },
        )
        for n in LENGTHS
    ]


def _run(engine: Engine, data: list[WireDatum], forward_only: bool):
    """Outputs, ``loss:sum`` and the adapter's gradient (then cleared) of one request."""
    request = FwdBwdRequest(
        model_id="c",
        seq_id=0,
        loss_fn="ppo",
        loss_fn_config={},
        forward_only=forward_only,
        data=data,
    )
    result = engine.forward_backward(request)
    params = engine._clients["c"].params
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return result.outputs, result.metrics["loss:sum"], grads


def _forwards(engine: Engine, data: list[WireDatum], forward_only: bool):
    """:func:`_run`, and how many model forwards it took."""
    calls = [0]

    def hook(*_: object) -> None:
        calls[0] += 1

    handle = engine.model.register_forward_hook(hook)
    try:
        return _run(engine, data, forward_only), calls[0]
    finally:
        handle.remove()


@pytest.mark.parametrize("budget", [4096, 20])
@pytest.mark.parametrize("forward_only", [False, True])
def test_packed_forward_backward_equals_one_datum_at_a_time(
    engine: Engine, budget: int, forward_only: bool
) -> None:
    data = _data(engine.vocab_size)
    engine.token_budget = budget
    (packed, packed_loss, packed_grads), forwards = _forwards(engine, data, forward_only)
    assert forwards == (1 if budget >= sum(LENGTHS) else 3)  # 47 tokens: 3 rows of <= 20
    singles = [_run(engine, [d], forward_only) for d in data]
    assert packed_loss == pytest.approx(sum(s[1] for s in singles), abs=TOL)
    for out, (single, _, _) in zip(packed, singles, strict=True):
        for key in ("logprobs", "elementwise_loss"):
            assert out[key].shape == single[0][key].shape
            np.testing.assert_allclose(out[key], single[0][key], rtol=0, atol=TOL)
    summed = [sum(g) for g in zip(*(s[2] for s in singles), strict=True)]
    assert any(float(g.abs().max()) > 1e-3 for g in summed) != forward_only
    for got, want in zip(packed_grads, summed, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=TOL)


def test_an_empty_datum_gets_empty_outputs(engine: Engine) -> None:
    data = _data(engine.vocab_size)[:2]
    empty = WireDatum(
        tokens=np.zeros(0, np.int64),
        inputs={k: np.zeros(0, v.dtype) for k, v in data[0].inputs.items()},
    )
    outputs, loss, _ = _run(engine, [data[0], empty, data[1]], forward_only=True)
    both, both_loss, _ = _run(engine, data, forward_only=True)
    assert outputs[1]["logprobs"].shape == (0,) and outputs[1]["elementwise_loss"].shape == (0,)
    np.testing.assert_array_equal(outputs[2]["logprobs"], both[1]["logprobs"])
    assert loss == pytest.approx(both_loss, abs=TOL)
