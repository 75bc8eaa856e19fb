"""Real storage servers for the transport tests, all on 127.0.0.1.

* ``moto_endpoint``: moto's ``ThreadedMotoServer``, a real S3 protocol server (one per session).
* ``gateway``: the fault-injecting proxy (:mod:`asyncgrpo.testing.fault_proxy`) in front of
  moto, in its own thread and event loop. It strips a leading ``/testns`` path segment, which
  is how the Hugging Face S3 gateway addresses ``https://s3.hf.co/<namespace>/<bucket>/<key>``,
  and it injects faults: answer the next N requests with a status (503 for transient, 403 for
  permanent) without forwarding them, or forward the next request of a method whose path ends
  with a given suffix and answer 503 anyway (a write that landed but whose answer was lost).
* ``azurite``: Microsoft's Azure Storage emulator (npm ``azurite``, installed on first use into
  the user's cache, ``~/.cache/asyncgrpo/emulators``), and ``fake_gcs``: fake-gcs-server; both from
  :mod:`asyncgrpo.testing.emulators`. ``azure_proxy`` / ``gcs_proxy`` put a fault-injecting
  proxy in front of each.
"""

from __future__ import annotations

import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from threaded_app import ThreadedApp

BUCKET = "asyncgrpo-test"
NAMESPACE = "testns"


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    request = urllib.request.Request(f"{endpoint}/{BUCKET}", method="PUT")
    urllib.request.urlopen(request, timeout=10).read()
    try:
        yield endpoint
    finally:
        server.stop()


class FaultProxy(ThreadedApp):
    """:mod:`asyncgrpo.testing.fault_proxy` in front of ``upstream``, served from a thread;
    its :class:`~asyncgrpo.testing.fault_proxy.Faults` is ``faults`` (``fail_next`` etc.)."""

    def __init__(self, upstream: str, strip_prefix: str) -> None:
        from asyncgrpo.testing.fault_proxy import Faults

        super().__init__()
        self.upstream = upstream
        self.strip_prefix = strip_prefix
        self.faults = Faults()

    def __getattr__(self, name: str) -> Any:  # requests, failed, seen, fail_next, reset, ...
        return getattr(self.faults, name)

    async def make_app(self) -> web.Application:
        from asyncgrpo.testing.fault_proxy import fault_app

        return fault_app(self.upstream, self.faults, strip_prefix=self.strip_prefix)


