"""The policy as an environment sees it: token ids in, sampled turns out, under the current
adapter version.

:class:`PolicyClient` speaks vLLM's OpenAI-compatible ``/v1/completions`` (through the proxy, or
one replica; the HTTP is :class:`~asyncgrpo.vllm.client.VLLMClient`'s) with token-id prompts and
``return_token_ids``, so what a turn returns is exactly what vLLM sampled: its token ids, their
behaviour logprobs, the ids of the prompt vLLM saw, and the adapter version that was current when
the request went out. A multi-turn environment sends the previous turn's ids (plus its own text,
tokenized once) back as the next prompt, so nothing the policy produced is ever re-tokenised.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from asyncgrpo.config.rollout import GenerationConfig, RolloutConfig
from asyncgrpo.errors import ReplicaError
from asyncgrpo.proxy.http.headers import REPLICA_HEADER, SESSION_HEADER
from asyncgrpo.retry import Backoff, RetryNow, poll_until, retry
from asyncgrpo.vllm.api import COMPLETIONS_PATH, model_not_served
from asyncgrpo.vllm.client import TRANSPORT_ERRORS, VLLMClient

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0
#: How often a request for an adapter no replica serves is sent again (sooner when the policy
#: changes meanwhile).
ADAPTER_POLL_S = 1.0


@dataclass(slots=True)
class Turn:
    """One model turn exactly as vLLM returned it."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    version: int
    text: str
    finish_reason: str | None
    #: The replica that served it, as the proxy names it (None: no proxy in front).
    replica: str | None = None


class _Retryable(Exception):
    """A transport failure worth another attempt (connection, 5xx, 429, timeout)."""


class _NotServed(ReplicaError):
    """A 404 for the adapter still current: no replica serves it (yet, or any longer)."""

    def __init__(self, message: str, model: str) -> None:
        super().__init__(message)
        self.model = model


#: What a request retries after a wait: transport failures and the answers that say "later".
_RETRYABLE = (*TRANSPORT_ERRORS, _Retryable)


