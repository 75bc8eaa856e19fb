"""The one place that knows vLLM's HTTP API (and so the proxy's, which looks like one vLLM).

Errors name the server flag or environment variable to change, because that is what a user can
act on: a 404 from ``/v1/load_lora_adapter`` with no ``No adapter found`` in the body means the
runtime LoRA endpoints are off, not that the adapter is missing.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, NoReturn

import aiohttp
import anyio

from asyncgrpo.errors import ConfigError, ReplicaError, ReplicaHTTPError

ADAPTER_NOT_FOUND = "No adapter found"
#: The asyncgrpo proxy's list of replicas; a vLLM server has no such route.
PROXY_UPSTREAMS_PATH = "/proxy/upstreams"
#: The asyncgrpo proxy's book of the runs sharing its replicas (their LoRA slots and weights).
PROXY_RUNS_PATH = "/proxy/runs"
#: The asyncgrpo proxy's counters, the fleet's among them.
PROXY_STATS_PATH = "/proxy/stats"
#: Where a replica describes its configuration as JSON (needs ``VLLM_SERVER_DEV_MODE=1``).
SERVER_INFO_PATH = "/server_info?config_format=json"


def already_loaded(status: int, body: bytes) -> bool:
    """A load refused because the replica already holds an adapter of that name."""
    return status == 400 and b"already" in body


def _server_setting(info: Any, section: str, name: str) -> int | None:
    """``vllm_config.<section>.<name>`` from a ``/server_info`` document, if it says (an int)."""
    if not isinstance(info, dict):
        return None
    cfg = info.get("vllm_config", info)
    part = cfg.get(section) if isinstance(cfg, dict) else None  # a string in some versions
    value = part.get(name) if isinstance(part, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def block_size_of(info: Any) -> int | None:
    """``vllm_config.cache_config.block_size`` from a ``/server_info`` document, if it says."""
    return _server_setting(info, "cache_config", "block_size")


def lora_slots_of(info: Any) -> int | None:
    """The replica's ``--max-loras`` (None: LoRA off, or the document does not say)."""
    return _server_setting(info, "lora_config", "max_loras")


def max_num_seqs_of(info: Any) -> int | None:
    """The replica's ``--max-num-seqs``: sequences it runs at once; beyond, it queues them."""
    return _server_setting(info, "scheduler_config", "max_num_seqs")


# Routes of asyncgrpo's vLLM endpoint plugin (asyncgrpo.serve.vllm_plugin): the replica fetches a
# published version from the transport itself. Under /v1, so vLLM's --api-key guards them.
PLUGIN_LOAD_PATH = "/v1/asyncgrpo/load"
PLUGIN_UNLOAD_PATH = "/v1/asyncgrpo/unload"
PLUGIN_INFO_PATH = "/v1/asyncgrpo/info"
#: Error type of a plugin load whose version is not (yet) published: worth retrying.
ADAPTER_NOT_PUBLISHED = "AdapterNotPublished"

_PLUGIN_FIX = (
    "install asyncgrpo in the replica's Python environment and start vLLM with "
    "VLLM_PLUGINS=asyncgrpo and ASYNCGRPO_ADAPTER_TRANSPORTS=<transport url> "
    "(`python -m asyncgrpo.serve --transport URL` does both), or set "
    "serve.adapter_delivery=path if the replicas share the trainer's filesystem"
)


def plugin_served_name(uri: str) -> str | None:
    """The one name a plugin load of ``uri`` (``<root>/[<prefix>/]<name>/v<N>``) may serve the
    version under, ``<name>-v<N>``; None when the URI names no version."""
    parts = uri.rsplit("/", 2)
    version = re.fullmatch(r"v([0-9]+)", parts[-1])
    if len(parts) < 3 or not parts[1] or version is None:
        return None
    return f"{parts[1]}-v{int(version[1])}"


def adapter_not_there_yet(status: int, body: bytes | str) -> bool:
    """True for a load refused only because the version has not reached the replica yet."""
    mark: bytes | str
    if status == 404:
        mark = ADAPTER_NOT_FOUND
    elif status == 409:
        mark = ADAPTER_NOT_PUBLISHED
    else:
        return False
    if isinstance(body, bytes):
        mark = mark.encode()
    return mark in body  # type: ignore[operator]


