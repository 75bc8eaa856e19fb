"""Sampling through the asyncgrpo proxy: each training client's published adapter versions,
sampling sessions, and ``SampleRequest`` as one vLLM completion of ``n`` samples.

A training client's ``save_weights_for_sampler`` publishes its adapter as the next version of
an adapter named by its model id through the :class:`~asyncgrpo.store.adapters.AdapterStore`
and loads it on every replica through the proxy, all or nothing, with the run layer's own
:class:`~asyncgrpo.run.sync.AdapterSync` (the newest ``keep`` versions stay loaded). Each
client books ``keep + 1`` LoRA slots on the proxy as a run does, so clients share the fleet
as a sweep's runs do. A sampling session is a name vLLM serves (a version, or the base model);
sampling a version that has left the replicas loads it back from the store into the client's
spare slot (:meth:`Sampler.ensure_loaded`).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from asyncgrpo.errors import ConfigError
from asyncgrpo.proxy.admin_client import ProxyClient
from asyncgrpo.run.preflight import check_adapter_fetching
from asyncgrpo.run.sync import AdapterSync, LocalCacheSource, ProxyLoader, TransportSource
from asyncgrpo.store.adapters import AdapterStore
from asyncgrpo.tinker.wire import SampledSeq, SampleResult, WireError
from asyncgrpo.vllm.api import parse_served_name

__all__ = [
    "Sampler",
    "UnknownSampler",
    "completions_body",
    "open_sampler",
    "replicas_fetch",
    "sample_result",
]

logger = logging.getLogger(__name__)

#: The SDK's stop reasons for vLLM's finish reasons.
_STOP_REASONS = {"stop": "stop", "length": "length", "abort": "length"}


class UnknownSampler(LookupError):
    """A sampling session, path or model this service does not serve."""


def completions_body(
    model: str, prompt: list[int], num_samples: int, params: Any, prompt_logprobs: bool
) -> dict[str, Any]:
    """The vLLM ``/v1/completions`` body of one ``SampleRequest`` (``params``: its
    ``SamplingParams``): ``n`` samples of token ids with their logprobs."""
    if not prompt:
        raise WireError("the prompt is empty: give at least one token")
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "n": num_samples,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "logprobs": 0,
        "return_token_ids": True,
    }
    if params.max_tokens is not None:
        body["max_tokens"] = params.max_tokens
    if params.seed is not None:
        body["seed"] = params.seed
    stop = params.stop
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and len(stop) == 0:
        body["ignore_eos"] = True
    elif stop is not None and all(isinstance(s, int) for s in stop):
        body["stop_token_ids"] = list(stop)
    elif stop is not None:
        body["stop"] = list(stop)
    if prompt_logprobs:
        body["prompt_logprobs"] = 0
    return body


def _prompt_logprobs(entries: list[Any], prompt: list[int]) -> np.ndarray:
    """vLLM's per-position prompt logprobs (dicts by token id) as the SDK's array; position 0,
    which has no context, is NaN as the SDK's ``None``."""
    out = np.full(len(prompt), np.nan, dtype=np.float32)
    for i, entry in enumerate(entries[: len(prompt)]):
        if entry:
            found = entry.get(str(prompt[i])) or next(iter(entry.values()))
            out[i] = found["logprob"]
    return out


def sample_result(
    data: Mapping[str, Any], prompt: list[int], prompt_logprobs: bool
) -> SampleResult:
    """The samples of a vLLM completion answer, in the order of its choices."""
    sequences = []
    choices = sorted(data.get("choices") or [], key=lambda c: c.get("index", 0))
    for choice in choices:
        tokens = choice.get("token_ids") or []
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
        if len(logprobs) != len(tokens):
            raise RuntimeError("the replica returned no logprob for some sampled tokens")
        sequences.append(SampledSeq(tokens=np.asarray(tokens, dtype=np.int32),
                                    logprobs=np.asarray(logprobs, dtype=np.float32),
                                    stop_reason=_STOP_REASONS.get(choice.get("finish_reason"),
                                                                  "length")))  # fmt: skip
    prompt_lp = None
    if prompt_logprobs:
        entries = next((c["prompt_logprobs"] for c in choices if c.get("prompt_logprobs")), [])
        prompt_lp = _prompt_logprobs(entries, prompt)
    return SampleResult(sequences=sequences, prompt_logprobs=prompt_lp)


