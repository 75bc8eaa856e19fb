"""Hypothesis fuzzing of what the stores read from storage anyone with write access
may have written: rollout batches, bundle manifests (adapters, checkpoints) and cursor files.
Whatever the bytes, a reader answers with its own error type (IntegrityError, NotFound; a
foreign batch format: ConfigError), never a TypeError, a RecursionError or a hang."""

from __future__ import annotations

import json
import math
import struct
import tempfile
from pathlib import Path

import anyio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncgrpo.errors import ConfigError, IntegrityError, NotFound
from asyncgrpo.sample import Sample
from asyncgrpo.store.adapters import AdapterStore
from asyncgrpo.store.bundle import FetchLimits, _manifest_files
from asyncgrpo.store.channel import RolloutChannel, parse_cursor
from asyncgrpo.store.checkpoints import CheckpointStore
from asyncgrpo.store.codec import decode_batch, encode_batch
from asyncgrpo.transport.local import LocalTransport

FUZZ = settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
STORE_FUZZ = settings(
    max_examples=120, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=16,
)
int32 = st.integers(-(2**31), 2**31 - 1)
f32 = st.floats(width=32, allow_nan=False)


@st.composite
def samples(draw: st.DrawFn) -> Sample:
    n = draw(st.integers(0, 6))
    version = draw(st.integers(0, 2**31 - 1))
    multi = draw(st.booleans())
    return Sample(
        prompt_ids=draw(st.lists(st.integers(0, 2**31 - 1), max_size=6)),
        completion_ids=draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)),
        logprobs=draw(st.lists(f32, min_size=n, max_size=n)),
        reward=draw(st.floats(allow_nan=False)),
        advantage=draw(st.floats(allow_nan=False, allow_infinity=False)),
        version=version,
        group_id=draw(st.text(max_size=8)),
        temperature=draw(st.floats(min_value=1e-3, max_value=10)),
        rewards=draw(st.dictionaries(st.text(max_size=4), st.floats(allow_nan=False), max_size=2)),
        finish_reason=draw(st.none() | st.text(max_size=6)),
        completion_mask=draw(st.lists(st.booleans(), min_size=n, max_size=n)) if multi else None,
        versions=[version] * n if multi else None,
    )


def _decodes_or_refuses(data: bytes) -> None:
    try:
        out = decode_batch(data)
    except (IntegrityError, ConfigError):
        return
    for s in out:  # what decodes is a batch the trainer can use
        assert len(s.logprobs) == len(s.completion_ids) and math.isfinite(s.advantage)
        assert all(t >= 0 for t in s.prompt_ids + s.completion_ids)
    assert decode_batch(encode_batch(out)) is not None


# ---- rollout batches ----------------------------------------------------------------------------
@FUZZ
@given(st.lists(samples(), max_size=4))
def test_any_batch_round_trips_exactly(batch: list[Sample]) -> None:
    assert decode_batch(encode_batch(batch)) == batch


@FUZZ
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_are_refused(data: bytes) -> None:
    _decodes_or_refuses(data)
    _decodes_or_refuses(b"AGRB\x02" + data)


@FUZZ
@given(st.lists(samples(), min_size=1, max_size=3), st.data())
def test_a_mutated_batch_decodes_or_is_refused(batch: list[Sample], data: st.DataObject) -> None:
    raw = bytearray(encode_batch(batch))
    for _ in range(data.draw(st.integers(1, 4))):
        where = data.draw(st.integers(0, len(raw) - 1))
        action = data.draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        if action == "flip":
            raw[where] ^= data.draw(st.integers(1, 255))
        elif action == "cut":
            del raw[where:]
        elif action == "insert":
            raw[where:where] = data.draw(st.binary(min_size=1, max_size=8))
        else:
            del raw[where]
        if not raw:
            break
    _decodes_or_refuses(bytes(raw))


@FUZZ
@given(json_values, st.binary(max_size=64))
def test_any_header_decodes_or_is_refused(header: object, tail: bytes) -> None:
    head = json.dumps(header).encode()
    _decodes_or_refuses(struct.pack("<4sBI", b"AGRB", 2, len(head)) + head + tail)


ROW = {"np": st.integers(-1, 3), "nc": st.integers(-1, 3), "reward": json_values,
       "advantage": json_values, "version": json_values, "group_id": json_values,
       "temperature": json_values, "rewards": json_values, "finish_reason": json_values,
       "v": json_values, "m": json_values}  # fmt: skip


