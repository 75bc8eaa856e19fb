"""The client of an asyncgrpo proxy's own routes: its replicas, its book of runs, its counters.

A proxy looks like one vLLM, so :class:`ProxyClient` is a :class:`~asyncgrpo.vllm.client.VLLMClient`
with the proxy's routes added; a method asked of a plain vLLM server says so (None, False)
rather than failing. Used by the runs and launches above the proxy, never by the proxy itself
(which stays free of aiohttp).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from asyncgrpo.errors import ConfigError, NoRoom, ReplicaError, ReplicaHTTPError
from asyncgrpo.proxy.paths import RUNS_PATH, STATS_PATH, UPSTREAMS_PATH
from asyncgrpo.retry import Backoff, retry
from asyncgrpo.vllm.api import error_message
from asyncgrpo.vllm.client import VLLMClient

__all__ = ["ProxyClient", "update_proxy"]


class ProxyClient(VLLMClient):
    """Async client of an asyncgrpo proxy (or of a vLLM server, which has none of its routes)."""

    async def proxy_upstreams(self) -> list[str] | None:
        """The replicas behind this URL if it is an asyncgrpo proxy (``GET /proxy/upstreams``),
        else None (a vLLM server answers 404)."""
        status, body = await self._request("GET", UPSTREAMS_PATH)
        if status in (401, 403):
            raise ConfigError(
                f"{self.base_url} refused the API key ({status}): give the key it expects "
                "(a run's proxy.upstream_api_key: export ASYNCGRPO_PROXY__UPSTREAM_API_KEY)"
            )
        try:
            doc = json.loads(body) if status == 200 else None
        except ValueError:
            return None
        if not isinstance(doc, dict) or not isinstance(doc.get("upstreams"), list):
            return None
        return [str(u.get("url")) for u in doc["upstreams"] if isinstance(u, dict)]

    async def register_run(
        self, run: str, *, lora_slots: int, weight: float = 1.0, token: str | None = None
    ) -> bool:
        """Book ``lora_slots`` of the replicas' LoRA slots for adapter prefix ``run``, with its
        share weight, on the asyncgrpo proxy behind this URL; ``token`` (16 to 256 printable
        characters, kept secret) is what re-registering or releasing the booking takes. False
        when it keeps no such book (a vLLM server, an older proxy); ``NoRoom`` naming
        ``--max-loras`` and the numbers when the runs sharing the replicas would need more
        slots than they have; ``ConfigError`` saying who holds the booking."""
        body: dict[str, Any] = {"run": run, "lora_slots": lora_slots, "weight": weight}
        if token is not None:
            body["token"] = token
        status, text = await self._request("POST", RUNS_PATH, json_body=body)
        if status == 404:
            return False
        if status == 409:
            raise NoRoom(error_message(text))
        if status == 403:
            raise ConfigError(error_message(text))
        if status == 401:
            raise ConfigError(
                f"the proxy at {self.base_url} keeps its book of runs behind its admin key, and "
                "refused this one: give the run the key the proxy was started with "
                "(proxy.admin_api_key, or export ASYNCGRPO_PROXY__ADMIN_API_KEY)"
            )
        if status >= 400:
            self._refused("POST", RUNS_PATH, status, text)
        return True

    async def release_run(self, run: str, *, token: str | None = None) -> None:
        """Give back the LoRA slots :meth:`register_run` booked with ``token`` (a run that
        ends)."""
        body = {"run": run} if token is None else {"run": run, "token": token}
        status, text = await self._request("DELETE", RUNS_PATH, json_body=body)
        if status >= 400 and status != 404:
            self._refused("DELETE", RUNS_PATH, status, text)

    async def proxy_stats(self) -> dict[str, Any] | None:
        """An asyncgrpo proxy's ``GET /proxy/stats`` document; None if this URL does not answer
        one (a vLLM server)."""
        status, body = await self._request("GET", STATS_PATH)
        try:
            doc = json.loads(body) if status == 200 else None
        except ValueError:
            return None
        return doc if isinstance(doc, dict) else None

    async def add_upstream(self, url: str) -> None:
        """Add the replica at ``url`` to this asyncgrpo proxy (an admin route: the client's key
        is the proxy's admin key). The proxy answers once it has replayed its loaded adapters to
        the replica and put it in rotation; a replica it already has counts as added."""
        status, body = await self._request("POST", UPSTREAMS_PATH, json_body={"url": url})
        if status < 400 or (status == 400 and "already an upstream" in body):
            return
        self._refused(
            "POST",
            UPSTREAMS_PATH,
            status,
            body,
            f"adding replica {url} to the proxy at {self.base_url}",
        )

    async def remove_upstream(self, url: str) -> bool:
        """Take the replica at ``url`` out of this asyncgrpo proxy (admin route); False if the
        proxy did not have it."""
        status, body = await self._request("DELETE", UPSTREAMS_PATH, json_body={"url": url})
        if status == 404:
            return False
        if status >= 400:
            what = f"removing replica {url} from the proxy at {self.base_url}"
            self._refused("DELETE", UPSTREAMS_PATH, status, body, what)
        return True


async def update_proxy(
    proxy_url: str,
    admin_key: str | None,
    replica_url: str,
    *,
    remove: bool = False,
    timeout_s: float | None = None,
    interval_s: float = 2.0,
    on_retry: Callable[[str], None] | None = None,
) -> bool:
    """Add the replica at ``replica_url`` to the asyncgrpo proxy at ``proxy_url`` (or remove it),
    retrying while the proxy cannot be reached or cannot take the replica in yet (a 5xx: it
    could not replay the adapters to it). Returns False if ``timeout_s`` passed first; a refused
    key (401, 403) raises :class:`ConfigError` at once. ``on_retry(error)`` before each retry."""
    async with ProxyClient(proxy_url, api_key=admin_key, timeout_s=600) as proxy:

        async def attempt(number: int) -> None:
            try:
                if remove:
                    await proxy.remove_upstream(replica_url)
                else:
                    await proxy.add_upstream(replica_url)
            except ReplicaHTTPError as exc:
                if exc.status in (401, 403):
                    raise ConfigError(
                        f"the proxy at {proxy_url} refused the admin key ({exc.status}): give "
                        "the key it was started with (its proxy.admin_api_key)"
                    ) from exc
                raise

        try:
            await retry(
                attempt,
                attempts=None,
                backoff=Backoff(interval_s, factor=1.0),
                retry_on=_transient,
                timeout_s=timeout_s,
                on_retry=None if on_retry is None else lambda n, exc, wait_s: on_retry(str(exc)),
            )
        except ReplicaError as exc:
            if _transient(exc):
                return False  # timeout_s passed
            raise
        return True


def _transient(exc: Exception) -> bool:
    """The proxy could not be reached, or cannot take the replica in yet (a 5xx: it could not
    replay the adapters to it)."""
    if isinstance(exc, ReplicaHTTPError):
        return exc.status >= 500
    return isinstance(exc, ReplicaError)
