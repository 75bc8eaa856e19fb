"""A local transport follows no symbolic link under its root, and an
integrity error never describes the file it read (its size, its hash)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from asyncgrpo.errors import IntegrityError, NotFound, TransportError
from asyncgrpo.store.adapters import AdapterStore
from asyncgrpo.transport.local import LocalTransport

pytestmark = pytest.mark.anyio

SECRET = b"ssh-ed25519 AAAA the reader's private key, 61 bytes long!!\n"


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A file outside the store that the reader can read and a storage writer cannot."""
    path = tmp_path / "home" / "id_ed25519"
    path.parent.mkdir()
    path.write_bytes(SECRET)
    return path


async def _published(tmp_path: Path) -> tuple[AdapterStore, Path]:
    """A store with version 1 of ``run`` (one 700-byte file), and that file in the store."""
    store = AdapterStore(LocalTransport(tmp_path / "store"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "adapter_model.safetensors").write_bytes(b"weights" * 100)
    await store.publish("run", 1, src)
    (victim,) = (tmp_path / "store").rglob("v1/files-*/adapter_model.safetensors")
    return store, victim


async def test_a_linked_file_is_never_read(tmp_path: Path, outside: Path) -> None:
    transport = LocalTransport(tmp_path / "store")
    (tmp_path / "store" / "dir").mkdir()
    os.symlink(outside, tmp_path / "store" / "dir" / "key")
    for read in (
        transport.get("dir/key"),
        transport.head("dir/key"),
        transport.get_file("dir/key", tmp_path / "copy"),
    ):
        with pytest.raises(TransportError, match="symbolic link") as info:
            await read
        assert not isinstance(info.value, NotFound)
    assert not (tmp_path / "copy").exists()
    assert [i.key async for i in transport.list("dir")] == []


async def test_a_linked_directory_is_neither_read_nor_written_through(
    tmp_path: Path, outside: Path
) -> None:
    transport = LocalTransport(tmp_path / "store")
    os.symlink(outside.parent, tmp_path / "store" / "adapters")
    with pytest.raises(TransportError, match="symbolic link"):
        await transport.get("adapters/id_ed25519")
    with pytest.raises(TransportError, match="symbolic link"):
        await transport.delete("adapters/id_ed25519")
    with pytest.raises(TransportError, match="symbolic link"):
        await transport.put("adapters/planted", b"x")
    assert outside.read_bytes() == SECRET and not (outside.parent / "planted").exists()
    with pytest.raises(TransportError, match="symbolic link"):
        _ = [i.key async for i in transport.list("adapters")]
    assert [i.key async for i in transport.list()] == []  # the walk does not enter it


async def test_a_version_whose_file_is_a_link_is_refused_without_describing_it(
    tmp_path: Path, outside: Path
) -> None:
    """A storage writer replaces a published file by a link to the reader's secret; the fetch
    must fail, and its error (which a proxy client may see) must not give the secret's size or
    hash prefix."""
    store, victim = await _published(tmp_path)
    victim.unlink()
    os.symlink(outside, victim)
    with pytest.raises(TransportError) as info:
        await store.fetch("run", 1, tmp_path / "cache")
    message = str(info.value)
    assert f"{len(SECRET)} bytes" not in message
    assert hashlib.sha256(SECRET).hexdigest()[:8] not in message
    assert not list((tmp_path / "cache").rglob("adapter_model.safetensors"))


async def test_an_integrity_error_names_the_file_and_the_manifest_not_what_was_read(
    tmp_path: Path,
) -> None:
    store, victim = await _published(tmp_path)
    planted = b"somebody else's bytes, shorter"
    victim.write_bytes(planted)
    with pytest.raises(IntegrityError, match=r"adapter_model\.safetensors") as info:
        await store.fetch("run", 1, tmp_path / "cache")
    message = str(info.value)
    assert f"{len(planted)} bytes" not in message
    assert hashlib.sha256(planted).hexdigest()[:8] not in message
    assert "700 bytes" in message  # what the manifest declares is fine to show


# ---- no window between a check and the write ----------------------------
_SWAPPER = """
import os, sys, time
root, outside, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
d = os.path.join(root, "d")
end, n = time.monotonic() + seconds, 0
print("ready", flush=True)
while time.monotonic() < end:  # d: a directory, then a link to outside, then a directory
    n += 1
    for step in (lambda: os.rename(d, os.path.join(root, f"gone-{n}")),
                 lambda: os.symlink(outside, d), lambda: time.sleep(0.0005),
                 lambda: os.unlink(d), lambda: os.mkdir(d), lambda: time.sleep(0.0005)):
        try:
            step()
        except OSError:
            pass
"""


@pytest.mark.parametrize("mode", ["overwrite", "create"])
def test_a_link_swapped_in_while_writing_is_never_written_through(
    tmp_path: Path, mode: str
) -> None:
    """Another process swaps a directory under the root for a link to a directory outside it,
    over and over, while objects are written there. Writes checked the path, then wrote it:
    objects and temp files landed outside. Now each write walks by directory descriptor, so a
    write fails or lands inside, never outside."""
    import subprocess
    import sys

    import anyio

    root, outside = tmp_path / "store", tmp_path / "outside"
    outside.mkdir()
    (root / "d").mkdir(parents=True)
    transport = LocalTransport(root)

    async def write_for(seconds: float) -> int:
        written = 0
        with anyio.move_on_after(seconds):
            while True:
                try:
                    await transport.put(f"d/obj-{written}", b"planted?", mode=mode)  # type: ignore[arg-type]
                except (TransportError, OSError):
                    pass
                written += 1
        return written

    swapper = subprocess.Popen(
        [sys.executable, "-c", _SWAPPER, str(root), str(outside), "2.5"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert swapper.stdout is not None and swapper.stdout.readline() == "ready\n"
        written = anyio.run(write_for, 2.0)
    finally:
        swapper.wait(timeout=30)
    assert written > 100
    assert [p.name for p in outside.iterdir()] == []