class PolicyClient:
    """Completions under the current adapter version, with retries; shared by all episodes.

    ``policy`` returns the (adapter name, version) to request now; a request refused with a 4xx
    after the adapter changed under it is resent under the new name (its turn then carries the
    new version). ``adapter_wait_s``: how long a request refused because no replica serves the
    current adapter (a 404) waits for it to be served or for the next policy, sending again
    every ``ADAPTER_POLL_S``: a rollout process whose trainer restarts (it unloads its
    adapters when it dies, and loads the next version once resumed) or whose replicas are
    being replaced. 0 (the default, for a client the trainer itself keeps in step): raise at
    once. Counters (``tokens_total``, ``retries_total``, ``bad_logprobs_total``) are read
    by the rollout client's metrics.
    """

    def __init__(
        self,
        *,
        client: VLLMClient,
        generation: GenerationConfig,
        rollout: RolloutConfig,
        policy: Callable[[], tuple[str, int]],
        adapter_wait_s: float = 0.0,
    ) -> None:
        self.generation = generation
        self.adapter_wait_s = adapter_wait_s
        self.config = rollout
        self.base_url = client.base_url
        self._url = self.base_url + COMPLETIONS_PATH  # what errors and warnings name
        self._vllm = client
        self._policy = policy
        self.inflight = 0
        self.tokens_total = 0
        self._busy_total = 0.0
        self._busy_since: float | None = None
        self.retries_total = 0
        self.bad_logprobs_total = 0
        self._not_served_warned = ""

    @property
    def busy_s(self) -> float:
        """Seconds so far with at least one request in flight: the time generation took,
        whatever ran beside it (against the trainer's step time it shows the overlap)."""
        open_s = time.monotonic() - self._busy_since if self._busy_since is not None else 0.0
        return self._busy_total + open_s

    @property
    def model(self) -> str:
        """The adapter name new requests use (OpenAI's ``model`` field)."""
        return self._policy()[0]

    @property
    def version(self) -> int:
        """The adapter version new requests use."""
        return self._policy()[1]

    def body(
        self,
        prompt_ids: Sequence[int],
        model: str,
        *,
        n: int,
        seed: int | None,
        max_tokens: int | None,
        stop: Sequence[str] | None,
    ) -> dict[str, Any]:
        gen = self.generation
        body: dict[str, Any] = {
            "model": model,
            "prompt": list(prompt_ids),
            "n": n,
            "max_tokens": max_tokens or gen.max_completion_length,
            "temperature": gen.temperature,
            "top_p": gen.top_p,
            "top_k": gen.top_k,
            "min_p": gen.min_p,
            "repetition_penalty": gen.repetition_penalty,
            "logprobs": 0,
            "return_token_ids": True,
        }
        stops = list(gen.stop) if stop is None else list(stop)
        if stops:
            body["stop"] = stops
        if seed is not None:
            body["seed"] = seed
        return body

    async def complete(
        self,
        prompt_ids: Sequence[int],
        *,
        n: int = 1,
        seed: int | None = None,
        max_tokens: int | None = None,
        stop: Sequence[str] | None = None,
        session: str | None = None,
    ) -> list[Turn]:
        """``n`` sampled continuations of ``prompt_ids`` (fewer if some came back without
        usable logprobs: those are dropped and counted). ``max_tokens`` and ``stop`` default to
        the generation settings; ``session`` names the episode or group (sent as ``X-Session-ID``).
        Transport errors are retried with backoff, then raise :class:`ReplicaError`; a 404 for
        an adapter not served is waited out for ``adapter_wait_s``; any other 4xx raises at
        once."""
        headers = {SESSION_HEADER: session} if session else None
        retries = self.config.retries

        async def attempt(number: int) -> list[Turn]:
            model, version = self._policy()
            if not self.inflight:
                self._busy_since = time.monotonic()
            self.inflight += n
            try:
                body = self.body(
                    prompt_ids, model, n=n, seed=seed, max_tokens=max_tokens, stop=stop
                )
                status, data, answer = await self._vllm.post_completions(body, headers)
                if status >= 500 or status == 429:
                    raise _Retryable(f"HTTP {status}: {data[:300]}")
                if status >= 400:
                    if self._policy()[0] != model and number <= retries:
                        raise RetryNow("the adapter was swapped (maybe unloaded) under it")
                    error = f"{self._url} answered HTTP {status} for model {model!r}: {data[:500]}"
                    if model_not_served(status, data):
                        raise _NotServed(error, model)
                    raise ReplicaError(error)
                replica = answer.get(REPLICA_HEADER)
            finally:
                self.inflight -= n
                if not self.inflight and self._busy_since is not None:
                    self._busy_total += time.monotonic() - self._busy_since
                    self._busy_since = None
            return self._parse(prompt_ids, data, version, replica)

        waiting_since: float | None = None
        while True:
            try:
                return await retry(
                    attempt,
                    attempts=retries + 1,
                    backoff=Backoff(self.config.retry_backoff_s, max_s=MAX_BACKOFF_S),
                    retry_on=_RETRYABLE,
                    on_retry=self._retrying,
                )
            except _RETRYABLE as err:
                raise ReplicaError(
                    f"{self._url}: giving up after {retries + 1} attempts (rollout.retries="
                    f"{retries}): {type(err).__name__}: {err}"
                ) from err
            except _NotServed as err:
                now = time.monotonic()
                waiting_since = now if waiting_since is None else waiting_since
                if self.adapter_wait_s <= 0:
                    raise
                if now - waiting_since >= self.adapter_wait_s:
                    raise ReplicaError(
                        f"{err} (waited {now - waiting_since:.0f} s for it to be served or for "
                        "the next policy)"
                    ) from None
                await self._await_adapter(err.model, str(err))

    async def _await_adapter(self, model: str, error: str) -> None:
        """Wait ``ADAPTER_POLL_S``, or less if the policy moves on from ``model``."""
        self.retries_total += 1
        if self._not_served_warned != model:
            self._not_served_warned = model
            logger.warning(
                "%s; waiting up to %.0f s for it to be served or for the next policy",
                error,
                self.adapter_wait_s,
            )

        async def moved_on() -> bool | None:
            return True if self._policy()[0] != model else None

        await poll_until(moved_on, every=0.1, timeout_s=ADAPTER_POLL_S)

    def _retrying(self, attempt: int, err: BaseException, wait_s: float) -> None:
        self.retries_total += 1
        if not isinstance(err, RetryNow):
            logger.warning(
                "rollout request to %s failed (%s: %s); retry %d/%d in %.2f s",
                self._url,
                type(err).__name__,
                err,
                attempt,
                self.config.retries,
                wait_s,
            )

    def _parse(
        self, prompt_ids: Sequence[int], data: dict[str, Any], version: int, replica: str | None
    ) -> list[Turn]:
        out: list[Turn] = []
        choices = sorted(data.get("choices") or [], key=lambda c: c.get("index", 0))
        for choice in choices:
            token_ids = choice.get("token_ids")
            if token_ids is None:
                raise ReplicaError(
                    f"{self._url} returned no token_ids: the server ignores `return_token_ids` "
                    "(needs vLLM >= 0.10.2 serving /v1/completions)"
                )
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
            if (
                logprobs is None
                or len(logprobs) != len(token_ids)
                or any(lp is None or not math.isfinite(lp) for lp in logprobs)
            ):
                self.bad_logprobs_total += 1
                logger.warning("a completion from %s has missing logprobs; dropped", self._url)
                continue
            self.tokens_total += len(token_ids)
            out.append(
                Turn(
                    prompt_ids=list(choice.get("prompt_token_ids") or prompt_ids),
                    token_ids=list(token_ids),
                    logprobs=[float(lp) for lp in logprobs],
                    version=version,
                    text=choice.get("text") or "",
                    finish_reason=choice.get("finish_reason"),
                    replica=replica,
                )
            )
        return out
