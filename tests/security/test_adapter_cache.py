"""A replica's adapter cache cannot be prepared by someone else, and even
inside it only versions this process fetched and verified are served."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from asyncgrpo.errors import ConfigError
from asyncgrpo.serve.adapter_fetch import (
    CACHE_DIR_ENV,
    TRANSPORTS_ENV,
    AdapterFetcher,
    adapter_uri,
)
from asyncgrpo.store.adapters import AdapterStore
from asyncgrpo.store.bundle import LOCAL_MANIFEST
from asyncgrpo.transport.local import LocalTransport

pytestmark = pytest.mark.anyio


async def _store(tmp_path: Path) -> tuple[str, AdapterStore]:
    store = AdapterStore(LocalTransport(tmp_path / "shared" / "run1"))
    for version in (0, 1):
        src = tmp_path / f"src{version}"
        src.mkdir()
        (src / "adapter_model.safetensors").write_bytes(f"weights v{version}".encode())
        await store.publish("run-ab", version, src)
    return LocalTransport(tmp_path / "shared").url, store


def test_the_cache_is_new_private_and_not_where_a_squatter_expects_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: <tmp>/asyncgrpo-adapters-<port>, accepted if it already existed (mkdir
    exist_ok), so another local user could create it first and own it."""
    base = tmp_path / "tmp"
    base.mkdir()
    os.chmod(base, 0o1777)  # like /tmp: shared, sticky
    squatted = base / "asyncgrpo-adapters-8001"
    squatted.mkdir(mode=0o777)
    os.chmod(squatted, 0o777)
    monkeypatch.setenv(CACHE_DIR_ENV, str(base))
    monkeypatch.setenv(TRANSPORTS_ENV, str(tmp_path / "shared"))
    fetcher = AdapterFetcher.from_env(port=8001)
    assert fetcher.cache_dir != squatted and fetcher.cache_dir.parent == base
    st = os.lstat(fetcher.cache_dir)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert st.st_uid == os.geteuid()


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_cache_base_others_can_write_without_sticky_bit_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int
) -> None:
    base = tmp_path / "shared-base"
    base.mkdir()
    os.chmod(base, mode)
    monkeypatch.setenv(CACHE_DIR_ENV, str(base))
    with pytest.raises(ConfigError, match="writable by other users"):
        AdapterFetcher.from_env(port=8002)


def test_an_existing_cache_open_to_others_or_a_link_is_refused(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o755)
    with pytest.raises(ConfigError, match="other users could reach it"):
        AdapterFetcher([], open_dir)
    (tmp_path / "real").mkdir(mode=0o700)
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(ConfigError, match="not a directory"):
        AdapterFetcher([], tmp_path / "link")


async def test_a_version_planted_in_the_cache_is_not_served(tmp_path: Path) -> None:
    """Before: any directory holding a manifest copy counted as verified. A version this
    process did not fetch itself is fetched again, whatever the cache holds."""
    root, store = await _store(tmp_path)
    fetcher = AdapterFetcher([root], tmp_path / "cache")
    uri = adapter_uri(store.transport.url, store.prefix, "run-ab", 1)
    v0 = await fetcher.fetch(
        fetcher.resolve(adapter_uri(store.transport.url, store.prefix, "run-ab", 0))
    )
    planted = v0.parent / "run-ab-v1"  # where version 1 will be looked for
    planted.mkdir()
    (planted / "adapter_model.safetensors").write_bytes(b"another party's weights")
    (planted / LOCAL_MANIFEST).write_text(json.dumps({"format": "asyncgrpo.bundle/1"}))
    path = await fetcher.fetch(fetcher.resolve(uri))
    assert (path / "adapter_model.safetensors").read_bytes() == b"weights v1"
    assert sorted(p.name for p in fetcher.cached()) == ["run-ab-v0", "run-ab-v1"]
    # A version it verified is reused as long as it is in its record...
    again = await fetcher.fetch(fetcher.resolve(uri))
    assert again == path
    # ...and once pruned, it is fetched (and verified) afresh.
    assert fetcher.prune([v0]) == [path]
    assert [p.name for p in fetcher.cached()] == ["run-ab-v0"]
