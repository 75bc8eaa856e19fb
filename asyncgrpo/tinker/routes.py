"""The session, training and futures routes of the tinker SDK's REST API."""

from __future__ import annotations

import dataclasses
import logging
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from aiohttp import web
from tinker import types

from asyncgrpo.config.tinker import TinkerConfig
from asyncgrpo.tinker.checkpoints import check_ttl
from asyncgrpo.tinker.engine import AdamStep, LoraSpec
from asyncgrpo.tinker.http import (
    CONFIG,
    SERVICE,
    answer,
    read_body,
    read_bytes,
    refuse,
    refuse_taken,
    training_model,
)
from asyncgrpo.tinker.losses import SamplerGap, sampler_gap
from asyncgrpo.tinker.service import TinkerService, TrainingModel, in_thread, with_provenance
from asyncgrpo.tinker.states import parse_state_path, state_path
from asyncgrpo.tinker.wire import (
    PROTO_CONTENT_TYPE,
    FwdBwdRequest,
    FwdBwdResult,
    SampleResult,
    WireError,
    encode_fwdbwd,
    encode_sample,
    fwdbwd_json,
    fwdbwd_shape,
    parse_fwdbwd,
    read_fwdbwd,
)

logger = logging.getLogger(__name__)

#: How long ``retrieve_future`` waits for a pending request before answering ``try_again``
#: (the SDK's own read timeout for the call is 45 s).
POLL_S = 20.0
#: The SDK's own bound on a forward_backward chunk (its estimate of the tensors' bytes).
SDK_CHUNK_BYTES = 5_000_000


async def healthz(request: web.Request) -> web.Response:
    return answer({"status": "ok"})


async def capabilities(request: web.Request) -> web.Response:
    config = request.app[CONFIG]
    sampleable = request.app[SERVICE].sampler is not None
    model = types.SupportedModel(
        model_name=config.served_name,
        trainable=True,
        sampleable=sampleable,
        max_context_length=config.max_context_length,
    )
    return answer(types.GetServerCapabilitiesResponse(supported_models=[model]))


