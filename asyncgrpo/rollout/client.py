"""The rollout client: prompts in, scored ``Sample``s out, under the current adapter version.

Pipeline (one task group, owned by ``async with RolloutClient(...)``)::

    dataset -> admit G slots -> environment -> scoring workers -> bounded sample queue
               (max_inflight)   (G episodes:      (rewards,         (queue_maxsize)
                                 /v1/completions,  advantages)
                                 retries, policy)

The environment (:mod:`asyncgrpo.rollout.environment`) plays the G episodes of a prompt: by
default one single-turn ``n=G`` request; a multi-turn environment alternates model turns and
its own messages, token-exact.

A group keeps its G in-flight slots until a scoring worker takes it, so a full queue blocks
scoring (``rollout/backpressure_s``), busy scorers block generation
(``rollout/score_block_s``), and no more than ``max_inflight`` completions are ever generated or
waiting. The client talks to one base URL: the proxy (``asyncgrpo.proxy``), which balances
over the replicas by KV-prefix affinity and fails over, or a single vLLM server (same API). It
keeps no balancer of its own, so routing has one implementation and one place to tune. With an
:class:`~asyncgrpo.rollout.window.AdmissionWindow` (the trainer's own client), no group starts
whose samples the trainer would drop as stale.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectSendStream

from asyncgrpo.config.rollout import GenerationConfig, RolloutConfig
from asyncgrpo.errors import ConfigError, EpisodeError, ReplicaError, leaves
from asyncgrpo.rollout.dataset import Prompt, PromptDataset
from asyncgrpo.rollout.environment import Environment, Episode, group_rewards, load_environment
from asyncgrpo.rollout.policy import PolicyClient
from asyncgrpo.rollout.rewards import GroupScores, RewardScorer
from asyncgrpo.rollout.window import AdmissionWindow
from asyncgrpo.sample import Sample, group_advantages
from asyncgrpo.vllm.client import VLLMClient

logger = logging.getLogger(__name__)


class _Slots:
    """A counting semaphore whose acquire takes k units at once (a group of G completions)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0
        self._waiters: list[anyio.Event] = []

    async def acquire(self, k: int) -> None:
        while self.used + k > self.total:
            event = anyio.Event()
            self._waiters.append(event)
            await event.wait()
        self.used += k

    def release(self, k: int) -> None:
        self.used -= k
        waiters, self._waiters = self._waiters, []
        for event in waiters:
            event.set()


@dataclass(slots=True)
class _Generated:
    prompt: Prompt
    episodes: list[Episode]
    slots: int


T = TypeVar("T")


async def _send_timed(stream: MemoryObjectSendStream[T], item: T, blocked: _BlockClock) -> None:
    """Send ``item``; the time a full stream makes it wait counts in ``blocked``."""
    try:
        stream.send_nowait(item)
    except anyio.WouldBlock:
        token = blocked.start()
        try:
            await stream.send(item)
        finally:
            blocked.stop(token)


class _BlockClock:
    """Cumulative seconds some tasks spent blocked, counting blocks still in progress."""

    def __init__(self) -> None:
        self.done_s = 0.0
        self._open: dict[int, float] = {}
        self._next = 0

    def start(self) -> int:
        self._next += 1
        self._open[self._next] = anyio.current_time()
        return self._next

    def stop(self, token: int) -> None:
        self.done_s += anyio.current_time() - self._open.pop(token)

    def total(self) -> float:
        now = anyio.current_time()
        return self.done_s + sum(now - t for t in self._open.values())


