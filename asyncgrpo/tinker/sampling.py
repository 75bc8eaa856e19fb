"""Sampling through the asyncgrpo proxy: each training client's published adapter versions,
sampling sessions, LoRA-slot bookings, and a ``SampleRequest`` as vLLM completions.

A training client's ``save_weights_for_sampler`` publishes its adapter as the next version of
an adapter named by its model id through the :class:`~asyncgrpo.store.adapters.AdapterStore`
and loads it on every replica through the proxy, all or nothing, with the run layer's own
:class:`~asyncgrpo.run.sync.AdapterSync` (the newest ``keep`` versions stay loaded). Each
client books ``keep + 1`` LoRA slots on the proxy as a run does, so clients share the fleet
as a sweep's runs do. A sampling session is a name vLLM serves (a version, or the base model);
sampling a version that has left the replicas loads it back from the store into the client's
spare slot (:meth:`Sampler.ensure_loaded`). A version of a client that has ended is loaded
back under a booking of one slot of its own; such bookings are given back least recently
used first whenever another booking finds the replicas' slots taken.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections import OrderedDict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio

from asyncgrpo.errors import ConfigError, NoRoom, ReplicaHTTPError
from asyncgrpo.proxy.admin_client import ProxyClient
from asyncgrpo.run.preflight import check_adapter_fetching
from asyncgrpo.run.sync import AdapterSync, LocalCacheSource, ProxyLoader, TransportSource
from asyncgrpo.store.adapters import AdapterStore
from asyncgrpo.tinker.completions import (
    Ask,
    Limits,
    completions_body,
    sample_result,
    target_body,
    target_result,
)
from asyncgrpo.tinker.wire import SampleResult, WireError
from asyncgrpo.vllm import api
from asyncgrpo.vllm.api import parse_served_name

__all__ = [
    "Sampler",
    "SlotsFull",
    "UnknownSampler",
    "open_sampler",
    "replica_refusal",
    "replicas_fetch",
]

logger = logging.getLogger(__name__)


class UnknownSampler(LookupError):
    """A sampling session, path or model this service does not serve."""


class SlotsFull(WireError):
    """No LoRA slots are left for a booking (after giving back the ended clients' ones)."""


class Sampler:
    """The fleet side of the service: the proxy, the adapter store and what names are served."""

    def __init__(
        self,
        client: ProxyClient,
        store: AdapterStore,
        *,
        base_model: str,
        cache_dir: Path,
        keep: int,
        fetching: bool = False,
        limits: Limits | None = None,
        max_loras: int | None = None,
    ) -> None:
        self.client = client
        self.fetching = fetching  #: replicas fetch each version from the transport themselves
        self.store = store
        self.base_model = base_model
        self.cache_dir = cache_dir
        self.keep = keep
        #: what the replicas take (prompt and sampled tokens, top logprobs)
        self.limits = limits or Limits()
        self.max_loras = max_loras  #: the replicas' --max-loras, if they said
        self.paths: dict[str, str] = {}  #: tinker:// path -> served adapter name
        self.sessions: dict[str, str] = {}  #: sampling session id -> served name
        #: sampling session id -> the session (ServiceClient) that made it
        self.owners: dict[str, str | None] = {}
        self._syncs: dict[str, AdapterSync] = {}
        self._tokens: dict[str, str] = {}
        #: ended clients whose versions are loaded back, least recently used first
        self._orphans: OrderedDict[str, None] = OrderedDict()
        #: per client, the one version older than its newest ``keep`` loaded back on demand
        self._restored: dict[str, int] = {}
        self._locks: dict[str, anyio.Lock] = {}
        self._last: dict[str, int] = {}  #: per client, the newest version it published

    async def book(self, model_id: str, *, orphan: bool = False) -> None:
        """Book the client's LoRA slots: ``keep + 1`` for a live client, one for an ended
        client's version loaded back. When the replicas' slots are taken, the ended clients'
        bookings are given back (least recently used first) until this one fits; SlotsFull
        naming this service's flags if it still does not."""
        slots = 1 if orphan else self.keep + 1
        token = self._tokens.setdefault(model_id, secrets.token_hex(16))
        while True:
            try:
                await self.client.register_run(model_id, lora_slots=slots, token=token)
                break
            except NoRoom as exc:
                victim = next((m for m in self._orphans if m != model_id), None)
                if victim is None:
                    self._tokens.pop(model_id, None)
                    raise SlotsFull(self._full(model_id, slots)) from exc
                logger.info(
                    "giving back the slot of %s (an ended client's version, least "
                    "recently sampled) for %s",
                    victim,
                    model_id,
                )
                await self._evict(victim)
        if orphan:
            self._orphans[model_id] = None

    def _full(self, model_id: str, slots: int) -> str:
        live = len([m for m in self._tokens if m not in self._orphans and m != model_id])
        total = f"--max-loras {self.max_loras}" if self.max_loras else "--max-loras"
        return (
            f"no LoRA slots left on the replicas for {model_id}: it needs {slots} (--sampler-keep "
            f"{self.keep} + 1) and the replicas' {total} are taken by {live} live training "
            "client(s) of this service and whatever else shares the proxy. Start the service "
            "with a larger --max-loras (with --replicas) or a smaller --sampler-keep, or end a "
            "client: ServiceClient.close(), or its session ends --session-timeout-s after its "
            "heartbeats stop"
        )

    async def _evict(self, model_id: str) -> None:
        """Give back an ended client's booking: its loaded-back version leaves the replicas;
        its sampling sessions stay, and load it again when next sampled."""
        self._orphans.pop(model_id, None)
        sync = self._syncs.pop(model_id, None)
        self._restored.pop(model_id, None)
        if sync is not None:
            await sync.unload_all()
        if model_id in self._tokens:
            await self.client.release_run(model_id, token=self._tokens.pop(model_id))

    async def release(self, model_id: str) -> None:
        """The client's versions leave the replicas, its paths and sampling sessions this
        service (a sample of one is then NotFound), its LoRA slots go back to the proxy."""
        mine = {
            n
            for n in [*self.paths.values(), *self.sessions.values()]
            if (parse_served_name(n) or ("", 0))[0] == model_id
        }
        self.paths = {p: n for p, n in self.paths.items() if n not in mine}
        self.sessions = {s: n for s, n in self.sessions.items() if n not in mine}
        self.owners = {s: o for s, o in self.owners.items() if s in self.sessions}
        self._locks.pop(model_id, None)
        await self._evict(model_id)

    async def close(self) -> None:
        """Unload every client's versions and give back their slots (at shutdown)."""
        for model_id in sorted({*self._syncs, *self._tokens}):
            try:
                await self.release(model_id)
            except Exception as exc:  # the proxy lets bookings lapse; keep closing the others
                logger.warning("could not release %s on the proxy: %s", model_id, exc)

    def _sync(self, model_id: str) -> AdapterSync:
        sync = self._syncs.get(model_id)
        if sync is None:
            source = (
                TransportSource(self.store)
                if self.fetching
                else LocalCacheSource(self.store, self.cache_dir)
            )
            sync = self._syncs[model_id] = AdapterSync(
                store=self.store,
                source=source,
                loader=ProxyLoader(self.client, fetching=self.fetching),
                prefix=model_id,
                max_staleness=self.keep - 1,
                base_model=self.base_model,
            )
        return sync

    async def publish(self, model_id: str, local_dir: Path, step: int) -> str:
        """Publish ``local_dir`` as the client's next version, loaded everywhere; its name.
        Never a version number used before in this service (one deleted from the store
        included): vLLM and the replicas' caches key by the name."""
        sync = self._sync(model_id)
        async with self._lock(model_id):
            await self._drop_restored(model_id, sync)  # within the keep + 1 slots booked
            version = max(await self.store.latest(model_id) or 0, self._last.get(model_id, 0)) + 1
            self._last[model_id] = version
            await sync.sync(version, local_dir, step=step)
        return sync.name(version)

    def _lock(self, model_id: str) -> anyio.Lock:
        return self._locks.setdefault(model_id, anyio.Lock())

    async def _drop_restored(self, model_id: str, sync: AdapterSync) -> None:
        version = self._restored.pop(model_id, None)
        if version is not None:
            await sync.unpin(version)  # retired: it is older than the window
            if sync.newest is None:  # an ended client's: no window retires it, so unload here
                await sync.unload_all()

    async def ensure_loaded(self, served: str) -> None:
        """Load a client's version that has left the replicas back from the transport, in place
        of the one loaded back before (if any): a sampling client of any saved version keeps
        working while the replicas hold each client's newest ``keep`` and one more. A version
        of a client no longer live here (it ended, or the service restarted since) is loaded
        the same way, under a booking of one slot of its own, which is given back when a
        booking finds the replicas' slots taken and it is the least recently sampled."""
        parsed = parse_served_name(served)
        if parsed is None:
            return
        model_id, version = parsed
        if model_id in self._orphans:
            self._orphans.move_to_end(model_id)
        sync = self._syncs.get(model_id)
        if sync is not None and version in sync.loaded:
            return
        async with self._lock(model_id):
            if model_id not in self._tokens:
                await self.book(model_id, orphan=True)
            sync = self._sync(model_id)
            if version in sync.loaded:
                return
            await self._drop_restored(model_id, sync)
            await sync.restore(version)
            self._restored[model_id] = version
            logger.info("loaded %s back on the replicas for a sampling client", served)

    def new_session(self, served: str, owner: str | None) -> str:
        """A sampling session of ``served``, made by session ``owner`` (records of its samples
        belong to that session)."""
        sid = f"samp-{secrets.token_hex(6)}"
        self.sessions[sid] = served
        self.owners[sid] = owner
        return sid

    def path_of(self, session: str) -> str | None:
        """The ``tinker://`` path a sampling session samples, if it was made from one."""
        served = self.sessions[session]
        return next((p for p, name in self.paths.items() if name == served), None)

    def resolve(self, *, session: str | None, path: str | None, base: str | None) -> str:
        """The served name a sampling request or session names; UnknownSampler if none."""
        if session is not None:
            if session not in self.sessions:
                raise UnknownSampler(f"no sampling session {session!r} on this service")
            return self.sessions[session]
        if path is not None:
            if path not in self.paths:
                raise UnknownSampler(
                    f"no sampler weights at {path!r}: save them first with save_weights_for_sampler"
                )
            return self.paths[path]
        return self.base_model

    async def sample(self, served: str, ask: Ask) -> SampleResult:
        """The samples (and prompt logprobs) ``ask`` wants of the version ``served``. A version
        given back while this request was on its way is loaded again once."""
        for attempt in range(2):
            await self.ensure_loaded(served)
            try:
                return await self._sample(served, ask)
            except ReplicaHTTPError as exc:
                gone = exc.status == 404 and parse_served_name(served) is not None
                if not gone or attempt:
                    raise replica_refusal(exc) from None
        raise AssertionError("unreachable")

    async def _sample(self, served: str, ask: Ask) -> SampleResult:
        if ask.targets is None:
            return sample_result(await self.client.completions(completions_body(served, ask)), ask)
        async with anyio.create_task_group() as tg:
            answers: dict[str, Any] = {}

            async def call(key: str, body: dict[str, Any]) -> None:
                answers[key] = await self.client.completions(body)

            tg.start_soon(call, "samples", completions_body(served, ask))
            tg.start_soon(call, "targets", target_body(served, ask))
        result = sample_result(answers["samples"], ask)
        return SampleResult(
            sequences=result.sequences,
            prompt_logprobs=result.prompt_logprobs,
            topk_prompt=result.topk_prompt,
            target=target_result(answers["targets"], ask),
        )


def replica_refusal(exc: ReplicaHTTPError) -> Exception:
    """What a client is told of a replica's error answer: the limit when vLLM found the request
    too long, else the status only (vLLM's text goes to this service's log, not the client)."""
    logger.warning("a replica refused a sample request: %s", exc)
    if api.context_length_refusal(exc.status, exc.body):
        return WireError(
            "the prompt and max_tokens are more tokens than the replicas' "
            "--max-model-len: shorten the prompt, lower max_tokens, or start the "
            "service with a larger --max-model-len"
        )
    if 400 <= exc.status < 500:
        return WireError(
            f"the replicas refused this sample request ({exc.status}); the "
            "service's log has their answer"
        )
    return RuntimeError(
        f"the replicas failed this sample request ({exc.status}); the "
        "service's log has their answer"
    )


async def replicas_fetch(client: ProxyClient, transport_url: str, delivery: str) -> bool:
    """Whether the replicas behind the proxy fetch each version from ``transport_url``
    themselves (``delivery`` 'fetch', or 'auto' when every replica's adapter plugin may);
    'fetch' that a replica may not do is a ConfigError naming the replica and the fix."""
    if delivery == "path":
        return False
    try:
        check_adapter_fetching(await client.adapter_plugin_info(), transport_url)
    except ConfigError as exc:
        if delivery == "fetch":
            raise
        logger.info("replicas load sampler weights from this host's copies: %s", exc)
        return False
    return True


async def _server_info(client: ProxyClient) -> Any:
    """One replica's ``/server_info`` through the proxy (None if none says: the limits are
    then left to the replicas, whose refusals are reworded)."""
    try:
        return await client.server_info()
    except Exception as exc:  # an older replica, dev mode off: check nothing here
        logger.info("the replicas did not say their limits (%s): not checked before sampling", exc)
        return None


@contextlib.asynccontextmanager
async def open_sampler(
    proxy_url: str,
    admin_key: str | None,
    store: AdapterStore,
    *,
    base_model: str,
    work_dir: Path,
    keep: int,
    delivery: str = "path",
) -> AsyncIterator[Sampler]:
    """A :class:`Sampler` on the proxy at ``proxy_url``, publishing to ``store`` (replicas
    fetching from it or loading this host's copies, by ``delivery``); every client's versions
    unloaded and slots given back at the end."""
    async with ProxyClient(proxy_url, api_key=admin_key, timeout_s=600) as client:
        fetching = await replicas_fetch(client, store.transport.url, delivery)
        logger.info(
            "replicas %s",
            "fetch sampler weights from " + store.transport.url
            if fetching
            else "load sampler weights from copies on this host",
        )
        info = await _server_info(client)
        limits = Limits(
            max_model_len=api.max_model_len_of(info), max_logprobs=api.max_logprobs_of(info)
        )
        sampler = Sampler(
            client,
            store,
            base_model=base_model,
            cache_dir=work_dir / "cache",
            keep=keep,
            fetching=fetching,
            limits=limits,
            max_loras=api.lora_slots_of(info),
        )
        try:
            yield sampler
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(30):
                await sampler.close()
