"""The SDK's ``RestClient`` routes over the checkpoint index: training runs, their checkpoints,
``weights_info``, deletion and TTLs.

The service has one user (whoever holds its key), so every run is that user's: ``access_scope``
is accepted and changes nothing, and publishing (making a checkpoint readable by other users)
is refused as meaningless here. An unknown run or path is 404 (``NotFoundError``), a malformed
one 400 (``BadRequestError``).
"""

from __future__ import annotations

from datetime import UTC, datetime

import pydantic
from aiohttp import web
from tinker import types

from asyncgrpo.tinker.checkpoints import Checkpoint, Run
from asyncgrpo.tinker.http import CONFIG, SERVICE, answer, read_body, read_object
from asyncgrpo.tinker.service import adapter_name
from asyncgrpo.tinker.wire import WireError

__all__ = ["add_routes"]

#: Who owns every run: the one user of this service.
OWNER = "local"


def _time(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, tz=UTC)


def _checkpoint(run_id: str, checkpoint: Checkpoint) -> types.Checkpoint:
    return types.Checkpoint(
        checkpoint_id=checkpoint.checkpoint_id,
        checkpoint_type=checkpoint.kind,
        time=_time(checkpoint.created),
        tinker_path=checkpoint.path(run_id),
        size_bytes=checkpoint.size_bytes,
        user_metadata=checkpoint.user_metadata,
        expires_at=_time(checkpoint.expires_at),
    )


def _run(run: Run) -> types.TrainingRun:
    last = {kind: run.latest(kind) for kind in ("training", "sampler")}
    return types.TrainingRun(
        training_run_id=run.run_id,
        base_model=run.base_model,
        model_owner=OWNER,
        is_lora=True,
        lora_rank=run.rank,
        last_request_time=_time(run.last_request),
        last_checkpoint=last["training"] and _checkpoint(run.run_id, last["training"]),
        last_sampler_checkpoint=last["sampler"] and _checkpoint(run.run_id, last["sampler"]),
    )


def _page(request: web.Request, default_limit: int) -> tuple[int, int]:
    """``(limit, offset)`` of the query; WireError naming the bounds if not integers."""
    try:
        limit = int(request.query.get("limit", default_limit))
        offset = int(request.query.get("offset", 0))
    except ValueError:
        raise WireError("limit and offset must be integers") from None
    if not (1 <= limit <= 10_000 and offset >= 0):
        raise WireError(f"limit={limit}, offset={offset}: give limit 1 to 10000, offset >= 0")
    return limit, offset


def _path(request: web.Request) -> str:
    run_id = adapter_name(request.match_info["run_id"])
    return f"tinker://{run_id}/{request.match_info['segment']}/{request.match_info['name']}"


async def list_runs(request: web.Request) -> web.Response:
    limit, offset = _page(request, 20)
    runs = await request.app[SERVICE].states.index.runs()
    cursor = types.Cursor(offset=offset, limit=limit, total_count=len(runs))
    return answer(
        types.TrainingRunsResponse(
            training_runs=[_run(r) for r in runs[offset : offset + limit]], cursor=cursor
        )
    )


async def get_run(request: web.Request) -> web.Response:
    run_id = adapter_name(request.match_info["run_id"])
    return answer(_run(await request.app[SERVICE].states.index.run(run_id)))


async def list_checkpoints(request: web.Request) -> web.Response:
    run = await request.app[SERVICE].states.index.run(adapter_name(request.match_info["run_id"]))
    listed = sorted(run.checkpoints, key=lambda c: c.created)
    return answer(
        types.CheckpointsListResponse(checkpoints=[_checkpoint(run.run_id, c) for c in listed])
    )


async def list_user_checkpoints(request: web.Request) -> web.Response:
    limit, offset = _page(request, 100)
    runs = await request.app[SERVICE].states.index.runs()
    every = sorted(
        ((r.run_id, c) for r in runs for c in r.checkpoints),
        key=lambda rc: rc[1].created,
        reverse=True,
    )
    cursor = types.Cursor(offset=offset, limit=limit, total_count=len(every))
    return answer(
        types.CheckpointsListResponse(
            checkpoints=[_checkpoint(*rc) for rc in every[offset : offset + limit]], cursor=cursor
        )
    )


async def delete_checkpoint(request: web.Request) -> web.Response:
    service, path = request.app[SERVICE], _path(request)
    await service.states.index.delete(path)
    if service.sampler is not None:
        service.sampler.paths.pop(path, None)
    return answer({})


async def set_ttl(request: web.Request) -> web.Response:
    body = await read_object(request)
    ttl = body.get("ttl_seconds")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int)):
        raise WireError(f"ttl_seconds={ttl!r}: give an integer number of seconds, or null")
    await request.app[SERVICE].states.index.set_ttl(_path(request), ttl)
    return answer({})


async def publish(request: web.Request) -> web.Response:
    raise WireError(
        "publishing is not served: this service has one user (whoever holds its "
        "key), who can read every checkpoint already; share the tinker:// path"
    )


async def weights_info(request: web.Request) -> web.Response:
    body = await read_body(request, _WeightsInfoRequest)
    run, _ = await request.app[SERVICE].states.index.resolve(body.tinker_path)
    config = request.app[CONFIG]
    return answer(
        types.WeightsInfoResponse(
            base_model=run.base_model or config.served_name,
            is_lora=True,
            lora_rank=run.rank,
            train_unembed=False,
            train_mlp=run.train_mlp,
            train_attn=run.train_attn,
        )
    )


class _WeightsInfoRequest(pydantic.BaseModel):
    """The body the SDK posts (it has no type of its own for it)."""

    tinker_path: str


def add_routes(app: web.Application, api: str) -> None:
    runs, one = f"{api}/training_runs", f"{api}/training_runs/{{run_id}}"
    checkpoint = f"{one}/checkpoints/{{segment}}/{{name}}"
    app.router.add_get(runs, list_runs)
    app.router.add_get(one, get_run)
    app.router.add_get(f"{one}/checkpoints", list_checkpoints)
    app.router.add_get(f"{api}/checkpoints", list_user_checkpoints)
    app.router.add_delete(checkpoint, delete_checkpoint)
    app.router.add_put(f"{checkpoint}/ttl", set_ttl)
    app.router.add_post(f"{checkpoint}/publish", publish)
    app.router.add_delete(f"{checkpoint}/publish", publish)
    app.router.add_post(f"{api}/weights_info", weights_info)