class RolloutClient:
    """Generates G completions per prompt under the current policy and queues scored samples.

    Use as ``async with RolloutClient(...) as client:``; take samples with ``await
    client.get(n)`` or ``async for sample in client``. The trainer calls
    ``set_policy(name, version)`` after each weight sync; every token of a sample carries the
    version that was current when its turn's request was sent. ``environment`` defaults to the
    one ``rollout.environment`` names (single-turn when unset). ``position`` is the dataset position to checkpoint:
    every prompt below it has been pushed to the queue. Failures: transport errors are retried
    with backoff, then raise ``ReplicaError``; a 4xx answer raises ``ReplicaError`` at once
    (unless the adapter name changed meanwhile: then it is resent under the new name), but a
    404 for an adapter no replica serves waits up to ``adapter_wait_s`` for it or the next
    policy (:class:`~asyncgrpo.rollout.policy.PolicyClient`).
    """

    def __init__(
        self,
        *,
        base_url: str,
        dataset: PromptDataset | Iterable[Prompt],
        generation: GenerationConfig,
        rollout: RolloutConfig,
        policy: tuple[str, int],
        scorer: RewardScorer | None = None,
        start_position: int = 0,
        advantage_eps: float = 1e-4,
        api_key: str | None = None,
        window: AdmissionWindow | None = None,
        environment: Environment | None = None,
        adapter_wait_s: float = 0.0,
    ) -> None:
        rollout.check_against(generation)
        if not isinstance(base_url, str) or not base_url:
            raise ConfigError(
                f"RolloutClient(base_url={base_url!r}): give one URL, the proxy's or a single "
                "vLLM server's; to use several replicas put the proxy in front of them "
                "(asyncgrpo.proxy.serve_proxy, or python -m asyncgrpo.proxy --upstream URL ...)"
            )
        self.generation = generation
        self.config = rollout
        if environment is None:
            tokenizer = getattr(dataset, "tokenizer", None)
            environment = load_environment(
                rollout.environment,
                rollout.environment_args,
                tokenizer=tokenizer,
                generation=generation,
            )
        self.environment = environment
        if scorer is None and (rollout.reward_funcs or not environment.provides_reward):
            scorer = RewardScorer(
                rollout.reward_funcs,
                weights=rollout.reward_weights,
                max_threads=rollout.reward_max_threads,
            )
        self.scorer = scorer
        self._base_url = base_url
        self._dataset = dataset
        self._start_position = start_position
        self._advantage_eps = advantage_eps
        self._api_key = api_key
        self._policy = policy
        self._adapter_wait_s = adapter_wait_s
        self._slots = _Slots(rollout.max_inflight)
        self._window = window
        self._window_moved = anyio.Event()
        self._send, self._recv = anyio.create_memory_object_stream[Sample](rollout.queue_maxsize)
        self._score_send, self._score_recv = anyio.create_memory_object_stream[_Generated](0)
        self._pending: set[int] = set()
        self._next_position = start_position
        #: this client's name in its samples' ids: a restarted rollout process (which starts
        #: its dataset over) or a second one never repeats an id
        self.producer = secrets.token_hex(4)
        self._vllm: VLLMClient | None = None
        self._client: PolicyClient | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        # metrics
        self._backpressure = _BlockClock()
        self._score_block = _BlockClock()
        self._groups_total = 0
        self._env_failures_total = 0
        self._samples_total = 0
        self._model_turns_total = 0
        self._reward_sums: dict[str, list[float]] = {}
        self._last: dict[str, float] = {}

    # ----------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> RolloutClient:
        # one pool for every request in flight, as many connections as they need (no limit)
        self._vllm = VLLMClient(
            self._base_url,
            api_key=self._api_key,
            timeout_s=self.config.request_timeout_s,
            pool_limit=0,
        )
        self._client = PolicyClient(
            client=self._vllm,
            generation=self.generation,
            rollout=self.config,
            policy=lambda: self._policy,
            adapter_wait_s=self._adapter_wait_s,
        )
        self._last = {"t": anyio.current_time(), "tokens": 0.0, "bp": 0.0, "sb": 0.0}
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._pipeline, name="rollout-pipeline")
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        assert self._tg is not None and self._vllm is not None
        self._tg.cancel_scope.cancel()
        try:
            return await self._tg.__aexit__(*exc_info)
        except BaseExceptionGroup as group:
            errors = [
                e for e in leaves(group) if not isinstance(e, anyio.get_cancelled_exc_class())
            ]
            # Concurrent groups often fail alike (a dead server): surface one readable error.
            if len(errors) == 1 or (errors and all(isinstance(e, ReplicaError) for e in errors)):
                if len(errors) > 1:
                    errors[0].add_note(f"({len(errors) - 1} more rollout requests failed alike)")
                raise errors[0] from None
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await self._vllm.aclose()
                self._recv.close()

    # ----------------------------------------------------------------- public API

    @property
    def policy(self) -> tuple[str, int]:
        """(adapter name, version) sent with new requests."""
        return self._policy

    def set_policy(self, name: str, version: int) -> None:
        """Switch new requests to adapter ``name`` (already loaded on every replica)."""
        if version < self._policy[1]:
            raise ValueError(f"policy version went backwards: {version} < {self._policy[1]}")
        if self._window is not None and version > self._policy[1]:
            self._window.new_version()
            self._wake_producer()
        self._policy = (name, version)

    @property
    def position(self) -> int:
        """Dataset position to resume from: all prompts below it are in the queue (or done)."""
        return min(self._pending) if self._pending else self._next_position

    @property
    def queue_size(self) -> int:
        """Samples waiting in the queue."""
        return self._recv.statistics().current_buffer_used

    async def get(self, n: int) -> list[Sample]:
        """The next ``n`` samples; fewer only when the dataset is exhausted (then [] at the end)."""
        out: list[Sample] = []
        window = self._window
        try:
            while len(out) < n:
                try:
                    sample = self._recv.receive_nowait()
                except anyio.WouldBlock:
                    if window is None:
                        sample = await self._recv.receive()
                    else:
                        window.demand = n - len(out)
                        self._wake_producer()
                        try:
                            sample = await self._recv.receive()
                        finally:
                            window.demand = 0
                out.append(sample)
                if window is not None:
                    window.took(1)
        except anyio.EndOfStream:
            pass
        return out

    async def __aiter__(self) -> AsyncIterator[Sample]:
        while batch := await self.get(1):
            yield batch[0]

    def stats(self) -> dict[str, float]:
        """Metrics since the previous call (``_s`` durations, rates) plus totals and gauges.

        Meant for one reader (the trainer, once per step): each call starts a new interval.
        """
        now = anyio.current_time()
        bp, sb = self._backpressure.total(), self._score_block.total()
        dt = max(now - self._last.get("t", now), 1e-9)
        client = self._client
        tokens = client.tokens_total if client else 0
        busy = client.busy_s if client else 0.0
        out: dict[str, float] = {
            "rollout/inflight": float(client.inflight if client else 0),
            "rollout/admitted": float(self._slots.used),
            "rollout/backpressure_s": bp - self._last.get("bp", 0.0),
            "rollout/score_block_s": sb - self._last.get("sb", 0.0),
            "rollout/generated_tok_s": (tokens - self._last.get("tokens", 0.0)) / dt,
            "rollout/busy_s": busy - self._last.get("busy", 0.0),
            "rollout/backpressure_total_s": bp,
            "rollout/score_block_total_s": sb,
            "rollout/generated_tokens_total": float(tokens),
            "rollout/groups_total": float(self._groups_total),
            "rollout/env_failures_total": float(self._env_failures_total),
            "rollout/samples_total": float(self._samples_total),
            "rollout/model_turns_total": float(self._model_turns_total),
            "rollout/retries_total": float(client.retries_total if client else 0),
            "rollout/bad_logprobs_total": float(client.bad_logprobs_total if client else 0),
            "rollout/reward_nan_total": float(self.scorer.nan_total if self.scorer else 0),
            "rollout/reward_errors_total": float(self.scorer.error_total if self.scorer else 0),
            "rollout/queue_size": float(self.queue_size),
            "rollout/position": float(self.position),
        }
        for name, (total, count) in self._reward_sums.items():
            if count:
                out[f"rewards/{name}"] = total / count
        self._reward_sums = {}
        self._last = {"t": now, "tokens": float(tokens), "bp": bp, "sb": sb, "busy": busy}
        return out

    # ----------------------------------------------------------------- pipeline

    async def _pipeline(self) -> None:
        async with self.environment.running(), anyio.create_task_group() as tg:
            tg.start_soon(self._produce, name="rollout-produce")
            tg.start_soon(self._score_all, name="rollout-score")

    async def _produce(self) -> None:
        """Admit one group per prompt as slots free up; close the scoring stream at the end."""
        g = self.generation.num_generations
        prompts = (
            self._dataset.iter_from(self._start_position)
            if isinstance(self._dataset, PromptDataset)
            else iter(self._dataset)
        )
        async with self._score_send, anyio.create_task_group() as groups:
            for prompt in prompts:
                if self._window is not None:
                    while not self._window.may_admit(g):
                        await self._window_moved.wait()
                    self._window.admitted(g)
                await self._slots.acquire(g)
                self._pending.add(prompt.index)
                self._next_position = prompt.index + 1
                groups.start_soon(self._run_group, prompt, name=f"rollout-group-{prompt.index}")

    async def _run_group(self, prompt: Prompt) -> None:
        g = self.generation.num_generations
        handed_over = False
        assert self._client is not None
        try:
            try:
                episodes = await self.environment.group(prompt, self._client, g)
            except (EpisodeError, BaseExceptionGroup) as exc:
                failed = leaves(exc)
                if not all(isinstance(e, EpisodeError) for e in failed):
                    raise
                self._env_failures_total += 1
                logger.warning(
                    "prompt %d: environment failed, group dropped: %s", prompt.index, failed[0]
                )
                return
            if not episodes:
                logger.warning("prompt %d: no usable episode; group dropped", prompt.index)
                return
            item = _Generated(prompt, episodes, g)
            await _send_timed(self._score_send, item, self._score_block)
            handed_over = True
        finally:
            if not handed_over:
                self._slots.release(g)
                self._pending.discard(prompt.index)
                self._lost(g)

    async def _score_all(self) -> None:
        """Scoring workers; the sample queue closes when the last one is done."""
        async with self._send, self._score_recv, anyio.create_task_group() as tg:
            for i in range(self.config.score_concurrency):
                tg.start_soon(self._score_worker, name=f"rollout-scorer-{i}")

    async def _score_worker(self) -> None:
        async for item in self._score_recv:
            self._slots.release(item.slots)
            try:
                await self._score_group(item)
            finally:
                self._pending.discard(item.prompt.index)

    async def _rewards(self, prompt: Prompt, episodes: list[Episode]) -> GroupScores:
        return await group_rewards(self.scorer, prompt, episodes)

    async def _score_group(self, item: _Generated) -> None:
        prompt, episodes = item.prompt, item.episodes
        k = len(episodes)
        scores = await self._rewards(prompt, episodes)
        advantages = group_advantages(scores.rewards, eps=self._advantage_eps)
        for name, values in scores.per_func.items():
            finite = [v for v in values if not math.isnan(v)]
            acc = self._reward_sums.setdefault(name, [0.0, 0.0])
            acc[0] += sum(finite)
            acc[1] += len(finite)
        self._groups_total += 1
        for j, e in enumerate(episodes):
            sample = Sample(
                prompt_ids=e.prompt_ids,
                completion_ids=e.completion_ids,
                logprobs=e.logprobs,
                reward=scores.rewards[j],
                advantage=advantages[j],
                version=e.version,
                group_id=str(prompt.index),
                temperature=self.generation.temperature,
                rewards={name: values[j] for name, values in scores.per_func.items()},
                finish_reason=e.finish_reason,
                completion_mask=e.completion_mask,
                versions=e.versions,
                replica=e.served_by,
                sample_id=f"{self.producer}-{prompt.index}-{j}",
            )
            await _send_timed(self._send, sample, self._backpressure)
            self._samples_total += 1
            self._model_turns_total += e.model_turns
        self._lost(item.slots - k)

    def _lost(self, k: int) -> None:
        if self._window is not None and k:
            self._window.lost(k)
            self._wake_producer()

    def _wake_producer(self) -> None:
        self._window_moved.set()
        self._window_moved = anyio.Event()