@pytest.fixture(scope="session")
def gateway(moto_endpoint: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(moto_endpoint, strip_prefix=f"/{NAMESPACE}")
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()


def s3_options(**overrides: Any) -> dict[str, Any]:
    """Credentials moto accepts and a fast backoff, so retry tests take milliseconds."""
    return {
        "region": "us-east-1",
        "access_key_id": "testing",
        "secret_access_key": "testing",
        "backoff_initial_s": 0.01,
        "backoff_max_s": 0.05,
        "max_retries": 4,
        "retry_timeout_s": 10.0,
        **overrides,
    }


@pytest.fixture(scope="session")
def azurite() -> Iterator[str]:
    """Azurite's blob service with the test container; yields its connection string."""
    from asyncgrpo.testing.emulators import azurite as run_azurite
    from asyncgrpo.testing.emulators import azurite_binary

    try:
        azurite_binary()  # installs it into the user's cache on first use
    except FileNotFoundError as exc:  # no npm on this machine
        pytest.skip(f"the Azure Blob tests need the Azurite emulator: {exc}")
    with run_azurite(BUCKET) as conn:
        yield conn


@pytest.fixture(scope="session")
def fake_gcs() -> Iterator[str]:
    """fake-gcs-server with the test bucket; yields its base URL."""
    from asyncgrpo.testing.emulators import fake_gcs_server

    with fake_gcs_server(BUCKET) as url:
        yield url


@pytest.fixture
def gcs_seed(fake_gcs: str) -> Any:
    """``gcs_seed(key, data)``: write through fake-gcs-server's JSON API (see GCS_WRITES_SKIP)."""
    from asyncgrpo.testing.emulators import seed_fake_gcs

    return lambda key, data: seed_fake_gcs(fake_gcs, BUCKET, key, data)


@pytest.fixture(scope="session")
def azure_proxy(azurite: str) -> Iterator[FaultProxy]:
    blob_endpoint = azurite.split("BlobEndpoint=")[1].rstrip(";")
    proxy = FaultProxy(blob_endpoint.rsplit("/", 1)[0], strip_prefix="")
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture(scope="session")
def gcs_proxy(fake_gcs: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(fake_gcs, strip_prefix="")
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()


GCS_WRITES_SKIP = (
    "fake-gcs-server implements GCS's XML API for reads, listing and deletes but not XML "
    "object writes (a plain PUT without a signed-URL query is refused with 'invalid uploadType', "
    "and x-goog-if-generation-match is ignored: fake-gcs-server issues 994, 852), and obstore "
    "writes through the XML API; no installable emulator does. On real GCS the same PUT "
    "with x-goog-if-generation-match: 0 is a documented exclusive create (412 if the object "
    "exists); tests/transport/test_cloud_live.py checks it against a real bucket"
)


def _read_only_gcs():
    from asyncgrpo.transport.base import check_key
    from asyncgrpo.transport.gcs import GCSTransport

    class ReadOnlyGCS(GCSTransport):
        """The real GCS transport; a test that writes through it is skipped (see above)."""

        async def put(self, key: str, data: bytes, **kw: Any) -> None:
            check_key(key)  # bad keys are still refused before any request
            pytest.skip(GCS_WRITES_SKIP)

        async def put_file(self, key: str, path: Any, **kw: Any) -> None:
            check_key(key)
            pytest.skip(GCS_WRITES_SKIP)

    return ReadOnlyGCS


FAST_RETRY = {
    "backoff_initial_s": 0.01,
    "backoff_max_s": 0.05,
    "max_retries": 4,
    "retry_timeout_s": 10.0,
}
# Which server (fixture) a kind of transport talks to, and the fault proxy in front of it.
PROXIES = {
    "s3-proxy": "gateway",
    "hf": "gateway",
    "azure-proxy": "azure_proxy",
    "gcs-proxy": "gcs_proxy",
}


def make_transport(kind: str, tmp_path: Path, request: pytest.FixtureRequest, **overrides: Any):
    """A fresh, empty transport of ``kind`` (unique prefix per call); servers start lazily."""
    from asyncgrpo.transport.azure import AzureBlobTransport
    from asyncgrpo.transport.hf import HFBucketTransport
    from asyncgrpo.transport.local import LocalTransport
    from asyncgrpo.transport.s3 import S3Transport

    prefix = f"t-{uuid.uuid4().hex[:10]}"
    if kind == "local":
        return LocalTransport(tmp_path / "store" / prefix)
    if kind == "s3":
        moto = request.getfixturevalue("moto_endpoint")
        return S3Transport(BUCKET, prefix, endpoint=moto, **s3_options(**overrides))
    if kind in PROXIES:
        proxy_url = request.getfixturevalue(PROXIES[kind]).url
    if kind == "s3-proxy":
        return S3Transport(BUCKET, prefix, endpoint=proxy_url, **s3_options(**overrides))
    if kind == "hf":
        opts = s3_options(**overrides)
        opts.pop("region")
        return HFBucketTransport(NAMESPACE, BUCKET, prefix, endpoint=proxy_url, **opts)
    if kind in ("azure", "azure-proxy"):
        conn = request.getfixturevalue("azurite")
        if kind == "azure-proxy":
            head, _, _ = conn.partition("BlobEndpoint=")
            conn = f"{head}BlobEndpoint={proxy_url}/devstoreaccount1;"
        return AzureBlobTransport(
            BUCKET, prefix, connection_string=conn, **{**FAST_RETRY, **overrides}
        )
    if kind in ("gcs", "gcs-proxy"):
        base = proxy_url if kind == "gcs-proxy" else request.getfixturevalue("fake_gcs")
        return _read_only_gcs()(BUCKET, prefix, base_url=base, **{**FAST_RETRY, **overrides})
    raise ValueError(kind)


ALL_KINDS = ["local", "s3", "hf", "azure", "gcs"]


@pytest.fixture(params=ALL_KINDS)
def transport(request: pytest.FixtureRequest, tmp_path: Path):
    if request.param == "gcs" and request.node.get_closest_marker("racing_writes"):
        pytest.skip(GCS_WRITES_SKIP)  # not from inside a task group: skip before racing
    return make_transport(request.param, tmp_path, request)


@pytest.fixture
def transport_factory(tmp_path: Path, request: pytest.FixtureRequest):
    def factory(kind: str, **overrides: Any):
        return make_transport(kind, tmp_path, request, **overrides)

    return factory


@pytest.fixture
def proxy_of(request: pytest.FixtureRequest) -> Iterator[Any]:
    """``proxy_of(kind)``: the (reset) fault proxy in front of that kind's server."""
    used: list[FaultProxy] = []

    def get(kind: str) -> FaultProxy:
        proxy = request.getfixturevalue(PROXIES[kind])
        proxy.reset()
        used.append(proxy)
        return proxy

    yield get
    for proxy in used:
        proxy.reset()