class VLLMClient:
    """Async client for one vLLM OpenAI server (or the asyncgrpo proxy in front of several)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        session: aiohttp.ClientSession | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session = session
        self._own_session = session is None
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def __aenter__(self) -> VLLMClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: Mapping[str, str] | None = None,
    ) -> tuple[int, str]:
        url = self.base_url + path
        try:
            async with self.session.request(
                method, url, json=json_body, params=params, headers=self._headers,
                timeout=self._timeout,
            ) as resp:  # fmt: skip
                return resp.status, await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ReplicaError(f"{method} {url} failed: {exc!r}") from exc

    async def _ok(self, method: str, path: str, **kw: Any) -> str:
        status, body = await self._request(method, path, **kw)
        if status >= 400:
            self._refused(method, path, status, body)
        return body

    def _refused(self, method: str, path: str, status: int, body: str) -> NoReturn:
        raise ReplicaHTTPError(
            f"{method} {self.base_url}{path} -> {status}: {body[:500]}",
            url=self.base_url + path, status=status, body=body,
        )  # fmt: skip

    async def health(self) -> bool:
        try:
            status, _ = await self._request("GET", "/health")
        except ReplicaError:
            return False
        return status == 200

    async def proxy_upstreams(self) -> list[str] | None:
        """The replicas behind this URL if it is an asyncgrpo proxy (``GET /proxy/upstreams``),
        else None (a vLLM server answers 404)."""
        status, body = await self._request("GET", PROXY_UPSTREAMS_PATH)
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
        when it keeps no such book (a vLLM server, an older proxy); ``ConfigError`` naming
        ``--max-loras`` and the numbers when the runs sharing the replicas would need more
        slots than they have, or saying who holds the booking."""
        body: dict[str, Any] = {"run": run, "lora_slots": lora_slots, "weight": weight}
        if token is not None:
            body["token"] = token
        status, text = await self._request("POST", PROXY_RUNS_PATH, json_body=body)
        if status == 404:
            return False
        if status in (403, 409):
            raise ConfigError(_error_message(text))
        if status >= 400:
            self._refused("POST", PROXY_RUNS_PATH, status, text)
        return True

    async def release_run(self, run: str, *, token: str | None = None) -> None:
        """Give back the LoRA slots :meth:`register_run` booked with ``token`` (a run that
        ends)."""
        body = {"run": run} if token is None else {"run": run, "token": token}
        status, text = await self._request("DELETE", PROXY_RUNS_PATH, json_body=body)
        if status >= 400 and status != 404:
            self._refused("DELETE", PROXY_RUNS_PATH, status, text)

    async def proxy_stats(self) -> dict[str, Any] | None:
        """An asyncgrpo proxy's ``GET /proxy/stats`` document; None if this URL does not answer
        one (a vLLM server)."""
        status, body = await self._request("GET", PROXY_STATS_PATH)
        try:
            doc = json.loads(body) if status == 200 else None
        except ValueError:
            return None
        return doc if isinstance(doc, dict) else None

    async def add_upstream(self, url: str) -> None:
        """Add the replica at ``url`` to this asyncgrpo proxy (an admin route: the client's key
        is the proxy's admin key). The proxy answers once it has replayed its loaded adapters to
        the replica and put it in rotation; a replica it already has counts as added."""
        status, body = await self._request("POST", PROXY_UPSTREAMS_PATH, json_body={"url": url})
        if status < 400 or (status == 400 and "already an upstream" in body):
            return
        raise ReplicaHTTPError(
            f"adding replica {url} to the proxy at {self.base_url} failed ({status}): "
            f"{body[:500]}",
            url=self.base_url + PROXY_UPSTREAMS_PATH, status=status, body=body,
        )  # fmt: skip

    async def remove_upstream(self, url: str) -> bool:
        """Take the replica at ``url`` out of this asyncgrpo proxy (admin route); False if the
        proxy did not have it."""
        status, body = await self._request("DELETE", PROXY_UPSTREAMS_PATH, json_body={"url": url})
        if status == 404:
            return False
        if status >= 400:
            raise ReplicaHTTPError(
                f"removing replica {url} from the proxy at {self.base_url} failed ({status}): "
                f"{body[:500]}",
                url=self.base_url + PROXY_UPSTREAMS_PATH, status=status, body=body,
            )  # fmt: skip
        return True

    async def models(self) -> list[str]:
        body = json.loads(await self._ok("GET", "/v1/models"))
        return [m["id"] for m in body.get("data", [])]

    async def server_info(self) -> dict[str, Any]:
        """``/server_info?config_format=json`` (needs ``VLLM_SERVER_DEV_MODE=1`` on the server)."""
        status, body = await self._request("GET", SERVER_INFO_PATH)
        if status == 404:
            raise ConfigError(
                f"{self.base_url}/server_info is not served: start vLLM with VLLM_SERVER_DEV_MODE=1"
            )
        if status >= 400:
            raise ReplicaHTTPError(
                f"GET {self.base_url}/server_info -> {status}: {body[:500]}",
                url=self.base_url + "/server_info", status=status, body=body,
            )  # fmt: skip
        return json.loads(body)

    async def load_lora_adapter(self, name: str, path: str) -> None:
        status, body = await self._request(
            "POST", "/v1/load_lora_adapter", json_body={"lora_name": name, "lora_path": path}
        )
        if status < 400:
            return
        if status == 404 and ADAPTER_NOT_FOUND not in body:
            raise ConfigError(
                f"{self.base_url} has no runtime LoRA loading: start vLLM with --enable-lora and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"
            )
        raise ReplicaHTTPError(
            f"loading adapter {name!r} from {path} on {self.base_url} failed ({status}): {body[:500]}",
            url=self.base_url + "/v1/load_lora_adapter", status=status, body=body,
        )  # fmt: skip

    async def unload_lora_adapter(self, name: str) -> None:
        await self._ok("POST", "/v1/unload_lora_adapter", json_body={"lora_name": name})

    async def load_lora_adapter_from(self, name: str, uri: str) -> None:
        """Have the replica(s) fetch the published version at ``uri`` and load it as ``name``."""
        status, body = await self._request(
            "POST", PLUGIN_LOAD_PATH, json_body={"lora_name": name, "lora_uri": uri}
        )
        if status < 400:
            return
        if status == 404 and ADAPTER_NOT_PUBLISHED not in body:
            raise ConfigError(
                f"{self.base_url}: a replica has no asyncgrpo adapter plugin ({PLUGIN_LOAD_PATH} "
                f"answered 404): {_PLUGIN_FIX}"
            )
        raise ReplicaHTTPError(
            f"loading adapter {name!r} from {uri} on {self.base_url} failed ({status}): {body[:800]}",
            url=self.base_url + PLUGIN_LOAD_PATH, status=status, body=body,
        )  # fmt: skip

    async def unload_fetched_adapter(self, name: str) -> None:
        """Unload ``name`` and drop the replica's cached copy (plugin route)."""
        await self._ok("POST", PLUGIN_UNLOAD_PATH, json_body={"lora_name": name})

    async def adapter_plugin_info(self) -> list[dict[str, Any]]:
        """The plugin's answer of every replica behind this URL (one, or all behind a proxy).

        Each entry: ``url``, ``status`` and either ``info`` (the plugin's JSON) or ``body``.
        """
        status, body = await self._request("GET", PLUGIN_INFO_PATH)
        try:
            doc = json.loads(body) if status == 200 else None
        except ValueError:
            doc = None
        if isinstance(doc, dict) and isinstance(doc.get("replicas"), list):
            return doc["replicas"]  # the proxy's broadcast
        if isinstance(doc, dict):
            return [{"url": self.base_url, "status": status, "info": doc}]
        return [{"url": self.base_url, "status": status, "body": body[:300]}]

    async def pause(self, mode: str = "keep") -> None:
        await self._ok("POST", "/pause", params={"mode": mode})

    async def resume(self) -> None:
        await self._ok("POST", "/resume")

    async def metrics_text(self) -> str:
        return await self._ok("GET", "/metrics")

    async def completions(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        return json.loads(await self._ok("POST", "/v1/completions", json_body=payload))


def _error_message(text: str) -> str:
    """The message of an OpenAI-style error body (the proxy's), else the body itself."""
    try:
        error = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return text[:500]
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) else text[:500]


