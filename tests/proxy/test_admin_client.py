"""Adding a replica to a proxy's fleet (``update_proxy``) against a stand-in admin route."""

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from asyncgrpo.errors import ConfigError, ReplicaHTTPError
from asyncgrpo.proxy.admin_client import update_proxy


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
        assert await update_proxy(
            url, "adm", "http://r:1", interval_s=0.01, on_retry=retries.append
        )
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
)
async def test_adding_or_removing_a_replica_ends(
    answers: list[tuple[int, str]], remove: bool, outcome: object
) -> None:
    server = await _admin_route(list(answers), [])
    try:
        url = str(server.make_url("/")).rstrip("/")
        call = update_proxy(
            url, "adm", "http://r:1", remove=remove, timeout_s=0.03, interval_s=0.01
        )
        if isinstance(outcome, bool):
            assert await call is outcome
        else:
            with pytest.raises(outcome):  # type: ignore[call-overload]
                await call
    finally:
        await server.close()


@pytest.mark.anyio
async def test_a_registered_replica_joins_a_restarted_proxy_again() -> None:
    """A proxy restarted by its supervisor lists only the replicas of its command line: a
    replica that joined later (``python -m asyncgrpo.serve --register``) joins again."""
    from types import SimpleNamespace

    import anyio

    from asyncgrpo.serve.__main__ import Registration, stay_joined

    replica = SimpleNamespace(index=0, url="http://127.0.0.1:9")
    listed = [[replica.url], [replica.url], [], []]  # the proxy restarts after two looks
    posts: list[dict] = []

    async def handler(request: web.Request) -> web.Response:
        if request.method == "GET":
            urls = listed.pop(0) if len(listed) > 1 else listed[0]
            return web.json_response({"upstreams": [{"url": u} for u in urls]})
        posts.append(await request.json())
        listed[:] = [[replica.url]]  # joined: listed again
        return web.json_response({"added": replica.url})

    app = web.Application()
    app.router.add_route("*", "/proxy/upstreams", handler)
    server = TestServer(app)
    await server.start_server()
    try:
        proxy = str(server.make_url("/")).rstrip("/")
        with anyio.move_on_after(1.0):
            await stay_joined(Registration(proxy, "adm"), [replica], 5, interval_s=0.02)
    finally:
        await server.close()
    assert posts == [{"url": replica.url}]  # once: not while listed, once when forgotten
