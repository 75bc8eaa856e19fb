"""``serve_tinker``: the service running, as an async context manager yielding its URL."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio

from asyncgrpo.config.proxy import ProxyConfig
from asyncgrpo.config.serve import ServeConfig
from asyncgrpo.config.tinker import TinkerConfig
from asyncgrpo.run.endpoint import open_fleet
from asyncgrpo.store.adapters import AdapterStore
from asyncgrpo.tinker.app import build_app
from asyncgrpo.tinker.checkpoints import CheckpointIndex
from asyncgrpo.tinker.engine import Engine
from asyncgrpo.tinker.front import listen
from asyncgrpo.tinker.ranks import RankedEngine
from asyncgrpo.tinker.sampling import open_sampler
from asyncgrpo.tinker.service import TinkerService
from asyncgrpo.tinker.states import StateStore, files_deleter
from asyncgrpo.trainer.distributed import DataParallel
from asyncgrpo.transport.registry import open_transport

__all__ = ["load_engine", "replica_config", "serve_tinker"]

logger = logging.getLogger(__name__)


def load_engine(config: TinkerConfig, dp: DataParallel | None = None) -> Engine:
    """The service's engine on this rank's device (each rank loads the base model itself)."""
    return Engine(
        config.model,
        dtype=config.dtype,
        lora_alpha=config.lora_alpha,
        token_budget=config.token_budget,
        device=dp.device() if dp is not None else None,
    )


@contextlib.asynccontextmanager
async def serve_tinker(config: TinkerConfig, dp: DataParallel | None = None) -> AsyncIterator[str]:
    """Load the base model, listen on ``config.host:config.port`` and serve until the block
    ends; yields ``http://HOST:PORT`` (the bound port when ``port`` is 0). ``dp``: rank 0 of
    several (torchrun), whose weight operations every rank runs (:mod:`asyncgrpo.tinker.ranks`)."""
    local = await anyio.to_thread.run_sync(lambda: load_engine(config, dp))
    engine: Any = local if dp is None else RankedEngine(local, dp)
    async with contextlib.AsyncExitStack() as ranks:
        if dp is not None:  # the last thing to go: the other ranks exit once rank 0 is done
            ranks.push_async_callback(anyio.to_thread.run_sync, engine.close)
        async with _serve_engine(config, engine) as url:
            yield url


@contextlib.asynccontextmanager
async def _serve_engine(config: TinkerConfig, engine: Any) -> AsyncIterator[str]:
    work = Path(config.work_dir).resolve()
    transport = open_transport(config.transport_url or str(work / "store"))
    adapters = AdapterStore(transport)
    states = StateStore(
        transport,
        CheckpointIndex(transport, files_deleter(transport, adapters)),
        config.served_name,
    )
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(transport.aclose)
        sampler = None
        proxy_url, admin_key = config.proxy_url, config.proxy_admin_key
        if config.replicas or config.upstreams:
            fleet = _own_fleet(config, engine.dtype_name, work, transport.url)
            proxy_url, admin_key = await stack.enter_async_context(fleet), None
        if proxy_url:
            sampler = await stack.enter_async_context(
                open_sampler(
                    proxy_url,
                    admin_key,
                    adapters,
                    base_model=config.model,
                    work_dir=work,
                    keep=config.sampler_keep,
                    delivery=config.adapter_delivery,
                )
            )
        service = TinkerService(
            engine,
            states,
            sampler,
            session_timeout_s=config.session_timeout_s,
            max_clients=config.max_training_clients,
            max_queued=config.max_queued_per_client,
        )
        async with _serving(config, service) as url:
            yield url


def replica_config(config: TinkerConfig, dtype: str, work: Path, transport_url: str) -> ServeConfig:
    """The replicas ``--replicas`` starts: the service's model at the trainer's resolved dtype
    (so the served policy is the trained one), its rank bound, slots for its sampler versions,
    allowed to fetch from its transport."""
    return ServeConfig(
        model=config.model,
        replicas=config.replicas,
        lora_rank=config.max_lora_rank,
        max_staleness=config.sampler_keep - 1,
        runs=2,
        max_loras=config.max_loras,
        dtype=dtype,
        kv_cache_gib=config.kv_cache_gib,
        max_model_len=config.max_model_len,
        log_dir=str(work / "replica-logs"),
        transports=(transport_url,),
        adapter_cache_dir=str(work / "replica-adapters"),
    )


@contextlib.asynccontextmanager
async def _own_fleet(
    config: TinkerConfig, dtype: str, work: Path, transport_url: str
) -> AsyncIterator[str]:
    """``--replicas N`` started here and ``--upstream`` URLs behind an in-process proxy, by the
    same starter as a run's (:func:`asyncgrpo.run.endpoint.open_fleet`); yields its URL."""
    serve = replica_config(config, dtype, work, transport_url) if config.replicas else None
    proxy = ProxyConfig(upstreams=tuple(config.upstreams), port=0, lora_roots=(str(work),))
    async with open_fleet(serve, proxy, phase=lambda text: logger.info("%s", text)) as url:
        yield url


@contextlib.asynccontextmanager
async def _serving(config: TinkerConfig, service: TinkerService) -> AsyncIterator[str]:
    async with anyio.create_task_group() as tg:
        await tg.start(service.run)
        try:
            async with listen(
                build_app(config, service),
                config.host,
                config.port,
                max_connections=config.max_connections,
                head_timeout_s=config.head_timeout_s,
                idle_timeout_s=config.client_idle_timeout_s,
            ) as port:
                host = f"[{config.host}]" if ":" in config.host else config.host
                yield f"http://{host}:{port}"
        finally:
            tg.cancel_scope.cancel()
