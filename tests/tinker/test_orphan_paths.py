"""Sampler weights of a client no longer live here (it ended, or the service restarted) are
loaded back on demand under a booking of one slot of their own, given back least recently used
first when another booking needs the slots (no vLLM: a fake proxy records what the sampler asks
of it and refuses bookings past its slots as the proxy does, 409)."""

from __future__ import annotations

from pathlib import Path


class FakeProxy:
    def __init__(self, max_loras: int = 64) -> None:
        self.max_loras = max_loras
        self.bookings: dict[str, int] = {}
        self.served: set[str] = set()
        self.most = 0

    async def register_run(self, run: str, *, lora_slots: int, token: str) -> None:
        from asyncgrpo.errors import NoRoom

        others = sum(n for r, n in self.bookings.items() if r != run)
        if others + lora_slots > self.max_loras:
            raise NoRoom(f"run {run} needs {lora_slots} LoRA slots")
        self.bookings[run] = lora_slots

    async def release_run(self, run: str, *, token: str) -> None:
        del self.bookings[run]

    async def load_lora_adapter_from(self, name: str, location: str) -> None:
        self.served.add(name)
        self.most = max(self.most, len(self.served))

    async def unload_fetched_adapter(self, name: str) -> None:
        self.served.discard(name)

    async def models(self) -> list[str]:
        return sorted(self.served)


def test_an_ended_client_s_versions_load_back_one_at_a_time(tmp_path: Path) -> None:
    import anyio

    from asyncgrpo.store.adapters import AdapterStore
    from asyncgrpo.tinker.sampling import Sampler

    proxy = FakeProxy()
    sampler = Sampler(
        proxy,
        AdapterStore(str(tmp_path)),
        base_model="base",  # type: ignore[arg-type]
        cache_dir=tmp_path / "cache",
        keep=1,
        fetching=True,
    )

    async def body() -> None:
        await sampler.ensure_loaded("run-a-v1")
        assert proxy.bookings == {"run-a": 1} and proxy.served == {"run-a-v1"}
        await sampler.ensure_loaded("run-a-v1")  # loaded already: nothing more
        await sampler.ensure_loaded("run-a-v3")  # in place of v1, as a live client's would be
        assert proxy.served == {"run-a-v3"} and proxy.most == 1
        await sampler.ensure_loaded("base")  # the base model needs nothing
        await sampler.close()
        assert proxy.bookings == {} and proxy.served == set()

    anyio.run(body)


def test_ended_clients_slots_are_given_back_least_recently_used_first(tmp_path: Path) -> None:
    import anyio
    import pytest

    from asyncgrpo.store.adapters import AdapterStore
    from asyncgrpo.tinker.sampling import Sampler, SlotsFull

    proxy = FakeProxy(max_loras=4)
    sampler = Sampler(
        proxy,
        AdapterStore(str(tmp_path)),
        base_model="base",  # type: ignore[arg-type]
        cache_dir=tmp_path / "cache",
        keep=1,
        fetching=True,
        max_loras=4,
    )

    async def body() -> None:
        await sampler.book("live")  # keep + 1 = 2 slots
        await sampler.ensure_loaded("old-a-v1")
        await sampler.ensure_loaded("old-b-v2")
        assert proxy.bookings == {"live": 2, "old-a": 1, "old-b": 1}
        await sampler.ensure_loaded("old-a-v1")  # a sample: old-a is now the most recent
        await sampler.ensure_loaded("old-c-v1")  # full: old-b, least recently sampled, goes
        assert proxy.bookings == {"live": 2, "old-a": 1, "old-c": 1}
        assert proxy.served == {"old-a-v1", "old-c-v1"}
        await sampler.book("new")  # a new live client takes both ended clients' slots
        assert proxy.bookings == {"live": 2, "new": 2} and proxy.served == set()
        with pytest.raises(
            SlotsFull,
            match=r"needs 2 \(--sampler-keep 1 \+ 1\).*--max-loras 4 "
            r"are taken by 2 live training client",
        ):
            await sampler.book("third")
        await sampler.ensure_loaded("old-b-v2")  # sampled again: refused the same way, nothing
        # of the live clients is given back for an ended one

    with pytest.raises(SlotsFull):
        anyio.run(body)