async def client_config(request: web.Request) -> web.Response:
    # API keys only (no JWT exchange), plain httpx, one fwd/bwd chunk at a time in order, each
    # chunk within this service's limits on datums and bytes
    config = request.app[CONFIG]
    return answer(
        types.ClientConfigResponse(
            pjwt_auth_enabled=False,
            use_pyqwest_transport=False,
            parallel_fwdbwd_chunks=False,
            proto_compress_fwdbwd=False,
            fwdbwd_max_chunk_len=config.max_datums,
            fwdbwd_max_chunk_bytes_count=min(SDK_CHUNK_BYTES, config.max_body_bytes // 4),
        )
    )


async def dynamic_config(request: web.Request) -> web.Response:
    return answer(types.ClientDynamicConfigResponse())


async def create_session(request: web.Request) -> web.Response:
    await read_body(request, types.CreateSessionRequest)
    session = request.app[SERVICE].new_session()
    logger.info("session %s started", session.session_id)
    return answer(types.CreateSessionResponse(session_id=session.session_id))


async def heartbeat(request: web.Request) -> web.Response:
    body = await read_body(request, types.SessionHeartbeatRequest)
    session = request.app[SERVICE].sessions.get(body.session_id)
    if session is None or session.finished:
        raise refuse(web.HTTPGone, f"session {body.session_id!r} is not open on this service")
    request.app[SERVICE].touch(session.session_id)
    return answer(types.SessionHeartbeatResponse())


async def finish_session(request: web.Request) -> web.Response:
    request.app[SERVICE].end_session(request.match_info["session_id"], "finished")
    return answer({})


async def telemetry(request: web.Request) -> web.Response:
    return answer({"status": "accepted"})


def _check_base(config: TinkerConfig, base_model: str | None) -> None:
    if base_model is not None and base_model != config.served_name:
        raise WireError(
            f"base_model {base_model!r} is not served here: use "
            f"{config.served_name!r} (get_server_capabilities lists it)"
        )


def _check_rank(config: TinkerConfig, rank: int) -> None:
    if not 1 <= rank <= config.max_lora_rank:
        raise WireError(
            f"rank={rank}: this service trains LoRA ranks 1 to "
            f"{config.max_lora_rank} (its --max-lora-rank); ask for a smaller rank"
        )


def _check_create(config: TinkerConfig, body: types.CreateModelRequest) -> LoraSpec:
    _check_base(config, body.base_model)
    lora = body.lora_config or types.LoraConfig(rank=config.max_lora_rank)
    _check_rank(config, lora.rank)
    if body.optimizer_config.type != "adamw":
        raise WireError(
            f"optimizer {body.optimizer_config.type!r} is not served here: use the "
            "default AdamOptimizerConfig"
        )
    if lora.seed is not None and not 0 <= lora.seed < 2**64:  # torch's range
        raise WireError(f"seed={lora.seed}: give a seed from 0 to 2**64 - 1")
    if not (lora.train_mlp or lora.train_attn):
        raise WireError(
            "train_mlp and train_attn are both False: LoRA here trains the MLP "
            "and/or attention layers (the LM head is never trained)"
        )
    return LoraSpec(
        rank=lora.rank, seed=lora.seed, train_mlp=lora.train_mlp, train_attn=lora.train_attn
    )


async def create_model(request: web.Request) -> web.Response:
    service, config = request.app[SERVICE], request.app[CONFIG]
    body = await read_body(request, types.CreateModelRequest)
    if not service.is_open(body.session_id):
        raise refuse(
            web.HTTPNotFound,
            f"session {body.session_id!r} is not open on this service: make a new ServiceClient",
        )
    spec = _check_create(config, body)
    model_id = f"{body.session_id}_m{body.model_seq_id}"
    if model_id in service.models:  # the SDK retried: the same client
        return answer({"request_id": service.done({"model_id": model_id}), "model_id": model_id})
    model = TrainingModel(model_id, body.session_id, spec.rank)
    service.add_model(model)

    async def job() -> dict[str, str]:
        await add_client(service, model, spec)  # refused: it holds nothing
        return {"model_id": model_id, "type": "create_model"}

    # beside the queue: booking slots may wait for another session's to come back, and the
    # worker must meanwhile run that session's removal
    return answer({"request_id": service.spawn(job, model_id), "model_id": model_id})


async def add_client(service: TinkerService, model: TrainingModel, spec: LoraSpec) -> None:
    """Book the new client's slots (waiting, beside the queue, for those of sessions that
    stopped heartbeating), then add its adapter in its turn on the worker. On any failure, or
    if its session ends meanwhile, everything booked goes back (:meth:`TinkerService.discard`):
    slots booked before a failed create (``seed=2**70``) stayed booked, and a client made
    after its session ended was never removed."""

    def check_live() -> None:
        if not service.is_live(model):
            raise WireError(
                f"the session of training client {model.model_id!r} ended while "
                "the client was being made: make a new ServiceClient"
            )

    try:
        if service.sampler is not None:  # refused, naming --max-loras, if the fleet is full
            await service.book_slots(model)
        check_live()
        await service.in_turn(
            model.model_id, in_thread(lambda: service.engine.create(model.adapter, spec))
        )
        check_live()
        await service.states.start_run(model.adapter, spec)
        check_live()
    except BaseException:
        service.discard(model)
        raise
    logger.info("training client %s: LoRA rank %d", model.model_id, spec.rank)


async def get_info(request: web.Request) -> web.Response:
    service, config = request.app[SERVICE], request.app[CONFIG]
    body = await read_body(request, types.GetInfoRequest)
    model = training_model(service, body.model_id)
    data = types.ModelData(arch="lora", model_name=config.served_name, tokenizer_id=config.model)
    return answer(
        types.GetInfoResponse(
            type="get_info",
            model_data=data,
            model_id=model.model_id,
            is_lora=True,
            lora_rank=model.rank,
            model_name=config.served_name,
        )
    )


async def forward_backward(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    if request.content_type != PROTO_CONTENT_TYPE:
        raise WireError(f"forward_backward takes a {PROTO_CONTENT_TYPE} body (the tinker SDK's)")
    if request.headers.get("Content-Encoding"):
        raise WireError("compressed bodies are not read here: send forward_backward unencoded")
    config = request.app[CONFIG]
    body = await read_bytes(request, config.max_body_bytes)
    # its shape (client, datums, parts) first, then the client and the queue; only then parsed
    # and read into arrays, and checked against the model: in a worker thread
    model_id, _ = await anyio.to_thread.run_sync(
        lambda: fwdbwd_shape(body, max_datums=config.max_datums)
    )
    model = training_model(service, model_id)
    service.check_room(model.model_id)

    def read() -> FwdBwdRequest:
        fwdbwd = read_fwdbwd(
            parse_fwdbwd(body), max_datums=config.max_datums, max_tokens=config.max_context_length
        )
        fwdbwd = dataclasses.replace(fwdbwd, model_id=model.adapter)
        service.engine.check(fwdbwd)
        return fwdbwd

    fwdbwd = await anyio.to_thread.run_sync(read)
    fwdbwd = with_provenance(fwdbwd, service.records, model.session_id, time.monotonic())

    def job() -> FwdBwdResult:
        result = service.engine.forward_backward(fwdbwd)
        gap = sampler_gap(
            fwdbwd.loss_fn,
            [d.inputs for d in fwdbwd.data],
            [d.trained for d in fwdbwd.data],
            [o["logprobs"] for o in result.outputs],
        )
        if not fwdbwd.forward_only:
            service.gaps.setdefault(model.model_id, SamplerGap()).add(gap)
        result.metrics.update(gap.metrics())
        return result

    rid = service.submit(model.model_id, in_thread(job), bounded=True)
    return answer({"request_id": rid, "model_id": model.model_id})


async def optim_step(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    body = await read_body(request, types.OptimStepRequest)
    model = training_model(service, body.model_id)
    params = body.optim_params
    if not isinstance(params, types.AdamParams):
        raise WireError("optim_step takes AdamParams here (the only optimizer served)")
    step = AdamStep(
        learning_rate=params.learning_rate,
        beta1=params.beta1,
        beta2=params.beta2,
        eps=params.eps,
        weight_decay=params.weight_decay,
        grad_clip_norm=params.grad_clip_norm,
    )

    def job() -> dict[str, Any]:
        metrics = service.engine.optim_step(model.adapter, step)
        return {"metrics": {**metrics, **service.gaps.pop(model.model_id, SamplerGap()).metrics()}}

    rid = service.submit(body.model_id, in_thread(job), bounded=True)
    return answer({"request_id": rid, "model_id": body.model_id})


async def retrieve_future(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    body = await read_body(request, types.FutureRetrieveRequest)
    try:
        outcome = await service.futures.wait(body.request_id, POLL_S)
    except KeyError:
        raise refuse(
            web.HTTPNotFound,
            f"no request {body.request_id!r} on this service "
            "(it restarted, or the id is another server's)",
        ) from None
    if outcome is None:
        return answer({"type": "try_again", "request_id": body.request_id, "queue_state": "active"})
    if outcome.error is not None:
        return answer({"error": outcome.error, "category": outcome.category})
    if isinstance(outcome.value, SampleResult):
        return web.Response(body=encode_sample(outcome.value), content_type=PROTO_CONTENT_TYPE)
    if isinstance(outcome.value, FwdBwdResult):
        if PROTO_CONTENT_TYPE in request.headers.get("Accept", ""):
            return web.Response(body=encode_fwdbwd(outcome.value), content_type=PROTO_CONTENT_TYPE)
        return answer(fwdbwd_json(outcome.value))
    return answer(outcome.value)


async def save_weights(request: web.Request) -> web.Response:
    service, config = request.app[SERVICE], request.app[CONFIG]
    body = await read_body(request, types.SaveWeightsRequest)
    model = training_model(service, body.model_id)
    name = body.path or f"state-{secrets.token_hex(4)}"
    check_ttl(body.ttl_seconds)
    await refuse_taken(service, state_path(model.adapter, name), body.overwrite)
    work = Path(config.work_dir) / "saved"

    async def job() -> dict[str, Any]:
        work.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=work) as tmp:
            await in_thread(lambda: service.engine.save_state(model.adapter, Path(tmp)))()
            spec = service.engine.spec(model.adapter)
            path = await service.states.save(
                model.adapter,
                name,
                Path(tmp),
                spec,
                ttl_seconds=body.ttl_seconds,
                user_metadata=body.user_metadata,
            )
        logger.info("training client %s: state saved as %s", model.model_id, path)
        return {"path": path, "type": "save_weights"}

    return answer(
        {
            "request_id": service.submit(model.model_id, job, bounded=True),
            "model_id": model.model_id,
        }
    )


async def load_weights(request: web.Request) -> web.Response:
    service, config = request.app[SERVICE], request.app[CONFIG]
    body = await read_body(request, types.LoadWeightsRequest)
    parse_state_path(body.path)
    await service.states.index.resolve(body.path)  # NotFoundError now for an unknown path
    if body.model_id is not None:
        model, new = training_model(service, body.model_id), False
    elif body.session_id is not None and body.model_seq_id is not None:
        _check_base(config, body.base_model)
        if not service.is_open(body.session_id):
            raise refuse(
                web.HTTPNotFound,
                f"session {body.session_id!r} is not open on this "
                "service: make a new ServiceClient",
            )
        model_id = f"{body.session_id}:train:{body.model_seq_id}"  # the id the SDK derives
        model, new = (
            service.models.get(model_id) or TrainingModel(model_id, body.session_id, 0),
            True,
        )
    else:
        raise WireError("load_weights needs model_id, or session_id with model_seq_id")
    work = Path(config.work_dir) / "loaded"

    async def job() -> dict[str, Any]:
        work.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=work) as tmp:
            state, spec = await service.states.fetch(body.path, Path(tmp))
            if new and model.model_id not in service.models:
                _check_rank(config, spec.rank)
                made = dataclasses.replace(model, rank=spec.rank)
                service.add_model(made)  # refused if the session ended meanwhile
                await add_client(service, made, spec)  # refused: it holds nothing

            def load_now() -> None:
                if not service.engine.has(model.adapter):  # it ended while this waited
                    raise WireError(
                        f"training client {model.model_id!r} ended (its session "
                        "did) before its state was loaded"
                    )
                service.engine.load_state(model.adapter, state, optimizer=body.optimizer)

            load = in_thread(load_now)
            await (service.in_turn(model.model_id, load) if new else load())
        logger.info("training client %s: state %s loaded", model.model_id, body.path)
        return {"path": body.path, "model_id": model.model_id, "type": "load_weights"}

    # a new client's runs beside the queue as create_model's does; an existing one's in its turn
    rid = (
        service.spawn(job, model.model_id)
        if new
        else service.submit(model.model_id, job, bounded=True)
    )
    return answer({"request_id": rid, "model_id": model.model_id})
