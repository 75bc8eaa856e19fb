"""Waiting for a server's ``GET /health``: the one health poll of local replicas and of a
launch's replica and proxy jobs."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

import aiohttp

from asyncgrpo.retry import poll_until
from asyncgrpo.vllm.api import HEALTH_PATH


async def wait_healthy(
    base_url: Callable[[], Awaitable[str | None]],
    *,
    timeout_s: float,
    interval_s: float,
    headers: Mapping[str, str] | None = None,
    request_timeout_s: float = 10.0,
) -> bool:
    """Poll ``GET /health`` until it answers 200 (True) or ``timeout_s`` passes (False).

    ``base_url()`` is awaited before each probe: it returns the server's URL (None while it is
    not known yet), or raises to stop waiting (the process or job behind it has ended).
    """
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    async with aiohttp.ClientSession(headers=dict(headers or {})) as session:

        async def healthy() -> bool | None:
            url = await base_url()
            if url is not None:
                try:
                    async with session.get(url.rstrip("/") + HEALTH_PATH, timeout=timeout) as r:
                        if r.status == 200:
                            return True
                except (aiohttp.ClientError, TimeoutError):
                    pass
            return None

        return await poll_until(healthy, every=interval_s, timeout_s=timeout_s) is not None
