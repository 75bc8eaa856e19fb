"""Making a training client releases everything it booked when it fails or its session ends
meanwhile: create, load and finish, each path (the slots are the sampler's side of booking,
as in test_expiry.py; the engine is the real one where the failure is its own)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import anyio
import pytest

from asyncgrpo.tinker.engine import LoraSpec
from asyncgrpo.tinker.sampling import SlotsFull
from asyncgrpo.tinker.service import TinkerService, TrainingModel
from asyncgrpo.tinker.wire import WireError

SPEC = LoraSpec(rank=1, seed=0, train_mlp=True, train_attn=True)


class _Slots:
    """A fleet's LoRA slots; ``gate``, when given, holds each booking until set."""

    def __init__(self, gate: anyio.Event | None = None) -> None:
        self.booked: set[str] = set()
        self.gate, self.asked = gate, anyio.Event()

    async def book(self, model_id: str) -> None:
        self.asked.set()
        if self.gate is not None:
            await self.gate.wait()
        if len(self.booked) >= 8:
            raise SlotsFull("full")
        self.booked.add(model_id)

    async def release(self, model_id: str) -> None:
        self.booked.discard(model_id)


class _Engine:
    def __init__(self, fail: bool = False) -> None:
        self.adapters: set[str] = set()
        self.fail = fail

    def create(self, model_id: str, spec: object) -> None:
        if self.fail:
            raise ValueError("Overflow when unpacking long long")  # torch, for seed=2**70
        self.adapters.add(model_id)

    def remove(self, model_id: str) -> None:
        self.adapters.discard(model_id)

    def has(self, model_id: str) -> bool:
        return model_id in self.adapters


class _States:
    async def start_run(self, run_id: str, spec: object) -> None:
        pass


async def _settle(service: TinkerService) -> None:
    """Until the worker ran everything queued."""
    for _ in range(100):
        await anyio.sleep(0.02)
        if not len(service._queue) and not service._leaving:
            return


def _create(service: TinkerService) -> tuple[TrainingModel, str]:
    """What create_model does: count the client, then make it beside the queue."""
    from asyncgrpo.tinker.routes import add_client

    session = service.new_session()
    model = TrainingModel(f"{session.session_id}_m0", session.session_id, 1)
    service.add_model(model)
    return model, service.spawn(lambda: add_client(service, model, SPEC), model.model_id)


def test_a_create_that_fails_after_booking_gives_its_slots_back() -> None:
    slots, engine = _Slots(), _Engine(fail=True)
    service = TinkerService(engine, _States(), slots)

    async def body() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(service.run)
            for _ in range(6):  # six such calls held all 12 slots of a fleet
                _, rid = _create(service)
                outcome = await service.futures.wait(rid, 5.0)
                assert outcome is not None and "failed (ValueError)" in (outcome.error or "")
            await _settle(service)
            assert slots.booked == set() and service.models == {}
            tg.cancel_scope.cancel()

    anyio.run(body)


def test_a_create_whose_session_ends_while_it_books_leaves_nothing() -> None:
    slots, engine = _Slots(gate=anyio.Event()), _Engine()
    service = TinkerService(engine, _States(), slots)

    async def body() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(service.run)
            model, rid = _create(service)
            await slots.asked.wait()
            service.end_session(model.session_id, "finished")
            assert slots.gate is not None
            slots.gate.set()
            outcome = await service.futures.wait(rid, 5.0)
            assert outcome is not None and "ended while the client was being made" in (
                outcome.error or ""
            )
            await _settle(service)
            assert slots.booked == set() and engine.adapters == set()
            assert service.models == {}
            tg.cancel_scope.cancel()

    anyio.run(body)


def test_no_client_is_added_to_a_session_that_ended() -> None:
    """What load_weights does after fetching a state: its session may have ended meanwhile
    (finished, or expired while the load was queued)."""
    service = TinkerService(_Engine(), _States())
    session = service.new_session()
    service.end_session(session.session_id, "finished")
    with pytest.raises(WireError, match="ended before training client"):
        service.add_model(TrainingModel(f"{session.session_id}:train:0", session.session_id, 1))
    assert service.models == {}


def test_a_removal_whose_release_fails_still_removes_the_adapter() -> None:
    class _Down(_Slots):
        async def release(self, model_id: str) -> None:
            raise OSError("the proxy is down")

    slots, engine = _Down(), _Engine()
    service = TinkerService(engine, _States(), slots)

    async def body() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(service.run)
            model, rid = _create(service)
            assert (await service.futures.wait(rid, 5.0)).error is None  # type: ignore[union-attr]
            assert engine.adapters == {model.adapter}
            service.end_session(model.session_id, "finished")
            await _settle(service)
            assert engine.adapters == set()
            tg.cancel_scope.cancel()

    anyio.run(body)


def test_ended_sessions_are_pruned() -> None:
    service = TinkerService(_Engine(), _States())
    ids = [service.new_session().session_id for _ in range(100)]
    for sid in ids[:99]:
        service.end_session(sid, "finished")
    service.expire_now()
    assert list(service.sessions) == ids[99:]


def test_a_seed_beyond_64_bits_is_a_bad_request(service_client, served) -> None:
    import tinker

    with pytest.raises(tinker.BadRequestError, match=r"seed"):  # not a server failure
        service_client.create_lora_training_client(
            base_model=served.model, rank=1, seed=2**70
        ).result()


def _post(s: socket.socket, path: str, body: dict) -> None:
    data = json.dumps(body).encode()
    s.sendall(
        b"POST /api/v1/%s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data)
    )


def test_a_load_racing_its_session_s_end_leaves_no_client(tiny_model: Path, start_service) -> None:
    """load_weights into a new client, and the session's finish right behind it on the same
    connection: the client the load makes once its state is fetched must not outlive the
    session (it held a place under --max-training-clients for good)."""
    import httpx
    import tinker

    with start_service(tiny_model, max_training_clients=1) as served:
        saver = tinker.ServiceClient(base_url=served.url)
        training = saver.create_lora_training_client(base_model=served.model, rank=1).result()
        path = training.save_state("racing").result().path
        saver.close("success").result()
        sid = httpx.post(
            f"{served.url}/api/v1/create_session",
            json={"tags": [], "user_metadata": {}, "sdk_version": "t"},
        ).json()["session_id"]
        host, port = served.url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port))) as s:
            _post(
                s,
                "load_weights",
                {
                    "path": path,
                    "session_id": sid,
                    "model_seq_id": 0,
                    "optimizer": False,
                    "type": "load_weights",
                },
            )
            _post(s, f"sessions/{sid}/finish", {})
            time.sleep(2.0)
        other = tinker.ServiceClient(base_url=served.url)
        made = other.create_lora_training_client(base_model=served.model, rank=1).result()
        assert made.get_info().lora_rank == 1
        other.close("success").result()
