"""What one client can make the service hold: queued requests, retained outcomes, datum parts
(pure: the service's queue and future table without a model)."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from asyncgrpo.tinker.futures import FutureTable, Outcome
from asyncgrpo.tinker.service import QueueFull, TinkerService
from asyncgrpo.tinker.wire import FwdBwdResult, WireError, fwdbwd_shape


def test_a_client_s_queue_is_bounded_and_the_service_s_own_jobs_are_not() -> None:
    async def body() -> None:
        service = TinkerService(engine=None, states=None, max_queued=3)
        gate = anyio.Event()

        async def blocked() -> None:
            await gate.wait()

        async with anyio.create_task_group() as tg:
            await tg.start(service.run)
            service.submit("a", blocked, bounded=True)  # running: no longer queued
            await anyio.sleep(0.05)
            for _ in range(3):
                service.submit("a", blocked, bounded=True)
            with pytest.raises(QueueFull, match="3 requests queued"):
                service.submit("a", blocked, bounded=True)
            service.submit("b", blocked, bounded=True)  # another client has its own room
            service.submit("a", blocked)  # the service's own (a removal) always queues
            gate.set()
            tg.cancel_scope.cancel()

    anyio.run(body)


def test_sample_requests_in_flight_are_bounded(monkeypatch) -> None:
    from asyncgrpo.tinker import service as module

    monkeypatch.setattr(module, "MAX_SAMPLING", 4)

    async def body() -> None:
        service = TinkerService(engine=None, states=None)
        gate = anyio.Event()

        async def sample() -> str:
            await gate.wait()
            return "sampled"

        async with anyio.create_task_group() as tg:
            await tg.start(service.run)
            rids = [service.spawn(sample) for _ in range(4)]
            with pytest.raises(QueueFull, match="4 sample requests in flight"):
                service.spawn(sample)
            service.spawn(sample, "a-client")  # a client being made is not a sample
            gate.set()
            assert (await service.futures.wait(rids[0], 5.0)).value == "sampled"  # type: ignore[union-attr]
            service.spawn(sample)  # room again
            tg.cancel_scope.cancel()

    anyio.run(body)


def test_retained_outcomes_are_bounded_by_count_and_bytes() -> None:
    table = FutureTable(keep=100, keep_bytes=64 << 20)
    ids = []
    for _ in range(40):  # 40 results of 8 MB each: 320 MB kept before
        rid = table.new()
        result = FwdBwdResult(outputs=[{"logprobs": np.zeros(2 << 20, np.float32)}])
        table.finish(rid, Outcome(value=result))
        ids.append(rid)
    kept = [rid for rid in ids if table.known(rid)]
    assert 1 <= len(kept) <= 8 and kept == ids[-len(kept) :]
    for _ in range(300):
        table.finish(table.new(), Outcome(value={"ok": 1}))
    assert sum(table.known(rid) for rid in ids) == 0


def test_a_body_of_many_empty_parts_is_refused_before_it_is_parsed() -> None:
    from tinker.proto import tinker_public_pb2 as pb

    msg = pb.ForwardBackwardRequest(model_id="m")
    msg.data.add().model_input.extend([pb.Chunk() for _ in range(5000)])
    with pytest.raises(WireError, match="datum 0 has more than 4096 fields"):
        fwdbwd_shape(msg.SerializeToString(), max_datums=10)
    assert fwdbwd_shape(
        pb.ForwardBackwardRequest(model_id="m").SerializeToString(), max_datums=10
    ) == ("m", 0)
    with pytest.raises(WireError, match=r"truncated|malformed"):
        fwdbwd_shape(b"\x1a\xff\xff\x01", max_datums=10)