def check_lora_capacity(info: Mapping[str, Any], *, lora_rank: int, max_staleness: int) -> int:
    """Validate a ``/server_info`` document for async GRPO; return the KV block size.

    Refuses, naming the flag to change, when LoRA is off, the rank is too small, or there are
    fewer than ``max_staleness + 2`` slots (load-before-unload would make vLLM silently evict a
    policy that still has rollouts in flight).
    """
    config = info.get("vllm_config", info)
    lora = config.get("lora_config")
    if not lora:
        raise ConfigError("vLLM has LoRA disabled: start it with --enable-lora")
    if lora["max_lora_rank"] < lora_rank:
        raise ConfigError(
            f"vLLM --max-lora-rank is {lora['max_lora_rank']} but the adapter has r={lora_rank}: "
            "raise --max-lora-rank (allowed 1, 8, 16, 32, 64, 128, 256, 320, 512)"
        )
    need = max_staleness + 2
    if lora["max_loras"] < need:
        raise ConfigError(
            f"vLLM --max-loras is {lora['max_loras']} but max_staleness={max_staleness} needs "
            f">= {need} (max_staleness + 2: load before unload); raise --max-loras or lower "
            "max_staleness"
        )
    return int(config.get("cache_config", {}).get("block_size", 16))


def check_adapter_fetching(replicas: list[Mapping[str, Any]], transport_url: str) -> None:
    """Refuse to start unless every replica that answered runs the adapter plugin and may fetch
    from ``transport_url``; the message names the replica and the fix. A replica that could not
    be reached (status 0: it left the fleet) is not judged: the proxy replays the adapters to it
    through the plugin before it takes requests again, which fails without the plugin."""
    answered = [entry for entry in replicas if entry.get("status") != 0]
    if not answered:
        raise ConfigError("no replica answered the adapter-plugin check")
    for entry in answered:
        url, info = entry.get("url"), entry.get("info")
        if not isinstance(info, Mapping):
            raise ConfigError(
                f"replica {url} has no asyncgrpo adapter plugin ({PLUGIN_INFO_PATH} answered "
                f"{entry.get('status')}: {str(entry.get('body', ''))[:200]}): {_PLUGIN_FIX}"
            )
        if not info.get("ok", False):
            raise ConfigError(f"replica {url}: {info.get('error')}")
        roots = [str(r).rstrip("/") for r in info.get("transports") or []]
        target = transport_url.rstrip("/")
        if not any(target == r or target.startswith(r + "/") for r in roots):
            raise ConfigError(
                f"replica {url} may not fetch adapters from {target} (it allows "
                f"{roots or 'no transport'}): start it with --transport {target} "
                f"(python -m asyncgrpo.serve) or ASYNCGRPO_ADAPTER_TRANSPORTS={target}"
            )


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
    not known yet), or raises to stop waiting (the process or job behind it has ended). The one
    health poll of local replicas and of a launch's replica jobs.
    """
    deadline = time.monotonic() + timeout_s
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    async with aiohttp.ClientSession(headers=dict(headers or {})) as session:
        while True:
            url = await base_url()
            if url is not None:
                try:
                    async with session.get(f"{url.rstrip('/')}/health", timeout=timeout) as resp:
                        if resp.status == 200:
                            return True
                except (aiohttp.ClientError, TimeoutError):
                    pass
            if time.monotonic() > deadline:
                return False
            await anyio.sleep(interval_s)


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
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    async with VLLMClient(proxy_url, api_key=admin_key, timeout_s=600) as proxy:
        while True:
            try:
                if remove:
                    await proxy.remove_upstream(replica_url)
                else:
                    await proxy.add_upstream(replica_url)
                return True
            except ReplicaHTTPError as exc:
                if exc.status in (401, 403):
                    raise ConfigError(
                        f"the proxy at {proxy_url} refused the admin key ({exc.status}): give "
                        "the key it was started with (its proxy.admin_api_key)"
                    ) from exc
                if exc.status < 500:
                    raise
                error = str(exc)
            except ReplicaError as exc:
                error = str(exc)
            if deadline is not None and time.monotonic() + interval_s > deadline:
                return False
            if on_retry is not None:
                on_retry(error)
            await anyio.sleep(interval_s)
