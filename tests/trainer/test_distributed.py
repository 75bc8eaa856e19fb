"""Data parallelism on CPU (gloo): 2 ranks train exactly the adapter 1 rank trains.

The ranks are real processes (``torch.multiprocessing.spawn``) joined through torch.distributed
the way torchrun joins them (``RANK``/``WORLD_SIZE``/``MASTER_*`` in the environment); rank 0
alone receives the fixed samples and scatters them.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from trainer_helpers import make_samples

from asyncgrpo.config.trainer import LoraConfig, TrainerConfig
from asyncgrpo.errors import RankError
from asyncgrpo.trainer.distributed import DataParallel, shard_samples
from asyncgrpo.trainer.loop import Trainer

STEPS = 3
SAMPLES = (24, 24, 1)  # the last step leaves rank 1 without a sample


def _step_samples(step: int):
    return make_samples(SAMPLES[step], seed=10 + step)


def _trainer_config(**overrides) -> TrainerConfig:
    # off_policy=none: the random behaviour logprobs put importance weights up to e^3 on
    # tokens, whose float32 noise AdamW then turns into ~1e-5 adapter differences
    cfg = dict(
        learning_rate=5e-3, token_budget=96, max_steps=10, dtype="float32", off_policy="none"
    )
    cfg.update(overrides)
    return TrainerConfig(**cfg)


def _adapter(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, model_dir: str, out: str, fsdp: bool):
    """One rank: rank 0 steps over fixed samples, the others follow; rank 0 saves the adapter."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    dp = DataParallel.from_env(timeout_s=60)
    trainer = Trainer(
        model_dir,
        lora=LoraConfig(r=4, alpha=8.0),
        trainer=_trainer_config(fsdp=fsdp),
        seed=rank,
        device="cpu",
        dp=dp,
    )
    if dp.is_main:
        metrics = [trainer.step(_step_samples(i)) for i in range(STEPS)]
        trainer.release()
        torch.save({"adapter": _adapter(trainer), "metrics": metrics}, out)
    else:
        assert trainer.follow() == STEPS
    dp.close()
    # Leave without the interpreter's teardown: with FSDP, a rank's exit sometimes aborts in a
    # C++ thread's destructor ("terminate called without an active exception", SIGABRT) after
    # everything above is done and saved; what this test compares is the adapter.
    os._exit(0)


def _run_ranks(model_dir: Path, tmp_path: Path, *, fsdp: bool = False) -> dict:
    out = tmp_path / "rank0.pt"
    mp.spawn(_rank_main, args=(2, _free_port(), str(model_dir), str(out), fsdp), nprocs=2)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def one_rank(tiny_model_dir) -> dict:
    trainer = Trainer(
        tiny_model_dir,
        lora=LoraConfig(r=4, alpha=8.0),
        trainer=_trainer_config(),
        seed=0,
        device="cpu",
    )
    metrics = [trainer.step(_step_samples(i)) for i in range(STEPS)]
    return {"adapter": _adapter(trainer), "metrics": metrics}


def _assert_same(two: dict, one: dict) -> None:
    assert set(two["adapter"]) == set(one["adapter"])
    moved = [k for k in one["adapter"] if "lora_B" in k and one["adapter"][k].abs().max() > 1e-3]
    assert moved, "the adapter did not train: the comparison would prove nothing"
    for name, value in one["adapter"].items():
        # float32 summation order: up to 1.03e-5 measured with FSDP (1 run in 13); a sharding
        # or gradient-sum mistake moves an entry by about the learning rate, 5e-3
        diff = float((two["adapter"][name] - value).abs().max())
        assert diff <= 5e-5, f"{name}: 2 ranks differ from 1 rank by {diff:.2e}"
    for m2, m1 in zip(two["metrics"], one["metrics"], strict=True):
        for key in (
            "loss",
            "grad_norm",
            "ratio",
            "batch/completion_tokens",
            "batch/samples",
            "batch/tokens",
            "reward",
            "off_policy/weight_mean",
            "off_policy/weight_max",
            "off_policy/staleness_0/weight_max",
        ):
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
        assert m2["batch/ranks"] == 2


def test_two_ranks_train_the_same_adapter_as_one(tiny_model_dir, tmp_path, one_rank) -> None:
    # Rank 1 starts from another seed: the adapter broadcast at start makes the ranks agree.
    _assert_same(_run_ranks(tiny_model_dir, tmp_path), one_rank)


def test_two_ranks_with_fsdp_train_the_same_adapter_as_one(
    tiny_model_dir, tmp_path, one_rank
) -> None:
    _assert_same(_run_ranks(tiny_model_dir, tmp_path, fsdp=True), one_rank)


def test_shards_balance_tokens_not_counts() -> None:
    samples = make_samples(1, seed=0, prompt_len=(70, 70), completion_len=(10, 10))
    samples += make_samples(10, seed=1, prompt_len=(5, 5), completion_len=(5, 5))
    shards = shard_samples(samples, 2)
    assert [sum(s.num_tokens for s in shard) for shard in shards] == [90, 90]
    assert sorted(map(len, shards)) == [2, 9]  # by count it would be 6 vs 5: 120 vs 60 tokens
    assert sorted(id(s) for shard in shards for s in shard) == sorted(map(id, samples))
    assert shard_samples(samples[:1], 3)[1:] == [[], []]


def _dying_rank(rank: int, port: int, report: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    dp = DataParallel.from_env(timeout_s=20)
    if rank == 1:
        os._exit(9)  # dies without a word, as a killed process does
    try:
        dp.scatter(make_samples(4))
    except RankError as exc:
        Path(report).write_text(str(exc))
        os._exit(3)
    os._exit(0)


def test_a_dead_rank_fails_the_collective_with_a_clear_error(tmp_path) -> None:
    ctx = mp.get_context("spawn")
    port, report = _free_port(), tmp_path / "error.txt"
    ranks = [ctx.Process(target=_dying_rank, args=(r, port, str(report))) for r in (0, 1)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=120)
    assert [p.exitcode for p in ranks] == [3, 9]
    message = report.read_text()
    assert message.startswith("rank 0 of 2: receiving this step's samples failed"), message
    assert "resumes from the latest checkpoint" in message
