"""What every route of the service's HTTP app (aiohttp) shares: its keys, the request guard,
reading the SDK's request types and answering its response types.

The guard refuses web pages (an ``Origin`` header) and, when the service has a key, requests
without it (401: the SDK raises ``AuthenticationError``); it turns bad input into one-line 400s
(``BadRequestError``).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pydantic
from aiohttp import web

from asyncgrpo.config.bounded_json import JSONRefused, loads_object
from asyncgrpo.config.serve import is_loopback
from asyncgrpo.config.tinker import TinkerConfig
from asyncgrpo.errors import NotFound
from asyncgrpo.proxy.http.policy import host_is_local
from asyncgrpo.tinker.futures import server_failure
from asyncgrpo.tinker.losses import LossInputError
from asyncgrpo.tinker.provenance import ProvenanceError
from asyncgrpo.tinker.service import QueueFull, TinkerService, TrainingModel
from asyncgrpo.tinker.wire import WireError

__all__ = [
    "CONFIG",
    "CONTROL_BODY_BYTES",
    "SERVICE",
    "answer",
    "guard",
    "read_body",
    "read_bytes",
    "read_object",
    "refuse",
    "refuse_taken",
    "training_model",
]

logger = logging.getLogger(__name__)

#: The largest body of a control call (every route but forward_backward and asample).
CONTROL_BODY_BYTES = 64 * 1024
#: A sample request's body: a control call's and this many bytes per token of the context.
SAMPLE_BYTES_PER_TOKEN = 32
#: JSON bodies larger than this are decoded and checked in a worker thread.
OFFLOAD_BYTES = 256 * 1024
#: Validation errors listed one by one up to this many (beyond, their number).
FIRST_ERRORS = 16

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SERVICE = web.AppKey("service", TinkerService)
CONFIG = web.AppKey("config", TinkerConfig)


def one_line(text: str) -> str:
    """``text`` with every character that is not printable escaped: a request path or a value
    quoted back may carry line breaks (``\\x1e`` and ``\\u2028`` are ones too), and an answer
    or a log entry is one line."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def refuse(status: type[web.HTTPException], message: str) -> web.HTTPException:
    return status(text=one_line(message), content_type="text/plain")


@web.middleware
async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse web pages and requests without the key; turn bad input into one-line 400s."""
    config = request.app[CONFIG]
    if request.headers.get("Origin") is not None:
        raise refuse(web.HTTPForbidden, "requests from web pages (an Origin header) are refused")
    if is_loopback(config.host) and not host_is_local(request.host):
        raise refuse(
            web.HTTPForbidden,
            "this service listens on loopback and answers only Host "
            "localhost or a loopback address (a guard against DNS rebinding)",
        )
    if config.api_key:
        # bytes as they came (aiohttp keeps undecodable ones as surrogates: a 500 before)
        given = request.headers.get("X-API-Key", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, config.api_key.encode()):
            raise refuse(
                web.HTTPUnauthorized,
                "missing or wrong API key: set TINKER_API_KEY "
                "to the key this service was started with",
            )
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except (WireError, LossInputError, ProvenanceError) as exc:
        logger.warning("%s refused: %s", one_line(request.path), exc)
        raise refuse(web.HTTPBadRequest, str(exc)) from None
    except NotFound as exc:  # an unknown run or checkpoint path: the SDK's NotFoundError
        raise refuse(web.HTTPNotFound, str(exc)) from None
    except QueueFull as exc:  # the SDK retries a 429 after a pause
        raise refuse(web.HTTPTooManyRequests, str(exc)) from None
    except Exception as exc:  # the service's own failure: its log says what, the client why not
        logger.error("%s failed: %s", one_line(request.path), server_failure(exc, logged=True))
        raise refuse(web.HTTPInternalServerError, server_failure(exc)) from None


async def read_bytes(request: web.Request, limit: int) -> bytes:
    """The request's body, at most ``limit`` bytes (413 beyond: refused by its
    Content-Length before anything is read, or once a chunked body passes it), arriving within
    ``client_idle_timeout_s`` (408). A refused request's connection closes once answered."""
    length = request.content_length
    if length is not None and length > limit:
        raise _too_large(request, limit)
    chunks, size = [], 0
    try:
        with anyio.fail_after(request.app[CONFIG].client_idle_timeout_s):
            async for chunk in request.content.iter_any():
                size += len(chunk)
                if size > limit:
                    raise _too_large(request, limit)
                chunks.append(chunk)
    except TimeoutError:
        request.protocol.force_close()
        raise refuse(
            web.HTTPRequestTimeout,
            f"{request.path}: the body did not arrive within client_idle_timeout_s",
        ) from None
    return b"".join(chunks)


