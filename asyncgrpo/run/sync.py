"""Adapter sync: publish version N, get it onto every replica, retire N - (max_staleness + 1).

The sequence (the trainer's clock, ``perf/weight_sync_s``):

1. publish the saved adapter to the :class:`~asyncgrpo.store.adapters.AdapterStore` (files, then the
   manifest: readers never see half a version);
2. decide where replicas load it from (:class:`AdapterSource`, the one place that decides it):
   a reference into the transport that each replica fetches and verifies itself
   (:class:`TransportSource`: replicas on other machines), or a directory on this host that the
   trainer fetched (:class:`LocalCacheSource`: replicas that share this filesystem);
3. the load on every replica, all or nothing (the proxy rolls back a partial load), while the
   replicas keep serving: no ``/pause``, which would stop every run's generation on a shared
   fleet, and none is needed since a new version is a new name no request uses yet;
4. switch the rollouts to the new name (``on_loaded``), then unload the version that fell out of
   the staleness window, unless an evaluation pinned it (:meth:`AdapterSync.pin`): a pinned
   version stays loaded until its evaluation ends, and is unloaded then if it has left the
   window meanwhile.

So no request ever names an adapter that some replica lacks: the new name is used only once it
is loaded everywhere, and the old one is retired only after the switch (unloading first races
when ``max_staleness=0``: it retires the version rollouts are still requesting, and they get 404). A load that
keeps failing raises :class:`SyncError`; the trainer never trains on as if the replicas had the
new version. A refusal that a retry cannot change (a tampered file, a source the replicas do
not allow) fails at once.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import anyio

from asyncgrpo.errors import ReplicaError, ReplicaHTTPError, SyncError
from asyncgrpo.retry import Backoff, retry
from asyncgrpo.serve.adapter_fetch import adapter_uri
from asyncgrpo.store.adapters import AdapterStore, AdapterVersion
from asyncgrpo.vllm.api import parse_served_name, served_name
from asyncgrpo.vllm.client import VLLMClient

logger = logging.getLogger(__name__)


class AdapterSource(Protocol):
    """Where replicas find version N: a local path, or a transport URI they fetch themselves."""

    async def locate(self, prefix: str, version: int) -> str: ...

    async def forget(self, prefix: str, version: int) -> None:
        """The version has left every replica: drop whatever :meth:`locate` made for it."""
        ...


class TransportSource:
    """Send the replicas a reference into the transport; each fetches the version itself.

    Nothing of the trainer's disk is involved, so replicas can run anywhere that reaches the
    transport (asyncgrpo's vLLM plugin does the fetch, verifying every sha256).
    """

    def __init__(self, store: AdapterStore) -> None:
        self.store = store

    async def locate(self, prefix: str, version: int) -> str:
        return adapter_uri(self.store.transport.url, self.store.prefix, prefix, version)

    async def forget(self, prefix: str, version: int) -> None:
        """Nothing here: each replica's plugin drops its own copy when the version unloads."""


class LocalCacheSource:
    """Fetch each version from the store into a directory the replicas can read.

    Right only when the replicas share this host's filesystem (local replicas, or one mounted
    identically everywhere). The fetch verifies every checksum and appears atomically, so a
    replica never loads half a version.
    """

    def __init__(self, store: AdapterStore, cache_dir: str | Path) -> None:
        self.store = store
        self.cache_dir = Path(cache_dir)

    async def locate(self, prefix: str, version: int) -> str:
        return str(await self.store.fetch(prefix, version, self.cache_dir))

    async def forget(self, prefix: str, version: int) -> None:
        """Remove the fetched copy, so that the cache holds the staleness window, not every
        version of the run (the store keeps them all). Safe only once no replica has the
        version loaded: vLLM may read an adapter's files again after evicting it from memory."""
        path = self.cache_dir / served_name(prefix, version)
        await anyio.to_thread.run_sync(lambda: shutil.rmtree(path, ignore_errors=True))


class AdapterLoader(Protocol):
    """Load and unload on every replica; the proxy by default."""

    async def load(self, name: str, location: str) -> None: ...
    async def unload(self, name: str) -> None: ...
    async def loaded(self) -> list[str]: ...


class ProxyLoader:
    """Broadcast through the asyncgrpo proxy (or a single vLLM server: same API).

    ``fetching``: locations are transport URIs for the replicas' adapter plugin
    (:class:`TransportSource`), not local paths.
    """

    def __init__(self, client: VLLMClient, *, fetching: bool = False) -> None:
        self.client = client
        self.fetching = fetching

    async def load(self, name: str, location: str) -> None:
        if self.fetching:
            await self.client.load_lora_adapter_from(name, location)
        else:
            await self.client.load_lora_adapter(name, location)

    async def unload(self, name: str) -> None:
        if self.fetching:  # the plugin also drops the replica's cached copy
            await self.client.unload_fetched_adapter(name)
        else:
            await self.client.unload_lora_adapter(name)

    async def loaded(self) -> list[str]:
        return await self.client.models()


@dataclass(eq=False, repr=False, kw_only=True)
class AdapterSync:
    """Runs the sync sequence for one run's adapter versions."""

    store: AdapterStore
    source: AdapterSource
    loader: AdapterLoader
    prefix: str
    max_staleness: int
    base_model: str | None = None
    attempts: int = 3
    retry_backoff_s: float = 2.0
    #: versions this process loaded and has not unloaded
    loaded: list[int] = field(default_factory=list, init=False)
    #: the last version loaded everywhere
    newest: int | None = field(default=None, init=False)
    #: the last version this sync published
    published: AdapterVersion | None = field(default=None, init=False)
    #: versions kept loaded past the window
    _pins: Counter[int] = field(default_factory=Counter, init=False)
    #: the trainer's retire and an evaluation's end race
    _unloading: anyio.Lock = field(default_factory=anyio.Lock, init=False)

    def name(self, version: int) -> str:
        return served_name(self.prefix, version)

    async def retire_leftovers(self, newest: int) -> list[str]:
        """Take over this run's versions an earlier (killed) process left on the replicas,
        before ``newest`` is published: those within its staleness window stay loaded (rollout
        processes request them until they see the new policy, and their samples are fresh
        enough to train) and retire as they age out, like this process's own; older ones are
        unloaded now, freeing their slots. Returns the names unloaded."""
        oldest_kept = newest - self.max_staleness
        stale: list[str] = []
        for model in await self.loader.loaded():
            parsed = parse_served_name(model)
            if not parsed or parsed[0] != self.prefix or parsed[1] in self.loaded:
                continue
            if parsed[1] >= oldest_kept:
                self.loaded = sorted({*self.loaded, parsed[1]})
            else:
                stale.append(model)
        for name in stale:
            try:
                await self.loader.unload(name)
            except ReplicaError as exc:
                logger.warning("could not unload leftover adapter %s: %s", name, exc)
        return stale

    def pin(self, version: int) -> str:
        """Keep ``version`` (loaded by this sync) loaded, even once it leaves the staleness
        window, until :meth:`unpin`; returns its name. Synchronous: pinned before any other
        task can retire it."""
        if version not in self.loaded:
            raise SyncError(f"version {version} is not loaded by this run: it cannot be pinned")
        self._pins[version] += 1
        return self.name(version)

    async def restore(self, version: int) -> str:
        """Load ``version``, published earlier and since retired, back on every replica, pinned
        until :meth:`unpin` (which retires it again); returns its name. A sampler of an old
        version is served on demand without the window keeping every version loaded."""
        if version not in self.loaded:
            location = await self.source.locate(self.prefix, version)
            await self._load_everywhere(self.name(version), location)
            self.loaded = sorted({*self.loaded, version})
        return self.pin(version)

    async def unpin(self, version: int) -> None:
        """Release a :meth:`pin`; the version is unloaded now if it has left the window."""
        self._pins[version] -= 1
        if self._pins[version] > 0:
            return
        del self._pins[version]
        if self.newest is not None:
            with anyio.CancelScope(shield=True):
                await self._retire(self.newest)

    def pinned(self) -> list[int]:
        """The versions kept loaded past the window now."""
        return sorted(self._pins)

    async def unload_all(self, timeout_s: float = 30.0) -> None:
        """Unload every version this process loaded (on exit: the store keeps them all)."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(timeout_s):
            await self._unload(list(self.loaded))

    async def sync(
        self,
        version: int,
        local_dir: str | Path,
        *,
        step: int,
        on_loaded: Callable[[str, int], Awaitable[None]] | None = None,
    ) -> dict[str, float]:
        """Publish ``local_dir`` as ``version`` and load it everywhere; returns timing metrics.

        ``on_loaded(name, version)`` runs once every replica has the new version and before the
        oldest is unloaded: switch the rollouts there. With ``max_staleness=0`` the version
        retired is the one rollouts were still requesting, so the switch must come first.
        """
        t0 = time.perf_counter()
        self.published = await self.store.publish(
            self.prefix, version, Path(local_dir), step=step, base_model=self.base_model
        )
        t1 = time.perf_counter()
        location = await self.source.locate(self.prefix, version)
        t2 = time.perf_counter()
        await self._load_everywhere(self.name(version), location)
        self.loaded.append(version)
        self.newest = version
        if on_loaded is not None:
            await on_loaded(self.name(version), version)
        t3 = time.perf_counter()
        await self._retire(version)
        t4 = time.perf_counter()
        return {
            "perf/weight_sync_s": t4 - t0,
            "perf/weight_sync/publish_s": t1 - t0,
            "perf/weight_sync/fetch_s": t2 - t1,
            "perf/weight_sync/load_s": t3 - t2,
            "perf/weight_sync/unload_s": t4 - t3,
        }

    async def _load_everywhere(self, name: str, location: str) -> None:
        async def attempt(number: int) -> None:
            try:
                await self.loader.load(name, location)
            except ReplicaError as exc:
                logger.warning(
                    "loading %s failed (attempt %d/%d): %s", name, number, self.attempts, exc
                )
                if _permanent(exc):
                    raise SyncError(
                        f"adapter {name} was refused and a retry cannot change that; training "
                        f"stops rather than train on a version the replicas lack: {exc}"
                    ) from exc
                raise

        try:
            await retry(
                attempt,
                attempts=self.attempts,
                backoff=Backoff(self.retry_backoff_s),
                retry_on=ReplicaError,
            )
        except ReplicaError as last:
            raise SyncError(
                f"adapter {name} could not be loaded on every replica after {self.attempts} "
                "attempts; training stops rather than train on a version the replicas lack: "
                f"{last}"
            ) from last

    async def _retire(self, newest: int) -> None:
        """Unload the versions older than the window, except the pinned ones."""
        oldest_kept = newest - self.max_staleness
        await self._unload([v for v in self.loaded if v < oldest_kept and v not in self._pins])

    async def _unload(self, versions: list[int]) -> None:
        """Unload each of ``versions``; never fatal. One whose unload failed (not one no replica
        knows: vLLM may have evicted it) stays in :attr:`loaded` and is tried again at the next
        retire and at exit: the replica that missed it would serve, and cache, it until it
        restarts, since the proxy replays no unload to a replica that stayed in rotation."""
        async with self._unloading:
            for version in versions:
                if version in self.loaded:  # another caller may have unloaded it meanwhile
                    await self._unload_one(version)

    async def _unload_one(self, version: int) -> None:
        try:
            await self.loader.unload(self.name(version))
        except ReplicaError as exc:
            if not (isinstance(exc, ReplicaHTTPError) and exc.status == 404):
                logger.warning(
                    "unloading %s failed (tried again later): %s", self.name(version), exc
                )
                return
        self.loaded.remove(version)
        await self.source.forget(self.prefix, version)


def _permanent(exc: ReplicaError) -> bool:
    """A refusal a retry cannot change: bad request, forbidden source, tampered files."""
    return isinstance(exc, ReplicaHTTPError) and exc.status in (400, 401, 403, 422)
