"""The trainer's channel source across a checkpoint and a restart: each sample trained once.

A checkpoint stores where the source resumes; a trainer killed after it and restarted from it
must take exactly the samples after the last one it took before the checkpoint: none again
(trained twice) and none skipped (lost), whether the checkpoint fell at a batch boundary or in
the middle of a batch (the trainer takes ``samples_per_step`` samples, which need not be whole
batches once stale samples are dropped)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncgrpo.run.sources import ChannelSource
from asyncgrpo.store.channel import RolloutChannel
from asyncgrpo.testing.samples import sample
from asyncgrpo.transport.local import LocalTransport

pytestmark = pytest.mark.anyio


async def _filled(root: Path, batches: int = 4, size: int = 8) -> LocalTransport:
    transport = LocalTransport(root)
    producer = RolloutChannel(transport)
    for b in range(batches):
        await producer.append([sample(f"g{b}", sample_id=f"b{b}-{j}") for j in range(size)])
    return transport


async def _resumed(transport: LocalTransport, state: tuple[int, int]) -> ChannelSource:
    """A restarted trainer's source, from a checkpoint's (position, skip)."""
    channel = RolloutChannel(transport, poll_interval_s=0.01)
    await channel.seek(state[0])
    return ChannelSource(channel, skip=state[1])


@pytest.mark.parametrize("taken", [16, 13, 8, 3])  # whole batches, and partway into one
async def test_a_resumed_source_continues_after_the_last_sample_taken(
    tmp_path: Path, taken: int
) -> None:
    transport = await _filled(tmp_path / "store")
    source = ChannelSource(RolloutChannel(transport, poll_interval_s=0.01))
    before: list[str | None] = []
    while len(before) < taken:
        before += [s.sample_id for s in await source.take(min(5, taken - len(before)))]
    state = (source.position(), source.skip())  # what the checkpoint stores
    await source.committed()
    # Killed here; the restart resumes from the checkpoint.
    after = await _resumed(transport, state)
    rest: list[str | None] = []
    while len(rest) < 32 - taken:
        rest += [s.sample_id for s in await after.take(32 - taken - len(rest))]
    everything = [f"b{b}-{j}" for b in range(4) for j in range(8)]
    assert before + rest == everything


async def test_an_unfinished_batch_is_not_committed(tmp_path: Path) -> None:
    """The cursor (what a compacting channel deletes up to) never passes a sample not taken."""
    transport = await _filled(tmp_path / "store")
    source = ChannelSource(RolloutChannel(transport, poll_interval_s=0.01))
    await source.take(8)
    await source.take(3)  # batch 1 partly taken
    await source.committed()
    assert await RolloutChannel(transport)._load_cursor() == 1
    await source.take(5)  # the rest of batch 1
    await source.committed()
    assert await RolloutChannel(transport)._load_cursor() == 2


async def test_a_trainer_without_a_checkpoint_reads_from_the_first_batch(tmp_path: Path) -> None:
    """A trainer killed before its first checkpoint had moved the channel's cursor; the next
    one starts from step 0 and must read those batches again (they were trained by weights
    that died), not skip them."""
    from types import SimpleNamespace

    from asyncgrpo.run.training import _sample_source, _Start

    transport = await _filled(tmp_path / "store")
    first = ChannelSource(RolloutChannel(transport, poll_interval_s=0.01))
    await first.take(8)
    await first.take(8)
    await first.committed()  # the cursor is at batch 2; no checkpoint was saved
    from asyncgrpo.sample import SampleBounds

    cfg = SimpleNamespace(trainer=None, serve=SimpleNamespace(max_model_len=None))
    run = SimpleNamespace(cfg=cfg, transport=transport)
    trainer = SimpleNamespace(sample_bounds=lambda max_len: SampleBounds(vocab_size=152_000))
    fresh = _Start(trainer=trainer, resumed_from=None, position=0)
    async with _sample_source(run, None, "channel", ("p-v0", 0), fresh) as source:  # type: ignore[arg-type]
        assert [s.sample_id for s in await source.take(8)] == [f"b0-{j}" for j in range(8)]
