"""No batch stops the trainer at every resume, whatever it raises
when decoded; cursor files (and planted batch names) are checked, never trusted."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

from asyncgrpo.errors import ConfigError, IntegrityError
from asyncgrpo.sample import Sample
from asyncgrpo.store.channel import RolloutChannel
from asyncgrpo.transport.local import LocalTransport

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
BATCH = "rollouts/batches/{:012d}.agrb"


def _sample(tag: str) -> Sample:
    return Sample(
        prompt_ids=[1, 2],
        completion_ids=[3, 4],
        logprobs=[-0.5, -0.25],
        reward=1.0,
        advantage=0.5,
        version=2,
        group_id=tag,
    )


def _agrb(header: bytes) -> bytes:
    """An AGRB batch of the current format around a raw header."""
    return struct.pack("<4sBI", b"AGRB", 2, len(header)) + header


def _deep_header(depth: int = 100_000) -> bytes:
    return _agrb(b"[" * depth + b"]" * depth)


# ---- finding 7 ----------------------------------------------------------------------------------
async def test_a_header_nested_100000_deep_is_quarantined_not_raised(tmp_path: Path) -> None:
    """RecursionError was not caught: the consumer raised on the batch after every restart."""
    transport = LocalTransport(tmp_path / "store")
    producer = RolloutChannel(transport)
    await producer.append([_sample("a")])
    await transport.put(BATCH.format(1), _deep_header(), mode="create")
    producer._next_write = None  # a fresh producer continues after what it lists
    await producer.append([_sample("c")])
    consumer = RolloutChannel(transport, poll_interval_s=0.01)
    with anyio.fail_after(10):
        seqs = [(await consumer.receive()).seq for _ in range(2)]
    assert seqs == [0, 2] and consumer.quarantined == 1
    assert await transport.get("rollouts/quarantine/000000000001.agrb") == _deep_header()
    assert await transport.get(BATCH.format(1)) == b""  # tombstone: no resume stops there


def test_a_memory_error_while_decoding_is_an_integrity_error(tmp_path: Path) -> None:
    """A real MemoryError (an address-space limit below what a 64 MB header's copies need),
    in a child process, so the limit does not touch the test runner."""
    batch = tmp_path / "huge.agrb"
    batch.write_bytes(_agrb(b'["' + b"a" * (64 << 20) + b'"]'))
    script = textwrap.dedent(f"""
        import resource
        from asyncgrpo.errors import IntegrityError
        from asyncgrpo.store.codec import decode_batch
        data = open({str(batch)!r}, "rb").read()
        used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (used + (96 << 20), resource.RLIM_INFINITY))
        try:
            decode_batch(data)
        except IntegrityError as exc:
            print("IntegrityError", exc)
    """)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("IntegrityError cannot decode rollout batch: MemoryError")


# ---- finding 9 ----------------------------------------------------------------------------------
BAD_CURSORS = [b'{"next": 1e9}', b'{"next": null}', b"[]", b'{"next": true}', b'{"next": -1}',
               b'{"next": "3"}', b"{}", b"\xff\xfe", b"[" * 100_000, b'{"next": 7}']  # fmt: skip


@pytest.mark.parametrize("raw", BAD_CURSORS)
async def test_a_bad_cursor_does_not_move_a_producer(tmp_path: Path, raw: bytes) -> None:
    """A fresh producer wrote at 1,000,000,000 (the trainer waiting at 0), or raised TypeError."""
    transport = LocalTransport(tmp_path / "store")
    for consumer in ("trainer", "auditor"):
        await transport.put(f"rollouts/cursors/{consumer}.json", raw)
    for seq in range(3):
        assert await RolloutChannel(transport).append([_sample(f"b{seq}")]) == seq


@pytest.mark.parametrize("raw", BAD_CURSORS)
async def test_a_bad_cursor_stops_the_consumer_with_one_clear_line(
    tmp_path: Path, raw: bytes
) -> None:
    """Not a TypeError, not a wait at batch 1e9, not a silent restart from 0 (a redelivery)."""
    transport = LocalTransport(tmp_path / "store")
    producer = RolloutChannel(transport)
    for seq in range(3):
        await producer.append([_sample(f"b{seq}")])
    await transport.put("rollouts/cursors/trainer.json", raw)
    consumer = RolloutChannel(transport, poll_interval_s=0.01)
    with pytest.raises(IntegrityError, match=r"cursors/trainer\.json is unusable") as info:
        await consumer.receive(timeout_s=5)
    assert "\n" not in str(info.value) and "delete it" in str(info.value)
    await consumer.seek(1)  # the way out it names: a checkpoint's position
    assert (await consumer.receive(timeout_s=5)).seq == 1


async def test_a_cursor_at_the_end_of_the_channel_is_valid(tmp_path: Path) -> None:
    transport = LocalTransport(tmp_path / "store")
    producer = RolloutChannel(transport)
    for seq in range(3):
        await producer.append([_sample(f"b{seq}")])
    await transport.put("rollouts/cursors/trainer.json", json.dumps({"next": 3}).encode())
    consumer = RolloutChannel(transport, poll_interval_s=0.01)
    with pytest.raises(TimeoutError):
        await consumer.receive(timeout_s=0.2)  # all consumed: waits for batch 3
    await producer.append([_sample("b3")])
    assert (await consumer.receive(timeout_s=5)).seq == 3


@pytest.mark.parametrize("position", [10**9, 4, -1, True, 2.0, "1"])
async def test_seek_refuses_a_position_the_channel_never_held(
    tmp_path: Path, position: object
) -> None:
    transport = LocalTransport(tmp_path / "store")
    producer = RolloutChannel(transport)
    for seq in range(3):
        await producer.append([_sample(f"b{seq}")])
    with pytest.raises(ConfigError, match="seek position"):
        await RolloutChannel(transport).seek(position)  # type: ignore[arg-type]


async def test_a_planted_batch_number_past_a_gap_does_not_move_a_producer(
    tmp_path: Path,
) -> None:
    """Producers leave no gaps, so ``999999999999999999.agrb`` was planted: it is ignored (and
    ``5.agrb``, another spelling of batch 5, is not batch 5)."""
    transport = LocalTransport(tmp_path / "store")
    await RolloutChannel(transport).append([_sample("a")])
    await transport.put("rollouts/batches/999999999999999999.agrb", b"junk")
    await transport.put("rollouts/batches/1.agrb", b"junk")
    assert await RolloutChannel(transport).append([_sample("b")]) == 1
    consumer = RolloutChannel(transport, poll_interval_s=0.01)
    assert [(await consumer.receive(timeout_s=5)).seq for _ in range(2)] == [0, 1]
