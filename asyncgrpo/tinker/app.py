"""The HTTP app (aiohttp): the tinker SDK's REST routes over a :class:`TinkerService`.

Every route reads its body as the SDK's own request type and answers the SDK's response type
(:mod:`asyncgrpo.tinker.wire`). Calls that do work answer an ``UntypedAPIFuture`` at once and
queue the work; ``retrieve_future`` long-polls its outcome. A bad request is answered 400 (the
SDK raises ``BadRequestError``) or 404 for an unknown id (``NotFoundError``), as one line of
text naming the fix; a request that fails while it runs comes back from ``retrieve_future`` as
a ``RequestFailedResponse`` (the SDK raises ``RequestFailedError``).
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pydantic
from aiohttp import web
from tinker import types

from asyncgrpo.tinker.config import TinkerConfig
from asyncgrpo.tinker.engine import AdamStep, LoraSpec
from asyncgrpo.tinker.losses import LossInputError
from asyncgrpo.tinker.service import TinkerService, TrainingModel, in_thread
from asyncgrpo.tinker.wire import (
    PROTO_CONTENT_TYPE,
    FwdBwdResult,
    WireError,
    decode_fwdbwd,
    encode_fwdbwd,
    fwdbwd_json,
)

__all__ = ["build_app"]

logger = logging.getLogger(__name__)

#: How long ``retrieve_future`` waits for a pending request before answering ``try_again``
#: (the SDK's own read timeout for the call is 45 s).
POLL_S = 20.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SERVICE = web.AppKey("service", TinkerService)
CONFIG = web.AppKey("config", TinkerConfig)


def _refuse(status: type[web.HTTPException], message: str) -> web.HTTPException:
    return status(text=message, content_type="text/plain")


@web.middleware
async def _guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse web pages and requests without the key; turn bad input into one-line 400s."""
    config = request.app[CONFIG]
    if request.headers.get("Origin") is not None:
        raise _refuse(web.HTTPForbidden, "requests from web pages (an Origin header) are refused")
    if config.api_key:
        given = request.headers.get("X-API-Key", "")
        if not hmac.compare_digest(given.encode(), config.api_key.encode()):
            raise _refuse(web.HTTPUnauthorized, "missing or wrong API key: set TINKER_API_KEY "
                          "to the key this service was started with")  # fmt: skip
    try:
        return await handler(request)
    except (WireError, LossInputError) as exc:
        logger.warning("%s refused: %s", request.path, exc)
        raise _refuse(web.HTTPBadRequest, str(exc)) from None


async def _body(request: web.Request, model: type[pydantic.BaseModel]) -> Any:
    try:
        return model.model_validate(await request.json())
    except (ValueError, pydantic.ValidationError) as exc:
        first = exc.errors()[0] if isinstance(exc, pydantic.ValidationError) else None
        where = ".".join(map(str, first["loc"])) + ": " + first["msg"] if first else str(exc)
        raise WireError(
            f"{request.path}: the body is not a valid {model.__name__} ({where})"
        ) from None


def _json(value: Any) -> web.Response:
    if isinstance(value, pydantic.BaseModel):
        value = value.model_dump(mode="json", exclude_none=True)
    return web.json_response(value)


def _model(service: TinkerService, model_id: str) -> TrainingModel:
    found = service.models.get(model_id)
    if found is None:
        raise _refuse(web.HTTPNotFound, f"no training client {model_id!r} on this service: "
                      "create one with create_lora_training_client")  # fmt: skip
    return found


