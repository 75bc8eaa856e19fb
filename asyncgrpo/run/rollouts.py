"""``asyncgrpo rollout CONFIG``: a rollout process of a split run.

It generates under the trainer's current policy (``policy.json``, polled) and ships scored
samples through the transport's :class:`~asyncgrpo.store.channel.RolloutChannel` until the trainer
writes ``done.json`` (:class:`~asyncgrpo.store.run_documents.RunStore`). Requests go to the run's endpoint
(:func:`~asyncgrpo.run.endpoint.open_endpoint`): a standalone proxy directly, or local replicas and
``proxy.upstreams`` behind an in-process proxy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING

import anyio

from asyncgrpo.config.model_source import check_model
from asyncgrpo.config.training import run_transport_url
from asyncgrpo.errors import IntegrityError, ReplicaError, TransportError
from asyncgrpo.rollout.client import RolloutClient
from asyncgrpo.run.endpoint import open_endpoint
from asyncgrpo.run.ledger import SHIPPED_FILE, Ledger
from asyncgrpo.run.preflight import dry_run
from asyncgrpo.run.progress import RunProgress, as_progress
from asyncgrpo.run.sources import rollout_client
from asyncgrpo.sample import Sample
from asyncgrpo.store.channel import RolloutChannel
from asyncgrpo.store.run_documents import RunStore, warn_once
from asyncgrpo.transport import open_transport

if TYPE_CHECKING:
    from asyncgrpo.config.training import TrainingConfig

logger = logging.getLogger(__name__)

#: Seconds a rollout process keeps trying storage that fails (each try is the transport's own
#: retries) before it gives up: an outage of a few minutes costs a pause, not the process,
#: whose restart would drop every rollout in flight.
STORAGE_PATIENCE_S = 300.0
#: How long a request waits for an adapter no replica serves (or for the next policy): a
#: trainer that dies unloads its adapters, and its restart (model load, resume) loads the next
#: version; a rollout process that ended instead would drop every rollout in flight.
TRAINER_PATIENCE_S = 300.0


async def run_rollouts(
    cfg: TrainingConfig, *, poll_interval_s: float = 0.5, progress: RunProgress | None = None
) -> int:
    """Ship rollouts until the trainer finishes; returns the number of samples shipped.
    ``progress`` hears the phases: model, replicas, the trainer's policy and each new one."""
    report = as_progress(progress)
    await anyio.to_thread.run_sync(check_model, cfg.model)  # first, as run_training does
    await anyio.to_thread.run_sync(dry_run, cfg)  # every check of --dry-run, before anything
    report.phase(f"model {cfg.model}: found")
    transport = open_transport(run_transport_url(cfg))
    store = RunStore(transport)
    shipped = 0
    try:
        async with AsyncExitStack() as stack:
            endpoint = await stack.enter_async_context(  # first: a bad setup fails at once
                open_endpoint(cfg, cfg.run_dir / "adapter-cache", transport.url, phase=report.phase)
            )
            report.phase(f"waiting for the trainer's first version in {transport.url}")
            policy = await store.wait_for_policy(poll_interval_s)
            report.phase(f"generating under {policy[0]} (version {policy[1]})")
            client = await stack.enter_async_context(
                await rollout_client(
                    cfg,
                    endpoint.url,
                    policy,
                    0,
                    api_key=endpoint.api_key,
                    adapter_wait_s=TRAINER_PATIENCE_S,
                )
            )
            channel = RolloutChannel(transport)
            ledger = Ledger(cfg.run_dir / SHIPPED_FILE, enabled=cfg.logging.jsonl)
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    _follow_policy, store, client, poll_interval_s, tg.cancel_scope, report
                )
                while samples := await client.get(cfg.generation.num_generations):
                    ledger.shipped(await _append(channel, samples), samples)
                    shipped += len(samples)
                tg.cancel_scope.cancel()
    except* ReplicaError:
        # The trainer unloads its adapters right after writing done.json; requests still in
        # flight under them answer 404 before the next poll sees the end. That is the end too.
        if not await store.finished():
            raise
        logger.info("the trainer finished while rollouts were in flight; stopping")
    finally:
        await transport.aclose()
    return shipped


async def _append(channel: RolloutChannel, samples: Sequence[Sample]) -> int:
    """``channel.append``, tried again while storage fails, for ``STORAGE_PATIENCE_S`` (a retried
    append is delivered once: the channel recognises a create that landed)."""
    deadline = time.monotonic() + STORAGE_PATIENCE_S
    while True:
        try:
            return await channel.append(samples)
        except TransportError as exc:
            if isinstance(exc, IntegrityError) or time.monotonic() > deadline:
                raise
            logger.warning("shipping a rollout batch failed (trying again): %s", exc)
            await anyio.sleep(2.0)


async def _follow_policy(
    store: RunStore,
    client: RolloutClient,
    poll_interval_s: float,
    scope: anyio.CancelScope,
    report: RunProgress,
) -> None:
    """Switch the client to each new policy the trainer writes; end the shipping at done.
    Storage that fails meanwhile is asked again at the next poll (for ``STORAGE_PATIENCE_S``):
    the policy in use stays valid while the trainer cannot write a new one either. A malformed
    ``policy.json`` is logged and the current policy kept (the trainer rewrites it at its next
    sync)."""
    failing_since: float | None = None
    seen = ""
    while True:
        await anyio.sleep(poll_interval_s)
        try:
            if await store.finished():
                scope.cancel()
                return
            name, version = await store.read_policy()
        except IntegrityError as exc:
            seen = warn_once(seen, exc)
            continue
        except TransportError as exc:
            now = time.monotonic()
            if failing_since is None:
                failing_since = now
                logger.warning("reading the trainer's policy failed (polling on): %s", exc)
            if now - failing_since > STORAGE_PATIENCE_S:
                raise
            continue
        failing_since = None
        seen = ""
        if version > client.policy[1]:
            client.set_policy(name, version)
            report.phase(f"generating under version {version}")
