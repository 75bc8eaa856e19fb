"""``/proxy/runs``: the training runs sharing the replicas register the LoRA slots they hold and
their weight, and release them when they end. The books are :mod:`asyncgrpo.proxy.runs`'; what
the replicas can hold is read from their ``/server_info`` here.

``POST {"run", "lora_slots", "weight"}`` answers 409 naming ``--max-loras`` and the numbers when
the runs would need more slots than the replicas have; ``DELETE {"run"}``; ``GET`` lists them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math

from asyncgrpo.proxy.h1 import Response
from asyncgrpo.proxy.jsonbody import BodyError, decode_object
from asyncgrpo.proxy.metrics import runs_stats
from asyncgrpo.proxy.state import Proxy, error_answer, json_answer
from asyncgrpo.proxy.upstream import Upstream
from asyncgrpo.vllm_client import SERVER_INFO_PATH, lora_slots_of, max_num_seqs_of

__all__ = ["replica_limits", "runs_route"]

log = logging.getLogger(__name__)


async def replica_limits(proxy: Proxy) -> tuple[int | None, int | None]:
    """The smallest ``--max-loras`` and ``--max-num-seqs`` among the replicas taking requests
    (None where none says)."""

    async def one(up: Upstream) -> tuple[int | None, int | None]:
        try:
            status, data = await proxy.pool.call(
                up, "GET", SERVER_INFO_PATH, timeout_s=proxy.config.health_timeout_s
            )
            info = json.loads(data) if status == 200 else None
        except (OSError, ValueError):
            return None, None
        return lora_slots_of(info), max_num_seqs_of(info)

    answers = await asyncio.gather(*(one(u) for u in proxy.pool.targets()))
    loras = [n for n, _ in answers if n is not None]
    seqs = [n for _, n in answers if n is not None]
    return min(loras, default=None), min(seqs, default=None)


def _weight(value: object) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok and math.isfinite(value) and value > 0 else None  # type: ignore[arg-type]


async def runs_route(proxy: Proxy, method: str, target: str, body: bytes) -> Response:
    runs = proxy.runs
    if method == "GET":
        return json_answer(200, runs_stats(proxy))
    try:
        doc = decode_object(body, proxy.config.max_body_bytes)
    except BodyError as exc:
        return error_answer(exc.status, str(exc))
    name = doc.get("run")
    if not isinstance(name, str) or not name or len(name) > 256:
        return error_answer(400, 'body must name the run: {"run": "<adapter prefix>", ...}')
    if method == "DELETE":
        if not runs.release(name):
            return error_answer(404, f"run {name} is not registered", kind="NotFoundError")
        log.info("run %s released its LoRA slots", name)
        return json_answer(200, {"released": name})
    slots, weight = doc.get("lora_slots"), _weight(doc.get("weight", 1.0))
    if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1 or weight is None:
        return error_answer(400, "lora_slots must be an integer >= 1 and weight a number > 0")
    max_loras, max_seqs = await replica_limits(proxy)
    if max_loras is None:
        return error_answer(
            503, "no replica in rotation said its --max-loras (GET /server_info): is LoRA on?",
            kind="ServiceUnavailableError",
        )  # fmt: skip
    now = proxy.loop.time()
    if proxy.config.max_inflight_per_replica is None and max_seqs is not None:
        runs.per_replica = max_seqs
        runs.resize(len(proxy.pool.targets()), now)
    for lapsed in runs.expire(now):
        log.warning("run %s sent nothing for run_lease_s: its LoRA slots are free", lapsed)
    why = runs.register(name, slots=slots, weight=weight, max_loras=max_loras,
                        loaded=list(proxy.pool.adapters), now=now)  # fmt: skip
    if why is not None:
        log.warning("refused: %s", why)
        return error_answer(409, why, kind="ConflictError")
    held = runs.holders(proxy.pool.adapters)
    log.info("run %s holds %d LoRA slots (weight %g); %d of --max-loras %d held", name, slots,
             weight, sum(held.values()), max_loras)  # fmt: skip
    return json_answer(200, {"run": name, "lora_slots": slots, "weight": weight,
                             "max_loras": max_loras, "lora_slots_held": held})  # fmt: skip
