"""The async client of one vLLM OpenAI server (or of the asyncgrpo proxy, which looks like one):
the package's one HTTP client of vLLM's API.

What the paths are and how vLLM's answers read is :mod:`asyncgrpo.vllm.api`; this module adds the
HTTP. Errors name the server flag or environment variable to change, because that is what a user
can act on. Rollouts and evaluations generate through :meth:`VLLMClient.post_completions`, whose
transport failures (:data:`TRANSPORT_ERRORS`) are left to the caller's retry.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, NoReturn

import aiohttp

from asyncgrpo.errors import ConfigError, ReplicaError, ReplicaHTTPError
from asyncgrpo.vllm import api

__all__ = ["TRANSPORT_ERRORS", "VLLMClient"]

#: A request that failed on its way rather than in the server's answer: no connection, one that
#: broke, an answer cut short, a timeout. What a caller that retries retries (with the answers
#: that say "later", 5xx and 429, which it reads itself).
TRANSPORT_ERRORS: tuple[type[Exception], ...] = (
    aiohttp.ClientConnectionError,
    aiohttp.ClientPayloadError,
    TimeoutError,
)


class VLLMClient:
    """Async client for one vLLM OpenAI server (or the asyncgrpo proxy in front of several)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        session: aiohttp.ClientSession | None = None,
        timeout_s: float = 60.0,
        headers: Mapping[str, str] | None = None,
        pool_limit: int = 100,
    ) -> None:
        """``headers``: sent with every request besides the key (the proxy's run header).
        ``pool_limit``: connections the session this client makes keeps open at most (0: no
        limit, for a rollout's hundreds of requests in flight); 100 is aiohttp's default."""
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._headers.update(headers or {})
        self._session = session
        self._own_session = session is None
        self._pool_limit = pool_limit
        self.timeout_s = timeout_s  #: what one request may take
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._completions_url = self.base_url + api.COMPLETIONS_PATH

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
        """The session requests go through: the one given, else one made on first use whose
        defaults are this client's headers and timeout (so a generation adds none per request)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._pool_limit),
                headers=self._headers,
                timeout=self._timeout,
            )
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
                method,
                url,
                json=json_body,
                params=params,
                headers=self._headers,
                timeout=self._timeout,
            ) as resp:
                return resp.status, await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ReplicaError(f"{method} {url} failed: {exc!r}") from exc

    async def _ok(self, method: str, path: str, **kw: Any) -> str:
        status, body = await self._request(method, path, **kw)
        if status >= 400:
            self._refused(method, path, status, body)
        return body

    def _refused(
        self, method: str, path: str, status: int, body: str, what: str = "", quoted: int = 500
    ) -> NoReturn:
        """An error answer as ReplicaHTTPError; ``what`` (e.g. "loading adapter 'x' from y on
        URL") names the call in the message, else the method and URL do."""
        said = (
            f"{what} failed ({status})" if what else f"{method} {self.base_url}{path} -> {status}"
        )
        raise ReplicaHTTPError(
            f"{said}: {body[:quoted]}", url=self.base_url + path, status=status, body=body
        )

    async def health(self) -> bool:
        try:
            status, _ = await self._request("GET", api.HEALTH_PATH)
        except ReplicaError:
            return False
        return status == 200

    async def models(self) -> list[str]:
        """The names served: the base model and every adapter version loaded."""
        return api.model_ids(await self._ok("GET", api.MODELS_PATH))

    async def dev_routes_open(self) -> bool:
        """Whether the server answers a development route (``/server_info``) to this client,
        rather than 401. Asked without a key: vLLM's ``--api-key`` guards only ``/v1``-style
        paths and asyncgrpo's plugin the rest, so True means the plugin did not load."""
        status, _ = await self._request("GET", api.SERVER_INFO_PATH)
        return status != 401

    async def server_info(self) -> dict[str, Any]:
        """``/server_info?config_format=json`` (needs ``VLLM_SERVER_DEV_MODE=1`` on the server)."""
        status, body = await self._request("GET", api.SERVER_INFO_JSON)
        if status == 404:
            raise ConfigError(
                f"{self.base_url}/server_info is not served: start vLLM with VLLM_SERVER_DEV_MODE=1"
            )
        if status >= 400:
            self._refused("GET", api.SERVER_INFO_PATH, status, body)
        return json.loads(body)

    async def load_lora_adapter(self, name: str, path: str) -> None:
        await self._load(api.LOAD_LORA_PATH, {"lora_name": name, "lora_path": path}, 500)

    async def unload_lora_adapter(self, name: str) -> None:
        await self._ok("POST", api.UNLOAD_LORA_PATH, json_body=api.unload_body(name))

    async def load_lora_adapter_from(self, name: str, uri: str) -> None:
        """Have the replica(s) fetch the published version at ``uri`` and load it as ``name``."""
        await self._load(api.PLUGIN_LOAD_PATH, {"lora_name": name, "lora_uri": uri}, 800)

    async def _load(self, path: str, body: dict[str, str], quoted: int) -> None:
        """POST a load; a route the server lacks is a ConfigError saying how to start it."""
        status, text = await self._request("POST", path, json_body=body)
        if status < 400:
            return
        if path == api.LOAD_LORA_PATH and api.lora_routes_off(status, text):
            raise ConfigError(
                f"{self.base_url} has no runtime LoRA loading: start vLLM with --enable-lora and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"
            )
        if path == api.PLUGIN_LOAD_PATH and api.plugin_missing(status, text):
            raise ConfigError(
                f"{self.base_url}: a replica has no asyncgrpo adapter plugin "
                f"({api.PLUGIN_LOAD_PATH} answered 404): {api.PLUGIN_FIX}"
            )
        source = body.get("lora_path") or body.get("lora_uri")
        what = f"loading adapter {body['lora_name']!r} from {source} on {self.base_url}"
        self._refused("POST", path, status, text, what, quoted)

    async def unload_fetched_adapter(self, name: str) -> None:
        """Unload ``name`` and drop the replica's cached copy (plugin route)."""
        await self._ok("POST", api.PLUGIN_UNLOAD_PATH, json_body=api.unload_body(name))

    async def adapter_plugin_info(self) -> list[dict[str, Any]]:
        """The plugin's answer of every replica behind this URL (one, or all behind a proxy):
        see :func:`asyncgrpo.vllm.api.plugin_answers`."""
        status, body = await self._request("GET", api.PLUGIN_INFO_PATH)
        return api.plugin_answers(self.base_url, status, body)

    async def pause(self, mode: str = "keep") -> None:
        await self._ok("POST", api.PAUSE_PATH, params={"mode": mode})

    async def resume(self) -> None:
        await self._ok("POST", api.RESUME_PATH)

    async def metrics_text(self) -> str:
        return await self._ok("GET", api.METRICS_PATH)

    async def completions(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        """One completions request: its answer, or ReplicaError / ReplicaHTTPError."""
        return json.loads(await self._ok("POST", api.COMPLETIONS_PATH, json_body=payload))

    async def post_completions(
        self, payload: Mapping[str, Any], headers: Mapping[str, str] | None = None
    ) -> tuple[int, Any, Mapping[str, str]]:
        """``POST /v1/completions`` for a caller that retries (the rollouts' hot path): the
        status, the body (its JSON below 400, else its text) and the answer's headers.
        ``headers`` are this request's own (a session's affinity header). A transport failure
        propagates as aiohttp raised it (:data:`TRANSPORT_ERRORS`)."""
        if not self._own_session and self._headers:  # a given session lacks this client's
            headers = {**self._headers, **(headers or {})}
        async with self.session.post(
            self._completions_url, json=payload, headers=headers, timeout=self._timeout
        ) as resp:
            if resp.status >= 400:
                return resp.status, await resp.text(), resp.headers
            return resp.status, await resp.json(), resp.headers
