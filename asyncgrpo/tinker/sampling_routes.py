"""The sampling routes of the tinker SDK's REST API: sampler weights, sessions, ``asample``."""

from __future__ import annotations

import logging
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web
from tinker import types

from asyncgrpo.tinker.checkpoints import Checkpoint, check_ttl
from asyncgrpo.tinker.completions import check_sample
from asyncgrpo.tinker.http import (
    CONFIG,
    CONTROL_BODY_BYTES,
    SAMPLE_BYTES_PER_TOKEN,
    SERVICE,
    answer,
    read_body,
    refuse,
    training_model,
)
from asyncgrpo.tinker.sampling import Sampler, UnknownSampler
from asyncgrpo.tinker.service import TinkerService, in_thread
from asyncgrpo.tinker.wire import SampleResult, WireError
from asyncgrpo.vllm.api import parse_served_name, served_name

__all__ = ["asample", "create_sampling_session", "get_sampler", "save_weights_for_sampler"]

logger = logging.getLogger(__name__)


def _sampler(service: TinkerService) -> Sampler:
    if service.sampler is None:
        raise WireError(
            "this service samples nothing: start it with --proxy-url (the asyncgrpo "
            "proxy in front of vLLM replicas of its model)"
        )
    return service.sampler


async def _resolve(service: TinkerService, **names: str | None) -> str:
    """The served name a session, path or base model names; a path through the index (one
    deleted or past its TTL is refused), then the sampler (it must serve the path's run)."""
    sampler, path = _sampler(service), names.get("path")
    if path is not None and names.get("session") is None:
        run, checkpoint = await service.states.index.resolve(path)
        if checkpoint.kind != "sampler":
            raise WireError(
                f"{path!r} is a save_state checkpoint: sample a path "
                "save_weights_for_sampler returned (.../sampler_weights/<name>)"
            )
        sampler.paths.setdefault(path, served_name(run.run_id, checkpoint.where))
    try:
        return sampler.resolve(session=names.get("session"), path=path, base=names.get("base"))
    except UnknownSampler as exc:
        raise refuse(web.HTTPNotFound, str(exc)) from None


def _check_base(request: web.Request, base: str | None) -> None:
    served = request.app[CONFIG].served_name
    if base is not None and base != served:
        raise WireError(f"base_model {base!r} is not served here: use {served!r}")


async def save_weights_for_sampler(request: web.Request) -> web.Response:
    service, config = request.app[SERVICE], request.app[CONFIG]
    body = await read_body(request, types.SaveWeightsForSamplerRequest)
    model = training_model(service, body.model_id)
    sampler = _sampler(service)
    check_ttl(body.ttl_seconds)
    work = Path(config.work_dir) / "saved"

    async def job() -> dict[str, Any]:
        work.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=work) as tmp:
            saved = await in_thread(lambda: service.engine.save_adapter(model.adapter, Path(tmp)))()
            step = service.engine.steps(model.adapter)
            served = await sampler.publish(model.adapter, saved, step)
        logger.info("training client %s: sampler weights %s loaded", model.model_id, served)
        if body.path is not None:
            path = await _index(service, model.adapter, body, served)
            sampler.paths[path] = served
            return {"path": path, "type": "save_weights_for_sampler"}
        return {
            "sampling_session_id": sampler.new_session(served, model.session_id),
            "type": "save_weights_for_sampler",
        }

    return answer(
        {
            "request_id": service.submit(model.model_id, job, bounded=True),
            "model_id": model.model_id,
        }
    )


async def _index(service: TinkerService, run_id: str, body: Any, served: str) -> str:
    """Record the sampler weights ``served`` under ``body.path`` in the index; their path."""
    if "/" in body.path or not body.path:
        raise WireError(f"save_weights_for_sampler name {body.path!r}: give a name without '/'")
    version = (parse_served_name(served) or (run_id, 0))[1]
    info = await service.sampler.store.info(run_id, version)
    await service.states.start_run(run_id, service.engine.spec(run_id))
    checkpoint = Checkpoint(
        kind="sampler",
        name=body.path,
        where=version,
        created=time.time(),
        size_bytes=info.size_bytes,
        user_metadata=body.user_metadata,
    )
    return await service.states.index.add(run_id, checkpoint, body.ttl_seconds)


async def create_sampling_session(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    body = await read_body(request, types.CreateSamplingSessionRequest)
    sampler = _sampler(service)
    _check_base(request, body.base_model)
    served = await _resolve(service, path=body.model_path, base=body.base_model)
    sid = sampler.new_session(served, body.session_id)
    return answer(types.CreateSamplingSessionResponse(sampling_session_id=sid))


async def asample(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    limit = CONTROL_BODY_BYTES + SAMPLE_BYTES_PER_TOKEN * request.app[CONFIG].max_context_length
    body = await read_body(request, types.SampleRequest, limit)
    sampler = _sampler(service)
    _check_base(request, body.base_model)
    ask = check_sample(body, sampler.limits, service.engine.vocab_size)
    served = await _resolve(
        service, session=body.sampling_session_id, path=body.model_path, base=body.base_model
    )
    owner = sampler.owners.get(body.sampling_session_id or "")
    if body.record_stability_info and owner is None:
        raise WireError(
            "record_stability_info needs a sampling client of a ServiceClient's "
            "session (its records belong to that session): make it with "
            "save_weights_and_get_sampling_client or create_sampling_client"
        )
    if owner is not None:
        service.touch(owner)  # sampling is a sign of life of the session too
    ids = [f"seq-{secrets.token_hex(8)}" for _ in range(body.num_samples)]

    async def job() -> SampleResult:
        result = await sampler.sample(served, ask)
        if body.record_stability_info and owner is not None and service.is_open(owner):
            samples = [
                (i, s.tokens, s.logprobs) for i, s in zip(ids, result.sequences, strict=True)
            ]
            service.records.record(
                owner, np.asarray(ask.prompt, np.int64), samples, time.monotonic()
            )
        return result

    rid = service.spawn(job)
    return answer({"request_id": rid, "sample_sequence_ids": ids})


async def get_sampler(request: web.Request) -> web.Response:
    sampler = _sampler(request.app[SERVICE])
    sid = request.match_info["sampler_id"]
    await _resolve(request.app[SERVICE], session=sid)
    return answer(
        types.GetSamplerResponse(
            sampler_id=sid,
            base_model=request.app[CONFIG].served_name,
            model_path=sampler.path_of(sid),
        )
    )
