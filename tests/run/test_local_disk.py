"""The trainer's writes to its own disk (a sync's adapter, a checkpoint) when the disk is full:
put off to the next step, what was written removed, for a bounded time; storage errors are not
the disk's and pass through."""

from __future__ import annotations

import errno
from pathlib import Path

import anyio
import pytest

from asyncgrpo.errors import TransportError
from asyncgrpo.run.training import LocalDisk

pytestmark = pytest.mark.anyio


def full_disk(directory: Path) -> Path:
    directory.mkdir()
    (directory / "half-written").write_bytes(b"x" * 100)
    raise OSError(errno.ENOSPC, "No space left on device")


async def test_a_full_disk_puts_a_write_off_then_gives_up(tmp_path: Path) -> None:
    disk = LocalDisk(patience_s=0.2)

    async def refused(d: Path) -> Path:
        return full_disk(d)

    async def fine(d: Path) -> Path:
        d.mkdir()
        return d

    assert await disk.write("checkpoint", tmp_path / "ckpt-10", refused) is None
    assert disk.owes("checkpoint") and not disk.owes("sync")
    assert not (tmp_path / "ckpt-10").exists()  # the room it took is given back
    assert await disk.write("checkpoint", tmp_path / "ckpt-11", fine) == tmp_path / "ckpt-11"
    assert not disk.owes("checkpoint")
    assert await disk.write("sync", tmp_path / "v3", refused) is None
    await anyio.sleep(0.3)
    with pytest.raises(OSError, match="No space left"):  # full for longer than its patience
        await disk.write("sync", tmp_path / "v3", refused)


async def test_a_storage_error_is_not_put_off(tmp_path: Path) -> None:
    async def storage(d: Path) -> Path:
        raise TransportError("s3://b/k: 503")

    with pytest.raises(TransportError):
        await LocalDisk().write("checkpoint", tmp_path / "c", storage)
