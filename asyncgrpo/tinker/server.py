"""``serve_tinker``: the service running, as an async context manager yielding its URL."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
from aiohttp import web

from asyncgrpo.store.adapters import AdapterStore
from asyncgrpo.tinker.app import build_app
from asyncgrpo.tinker.config import TinkerConfig
from asyncgrpo.tinker.engine import Engine
from asyncgrpo.tinker.sampling import open_sampler
from asyncgrpo.tinker.service import TinkerService
from asyncgrpo.tinker.states import StateStore
from asyncgrpo.transport.registry import open_transport

__all__ = ["serve_tinker"]


@contextlib.asynccontextmanager
async def serve_tinker(config: TinkerConfig) -> AsyncIterator[str]:
    """Load the base model, listen on ``config.host:config.port`` and serve until the block
    ends; yields ``http://HOST:PORT`` (the bound port when ``port`` is 0)."""
    engine = await anyio.to_thread.run_sync(
        lambda: Engine(config.model, dtype=config.dtype, lora_alpha=config.lora_alpha)
    )
    work = Path(config.work_dir).resolve()
    transport = open_transport(config.transport_url or str(work / "store"))
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(transport.aclose)
        sampler = None
        if config.proxy_url:
            sampler = await stack.enter_async_context(open_sampler(
                config.proxy_url, config.proxy_admin_key, AdapterStore(transport),
                base_model=config.model, work_dir=work, keep=config.sampler_keep,
                delivery=config.adapter_delivery,
            ))  # fmt: skip
        service = TinkerService(engine, StateStore(transport), sampler,
                                session_timeout_s=config.session_timeout_s,
                                max_clients=config.max_training_clients)  # fmt: skip
        async with _serving(config, service) as url:
            yield url


@contextlib.asynccontextmanager
async def _serving(config: TinkerConfig, service: TinkerService) -> AsyncIterator[str]:
    async with anyio.create_task_group() as tg:
        await tg.start(service.run)
        runner = web.AppRunner(build_app(config, service), access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, config.host, config.port)
            await site.start()
            port = runner.addresses[0][1]
            host = f"[{config.host}]" if ":" in config.host else config.host
            yield f"http://{host}:{port}"
        finally:
            with anyio.CancelScope(shield=True):
                await runner.cleanup()
            tg.cancel_scope.cancel()
