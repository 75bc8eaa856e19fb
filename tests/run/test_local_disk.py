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


FULL_CHECKPOINT = """
import sys
from pathlib import Path

import torch

from asyncgrpo.trainer.checkpoint import write_state
from asyncgrpo.trainer.model import save_adapter


class Adapter:
    def save_pretrained(self, path, safe_serialization):
        from safetensors.torch import save_file

        save_file({"w": torch.zeros(1_000_000)}, path + "/adapter_model.safetensors")


for what, write in (
    ("state", lambda d: write_state(d, {"adapter": torch.zeros(1_000_000)})),
    ("adapter", lambda d: save_adapter(Adapter(), d)),
):
    try:
        write(Path(sys.argv[1]))
    except OSError as exc:
        print(what, "OSError", exc.errno)
"""


def test_a_checkpoint_or_adapter_on_a_full_disk_fails_with_an_oserror(tmp_path: Path) -> None:
    """The trainer's state and adapter written to a full disk (a real one: a 1 MiB tmpfs in a
    private mount namespace) fail with ENOSPC, which :class:`LocalDisk` puts off. torch's own
    writer said "unexpected pos 64 vs 0" (a RuntimeError), and the trainer stopped (found by
    ``bench/chaos.py --seed 1``'s disk-full fault); safetensors says ``SafetensorError``."""
    from full_disk import on_full_disk

    done = on_full_disk(tmp_path / "disk", FULL_CHECKPOINT)
    assert done.returncode == 0, done.stderr[-2000:]
    said = f"state OSError {errno.ENOSPC}\nadapter OSError {errno.ENOSPC}"
    assert done.stdout.strip() == said, done.stdout + done.stderr[-2000:]
