"""One suite, every transport: local directory, S3 (moto), Hugging Face bucket (S3 gateway path)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import anyio
import pytest

from asyncgrpo.errors import AlreadyExists, IntegrityError, InvalidKey, NotFound, TransportError
from asyncgrpo.transport import Transport

pytestmark = pytest.mark.anyio


async def keys(t: Transport, prefix: str = "") -> list[str]:
    return sorted([info.key async for info in t.list(prefix)])


async def test_put_get_roundtrip_and_overwrite(transport: Transport) -> None:
    await transport.put("a/b/c.bin", b"one")
    assert await transport.get("a/b/c.bin") == b"one"
    await transport.put("a/b/c.bin", b"second value")
    assert await transport.get("a/b/c.bin") == b"second value"
    info = await transport.head("a/b/c.bin")
    assert (info.key, info.size) == ("a/b/c.bin", len(b"second value"))
    await transport.put("empty", b"")
    assert await transport.get("empty") == b""


async def test_a_read_stops_at_max_bytes(transport: Transport, tmp_path: Path) -> None:
    """A reader bounds what it accepts (a manifest, a file of declared size): larger objects
    raise IntegrityError and leave nothing behind; exactly max_bytes is fine."""
    await transport.put("big/object", b"x" * 10_000)
    assert await transport.get("big/object", max_bytes=10_000) == b"x" * 10_000
    with pytest.raises(IntegrityError, match="more than 9999 bytes"):
        await transport.get("big/object", max_bytes=9_999)
    target = tmp_path / "out" / "object"
    with pytest.raises(IntegrityError, match="more than 100 bytes"):
        await transport.get_file("big/object", target, max_bytes=100)
    assert not target.exists()
    assert not target.parent.exists() or list(target.parent.iterdir()) == []  # no temp file
    assert await transport.get_file("big/object", target, max_bytes=10_000) == 10_000
    assert target.read_bytes() == b"x" * 10_000


async def test_missing_key_is_not_found(transport: Transport) -> None:
    with pytest.raises(NotFound):
        await transport.get("no/such/key")
    with pytest.raises(FileNotFoundError):  # also the builtin
        await transport.head("no/such/key")
    assert not await transport.exists("no/such/key")
    await transport.put("no/such/key", b"x")
    assert await transport.exists("no/such/key")


async def test_create_mode_refuses_existing(transport: Transport) -> None:
    await transport.put("m/manifest.json", b"first", mode="create")
    with pytest.raises(AlreadyExists):
        await transport.put("m/manifest.json", b"second", mode="create")
    with pytest.raises(FileExistsError):
        await transport.put("m/manifest.json", b"third", mode="create")
    assert await transport.get("m/manifest.json") == b"first"


@pytest.mark.racing_writes
async def test_concurrent_creates_exactly_one_wins(transport: Transport) -> None:
    outcomes: dict[int, str] = {}

    async def creator(i: int) -> None:
        try:
            await transport.put("race/key", f"writer {i}".encode(), mode="create")
            outcomes[i] = "won"
        except AlreadyExists:
            outcomes[i] = "lost"

    async with anyio.create_task_group() as tg:
        for i in range(8):
            tg.start_soon(creator, i)
    winners = [i for i, o in outcomes.items() if o == "won"]
    assert len(winners) == 1, outcomes
    assert await transport.get("race/key") == f"writer {winners[0]}".encode()


async def test_list_prefix_whole_segments(transport: Transport) -> None:
    for key in ["p/a/1", "p/a/2", "p/a/deep/3", "p/ab/4", "q/5"]:
        await transport.put(key, key.encode())
    assert await keys(transport, "p/a") == ["p/a/1", "p/a/2", "p/a/deep/3"]
    assert await keys(transport, "p/a/") == ["p/a/1", "p/a/2", "p/a/deep/3"]
    assert await keys(transport, "p") == ["p/a/1", "p/a/2", "p/a/deep/3", "p/ab/4"]
    assert await keys(transport) == ["p/a/1", "p/a/2", "p/a/deep/3", "p/ab/4", "q/5"]
    assert await keys(transport, "nothing/here") == []
    sizes = {i.key: i.size async for i in transport.list("p")}
    assert sizes["p/ab/4"] == len(b"p/ab/4")


async def test_delete_is_idempotent(transport: Transport) -> None:
    await transport.put("d/x", b"1")
    await transport.put("d/y", b"2")
    await transport.delete("d/x")
    await transport.delete("d/x")
    await transport.delete("never/existed")
    assert await keys(transport, "d") == ["d/y"]
    with pytest.raises(NotFound):
        await transport.get("d/x")


async def test_large_file_streams_both_ways(transport: Transport, tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    data = os.urandom(3 * 1024 * 1024) * 6 + b"tail"  # 18 MiB: multipart on S3 (8 MiB parts)
    src.write_bytes(data)
    await transport.put_file("blobs/big.bin", src)
    assert (await transport.head("blobs/big.bin")).size == len(data)
    dst = tmp_path / "out" / "big.bin"
    assert await transport.get_file("blobs/big.bin", dst) == len(data)
    assert hashlib.sha256(dst.read_bytes()).digest() == hashlib.sha256(data).digest()
    assert [p.name for p in dst.parent.iterdir()] == ["big.bin"]  # no temp files left


async def test_get_file_missing_leaves_nothing(transport: Transport, tmp_path: Path) -> None:
    dst = tmp_path / "dl" / "x.bin"
    with pytest.raises(NotFound):
        await transport.get_file("missing.bin", dst)
    assert not dst.exists()
    assert not dst.parent.exists() or list(dst.parent.iterdir()) == []
    with pytest.raises(NotFound):
        await transport.put_file("k", tmp_path / "no-such-local-file")


async def test_put_file_create_mode(transport: Transport, tmp_path: Path) -> None:
    src = tmp_path / "f"
    src.write_bytes(b"v1")
    await transport.put_file("c/f", src, mode="create")
    src.write_bytes(b"v2")
    with pytest.raises(AlreadyExists):
        await transport.put_file("c/f", src, mode="create")
    assert await transport.get("c/f") == b"v1"


@pytest.mark.parametrize("bad", ["", "/abs", "../escape", "a/../../b", "a//b", "a/./b", "a\\b"])
async def test_invalid_keys_rejected(transport: Transport, bad: str) -> None:
    with pytest.raises(InvalidKey):
        await transport.put(bad, b"x")
    with pytest.raises(ValueError):
        await transport.get(bad)


async def test_async_context_manager(transport: Transport) -> None:
    async with transport as t:
        await t.put("ctx", b"ok")
        assert await t.get("ctx") == b"ok"
    assert isinstance(repr(transport), str) and transport.url in repr(transport)


async def test_errors_are_transport_errors(transport: Transport) -> None:
    with pytest.raises(TransportError):
        await transport.get("absent")
