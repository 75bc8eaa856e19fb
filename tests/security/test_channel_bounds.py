"""A rollout batch from storage that decodes but cannot be trained on (a token id at or past the
model's vocabulary, an empty prompt or completion, a sample longer than the model's context, a
logprob that is not finite), or that is too large to read, stops nothing: it is quarantined,
counted and logged, and the run goes on, also after a resume."""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.errors import ConfigError
from asyncgrpo.run.sources import ChannelSource, trainer_channel
from asyncgrpo.sample import Sample, SampleBounds
from asyncgrpo.store.channel import RolloutChannel
from asyncgrpo.store.codec import encode_batch
from asyncgrpo.transport.local import LocalTransport

pytestmark = pytest.mark.anyio

VOCAB = 384  #: the tiny model's (asyncgrpo.testing.make_tiny_model)
CONTEXT = 2048


def _sample(
    tag: str,
    prompt: list[int] | None = None,
    completion: list[int] | None = None,
    logprob: float = -1.0,
) -> Sample:
    prompt = [1, 2, 3] if prompt is None else prompt
    completion = [4, 5] if completion is None else completion
    return Sample(
        prompt_ids=prompt,
        completion_ids=completion,
        reward=1.0,
        advantage=0.5,
        logprobs=[logprob] * len(completion),
        version=0,
        group_id=tag,
    )


#: What a storage writer can ship that decodes, and what the trainer did with it before.
UNUSABLE = {
    "a token id equal to the vocabulary size (IndexError)": _sample("v", completion=[4, VOCAB]),
    "a token id far past it": _sample("w", prompt=[2**31 - 1]),
    "an empty prompt (ValueError)": _sample("p", prompt=[]),
    "an empty completion": _sample("c", completion=[]),
    "a sample longer than the model's context": _sample("l", prompt=[7] * CONTEXT),
    "a logprob that is NaN (a NaN update)": _sample("n", logprob=math.nan),
    "a logprob that is -inf": _sample("i", logprob=-math.inf),
}


@pytest.fixture(scope="module")
def trainer(tiny_model: Path) -> object:
    """A trainer on the session's tiny model (vocabulary 384, context 2048)."""
    from asyncgrpo.config.trainer import LoraConfig, TrainerConfig
    from asyncgrpo.trainer.loop import Trainer

    return Trainer(
        tiny_model,
        lora=LoraConfig(r=2, alpha=4.0),
        device="cpu",
        trainer=TrainerConfig(dtype="float32", token_budget=128),
    )


def _cfg() -> TrainingConfig:
    return TrainingConfig.from_dict({"model": "m", "dataset": {"prompts": ["p"]}})


async def test_batches_the_model_cannot_train_on_are_quarantined_and_the_run_goes_on(
    trainer: object, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert trainer.sample_bounds() == SampleBounds(VOCAB, CONTEXT)  # type: ignore[attr-defined]
    transport = LocalTransport(tmp_path / "store")
    producer = RolloutChannel(transport)
    good = [_sample(f"g{i}", prompt=[1, 2, 3 + i]) for i in range(4)]
    for bad in UNUSABLE.values():
        await producer.append([good[0], bad])
    await producer.append(good)
    caplog.set_level(logging.ERROR, "asyncgrpo.store.channel")

    source = ChannelSource(trainer_channel(transport, trainer, _cfg()))
    samples = await source.take(4)
    assert [s.group_id for s in samples] == [s.group_id for s in good]
    metrics = trainer.step(samples)  # type: ignore[attr-defined]
    assert math.isfinite(metrics["loss"])
    assert source.stats() == {"rollout/quarantined_batches": float(len(UNUSABLE))}
    assert len([r for r in caplog.records if "quarantined" in r.getMessage()]) == len(UNUSABLE)
    quarantined = [info.key async for info in transport.list("rollouts/quarantine")]
    assert len(quarantined) == len(UNUSABLE)
    assert await transport.get("rollouts/batches/000000000000.agrb") == b""  # tombstone

    # a resume from before them (a checkpoint's position) reads on to the good batch again
    again = ChannelSource(trainer_channel(transport, trainer, _cfg()))
    await again.channel.seek(0)
    assert [s.group_id for s in await again.take(4)] == [s.group_id for s in good]


@pytest.mark.parametrize("what", list(UNUSABLE))
def test_each_bound_names_the_sample_and_the_bound(what: str) -> None:
    bounds = SampleBounds(VOCAB, CONTEXT)
    bounds.check([_sample("ok"), _sample("ok", prompt=[VOCAB - 1] * (CONTEXT - 2))])
    with pytest.raises(ValueError, match=r"^sample 1 ") as info:
        bounds.check([_sample("ok"), UNUSABLE[what]])
    assert any(word in str(info.value) for word in ("vocabulary", "empty", "context", "finite"))


def test_context_length_is_generous_where_replicas_may_serve_longer() -> None:
    from asyncgrpo.trainer.model import context_length

    assert context_length(SimpleNamespace(max_position_embeddings=2048)) == 2048
    assert context_length(SimpleNamespace(n_positions=1024), max_model_len=4096) == 4096
    scaled = SimpleNamespace(
        max_position_embeddings=32768, rope_scaling={"rope_type": "yarn", "factor": 4.0}
    )
    assert context_length(scaled) == 131072
    assert context_length(SimpleNamespace()) is None
    assert context_length(SimpleNamespace(), max_model_len=100) == 100


class _Reads(LocalTransport):
    """A local store that records the bound of each read."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.reads: list[tuple[str, int | None]] = []

    async def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        self.reads.append((key, max_bytes))
        return await super().get(key, max_bytes=max_bytes)


async def test_a_batch_too_large_to_read_is_skipped_unread_and_left_in_place(
    tmp_path: Path,
) -> None:
    """A batch object of several GB was read whole before any check: MemoryError at every
    attempt, never quarantined. Its size is checked first now (here the bound is lowered to
    4 KiB so that the test need not write gigabytes)."""
    transport = _Reads(tmp_path / "store")
    small = RolloutChannel(transport, max_batch_bytes=4096)
    with pytest.raises(ConfigError, match="ship fewer samples per batch"):
        await small.append([_sample(f"s{i}", prompt=[1] * 100) for i in range(20)])
    huge = encode_batch([_sample(f"s{i}", prompt=[1] * 100) for i in range(20)])
    assert len(huge) > 4096
    await transport.put("rollouts/batches/000000000000.agrb", huge, mode="create")
    await RolloutChannel(transport).append([_sample("after")])

    consumer = RolloutChannel(transport, poll_interval_s=0.01, max_batch_bytes=4096)
    batch = await consumer.receive(timeout_s=5)
    assert (batch.seq, [s.group_id for s in batch.samples]) == (1, ["after"])
    assert consumer.quarantined == 1
    assert all(bound == 4096 for key, bound in transport.reads if "/batches/" in key)
    assert await transport.get("rollouts/batches/000000000000.agrb") == huge  # left as it was


def test_samples_that_fit_pass() -> None:
    bounds = SampleBounds(VOCAB, None)
    long = dataclasses.replace(_sample("x"), prompt_ids=[VOCAB - 1] * 10_000)
    bounds.check([long, _sample("y", completion=[0])])
