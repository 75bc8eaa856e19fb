"""A Tinker-compatible service on the tiny model, and the real ``tinker`` SDK as its client.

The service runs in this process on a background event loop (one per test module); the SDK
talks to it over real HTTP on loopback, exactly as it talks to Tinker.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

try:  # the SDK is the service's client and its wire types (`make install` has the extra)
    import tinker.proto  # noqa: F401  (``tinker`` alone would find this directory)
except ImportError:
    collect_ignore_glob = ["test_*.py"]  # without `.[tinker]` there is nothing to test here

#: The SDK refuses a key without this prefix before sending it; loopback needs none server-side.
CLIENT_KEY = "tml-loopback-test"


@pytest.fixture(scope="session", autouse=True)
def _sdk_env() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in ("TINKER_TELEMETRY", "TINKER_API_KEY")}
    os.environ["TINKER_TELEMETRY"] = "0"  # the SDK would post its telemetry to Tinker's servers
    os.environ["TINKER_API_KEY"] = CLIENT_KEY
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@dataclass(frozen=True)
class Served:
    url: str
    model: str


@contextlib.contextmanager
def _serve(model: Path, **overrides: object) -> Iterator[Served]:
    """Run the service on ``model`` for the block; yields its URL and served model name."""
    from anyio.from_thread import start_blocking_portal

    from asyncgrpo.tinker import TinkerConfig, serve_tinker

    config = TinkerConfig(model=str(model), port=0, max_lora_rank=8, **overrides)
    with (
        start_blocking_portal() as portal,
        portal.wrap_async_context_manager(serve_tinker(config)) as url,
    ):
        yield Served(url=url, model=config.served_name)


@pytest.fixture
def start_service() -> Callable[..., contextlib.AbstractContextManager[Served]]:
    """``with start_service(model, api_key=...) as served:``, for a service of the test's own."""
    return _serve


@pytest.fixture(scope="module")
def served(tiny_model: Path) -> Iterator[Served]:
    with _serve(tiny_model) as s:
        yield s


@pytest.fixture
def service_client(served: Served) -> Iterator[object]:
    import tinker

    client = tinker.ServiceClient(base_url=served.url)
    yield client
    client.close("success").result()


@pytest.fixture(scope="module")
def fleet(
    vllm_replicas: list, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The service in front of a proxy on the shared replicas (adapters stored under the
    session's temporary directory, which the replicas may read)."""
    import contextlib

    from anyio.from_thread import start_blocking_portal

    from asyncgrpo.proxy import ProxyConfig, serve_proxy
    from asyncgrpo.tinker import TinkerConfig, serve_tinker

    work = tmp_path_factory.mktemp("tinker-work")
    with start_blocking_portal() as portal, contextlib.ExitStack() as stack:
        proxy_cfg = ProxyConfig(upstreams=tuple(r.url for r in vllm_replicas), port=0)
        proxy_url = stack.enter_context(portal.wrap_async_context_manager(serve_proxy(proxy_cfg)))
        config = TinkerConfig(
            model=str(tiny_model),
            port=0,
            max_lora_rank=8,
            proxy_url=proxy_url,
            work_dir=str(work),
            sampler_keep=1,
        )
        yield stack.enter_context(portal.wrap_async_context_manager(serve_tinker(config)))
