"""Sessions whose heartbeats stop expire, releasing their clients; the cap on live clients."""

from __future__ import annotations

import time
from pathlib import Path

import pytest


def test_expired_sessions_are_the_open_ones_past_the_timeout() -> None:
    from asyncgrpo.tinker.service import Session, expired_sessions

    sessions = [Session("old", 0.0), Session("new", 9.0), Session("done", 0.0, finished=True)]
    assert expired_sessions(sessions, now=10.0, timeout_s=5.0) == ["old"]
    assert expired_sessions(sessions, now=10.0, timeout_s=20.0) == []


def test_an_abandoned_session_expires_and_frees_its_place_under_the_cap(
    tiny_model: Path, start_service
) -> None:
    import tinker
    from tinker import types

    still = types.AdamParams(learning_rate=0.0)  # a request that changes nothing
    # get_info() answers from the SDK's cache: optim_step is what reaches the service.
    # The SDK heartbeats every 10 s, so with a 1.5 s timeout a session lives only while it
    # makes requests: `abandoned` stops after its first, `alive` keeps asking.
    with start_service(tiny_model, session_timeout_s=1.5, max_training_clients=2) as served:
        abandoned, alive = (tinker.ServiceClient(base_url=served.url) for _ in range(2))
        gone = abandoned.create_lora_training_client(base_model=served.model, rank=2).result()
        kept = alive.create_lora_training_client(base_model=served.model, rank=2).result()
        with pytest.raises(
            tinker.BadRequestError, match=r"holds 2 training clients.*--max-training-clients"
        ):
            alive.create_lora_training_client(base_model=served.model, rank=2).result()
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            kept.optim_step(still).result()
            time.sleep(0.3)
        with pytest.raises(tinker.NotFoundError, match="no training client"):
            gone.optim_step(still).result()
        second = alive.create_lora_training_client(base_model=served.model, rank=1).result()
        assert second.get_info().lora_rank == 1
        kept.optim_step(still).result()
        alive.close("success").result()
        # Closing `abandoned` (its session long expired) stops its heartbeat thread, which
        # would otherwise print a failure every 10 s for the rest of the test session.
        abandoned.close("interrupted").result()


def test_an_expired_session_s_adapters_and_optimizers_leave_the_trainer(tiny_model: Path) -> None:
    import anyio

    from asyncgrpo.tinker.engine import Engine, LoraSpec
    from asyncgrpo.tinker.service import TinkerService, TrainingModel

    engine = Engine(str(tiny_model), dtype="float32", lora_alpha=16.0)
    service = TinkerService(engine, states=None, session_timeout_s=0.4)
    spec = LoraSpec(rank=2, seed=0, train_mlp=True, train_attn=True)

    async def body() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(service.run)
            gone, kept = service.new_session(), service.new_session()
            models = [TrainingModel(f"{s.session_id}_m0", s.session_id, 2) for s in (gone, kept)]
            for model in models:
                service.add_model(model)
                engine.create(model.adapter, spec)
            for _ in range(15):
                await anyio.sleep(0.1)
                service.touch(kept.session_id)
            assert not engine.has(models[0].adapter) and engine.has(models[1].adapter)
            assert list(service.models) == [models[1].model_id]
            assert not service.is_open(gone.session_id) and service.is_open(kept.session_id)
            tg.cancel_scope.cancel()

    anyio.run(body)


def test_a_released_client_s_paths_and_sampling_sessions_are_forgotten(tmp_path: Path) -> None:
    """The sampler's own map forgets them (a path is resolved again through the checkpoint
    index, and loaded back on demand: tests/tinker/test_orphan_paths.py)."""
    import anyio

    from asyncgrpo.tinker.sampling import Sampler, UnknownSampler

    # Nothing was booked or published, so releasing asks nothing of the proxy.
    sampler = Sampler(None, None, base_model="base", cache_dir=tmp_path, keep=1)  # type: ignore[arg-type]
    sampler.paths = {"tinker://a/sampler_weights/x": "a-v1", "tinker://b/sampler_weights/y": "b-v2"}
    gone, kept, base = (sampler.new_session(n, None) for n in ("a-v1", "b-v2", "base"))
    anyio.run(sampler.release, "a")
    with pytest.raises(UnknownSampler, match="no sampler weights"):
        sampler.resolve(session=None, path="tinker://a/sampler_weights/x", base=None)
    with pytest.raises(UnknownSampler, match="no sampling session"):
        sampler.resolve(session=gone, path=None, base=None)
    assert sampler.resolve(session=kept, path=None, base=None) == "b-v2"
    assert sampler.resolve(session=base, path=None, base=None) == "base"


class _Slots:
    """A fleet of ``capacity`` clients' slots (the sampler's side of booking)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.booked: set[str] = set()

    async def book(self, model_id: str) -> None:
        from asyncgrpo.tinker.sampling import SlotsFull

        if len(self.booked) >= self.capacity:
            raise SlotsFull(f"no LoRA slots left for {model_id}")
        self.booked.add(model_id)

    async def release(self, model_id: str) -> None:
        self.booked.discard(model_id)


class _Engine:
    def create(self, model_id: str, spec: object) -> None:
        pass

    def remove(self, model_id: str) -> None:
        pass


class _States:
    async def start_run(self, run_id: str, spec: object) -> None:
        pass


def test_a_client_that_does_not_fit_waits_for_a_quiet_session_to_expire() -> None:
    """Two sessions hold the fleet. While both heartbeat, a third client is refused as soon as
    both have spoken; once one stops (a program that ended without closing its ServiceClient),
    the third waits until it expires and gets its slots."""
    import anyio

    from asyncgrpo.tinker.engine import LoraSpec
    from asyncgrpo.tinker.routes import add_client
    from asyncgrpo.tinker.sampling import SlotsFull
    from asyncgrpo.tinker.service import TinkerService, TrainingModel

    spec = LoraSpec(rank=1, seed=0, train_mlp=True, train_attn=True)
    slots = _Slots(capacity=2)
    service = TinkerService(_Engine(), states=_States(), sampler=slots, session_timeout_s=1.0)
    speaking = {"gone": True}

    async def body() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(service.run)
            gone, alive, new = (service.new_session() for _ in range(3))
            models = [
                TrainingModel(f"{s.session_id}_m0", s.session_id, 1) for s in (gone, alive, new)
            ]

            async def heartbeats() -> None:
                while True:  # the waiting client's session heartbeats too, as the SDK's does
                    service.touch(alive.session_id)
                    service.touch(new.session_id)
                    if speaking["gone"]:
                        service.touch(gone.session_id)
                    await anyio.sleep(0.1)

            for model in models[:2]:
                service.add_model(model)
                await service.book_slots(model)
            tg.start_soon(heartbeats)
            start = time.monotonic()
            with pytest.raises(SlotsFull):  # both holders speak: refused, not waited on
                await service.book_slots(models[2])
            assert time.monotonic() - start < 0.9
            speaking["gone"] = False
            start = time.monotonic()
            # as create_model does: counted, then made beside the queue, so that the worker runs the quiet
            # session's removal meanwhile (booking from the worker would wait on itself)
            service.add_model(models[2])
            rid = service.spawn(lambda: add_client(service, models[2], spec), models[2].model_id)
            outcome = await service.futures.wait(rid, 10.0)
            assert outcome is not None and outcome.error is None, outcome
            waited = time.monotonic() - start
            assert 0.5 < waited < 3.0, waited
            assert slots.booked == {models[1].adapter, models[2].adapter}
            assert not service.is_open(gone.session_id) and service.is_open(alive.session_id)
            tg.cancel_scope.cancel()

    anyio.run(body)