def _too_large(request: web.Request, limit: int) -> web.HTTPException:
    message = one_line(
        f"{request.path}: request body over {limit} bytes, the most this route takes"
    )
    refused = web.HTTPRequestEntityTooLarge(
        max_size=limit,
        actual_size=request.content_length or limit + 1,
        text=message,
        content_type="text/plain",
    )
    refused.force_close()  # the connection closes (after LINGER_S of dropping what is sent)
    return refused


async def read_body(
    request: web.Request, model: type[pydantic.BaseModel], limit: int = CONTROL_BODY_BYTES
) -> Any:
    """The body as the SDK's request type ``model``: JSON of at most ``limit`` bytes (a
    control call's 64 KiB unless the route says more) nested at most ``MAX_DEPTH`` deep,
    decoded in a worker thread when larger than :data:`OFFLOAD_BYTES`; WireError (400) naming
    the first field that does not fit."""
    body = await read_bytes(request, limit)
    if len(body) > OFFLOAD_BYTES:
        return await anyio.to_thread.run_sync(_validate, body, model, request.path, limit)
    return _validate(body, model, request.path, limit)


async def read_object(request: web.Request) -> dict[str, Any]:
    """A control call's JSON object body that has no SDK type."""
    body = await read_bytes(request, CONTROL_BODY_BYTES)
    try:
        return loads_object(body, CONTROL_BODY_BYTES, what="the body")
    except JSONRefused as exc:
        raise WireError(f"{request.path}: {exc}") from None


def _validate(body: bytes, model: type[pydantic.BaseModel], path: str, limit: int) -> Any:
    try:
        return model.model_validate(loads_object(body, limit, what="the body"))
    except JSONRefused as exc:
        raise WireError(f"{path}: {exc}") from None
    except pydantic.ValidationError as exc:
        count = exc.error_count()
        if count > FIRST_ERRORS:  # listing them all cost seconds and gigabytes
            where = f"{count} fields do not fit its schema"
        else:
            first = exc.errors(include_url=False, include_input=False)[0]
            where = ".".join(map(str, first["loc"])) + ": " + first["msg"]
        raise WireError(f"{path}: the body is not a valid {model.__name__} ({where})") from None


def answer(value: Any) -> web.Response:
    if isinstance(value, pydantic.BaseModel):
        value = value.model_dump(mode="json", exclude_none=True)
    return web.json_response(value)


def training_model(service: TinkerService, model_id: str) -> TrainingModel:
    found = service.models.get(model_id)
    if found is None:
        raise refuse(
            web.HTTPNotFound,
            f"no training client {model_id!r} on this service: "
            "create one with create_lora_training_client",
        )
    service.touch(found.session_id)  # a request is a sign of life as a heartbeat is
    return found


async def refuse_taken(service: TinkerService, path: str, overwrite: bool) -> None:
    """A bad request if ``path`` is saved already and not to be overwritten (not 409: the SDK
    retries a 409 as a lock timeout)."""
    if overwrite:
        return
    try:
        await service.states.index.resolve(path)
    except NotFound:
        return
    raise WireError(
        f"a checkpoint {path!r} exists: pass overwrite=True to replace it, or "
        "save under another name"
    )
