"""PolicyClient's retries and refusals against a scripted stand-in for vLLM (no replica started):
which answers are retried, which raise at once and with what words, and what a turn keeps of the
answer (its replica)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web
from threaded_app import serving_app

from asyncgrpo.config.rollout import GenerationConfig, RolloutConfig
from asyncgrpo.errors import ReplicaError
from asyncgrpo.rollout.policy import PolicyClient
from asyncgrpo.vllm.client import VLLMClient

pytestmark = pytest.mark.anyio


def _choice(prompt: list[int]) -> dict[str, Any]:
    return {
        "index": 0,
        "text": "ab",
        "token_ids": [7, 8],
        "prompt_token_ids": prompt,
        "logprobs": {"token_logprobs": [-0.5, -0.25]},
        "finish_reason": "length",
    }


class Scripted:
    """Answers each completions request with the next scripted status (200 once they run out)."""

    def __init__(self, *statuses: int) -> None:
        self.statuses = list(statuses)
        self.requests: list[tuple[dict[str, str], dict[str, Any]]] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append((dict(request.headers), body))
        status = self.statuses.pop(0) if self.statuses else 200
        if status == 404:
            error = {"message": f"The model `{body['model']}` does not exist."}
            return web.json_response({"error": error}, status=404)
        if status != 200:
            return web.Response(status=status, text=f"scripted {status}")
        answer = {"choices": [_choice(body["prompt"])]}
        return web.json_response(answer, headers={"X-Asyncgrpo-Replica": "replica-1"})

    @contextlib.asynccontextmanager
    async def serve(self) -> AsyncIterator[str]:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        async with serving_app(app) as url:
            yield url


@contextlib.asynccontextmanager
async def policy_client(
    url: str, policy: Callable[[], tuple[str, int]] = lambda: ("m-v1", 1), **rollout: Any
) -> AsyncIterator[PolicyClient]:
    config = RolloutConfig(**{"retry_backoff_s": 0.01, "retries": 3, **rollout})
    async with VLLMClient(url, api_key="key", timeout_s=config.request_timeout_s) as client:
        yield PolicyClient(
            client=client,
            generation=GenerationConfig(num_generations=2, max_completion_length=2),
            rollout=config,
            policy=policy,
        )


async def test_a_turn_is_what_vllm_answered_and_the_request_carries_its_headers() -> None:
    fake = Scripted()
    async with fake.serve() as url, policy_client(url) as policy:
        (turn,) = await policy.complete([1, 2, 3], session="episode-1")
    assert (turn.token_ids, turn.logprobs, turn.prompt_ids) == ([7, 8], [-0.5, -0.25], [1, 2, 3])
    assert (turn.version, turn.replica, turn.text) == (1, "replica-1", "ab")
    headers, body = fake.requests[0]
    assert headers["Authorization"] == "Bearer key" and headers["X-Session-ID"] == "episode-1"
    assert body["model"] == "m-v1" and body["return_token_ids"] is True
    assert policy.tokens_total == 2 and policy.inflight == 0


async def test_5xx_and_429_are_retried() -> None:
    fake = Scripted(503, 429, 500)
    async with fake.serve() as url, policy_client(url) as policy:
        assert len(await policy.complete([1])) == 1
    assert policy.retries_total == 3 and len(fake.requests) == 4


async def test_retries_run_out_with_the_last_error_named() -> None:
    async with Scripted(503, 503).serve() as url, policy_client(url, retries=1) as policy:
        with pytest.raises(ReplicaError, match=r"giving up after 2 attempts \(rollout.retries=1\)"):
            await policy.complete([1])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    async with policy_client(closed, retries=1) as policy:
        with pytest.raises(ReplicaError, match=r"giving up after 2 attempts.*: ClientConnector"):
            await policy.complete([1])


async def test_a_4xx_raises_at_once_unless_the_adapter_moved_on() -> None:
    fake = Scripted(400)
    async with fake.serve() as url, policy_client(url) as policy:
        with pytest.raises(ReplicaError, match=r"/v1/completions answered HTTP 400 for model"):
            await policy.complete([1])
    assert len(fake.requests) == 1

    names = iter(["a-v1", "a-v2"])  # the request's, then the one its 404 is checked against
    current = ["a-v1"]

    def policy_now() -> tuple[str, int]:
        current[0] = next(names, current[0])
        return current[0], int(current[0][-1])

    fake = Scripted(404)
    async with fake.serve() as url, policy_client(url, policy=policy_now) as policy:
        (turn,) = await policy.complete([1])
    assert turn.version == 2 and [b["model"] for _, b in fake.requests] == ["a-v1", "a-v2"]


async def test_an_adapter_not_served_raises_at_once_without_a_wait() -> None:
    async with Scripted(404).serve() as url, policy_client(url) as policy:
        with pytest.raises(ReplicaError, match=r"HTTP 404 for model 'm-v1'.*does not exist"):
            await policy.complete([1])
