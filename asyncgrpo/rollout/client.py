"""The rollout client: prompts in, scored ``Sample``s out, under the current adapter version.

Pipeline (one task group, owned by ``async with RolloutClient(...)``)::

    dataset -> admit G slots -> /v1/completions -> scoring workers -> bounded sample queue
               (max_inflight)   (retries, policy)   (rewards, advantages)  (queue_maxsize)

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
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
import anyio.abc

from asyncgrpo.errors import ConfigError, ReplicaError, leaves
from asyncgrpo.rollout.config import GenerationConfig, RolloutConfig
from asyncgrpo.rollout.dataset import Prompt, PromptDataset
from asyncgrpo.rollout.rewards import RewardScorer
from asyncgrpo.rollout.window import AdmissionWindow
from asyncgrpo.sample import Sample, group_advantages

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0


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
class _Completion:
    version: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None


@dataclass(slots=True)
class _Generated:
    prompt: Prompt
    completions: list[_Completion]
    slots: int


class _Retryable(Exception):
    """A transport failure worth another attempt (connection, 5xx, 429, timeout)."""


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
    ``set_policy(name, version)`` after each weight sync; every sample carries the version that
    was current when its request was sent. ``position`` is the dataset position to checkpoint:
    every prompt below it has been pushed to the queue. Failures: transport errors are retried
    with backoff, then raise ``ReplicaError``; a 4xx answer raises ``ReplicaError`` at once
    (unless the adapter name changed meanwhile: then it is resent under the new name).
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
        self.scorer = scorer or RewardScorer(
            rollout.reward_funcs,
            weights=rollout.reward_weights,
            max_threads=rollout.reward_max_threads,
        )
        self._dataset = dataset
        self._start_position = start_position
        self._advantage_eps = advantage_eps
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._url = f"{base_url.rstrip('/')}/v1/completions"
        self._policy = policy
        self._slots = _Slots(rollout.max_inflight)
        self._window = window
        self._window_moved = anyio.Event()
        self._send, self._recv = anyio.create_memory_object_stream[Sample](rollout.queue_maxsize)
        self._score_send, self._score_recv = anyio.create_memory_object_stream[_Generated](0)
        self._pending: set[int] = set()
        self._next_position = start_position
        self._session: aiohttp.ClientSession | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        # metrics
        self._inflight = 0
        self._backpressure = _BlockClock()
        self._score_block = _BlockClock()
        self._tokens_total = 0
        self._groups_total = 0
        self._samples_total = 0
        self._retries_total = 0
        self._bad_logprobs_total = 0
        self._reward_sums: dict[str, list[float]] = {}
        self._last: dict[str, float] = {}

    # ----------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> RolloutClient:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=self.config.request_timeout_s),
            headers=self._headers,
        )
        self._last = {"t": anyio.current_time(), "tokens": 0.0, "bp": 0.0, "sb": 0.0}
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._pipeline, name="rollout-pipeline")
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        assert self._tg is not None and self._session is not None
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
                await self._session.close()
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
        out: dict[str, float] = {
            "rollout/inflight": float(self._inflight),
            "rollout/admitted": float(self._slots.used),
            "rollout/backpressure_s": bp - self._last.get("bp", 0.0),
            "rollout/score_block_s": sb - self._last.get("sb", 0.0),
            "rollout/generated_tok_s": (self._tokens_total - self._last.get("tokens", 0.0)) / dt,
            "rollout/backpressure_total_s": bp,
            "rollout/score_block_total_s": sb,
            "rollout/generated_tokens_total": float(self._tokens_total),
            "rollout/groups_total": float(self._groups_total),
            "rollout/samples_total": float(self._samples_total),
            "rollout/retries_total": float(self._retries_total),
            "rollout/bad_logprobs_total": float(self._bad_logprobs_total),
            "rollout/reward_nan_total": float(self.scorer.nan_total),
            "rollout/reward_errors_total": float(self.scorer.error_total),
            "rollout/queue_size": float(self.queue_size),
            "rollout/position": float(self.position),
        }
        for name, (total, count) in self._reward_sums.items():
            if count:
                out[f"rewards/{name}"] = total / count
        self._reward_sums = {}
        self._last = {"t": now, "tokens": float(self._tokens_total), "bp": bp, "sb": sb}
        return out

    # ----------------------------------------------------------------- pipeline

    async def _pipeline(self) -> None:
        async with anyio.create_task_group() as tg:
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
        try:
            if self.generation.request_mode == "n":
                completions = await self._request(prompt, n=g, seed_offset=0)
            else:
                results: list[list[_Completion]] = [[] for _ in range(g)]

                async def one(i: int) -> None:
                    results[i] = await self._request(prompt, n=1, seed_offset=i)

                async with anyio.create_task_group() as tg:
                    for i in range(g):
                        tg.start_soon(one, i)
                completions = [c for r in results for c in r]
            if not completions:
                logger.warning("prompt %d: no usable completion; group dropped", prompt.index)
                return
            item = _Generated(prompt, completions, g)
            try:
                self._score_send.send_nowait(item)
            except anyio.WouldBlock:
                token = self._score_block.start()
                try:
                    await self._score_send.send(item)
                finally:
                    self._score_block.stop(token)
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

    async def _score_group(self, item: _Generated) -> None:
        prompt, comps = item.prompt, item.completions
        k = len(comps)
        texts = [c.text for c in comps]
        completions: list[Any] = (
            [[{"role": "assistant", "content": t}] for t in texts] if prompt.is_chat else texts
        )
        kwargs: dict[str, Any] = {
            key: [value] * k
            for key, value in prompt.extra.items()
            if key not in ("prompts", "completions")
        }
        kwargs["prompt_ids"] = [c.prompt_ids for c in comps]
        kwargs["completion_ids"] = [c.token_ids for c in comps]
        scores = await self.scorer.score([prompt.prompt] * k, completions, **kwargs)
        advantages = group_advantages(scores.rewards, eps=self._advantage_eps)
        for name, values in scores.per_func.items():
            finite = [v for v in values if not math.isnan(v)]
            acc = self._reward_sums.setdefault(name, [0.0, 0.0])
            acc[0] += sum(finite)
            acc[1] += len(finite)
        self._groups_total += 1
        for j, c in enumerate(comps):
            sample = Sample(
                prompt_ids=c.prompt_ids,
                completion_ids=c.token_ids,
                logprobs=c.logprobs,
                reward=scores.rewards[j],
                advantage=advantages[j],
                version=c.version,
                group_id=str(prompt.index),
                temperature=self.generation.temperature,
                rewards={name: values[j] for name, values in scores.per_func.items()},
                finish_reason=c.finish_reason,
            )
            try:
                self._send.send_nowait(sample)
            except anyio.WouldBlock:
                token = self._backpressure.start()
                try:
                    await self._send.send(sample)
                finally:
                    self._backpressure.stop(token)
            self._samples_total += 1
        self._lost(item.slots - k)

    def _lost(self, k: int) -> None:
        if self._window is not None and k:
            self._window.lost(k)
            self._wake_producer()

    def _wake_producer(self) -> None:
        self._window_moved.set()
        self._window_moved = anyio.Event()

    # ----------------------------------------------------------------- HTTP

    def _body(self, prompt: Prompt, model: str, n: int, seed_offset: int) -> dict[str, Any]:
        gen = self.generation
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompt.prompt_ids,
            "n": n,
            "max_tokens": gen.max_completion_length,
            "temperature": gen.temperature,
            "top_p": gen.top_p,
            "top_k": gen.top_k,
            "min_p": gen.min_p,
            "repetition_penalty": gen.repetition_penalty,
            "logprobs": 0,
            "return_token_ids": True,
        }
        if gen.stop:
            body["stop"] = list(gen.stop)
        if gen.seed is not None:
            # vLLM gives child i of an n>1 request seed + i, so both modes draw the same seeds.
            body["seed"] = gen.seed + prompt.index * gen.num_generations + seed_offset
        return body

    async def _request(self, prompt: Prompt, *, n: int, seed_offset: int) -> list[_Completion]:
        """One completions request, retried on transport errors; returns its usable choices."""
        assert self._session is not None
        attempt = 0
        while True:
            model, version = self._policy
            url = self._url
            self._inflight += n
            try:
                async with self._session.post(
                    url, json=self._body(prompt, model, n, seed_offset)
                ) as resp:
                    if resp.status >= 500 or resp.status == 429:
                        text = await resp.text()
                        raise _Retryable(f"HTTP {resp.status}: {text[:300]}")
                    if resp.status >= 400:
                        text = await resp.text()
                        if self._policy[0] != model and attempt < self.config.retries:
                            # The adapter was swapped (and maybe unloaded) under this request.
                            attempt += 1
                            self._retries_total += 1
                            continue
                        raise ReplicaError(
                            f"{url} answered HTTP {resp.status} for model {model!r}: {text[:500]}"
                        )
                    data = await resp.json()
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
                err: Exception = exc
            except _Retryable as exc:
                err = exc
            else:
                return self._parse(prompt, data, version, url)
            finally:
                self._inflight -= n
            attempt += 1
            if attempt > self.config.retries:
                raise ReplicaError(
                    f"{url}: giving up after {attempt} attempts (rollout.retries="
                    f"{self.config.retries}): {type(err).__name__}: {err}"
                ) from err
            delay = min(self.config.retry_backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S)
            self._retries_total += 1
            logger.warning(
                "rollout request to %s failed (%s: %s); retry %d/%d in %.2f s",
                url,
                type(err).__name__,
                err,
                attempt,
                self.config.retries,
                delay,
            )
            await anyio.sleep(delay)

    def _parse(
        self, prompt: Prompt, data: dict[str, Any], version: int, url: str
    ) -> list[_Completion]:
        out: list[_Completion] = []
        choices = sorted(data.get("choices") or [], key=lambda c: c.get("index", 0))
        for choice in choices:
            token_ids = choice.get("token_ids")
            if token_ids is None:
                raise ReplicaError(
                    f"{url} returned no token_ids: the server ignores `return_token_ids` "
                    "(needs vLLM >= 0.10.2 serving /v1/completions)"
                )
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
            if (
                logprobs is None
                or len(logprobs) != len(token_ids)
                or any(lp is None or not math.isfinite(lp) for lp in logprobs)
            ):
                self._bad_logprobs_total += 1
                logger.warning(
                    "prompt %d: a completion from %s has missing logprobs; dropped",
                    prompt.index,
                    url,
                )
                continue
            self._tokens_total += len(token_ids)
            out.append(
                _Completion(
                    version=version,
                    prompt_ids=list(choice.get("prompt_token_ids") or prompt.prompt_ids),
                    token_ids=list(token_ids),
                    logprobs=[float(lp) for lp in logprobs],
                    text=choice.get("text") or "",
                    finish_reason=choice.get("finish_reason"),
                )
            )
        return out
