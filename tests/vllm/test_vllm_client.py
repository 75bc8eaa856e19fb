"""VLLMClient's HTTP against a small aiohttp stand-in for vLLM (no replica started): what every
request carries, what a generation returns, and the callers moved onto it (``/server_info``'s
guard check, the prefix-cache counters)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from threaded_app import serving_app

from asyncgrpo.errors import ReplicaError, ReplicaHTTPError
from asyncgrpo.serve.replicas import dev_routes_open
from asyncgrpo.testing.vllm_metrics import prefix_cache
from asyncgrpo.vllm import api
from asyncgrpo.vllm.client import TRANSPORT_ERRORS, VLLMClient

pytestmark = pytest.mark.anyio

METRICS = """# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{model_name="m"} 3.0
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{model_name="m"} 8.0
"""


class FakeVLLM:
    """Answers completions (``status``) and records each request's headers."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []
        self.status = 200
        self.dev_status = 401

    async def completions(self, request: web.Request) -> web.Response:
        self.seen.append(dict(request.headers))
        body = await request.json()
        if self.status != 200:
            return web.json_response({"error": {"message": "no"}}, status=self.status)
        answer = {"choices": [{"index": 0, "token_ids": [1, 2], "prompt": body["prompt"]}]}
        return web.json_response(answer, headers={"X-Asyncgrpo-Replica": "r1"})

    async def server_info(self, request: web.Request) -> web.Response:
        self.seen.append(dict(request.headers))
        return web.json_response({}, status=self.dev_status)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=METRICS)

    @contextlib.asynccontextmanager
    async def serve(self) -> AsyncIterator[str]:
        app = web.Application()
        app.router.add_post(api.COMPLETIONS_PATH, self.completions)
        app.router.add_get(api.SERVER_INFO_PATH, self.server_info)
        app.router.add_get(api.METRICS_PATH, self.metrics)
        async with serving_app(app) as url:
            yield url + "/"


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


async def test_a_generation_carries_the_key_the_client_and_request_headers() -> None:
    fake = FakeVLLM()
    async with (
        fake.serve() as url,
        VLLMClient(url, api_key="k", headers={"X-Asyncgrpo-Run": "r-eval"}, pool_limit=0) as c,
    ):
        status, data, headers = await c.post_completions({"prompt": [5]}, {"X-Session-ID": "s"})
        assert (status, data["choices"][0]["prompt"]) == (200, [5])
        assert headers["X-Asyncgrpo-Replica"] == "r1"
        sent = fake.seen[-1]
        assert sent["Authorization"] == "Bearer k" and sent["X-Asyncgrpo-Run"] == "r-eval"
        assert sent["X-Session-ID"] == "s"
        await c.post_completions({"prompt": [5]})
        assert "X-Session-ID" not in fake.seen[-1] and fake.seen[-1]["Authorization"] == "Bearer k"
        assert c.session.connector is not None and c.session.connector.limit == 0
        assert c.session.timeout.total == 60.0
        fake.status = 404
        status, text, _ = await c.post_completions({"prompt": [5]})
        assert status == 404 and api.error_message(text) == "no"


async def test_a_given_session_gets_the_client_headers_per_request() -> None:
    fake = FakeVLLM()
    async with fake.serve() as url, aiohttp.ClientSession() as session:
        client = VLLMClient(url, api_key="k", session=session)
        await client.post_completions({"prompt": [1]}, {"X-Session-ID": "s"})
        assert fake.seen[-1]["Authorization"] == "Bearer k"
        assert fake.seen[-1]["X-Session-ID"] == "s"
        await client.aclose()
        assert not session.closed  # the caller's to close


async def test_a_refused_connection_is_a_transport_error_for_the_caller() -> None:
    async with VLLMClient(_closed_port_url()) as client:
        with pytest.raises(TRANSPORT_ERRORS):
            await client.post_completions({"prompt": [1]})
        with pytest.raises(ReplicaError, match="failed"):  # the one-shot calls wrap it
            await client.completions({"prompt": [1]})


async def test_dev_routes_open_reads_the_status_of_server_info() -> None:
    fake = FakeVLLM()
    async with fake.serve() as url:
        assert not await dev_routes_open(url)
        assert "Authorization" not in fake.seen[-1]
        fake.dev_status = 200
        assert await dev_routes_open(url)
    with pytest.raises(ReplicaError):
        await dev_routes_open(_closed_port_url())


async def test_prefix_cache_sums_the_replicas_counters() -> None:
    fake, other = FakeVLLM(), FakeVLLM()
    async with fake.serve() as a, other.serve() as b:
        assert await prefix_cache([a.rstrip("/"), b.rstrip("/")]) == (6.0, 16.0)


async def test_a_one_shot_completion_raises_the_answer_s_status() -> None:
    fake = FakeVLLM()
    fake.status = 400
    async with fake.serve() as url, VLLMClient(url) as client:
        with pytest.raises(ReplicaHTTPError) as err:
            await client.completions({"prompt": [1]})
    assert err.value.status == 400
