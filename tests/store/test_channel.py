"""RolloutChannel on the real local store: order, exactly-once, restarts, racing producers."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from asyncgrpo.errors import ConfigError
from asyncgrpo.store.channel import RolloutChannel
from asyncgrpo.testing.samples import sample
from asyncgrpo.transport.local import LocalTransport

pytestmark = pytest.mark.anyio


@pytest.fixture
def transport(tmp_path: Path) -> LocalTransport:
    return LocalTransport(tmp_path / "bucket")


async def test_in_order_each_once_then_waits(transport: LocalTransport) -> None:
    ch = RolloutChannel(transport, poll_interval_s=0.02)
    for i in range(5):
        assert await ch.append([sample(f"g{i}-{j}") for j in range(2)]) == i
    got = [await ch.receive() for _ in range(5)]
    assert [b.seq for b in got] == [0, 1, 2, 3, 4]
    assert [s.group_id for b in got for s in b.samples][:4] == ["g0-0", "g0-1", "g1-0", "g1-1"]
    with pytest.raises(TimeoutError):
        await ch.receive(timeout_s=0.1)


async def test_receive_waits_for_producer(transport: LocalTransport) -> None:
    consumer = RolloutChannel(transport, poll_interval_s=0.02)
    producer = RolloutChannel(transport)

    async def produce_later() -> None:
        await anyio.sleep(0.2)
        await producer.append([sample("late")])

    async with anyio.create_task_group() as tg:
        tg.start_soon(produce_later)
        batch = await consumer.receive(timeout_s=5)
    assert batch.samples[0].group_id == "late"


async def test_restart_resumes_without_loss_or_duplicates(transport: LocalTransport) -> None:
    producer = RolloutChannel(transport)
    for i in range(6):
        await producer.append([sample(f"b{i}")])
    first = RolloutChannel(transport)
    seen = [(await first.receive()).seq for _ in range(3)]  # 0, 1 committed; 2 in progress
    assert first.position == 2
    del first  # crash while working on batch 2

    second = RolloutChannel(transport)
    seen += [(await second.receive()).seq for _ in range(2)]  # 2 again (never committed), 3
    await second.commit()
    third = RolloutChannel(transport)
    seen += [(await third.receive()).seq for _ in range(2)]
    assert seen == [0, 1, 2, 2, 3, 4, 5]
    assert third.position == 5


async def test_seek_to_checkpointed_position(transport: LocalTransport) -> None:
    ch = RolloutChannel(transport)
    for i in range(4):
        await ch.append([sample(f"b{i}")])
    for _ in range(4):
        await ch.receive()
    await ch.seek(1)  # the trainer restored a checkpoint taken at channel position 1
    restarted = RolloutChannel(transport)
    assert [(await restarted.receive()).seq for _ in range(3)] == [1, 2, 3]


async def test_consumers_have_independent_cursors(transport: LocalTransport) -> None:
    a = RolloutChannel(transport, consumer="trainer")
    b = RolloutChannel(transport, consumer="auditor")
    await a.append([sample("x")])
    await a.append([sample("y")])
    assert [(await a.receive()).seq for _ in range(2)] == [0, 1]
    assert (await b.receive()).seq == 0


async def test_two_producers_never_clobber(transport: LocalTransport) -> None:
    producers = [RolloutChannel(transport) for _ in range(2)]

    async def produce(p: int) -> None:
        for i in range(15):
            await producers[p].append([sample(f"p{p}-{i}")])

    async with anyio.create_task_group() as tg:
        for p in range(2):
            tg.start_soon(produce, p)
    consumer = RolloutChannel(transport)
    batches = [await consumer.receive(timeout_s=5) for _ in range(30)]
    assert [b.seq for b in batches] == list(range(30))
    tags = [b.samples[0].group_id for b in batches]
    assert sorted(tags) == sorted(f"p{p}-{i}" for p in range(2) for i in range(15))
    for p in range(2):  # each producer's own batches stay in its order
        mine = [t for t in tags if t.startswith(f"p{p}-")]
        assert mine == [f"p{p}-{i}" for i in range(15)]


async def test_compaction_keeps_lagging_producer_safe(transport: LocalTransport) -> None:
    slow = RolloutChannel(transport)
    fast = RolloutChannel(transport)
    consumer = RolloutChannel(transport, compact=True)
    await slow.append([sample("s0")])  # slow caches next seq = 1
    for i in range(3):
        await fast.append([sample(f"f{i}")])
    for _ in range(4):
        await consumer.receive()
    await consumer.commit()
    assert await transport.get("rollouts/batches/000000000001.agrb") == b""  # tombstone
    assert await slow.append([sample("s1")]) == 4  # not into a compacted slot
    fresh = RolloutChannel(transport)  # a restarted producer starts past everything
    assert await fresh.append([sample("n")]) == 5
    got = [(await consumer.receive(timeout_s=5)).samples[0].group_id for _ in range(2)]
    assert got == ["s1", "n"]


async def test_a_batch_of_another_format_stops_the_consumer_and_stays(
    transport: LocalTransport,
) -> None:
    """Not quarantined like a malformed batch: every batch of a mixed-release fleet would be
    skipped. The consumer stops with the versions named; the batch waits for a matching reader."""
    ch = RolloutChannel(transport, poll_interval_s=0.01)
    await ch.append([sample("a")])
    key = "rollouts/batches/000000000000.agrb"
    data = bytearray(await transport.get(key))
    data[4] = 1
    await transport.put(key, bytes(data))
    with pytest.raises(ConfigError, match="format v1, this asyncgrpo reads v2"):
        await ch.receive(timeout_s=5)
    assert ch.quarantined == 0
    assert await transport.get(key) == bytes(data)