@FUZZ
@given(st.lists(st.fixed_dictionaries({}, optional=ROW), max_size=3), st.binary(max_size=80))
def test_headers_of_almost_right_rows_decode_or_are_refused(rows: list, tail: bytes) -> None:
    head = json.dumps(rows).encode()
    _decodes_or_refuses(struct.pack("<4sBI", b"AGRB", 2, len(head)) + head + tail)


# ---- cursor files -------------------------------------------------------------------------------
cursor_bytes = (
    st.binary(max_size=40)
    | json_values.map(lambda v: json.dumps(v).encode())
    | json_values.map(lambda v: json.dumps({"next": v}).encode())
    | st.integers(-3, 10**30).map(lambda n: json.dumps({"next": n}).encode())
)


@FUZZ
@given(cursor_bytes)
def test_parse_cursor_gives_a_count_or_a_value_error(raw: bytes) -> None:
    try:
        seq = parse_cursor(raw)
    except ValueError:
        return
    assert isinstance(seq, int) and not isinstance(seq, bool) and seq >= 0


@STORE_FUZZ
@given(cursor_bytes)
def test_a_channel_with_any_cursor_file_delivers_or_refuses(raw: bytes) -> None:
    async def main(root: Path) -> None:
        transport = LocalTransport(root)
        producer = RolloutChannel(transport)
        for i in range(2):
            await producer.append(
                [
                    Sample(
                        prompt_ids=[1],
                        completion_ids=[2],
                        logprobs=[-1.0],
                        reward=1.0,
                        advantage=0.0,
                        version=0,
                        group_id=f"{i}",
                    )
                ]
            )
        await transport.put("rollouts/cursors/trainer.json", raw)
        assert await RolloutChannel(transport).append([]) == 2  # no cursor moves a producer
        consumer = RolloutChannel(transport, poll_interval_s=0.01)
        try:
            batch = await consumer.receive(timeout_s=0.05)
        except IntegrityError as exc:
            assert "cursors/trainer.json is unusable" in str(exc)
            return
        except TimeoutError:
            return  # a cursor at the end: waits for batch 3
        assert 0 <= batch.seq <= 2

    with tempfile.TemporaryDirectory() as tmp:
        anyio.run(main, Path(tmp))


# ---- manifests ----------------------------------------------------------------------------------
file_entries = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "path": json_values | st.sampled_from(["a", "../x", "a/b", ""]),
            "size": json_values,
            "sha256": json_values | st.just("0" * 64),
        },
    ),
    max_size=3,
)
manifests = st.fixed_dictionaries(
    {},
    optional={
        "format": st.just("asyncgrpo.bundle/1") | json_values,
        "files": file_entries | json_values,
        "files_prefix": st.sampled_from(["files-1", "a/b", "..", ""]) | json_values,
        "step": st.just(1) | json_values,
        "meta": st.just({}) | json_values,
        "name": st.just("run") | json_values,
        "version": st.just(1) | json_values,
        "created_at": st.just(0.0) | json_values,
        "lora": json_values,
    },
)


@FUZZ
@given(manifests | json_values)
def test_manifest_files_are_checked_or_refused(manifest: object) -> None:
    try:
        _, files = _manifest_files(manifest, FetchLimits(max_files=4), "fuzz")
    except IntegrityError:
        return
    for path, size, sha in files:
        assert ".." not in path.split("/") and size >= 0 and len(sha) == 64


@STORE_FUZZ
@given(manifests.map(lambda m: json.dumps(m).encode()) | st.binary(max_size=60))
def test_stores_read_any_manifest_with_their_own_errors(raw: bytes) -> None:
    async def main(root: Path) -> None:
        transport = LocalTransport(root)
        await transport.put("checkpoints/step-000000001/manifest.json", raw)
        await transport.put("adapters/run/v1/manifest.json", raw)
        await transport.put("checkpoints/step-000000001/files-1/a", b"x")
        checkpoints = CheckpointStore(transport)
        for read in (
            lambda: checkpoints.meta(1),
            lambda: checkpoints.load(1, root / "out"),
            lambda: checkpoints.load_latest_verified(root / "out2"),
            lambda: AdapterStore(transport).info("run", 1),
            lambda: AdapterStore(transport).fetch("run", 1, root / "cache"),
        ):
            try:
                await read()
            except (IntegrityError, NotFound):
                pass

    with tempfile.TemporaryDirectory() as tmp:
        anyio.run(main, Path(tmp))
