"""Sampler weights of a client no longer live here (it ended, or the service restarted) are
loaded back on demand under a booking of their own, within the slots booked (no vLLM: a fake
proxy records what the sampler asks of it)."""

from __future__ import annotations

from pathlib import Path


class FakeProxy:
    def __init__(self) -> None:
        self.bookings: dict[str, int] = {}
        self.served: set[str] = set()
        self.most = 0

    async def register_run(self, run: str, *, lora_slots: int, token: str) -> None:
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
    sampler = Sampler(proxy, AdapterStore(str(tmp_path)), base_model="base",  # type: ignore[arg-type]
                      cache_dir=tmp_path / "cache", keep=1, fetching=True)  # fmt: skip

    async def body() -> None:
        await sampler.ensure_loaded("run-a-v1")
        assert proxy.bookings == {"run-a": 2} and proxy.served == {"run-a-v1"}
        await sampler.ensure_loaded("run-a-v1")  # loaded already: nothing more
        await sampler.ensure_loaded("run-a-v3")  # in place of v1, as a live client's would be
        assert proxy.served == {"run-a-v3"} and proxy.most == 1
        await sampler.ensure_loaded("base")  # the base model needs nothing
        await sampler.close()
        assert proxy.bookings == {} and proxy.served == set()

    anyio.run(body)