class Sampler:
    """The fleet side of the service: the proxy, the adapter store and what names are served."""

    def __init__(self, client: ProxyClient, store: AdapterStore, *, base_model: str,
                 cache_dir: Path, keep: int, fetching: bool = False) -> None:  # fmt: skip
        self.client = client
        self.fetching = fetching  #: replicas fetch each version from the transport themselves
        self.store = store
        self.base_model = base_model
        self.cache_dir = cache_dir
        self.keep = keep
        self.paths: dict[str, str] = {}  #: tinker:// path -> served adapter name
        self.sessions: dict[str, str] = {}  #: sampling session id -> served name
        self._syncs: dict[str, AdapterSync] = {}
        self._tokens: dict[str, str] = {}
        #: per client, the one version older than its newest ``keep`` loaded back on demand
        self._restored: dict[str, int] = {}
        self._locks: dict[str, anyio.Lock] = {}
        self._last: dict[str, int] = {}  #: per client, the newest version it published

    async def book(self, model_id: str) -> None:
        """Book ``keep + 1`` LoRA slots for the client (a refusal names ``--max-loras``)."""
        token = self._tokens.setdefault(model_id, secrets.token_hex(16))
        await self.client.register_run(model_id, lora_slots=self.keep + 1, token=token)

    async def release(self, model_id: str) -> None:
        """The client's versions leave the replicas, its paths and sampling sessions this
        service (a sample of one is then NotFound), its LoRA slots go back to the proxy."""
        mine = {n for n in [*self.paths.values(), *self.sessions.values()]
                if (parse_served_name(n) or ("", 0))[0] == model_id}  # fmt: skip
        self.paths = {p: n for p, n in self.paths.items() if n not in mine}
        self.sessions = {s: n for s, n in self.sessions.items() if n not in mine}
        sync = self._syncs.pop(model_id, None)
        self._restored.pop(model_id, None)
        self._locks.pop(model_id, None)
        if sync is not None:
            await sync.unload_all()
        if model_id in self._tokens:
            await self.client.release_run(model_id, token=self._tokens.pop(model_id))

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
            source = (TransportSource(self.store) if self.fetching
                      else LocalCacheSource(self.store, self.cache_dir))  # fmt: skip
            sync = self._syncs[model_id] = AdapterSync(
                store=self.store, source=source,
                loader=ProxyLoader(self.client, fetching=self.fetching), prefix=model_id,
                max_staleness=self.keep - 1, base_model=self.base_model,
            )  # fmt: skip
        return sync

    async def publish(self, model_id: str, local_dir: Path, step: int) -> str:
        """Publish ``local_dir`` as the client's next version, loaded everywhere; its name.
        Never a version number used before in this service (one deleted from the store
        included): vLLM and the replicas' caches key by the name."""
        sync = self._sync(model_id)
        async with self._lock(model_id):
            await self._drop_restored(model_id, sync)  # within the keep + 1 slots booked
            version = max(await self.store.latest(model_id) or 0,
                          self._last.get(model_id, 0)) + 1  # fmt: skip
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
        the same way, under a booking of ``keep + 1`` slots of its own, held until the
        service stops."""
        parsed = parse_served_name(served)
        if parsed is None:
            return
        model_id, version = parsed
        sync = self._syncs.get(model_id)
        if sync is not None and version in sync.loaded:
            return
        async with self._lock(model_id):
            if model_id not in self._syncs:
                await self.book(model_id)  # refused naming --max-loras if the fleet is full
            sync = self._sync(model_id)
            if version in sync.loaded:
                return
            await self._drop_restored(model_id, sync)
            await sync.restore(version)
            self._restored[model_id] = version
            logger.info("loaded %s back on the replicas for a sampling client", served)

    def new_session(self, served: str) -> str:
        sid = f"samp-{secrets.token_hex(6)}"
        self.sessions[sid] = served
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
                raise UnknownSampler(f"no sampler weights at {path!r}: save them first with "
                                     "save_weights_for_sampler")  # fmt: skip
            return self.paths[path]
        return self.base_model

    async def sample(self, served: str, request: Any) -> SampleResult:
        await self.ensure_loaded(served)
        prompt = request.prompt.to_ints()
        body = completions_body(served, prompt, request.num_samples, request.sampling_params,
                                bool(request.prompt_logprobs))  # fmt: skip
        data = await self.client.completions(body)
        result = sample_result(data, prompt, bool(request.prompt_logprobs))
        last_n = request.prompt_logprobs_last_n
        if result.prompt_logprobs is not None and last_n is not None:
            result.prompt_logprobs[: len(prompt) - last_n] = np.nan  # scored: the last n only
        return result


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


@contextlib.asynccontextmanager
async def open_sampler(
    proxy_url: str, admin_key: str | None, store: AdapterStore, *, base_model: str,
    work_dir: Path, keep: int, delivery: str = "path",
) -> AsyncIterator[Sampler]:  # fmt: skip
    """A :class:`Sampler` on the proxy at ``proxy_url``, publishing to ``store`` (replicas
    fetching from it or loading this host's copies, by ``delivery``); every client's versions
    unloaded and slots given back at the end."""
    async with ProxyClient(proxy_url, api_key=admin_key, timeout_s=600) as client:
        fetching = await replicas_fetch(client, store.transport.url, delivery)
        logger.info("replicas %s", "fetch sampler weights from " + store.transport.url
                    if fetching else "load sampler weights from copies on this host")  # fmt: skip
        sampler = Sampler(client, store, base_model=base_model, cache_dir=work_dir / "cache",
                          keep=keep, fetching=fetching)  # fmt: skip
        try:
            yield sampler
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(30):
                await sampler.close()
