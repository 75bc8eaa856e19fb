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

import pydantic
from aiohttp import web

from asyncgrpo.errors import NotFound
from asyncgrpo.tinker.config import TinkerConfig
from asyncgrpo.tinker.losses import LossInputError
from asyncgrpo.tinker.provenance import ProvenanceError
from asyncgrpo.tinker.service import TinkerService, TrainingModel
from asyncgrpo.tinker.wire import WireError

__all__ = [
    "CONFIG",
    "SERVICE",
    "answer",
    "guard",
    "read_body",
    "refuse",
    "refuse_taken",
    "training_model",
]

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SERVICE = web.AppKey("service", TinkerService)
CONFIG = web.AppKey("config", TinkerConfig)


def refuse(status: type[web.HTTPException], message: str) -> web.HTTPException:
    return status(text=message, content_type="text/plain")


@web.middleware
async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse web pages and requests without the key; turn bad input into one-line 400s."""
    config = request.app[CONFIG]
    if request.headers.get("Origin") is not None:
        raise refuse(web.HTTPForbidden, "requests from web pages (an Origin header) are refused")
    if config.api_key:
        given = request.headers.get("X-API-Key", "")
        if not hmac.compare_digest(given.encode(), config.api_key.encode()):
            raise refuse(web.HTTPUnauthorized, "missing or wrong API key: set TINKER_API_KEY "
                          "to the key this service was started with")  # fmt: skip
    try:
        return await handler(request)
    except (WireError, LossInputError, ProvenanceError) as exc:
        logger.warning("%s refused: %s", request.path, exc)
        raise refuse(web.HTTPBadRequest, str(exc)) from None
    except NotFound as exc:  # an unknown run or checkpoint path: the SDK's NotFoundError
        raise refuse(web.HTTPNotFound, str(exc)) from None


async def read_body(request: web.Request, model: type[pydantic.BaseModel]) -> Any:
    try:
        return model.model_validate(await request.json())
    except (ValueError, pydantic.ValidationError) as exc:
        first = exc.errors()[0] if isinstance(exc, pydantic.ValidationError) else None
        where = ".".join(map(str, first["loc"])) + ": " + first["msg"] if first else str(exc)
        raise WireError(
            f"{request.path}: the body is not a valid {model.__name__} ({where})"
        ) from None


def answer(value: Any) -> web.Response:
    if isinstance(value, pydantic.BaseModel):
        value = value.model_dump(mode="json", exclude_none=True)
    return web.json_response(value)


def training_model(service: TinkerService, model_id: str) -> TrainingModel:
    found = service.models.get(model_id)
    if found is None:
        raise refuse(web.HTTPNotFound, f"no training client {model_id!r} on this service: "
                      "create one with create_lora_training_client")  # fmt: skip
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