async def healthz(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def capabilities(request: web.Request) -> web.Response:
    config = request.app[CONFIG]
    model = types.SupportedModel(model_name=config.served_name, trainable=True, sampleable=False,
                                 max_context_length=config.max_context_length)  # fmt: skip
    return _json(types.GetServerCapabilitiesResponse(supported_models=[model]))


async def client_config(request: web.Request) -> web.Response:
    # API keys only (no JWT exchange), plain httpx, one fwd/bwd chunk at a time in order.
    return _json(types.ClientConfigResponse(pjwt_auth_enabled=False, use_pyqwest_transport=False,
                                            parallel_fwdbwd_chunks=False,
                                            proto_compress_fwdbwd=False))  # fmt: skip


async def dynamic_config(request: web.Request) -> web.Response:
    return _json(types.ClientDynamicConfigResponse())


async def create_session(request: web.Request) -> web.Response:
    await _body(request, types.CreateSessionRequest)
    session = request.app[SERVICE].new_session()
    logger.info("session %s started", session.session_id)
    return _json(types.CreateSessionResponse(session_id=session.session_id))


async def heartbeat(request: web.Request) -> web.Response:
    body = await _body(request, types.SessionHeartbeatRequest)
    session = request.app[SERVICE].sessions.get(body.session_id)
    if session is None or session.finished:
        raise _refuse(web.HTTPGone, f"session {body.session_id!r} is not open on this service")
    session.last_heartbeat = time.monotonic()
    return _json(types.SessionHeartbeatResponse())


async def finish_session(request: web.Request) -> web.Response:
    session = request.app[SERVICE].sessions.get(request.match_info["session_id"])
    if session is not None:
        session.finished = True
    return _json({})


async def telemetry(request: web.Request) -> web.Response:
    return _json({"status": "accepted"})


def _check_create(config: TinkerConfig, body: types.CreateModelRequest) -> LoraSpec:
    if body.base_model != config.served_name:
        raise WireError(f"base_model {body.base_model!r} is not served here: use "
                        f"{config.served_name!r} (get_server_capabilities lists it)")  # fmt: skip
    lora = body.lora_config or types.LoraConfig(rank=config.max_lora_rank)
    if not 1 <= lora.rank <= config.max_lora_rank:
        raise WireError(f"rank={lora.rank}: this service trains LoRA ranks 1 to "
                        f"{config.max_lora_rank} (its --max-lora-rank); ask for a smaller rank")  # fmt: skip
    if body.optimizer_config.type != "adamw":
        raise WireError(f"optimizer {body.optimizer_config.type!r} is not served here: use the "
                        "default AdamOptimizerConfig")  # fmt: skip
    if not (lora.train_mlp or lora.train_attn):
        raise WireError("train_mlp and train_attn are both False: LoRA here trains the MLP "
                        "and/or attention layers (the LM head is never trained)")  # fmt: skip
    return LoraSpec(rank=lora.rank, seed=lora.seed, train_mlp=lora.train_mlp,
                    train_attn=lora.train_attn)  # fmt: skip


async def create_model(request: web.Request) -> web.Response:
    service, config = request.app[SERVICE], request.app[CONFIG]
    body = await _body(request, types.CreateModelRequest)
    if body.session_id not in service.sessions:
        raise _refuse(web.HTTPNotFound, f"session {body.session_id!r} is not open on this "
                      "service: make a new ServiceClient")  # fmt: skip
    spec = _check_create(config, body)
    model_id = f"{body.session_id}_m{body.model_seq_id}"
    if model_id in service.models:  # the SDK retried: the same client
        return _json({"request_id": service.done({"model_id": model_id}), "model_id": model_id})
    service.models[model_id] = TrainingModel(model_id, body.session_id, spec.rank)

    def job() -> dict[str, str]:
        service.engine.create(model_id, spec)
        logger.info("training client %s: LoRA rank %d", model_id, spec.rank)
        return {"model_id": model_id, "type": "create_model"}

    return _json({"request_id": service.submit(model_id, in_thread(job)), "model_id": model_id})


async def get_info(request: web.Request) -> web.Response:
    service, config = request.app[SERVICE], request.app[CONFIG]
    body = await _body(request, types.GetInfoRequest)
    model = _model(service, body.model_id)
    data = types.ModelData(arch="lora", model_name=config.served_name, tokenizer_id=config.model)
    return _json(types.GetInfoResponse(type="get_info", model_data=data, model_id=model.model_id,
                                       is_lora=True, lora_rank=model.rank,
                                       model_name=config.served_name))  # fmt: skip


async def forward_backward(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    if request.content_type != PROTO_CONTENT_TYPE:
        raise WireError(f"forward_backward takes a {PROTO_CONTENT_TYPE} body (the tinker SDK's)")
    if request.headers.get("Content-Encoding"):
        raise WireError("compressed bodies are not read here: send forward_backward unencoded")
    fwdbwd = decode_fwdbwd(await request.read())
    _model(service, fwdbwd.model_id)
    service.engine.check(fwdbwd)
    for i, datum in enumerate(fwdbwd.data):
        if datum.tokens.size > request.app[CONFIG].max_context_length:
            raise WireError(f"datum {i} has {datum.tokens.size} tokens, more than this "
                            f"service's max_context_length {request.app[CONFIG].max_context_length}")  # fmt: skip
    rid = service.submit(
        fwdbwd.model_id, in_thread(lambda: service.engine.forward_backward(fwdbwd))
    )
    return _json({"request_id": rid, "model_id": fwdbwd.model_id})


async def optim_step(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    body = await _body(request, types.OptimStepRequest)
    _model(service, body.model_id)
    params = body.optim_params
    if not isinstance(params, types.AdamParams):
        raise WireError("optim_step takes AdamParams here (the only optimizer served)")
    step = AdamStep(learning_rate=params.learning_rate, beta1=params.beta1, beta2=params.beta2,
                    eps=params.eps, weight_decay=params.weight_decay,
                    grad_clip_norm=params.grad_clip_norm)  # fmt: skip

    def job() -> dict[str, Any]:
        return {"metrics": service.engine.optim_step(body.model_id, step)}

    rid = service.submit(body.model_id, in_thread(job))
    return _json({"request_id": rid, "model_id": body.model_id})


async def retrieve_future(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    body = await _body(request, types.FutureRetrieveRequest)
    try:
        outcome = await service.futures.wait(body.request_id, POLL_S)
    except KeyError:
        raise _refuse(web.HTTPNotFound, f"no request {body.request_id!r} on this service "
                      "(it restarted, or the id is another server's)") from None  # fmt: skip
    if outcome is None:
        return _json({"type": "try_again", "request_id": body.request_id,
                      "queue_state": "active"})  # fmt: skip
    if outcome.error is not None:
        return _json({"error": outcome.error, "category": outcome.category})
    if isinstance(outcome.value, FwdBwdResult):
        if PROTO_CONTENT_TYPE in request.headers.get("Accept", ""):
            return web.Response(body=encode_fwdbwd(outcome.value), content_type=PROTO_CONTENT_TYPE)
        return _json(fwdbwd_json(outcome.value))
    return _json(outcome.value)


def build_app(config: TinkerConfig, service: TinkerService) -> web.Application:
    app = web.Application(middlewares=[_guard], client_max_size=config.max_body_bytes)
    app[CONFIG], app[SERVICE] = config, service
    api = "/api/v1"
    app.router.add_get(f"{api}/healthz", healthz)
    app.router.add_get(f"{api}/get_server_capabilities", capabilities)
    app.router.add_post(f"{api}/client/config", client_config)
    app.router.add_post(f"{api}/client/dynamic_config", dynamic_config)
    app.router.add_post(f"{api}/create_session", create_session)
    app.router.add_post(f"{api}/session_heartbeat", heartbeat)
    app.router.add_post(f"{api}/sessions/{{session_id}}/finish", finish_session)
    app.router.add_post(f"{api}/telemetry", telemetry)
    app.router.add_post(f"{api}/create_model", create_model)
    app.router.add_post(f"{api}/get_info", get_info)
    app.router.add_post(f"{api}/forward_backward", forward_backward)
    app.router.add_post(f"{api}/optim_step", optim_step)
    app.router.add_post(f"{api}/retrieve_future", retrieve_future)
    return app
