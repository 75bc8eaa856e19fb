"""Server-flag checks against /server_info documents shaped like vLLM 0.32's; adding a replica
to a proxy's fleet against a stand-in admin route."""

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from asyncgrpo.errors import ConfigError, ReplicaHTTPError
from asyncgrpo.vllm.client import (
    adapter_not_there_yet,
    check_adapter_fetching,
    check_lora_capacity,
    update_proxy,
)


def info(lora: dict | None, block_size: int = 128) -> dict:
    return {"vllm_config": {"lora_config": lora, "cache_config": {"block_size": block_size}}}


def test_accepts_enough_slots_and_returns_block_size() -> None:
    assert (
        check_lora_capacity(
            info({"max_lora_rank": 8, "max_loras": 4}), lora_rank=8, max_staleness=2
        )
        == 128
    )


@pytest.mark.parametrize(
    ("lora", "flag"),
    [
        (None, "--enable-lora"),
        ({"max_lora_rank": 8, "max_loras": 6}, "--max-lora-rank"),
        ({"max_lora_rank": 16, "max_loras": 3}, "--max-loras"),
    ],
)
def test_refuses_naming_the_flag(lora: dict | None, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        check_lora_capacity(info(lora), lora_rank=16, max_staleness=2)


def plugin(url: str, *roots: str, ok: bool = True) -> dict:
    info = {"plugin": "asyncgrpo", "ok": ok, "error": None if ok else "vLLM 9 lacks it"}
    return {"url": url, "status": 200, "info": {**info, "transports": list(roots)}}


def test_adapter_fetching_check_accepts_replicas_that_allow_the_transport() -> None:
    check_adapter_fetching(
        [plugin("http://a", "s3://b/runs"), plugin("http://b", "s3://b/runs/r1", "/data")],
        "s3://b/runs/r1",
    )


def test_adapter_fetching_check_leaves_out_a_replica_that_could_not_be_reached() -> None:
    """A replica that left the fleet is not taken for one without the plugin."""
    gone = {"url": "http://b", "status": 0, "body": "ConnectionRefusedError: ..."}
    check_adapter_fetching([plugin("http://a", "s3://b/runs"), gone], "s3://b/runs/r1")


@pytest.mark.parametrize(
    ("replicas", "message"),
    [
        ([plugin("http://a", "s3://b/runs"), {"url": "http://b", "status": 404, "body": "{}"}],
         "http://b has no asyncgrpo adapter plugin.*VLLM_PLUGINS=asyncgrpo"),
        ([plugin("http://a", "s3://b/runs-other")],
         r"http://a may not fetch adapters from s3://b/runs/r1.*--transport s3://b/runs/r1"),
        ([plugin("http://a")], "allows no transport"),
        ([plugin("http://a", "s3://b/runs", ok=False)], "vLLM 9 lacks it"),
        ([], "no replica"),
        ([{"url": "http://a", "status": 0, "body": "ConnectionRefusedError"}], "no replica"),
    ],
)  # fmt: skip
def test_adapter_fetching_check_names_the_replica_and_the_fix(
    replicas: list[dict], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        check_adapter_fetching(replicas, "s3://b/runs/r1")


@pytest.mark.parametrize(
    ("status", "body", "retry"),
    [
        (404, "Loading lora x failed: No adapter found for /p", True),
        (409, '{"error": {"type": "AdapterNotPublished"}}', True),
        (404, '{"detail": "Not Found"}', False),  # no such route: the plugin is missing
        (422, '{"error": {"type": "AdapterIntegrityError"}}', False),
        (403, "No adapter found", False),
    ],
)
def test_only_a_version_that_has_not_arrived_is_worth_retrying(
    status: int, body: str, retry: bool
) -> None:
    assert adapter_not_there_yet(status, body) is retry
    assert adapter_not_there_yet(status, body.encode()) is retry


async def _admin_route(answers: list[tuple[int, str]], seen: list[tuple]) -> TestServer:
    """A stand-in for a proxy's /proxy/upstreams answering ``answers`` in turn."""

    async def handler(request: web.Request) -> web.Response:
        seen.append((request.method, await request.json(), request.headers.get("Authorization")))
        status, text = answers.pop(0)
        return web.Response(status=status, text=text)

    app = web.Application()
    app.router.add_route("*", "/proxy/upstreams", handler)
    server = TestServer(app)
    await server.start_server()
    return server


@pytest.mark.anyio
async def test_adding_a_replica_retries_while_the_proxy_cannot_take_it_in() -> None:
    seen: list[tuple] = []
    server = await _admin_route([(502, "could not join: replay"), (503, "busy"), (200, "{}")], seen)
    retries: list[str] = []
    try:
        url = str(server.make_url("/")).rstrip("/")
        assert await update_proxy(url, "adm", "http://r:1", interval_s=0.01,
                                  on_retry=retries.append)  # fmt: skip
    finally:
        await server.close()
    assert len(retries) == 2 and "could not join" in retries[0]
    assert seen == [("POST", {"url": "http://r:1"}, "Bearer adm")] * 3


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("answers", "remove", "outcome"),
    [
        ([(400, '{"error": {"message": "http://r:1 is already an upstream"}}')], False, True),
        ([(404, "not an upstream")], True, True),  # gone already: what was asked
        ([(502, "x")] * 5, False, False),  # the deadline passed
        ([(401, "wrong admin key")], False, ConfigError),
        ([(403, "admin routes are off")], True, ConfigError),
        ([(400, "bad url")], False, ReplicaHTTPError),
    ],
)  # fmt: skip
async def test_adding_or_removing_a_replica_ends(
    answers: list[tuple[int, str]], remove: bool, outcome: object
) -> None:
    server = await _admin_route(list(answers), [])
    try:
        url = str(server.make_url("/")).rstrip("/")
        call = update_proxy(url, "adm", "http://r:1", remove=remove, timeout_s=0.03,
                            interval_s=0.01)  # fmt: skip
        if isinstance(outcome, bool):
            assert await call is outcome
        else:
            with pytest.raises(outcome):  # type: ignore[call-overload]
                await call
    finally:
        await server.close()
