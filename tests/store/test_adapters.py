"""AdapterStore on the real local store (S3/HF variants: tests/transport/)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from asyncgrpo.errors import AlreadyExists, ConfigError, NotFound
from asyncgrpo.store.adapters import AdapterStore
from asyncgrpo.transport.local import LocalTransport

pytestmark = pytest.mark.anyio


def make_adapter(path: Path, *, seed: int = 0, r: int = 1) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "r": r,
        "lora_alpha": 2,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "base_model_name_or_path": "Qwen/Qwen2.5-1.5B",
        "peft_type": "LORA",
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    (path / "adapter_model.safetensors").write_bytes(
        __import__("random").Random(seed).randbytes(10_000)
    )
    return path


@pytest.fixture
def store(tmp_path: Path) -> AdapterStore:
    return AdapterStore(LocalTransport(tmp_path / "bucket"))


async def test_publish_fetch_roundtrip_and_manifest(store: AdapterStore, tmp_path: Path) -> None:
    src = make_adapter(tmp_path / "src")
    published = await store.publish("run-a1b2", 1, src, step=4, lr=4e-5)
    assert published.adapter_name == "run-a1b2-v1"
    assert (published.lora_r, published.lora_alpha) == (1, 2)
    assert published.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert published.base_model == "Qwen/Qwen2.5-1.5B"
    assert published.step == 4 and published.meta == {"lr": 4e-5}
    sha = hashlib.sha256((src / "adapter_model.safetensors").read_bytes()).hexdigest()
    entry = next(f for f in published.files if f["path"] == "adapter_model.safetensors")
    assert entry == {"path": "adapter_model.safetensors", "size": 10_000, "sha256": sha}
    assert published.size_bytes == sum(p.stat().st_size for p in src.iterdir())

    path = await store.fetch("run-a1b2", 1, tmp_path / "cache")
    assert path == tmp_path / "cache" / "run-a1b2-v1"
    for f in src.iterdir():
        assert (path / f.name).read_bytes() == f.read_bytes()
    assert (await store.info("run-a1b2", 1)).step == 4


async def test_versions_sorted_numerically(store: AdapterStore, tmp_path: Path) -> None:
    assert await store.versions("run") == [] and await store.latest("run") is None
    for v in (2, 10, 1):
        await store.publish("run", v, make_adapter(tmp_path / f"s{v}", seed=v))
    await store.publish("other", 99, make_adapter(tmp_path / "o"))
    assert await store.versions("run") == [1, 2, 10]
    assert await store.latest("run") == 10


async def test_publish_existing_version_fails_clearly(store: AdapterStore, tmp_path: Path) -> None:
    src = make_adapter(tmp_path / "src")
    await store.publish("run", 3, src)
    with pytest.raises(AlreadyExists, match="already published"):
        await store.publish("run", 3, make_adapter(tmp_path / "other", seed=9))
    path = await store.fetch("run", 3, tmp_path / "cache")
    assert (path / "adapter_model.safetensors").read_bytes() == (
        src / "adapter_model.safetensors"
    ).read_bytes()


async def test_missing_version_names_what_exists(store: AdapterStore, tmp_path: Path) -> None:
    await store.publish("run", 1, make_adapter(tmp_path / "s"))
    with pytest.raises(NotFound, match=r"version 5 is not published.*published versions: 1"):
        await store.fetch("run", 5, tmp_path / "cache")
    with pytest.raises(FileNotFoundError):
        await store.info("run", 5)
    with pytest.raises(NotFound, match="does not exist"):
        await store.publish("run", 2, tmp_path / "no-such-dir")


@pytest.mark.parametrize("name", ["", "a/b", "../x", "-lead", "sp ace", "x" * 200])
async def test_bad_names_rejected(store: AdapterStore, tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError):
        await store.publish(name, 1, make_adapter(tmp_path / "s"))


async def test_bad_version_rejected(store: AdapterStore, tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        await store.publish("run", -1, make_adapter(tmp_path / "s"))


FETCHER = r"""
import asyncio, sys
from asyncgrpo.store.adapters import AdapterStore
from asyncgrpo.transport.local import LocalTransport
store = AdapterStore(LocalTransport(sys.argv[1]))
print(asyncio.run(store.fetch("run", 1, sys.argv[2])))
"""


async def test_concurrent_fetchers_tasks_and_processes(store: AdapterStore, tmp_path: Path) -> None:
    src = make_adapter(tmp_path / "src")
    await store.publish("run", 1, src)
    cache = tmp_path / "cache"
    paths: list[Path] = []

    async def in_process() -> None:
        paths.append(await store.fetch("run", 1, cache))

    async def subprocess_fetch() -> None:
        result = await anyio.run_process(
            [sys.executable, "-c", FETCHER, str(tmp_path / "bucket"), str(cache)],
            stderr=subprocess.STDOUT,
        )
        paths.append(Path(result.stdout.decode().strip()))

    async with anyio.create_task_group() as tg:
        for _ in range(2):
            tg.start_soon(subprocess_fetch)
        for _ in range(4):
            tg.start_soon(in_process)
    assert set(paths) == {cache / "run-v1"} and len(paths) == 6
    assert sorted(p.name for p in cache.iterdir()) == ["run-v1"]  # no temp dirs left
    for f in src.iterdir():
        assert (cache / "run-v1" / f.name).read_bytes() == f.read_bytes()


async def test_fetch_reuses_verified_cache(store: AdapterStore, tmp_path: Path) -> None:
    await store.publish("run", 1, make_adapter(tmp_path / "s"))
    first = await store.fetch("run", 1, tmp_path / "cache")
    async for info in store.transport.list("adapters/run/v1"):
        if "files-" in info.key:
            await store.transport.delete(info.key)
    assert await store.fetch("run", 1, tmp_path / "cache") == first  # no download needed


async def test_retention_keeps_newest_and_pinned(tmp_path: Path) -> None:
    store = AdapterStore(LocalTransport(tmp_path / "bucket"), keep_last=2)
    store.pin("run", 1)
    for v in range(1, 6):
        await store.publish("run", v, make_adapter(tmp_path / f"s{v}", seed=v))
    assert await store.versions("run") == [1, 4, 5]
    store.unpin("run", 1)
    assert await store.prune("run", keep_last=1, pinned={4}) == [1]
    assert await store.versions("run") == [4, 5]
    keys = [i.key async for i in store.transport.list("adapters/run")]
    assert all(k.startswith(("adapters/run/v4/", "adapters/run/v5/")) for k in keys), keys


async def test_prune_removes_dead_uploads_older_than_newest(tmp_path: Path) -> None:
    store = AdapterStore(LocalTransport(tmp_path / "bucket"))
    await store.transport.put("adapters/run/v1/files-dead/adapter_model.safetensors", b"x")
    await store.transport.put("adapters/run/v9/files-busy/adapter_model.safetensors", b"y")
    await store.publish("run", 5, make_adapter(tmp_path / "s"))
    assert await store.versions("run") == [5]
    await store.prune("run", keep_last=3)
    keys = {i.key.split("/")[2] async for i in store.transport.list("adapters/run")}
    assert keys == {"v5", "v9"}  # v1 leftovers gone, v9 may still be uploading


async def test_store_from_url(tmp_path: Path) -> None:
    store = AdapterStore(f"file://{tmp_path}/via-url", prefix="lora")
    await store.publish("run", 1, make_adapter(tmp_path / "s"))
    assert (tmp_path / "via-url" / "lora" / "run" / "v1" / "manifest.json").is_file()
    with pytest.raises(ConfigError):
        AdapterStore(f"file://{tmp_path}/x", keep_last=0)
