"""CheckpointStore on the real local store (an S3 variant runs in tests/transport/)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncgrpo.errors import AlreadyExists, ConfigError, IntegrityError, NotFound
from asyncgrpo.store.checkpoints import CheckpointStore
from asyncgrpo.transport.local import LocalTransport

pytestmark = pytest.mark.anyio


def trainer_state(path: Path, step: int) -> Path:
    """What a trainer writes: adapter, optimizer, scheduler and RNG files (bytes suffice here)."""
    (path / "adapter").mkdir(parents=True, exist_ok=True)
    (path / "adapter" / "adapter_model.safetensors").write_bytes(bytes([step % 256]) * 2048)
    (path / "adapter" / "adapter_config.json").write_text(json.dumps({"r": 1}))
    (path / "optimizer.pt").write_bytes(b"opt" * (step + 1))
    (path / "scheduler.pt").write_bytes(b"sch")
    (path / "rng.pt").write_bytes(b"rng%d" % step)
    return path


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(LocalTransport(tmp_path / "bucket"))


async def test_save_load_roundtrip(store: CheckpointStore, tmp_path: Path) -> None:
    src = trainer_state(tmp_path / "s100", 100)
    meta = {"adapter_version": 25, "data_position": 12_800, "channel_position": 31}
    await store.save(100, src, meta)
    path, loaded = await store.load(100, tmp_path / "restore")
    assert loaded == {**meta, "step": 100}
    for f in src.rglob("*"):
        if f.is_file():
            assert (path / f.relative_to(src)).read_bytes() == f.read_bytes()
    assert await store.meta(100) == meta


async def test_latest_and_steps(store: CheckpointStore, tmp_path: Path) -> None:
    assert await store.latest_checkpoint() is None
    with pytest.raises(NotFound, match="no checkpoint"):
        await store.load("latest", tmp_path / "r")
    for step in (5, 1000, 50):
        await store.save(step, trainer_state(tmp_path / f"s{step}", step), {"s": step})
    assert await store.steps() == [5, 50, 1000]
    assert await store.latest_checkpoint() == 1000
    path, meta = await store.load("latest", tmp_path / "r")
    assert meta["step"] == 1000 and path.name == "step-000001000"
    _, meta = await store.load(None, tmp_path / "r2")
    assert meta["s"] == 1000


async def test_missing_step_and_duplicate(store: CheckpointStore, tmp_path: Path) -> None:
    await store.save(10, trainer_state(tmp_path / "s", 10), {})
    with pytest.raises(NotFound, match=r"step 11 not found.*complete checkpoints: 10"):
        await store.load(11, tmp_path / "r")
    with pytest.raises(AlreadyExists):
        await store.save(10, trainer_state(tmp_path / "s", 10), {})
    with pytest.raises(ConfigError):
        await store.save(-1, tmp_path / "s", {})


async def test_unfinished_checkpoint_is_invisible(store: CheckpointStore, tmp_path: Path) -> None:
    await store.save(1, trainer_state(tmp_path / "s1", 1), {})
    # a trainer killed mid-save: files present, manifest absent
    await store.transport.put("checkpoints/step-000000002/files-x/optimizer.pt", b"partial")
    assert await store.latest_checkpoint() == 1
    _, meta = await store.load("latest", tmp_path / "r")
    assert meta["step"] == 1


async def test_retention(tmp_path: Path) -> None:
    store = CheckpointStore(LocalTransport(tmp_path / "bucket"), keep_last=2)
    for step in (1, 2, 3, 4):
        await store.save(step, trainer_state(tmp_path / f"s{step}", step), {})
    assert await store.steps() == [3, 4]
    assert await store.prune(keep_last=1) == [3]
    assert await store.steps() == [4]


async def test_tampered_checkpoint_not_loaded(store: CheckpointStore, tmp_path: Path) -> None:
    await store.save(7, trainer_state(tmp_path / "s", 7), {})
    listed = [i.key async for i in store.transport.list("checkpoints")]
    key = next(k for k in listed if k.endswith("optimizer.pt"))
    await store.transport.put(key, b"evil")
    with pytest.raises(IntegrityError):
        await store.load(7, tmp_path / "r")
    assert not (tmp_path / "r" / "step-000000007").exists()


# ---- a resume survives one bad checkpoint --------------------------------
async def _three(store: CheckpointStore, tmp_path: Path) -> None:
    for step in (1, 2, 3):
        await store.save(step, trainer_state(tmp_path / f"s{step}", step), {"position": step * 10})


def _file_of(tmp_path: Path, step: int, name: str) -> Path:
    (path,) = (tmp_path / "bucket").glob(f"checkpoints/step-{step:09d}/files-*/{name}")
    return path


async def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(
    store: CheckpointStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await _three(store, tmp_path)
    victim = _file_of(tmp_path, 3, "optimizer.pt")
    victim.write_bytes(b"x" * victim.stat().st_size)  # same size, other bytes
    with caplog.at_level("WARNING", logger="asyncgrpo.store.checkpoints"):
        found = await store.load_latest_verified(tmp_path / "resume")
    assert found is not None
    path, meta = found
    assert meta == {"position": 20, "step": 2} and path.name == "step-000000002"
    (line,) = [r.getMessage() for r in caplog.records]
    assert "step 3 does not verify" in line and "resuming from step 2" in line
    assert "\n" not in line
    # set aside: the resumed run can save step 3 again, and nothing of the bad one is left
    assert await store.steps() == [1, 2]
    await store.save(3, trainer_state(tmp_path / "s3-again", 3), {"position": 31})
    _, meta = await store.load(3, tmp_path / "again")
    assert meta["position"] == 31


async def test_resume_skips_every_bad_checkpoint_and_says_how_many(
    store: CheckpointStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await _three(store, tmp_path)
    manifest = tmp_path / "bucket" / "checkpoints" / "step-000000003" / "manifest.json"
    manifest.write_text('{"format": "asyncgrpo.bundle/1", "files": 7}')  # malformed
    _file_of(tmp_path, 2, "rng.pt").unlink()  # a file missing
    with caplog.at_level("WARNING", logger="asyncgrpo.store.checkpoints"):
        found = await store.load_latest_verified(tmp_path / "resume")
    assert found is not None and found[1]["step"] == 1
    (line,) = [r.getMessage() for r in caplog.records]
    assert "step 3 does not verify" in line and "(and 1 newer)" in line
    assert "resuming from step 1" in line


async def test_resume_when_no_checkpoint_verifies_is_one_clear_error(
    store: CheckpointStore, tmp_path: Path
) -> None:
    assert await store.load_latest_verified(tmp_path / "resume") is None  # a fresh run
    await store.save(1, trainer_state(tmp_path / "s1", 1), {})
    _file_of(tmp_path, 1, "scheduler.pt").write_bytes(b"xyz")
    with pytest.raises(IntegrityError, match=r"no checkpoint under .* verifies"):
        await store.load_latest_verified(tmp_path / "resume")
    assert await store.steps() == [1]  # nothing is set aside without one to resume from


@pytest.mark.parametrize(
    "fields", [{"meta": [1]}, {"meta": None}, {"step": 8}, {"step": True}, {"step": None}]
)
async def test_a_checkpoint_manifest_with_a_bad_step_or_meta_is_an_integrity_error(
    store: CheckpointStore, tmp_path: Path, fields: dict
) -> None:
    await store.save(1, trainer_state(tmp_path / "s1", 1), {"position": 3})
    path = tmp_path / "bucket" / "checkpoints" / "step-000000001" / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    with pytest.raises(IntegrityError, match="malformed checkpoint manifest"):
        await store.meta(1)
    with pytest.raises(IntegrityError, match="malformed checkpoint manifest"):
        await store.load(1, tmp_path / "r")
