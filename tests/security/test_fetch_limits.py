"""What one fetch may take is bounded before it starts, and a file is read no
further than its manifest entry says; a storage writer cannot fill a reader's disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncgrpo.errors import IntegrityError
from asyncgrpo.serve import ServeConfig
from asyncgrpo.serve.adapter_fetch import AdapterFetcher, adapter_uri
from asyncgrpo.store.adapters import AdapterStore
from asyncgrpo.transport.local import LocalTransport

pytestmark = pytest.mark.anyio

BIG = 64 << 20


def _read_bytes() -> int:
    """Bytes this process has read through read(2) so far (Linux's per-process I/O counter)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


async def _published(tmp_path: Path, n_files: int = 1) -> tuple[AdapterStore, Path]:
    store = AdapterStore(LocalTransport(tmp_path / "store"))
    src = tmp_path / "src"
    src.mkdir()
    for i in range(n_files):
        (src / f"part-{i}.safetensors").write_bytes(b"w" * 4096)
    await store.publish("run", 1, src)
    return store, tmp_path / "store" / "adapters" / "run" / "v1"


async def test_a_file_larger_than_its_manifest_says_is_not_downloaded(tmp_path: Path) -> None:
    """The manifest says 4 KiB; the stored file is 64 MiB. The fetch must fail having read
    about the declared size, not the whole file (before the fix it copied all 64 MiB, then
    hashed it)."""
    store, version = await _published(tmp_path)
    (victim,) = version.rglob("part-0.safetensors")
    with victim.open("ab") as f:
        f.truncate(BIG)
    before = _read_bytes()
    with pytest.raises(IntegrityError, match=r"part-0\.safetensors"):
        await store.fetch("run", 1, tmp_path / "cache")
    assert _read_bytes() - before < 2 << 20
    assert not list((tmp_path / "cache").rglob("*.safetensors"))


@pytest.mark.parametrize(
    ("limits", "why"),
    [
        ({"max_files": 2}, "lists 3 files"),
        ({"max_total_bytes": 3 * 4096 - 1}, f"lists {3 * 4096} bytes"),
        ({"max_manifest_bytes": 256}, "more than 256 bytes"),
    ],
)
async def test_caps_refuse_a_version_before_any_file_is_fetched(
    tmp_path: Path, limits: dict[str, int], why: str
) -> None:
    from asyncgrpo.store.bundle import FetchLimits

    store, _ = await _published(tmp_path, n_files=3)
    root = LocalTransport(tmp_path).url
    fetcher = AdapterFetcher([root], tmp_path / "cache", limits=FetchLimits(**limits))
    ref = fetcher.resolve(adapter_uri(store.transport.url, store.prefix, "run", 1))
    with pytest.raises(IntegrityError, match=why):
        await fetcher.fetch(ref)
    assert not list((tmp_path / "cache").rglob("*.safetensors"))
    # the default limits take it
    ok = AdapterFetcher([root], tmp_path / "cache2")
    assert len(list((await ok.fetch(ref)).glob("*.safetensors"))) == 3


async def test_a_manifest_listing_a_huge_file_is_refused_before_downloading(
    tmp_path: Path,
) -> None:
    """A writer edits the manifest to declare one enormous file: refused by the total cap."""
    store, version = await _published(tmp_path)
    manifest = json.loads((version / "manifest.json").read_text())
    manifest["files"][0]["size"] = 1 << 40
    (version / "manifest.json").write_text(json.dumps(manifest))
    before = _read_bytes()
    with pytest.raises(IntegrityError, match="more than this reader accepts"):
        await store.fetch("run", 1, tmp_path / "cache")
    assert _read_bytes() - before < 1 << 20


def test_a_replicas_limits_are_settings_and_reach_its_fetcher() -> None:
    from asyncgrpo.serve.adapter_fetch import limits_from_env
    from asyncgrpo.store.bundle import FetchLimits

    config = ServeConfig(
        model="m",
        adapter_max_total_bytes=5 << 20,
        adapter_max_files=7,
        adapter_max_manifest_bytes=4096,
    )
    assert limits_from_env(config.env()) == FetchLimits(
        max_manifest_bytes=4096, max_files=7, max_total_bytes=5 << 20
    )
    unbounded = ServeConfig(model="m", adapter_max_total_bytes=None)
    assert limits_from_env(unbounded.env()).max_total_bytes is None
    assert limits_from_env({}) == FetchLimits()
