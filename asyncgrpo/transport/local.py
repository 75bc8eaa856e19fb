"""A directory as a transport: local disk or a shared mount (NFS, Lustre, a FUSE bucket).

Every write goes to a temp file beside its target and is renamed into place, so readers on any
host see the old object or the whole new one. ``mode="create"`` links the temp file to the
target (``link(2)`` fails if the target exists, atomically, also on NFS); where hard links are
unsupported it falls back to ``O_CREAT|O_EXCL`` plus an in-place write, which is exclusive but
lets a concurrent reader see a partial file (we log that once). Keys are confined to the root:
:func:`~asyncgrpo.transport.base.check_key` rejects ``..`` and absolute keys before any path is
built. Temp files are named ``.~asyncgrpo.*`` and never listed.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import anyio
import anyio.to_thread

from asyncgrpo.errors import AlreadyExists, ConfigError, NotFound, TransportError
from asyncgrpo.transport.base import ObjectInfo, PutMode, Transport, check_key

__all__ = ["LocalTransport"]

log = logging.getLogger(__name__)

TMP_PREFIX = ".~asyncgrpo."


class LocalTransport(Transport):
    """Objects are files under ``root``; directories are created on demand."""

    def __init__(self, root: str | os.PathLike[str], *, create: bool = True, fsync: bool = False):
        """``fsync=True`` also survives power loss (slower); rename alone survives SIGKILL."""
        self.root = Path(root).expanduser().absolute()
        self.url = self.root.as_uri()
        self._fsync = fsync
        self._warned_no_link = False
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        elif not self.root.is_dir():
            raise ConfigError(f"local transport root {self.root} is not a directory")

    @classmethod
    def from_url(cls, url: str, **options: Any) -> LocalTransport:
        if url.startswith("file://"):
            parts = urlsplit(url)
            if parts.netloc not in ("", "localhost"):
                raise ConfigError(
                    f"file URL {url!r} names host {parts.netloc!r}; use file:///abs/path "
                    "(three slashes) or a plain path"
                )
            if parts.query or parts.fragment:
                raise ConfigError(f"file URL {url!r} must not have a query or fragment")
            path = unquote(parts.path)
            if not path:
                raise ConfigError(f"file URL {url!r} has no path; use file:///abs/path")
            return cls(path, **options)
        return cls(url, **options)

    # ---- helpers ------------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def _tmp_for(self, path: Path) -> Path:
        return path.with_name(f"{TMP_PREFIX}{path.name}.{uuid.uuid4().hex[:12]}")

    def _finish(self, tmp: Path, path: Path, mode: PutMode) -> None:
        """Move a fully written temp file to ``path`` (rename, or link for create)."""
        if mode == "overwrite":
            os.replace(tmp, path)
            return
        try:
            os.link(tmp, path)
        except FileExistsError:
            tmp.unlink(missing_ok=True)
            raise AlreadyExists(f"{self.url}/{self._rel(path)} already exists") from None
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                tmp.unlink(missing_ok=True)
                raise
            self._create_without_link(tmp, path)
            return
        tmp.unlink(missing_ok=True)

    def _create_without_link(self, tmp: Path, path: Path) -> None:
        if not self._warned_no_link:
            log.warning(
                "%s: hard links unsupported; create-only writes are exclusive but not atomic",
                self.root,
            )
            self._warned_no_link = True
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            tmp.unlink(missing_ok=True)
            raise AlreadyExists(f"{self.url}/{self._rel(path)} already exists") from None
        with os.fdopen(fd, "wb") as dst, tmp.open("rb") as src:
            shutil.copyfileobj(src, dst)
        tmp.unlink(missing_ok=True)

    def _rel(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()

    def _write(self, path: Path, data: bytes | None, src: Path | None, mode: PutMode) -> None:
        if mode == "create" and path.exists():
            raise AlreadyExists(f"{self.url}/{self._rel(path)} already exists")
        tmp = self._tmp_for(path)
        for attempt in range(3):  # a concurrent delete may rmdir an empty parent under us
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                tmp.touch(exist_ok=False)
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
        try:
            if src is not None:
                try:
                    shutil.copyfile(src, tmp)
                except FileNotFoundError as exc:
                    raise NotFound(f"local file {src} does not exist") from exc
            else:
                with tmp.open("wb") as f:
                    f.write(data or b"")
            if self._fsync:
                with tmp.open("rb+") as f:
                    os.fsync(f.fileno())
            self._finish(tmp, path, mode)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    # ---- Transport ----------------------------------------------------------------------------
    async def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return await anyio.to_thread.run_sync(path.read_bytes)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            raise NotFound(f"{self.url}/{key} does not exist") from exc

    async def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> None:
        await anyio.to_thread.run_sync(self._write, self._path(key), bytes(data), None, mode)

    async def put_file(
        self, key: str, path: str | os.PathLike[str], *, mode: PutMode = "overwrite"
    ) -> None:
        await anyio.to_thread.run_sync(self._write, self._path(key), None, Path(path), mode)

    async def get_file(self, key: str, path: str | os.PathLike[str]) -> int:
        src, dst = self._path(key), Path(path)

        def copy() -> int:
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._tmp_for(dst)
            try:
                shutil.copyfile(src, tmp)
                os.replace(tmp, dst)
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
                tmp.unlink(missing_ok=True)
                if not src.is_file():
                    raise NotFound(f"{self.url}/{key} does not exist") from exc
                raise
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            return dst.stat().st_size

        return await anyio.to_thread.run_sync(copy)

    async def head(self, key: str) -> ObjectInfo:
        path = self._path(key)
        try:
            st = await anyio.to_thread.run_sync(path.stat)
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise NotFound(f"{self.url}/{key} does not exist") from exc
        if not path.is_file():
            raise NotFound(f"{self.url}/{key} is a directory, not an object")
        return ObjectInfo(key=check_key(key), size=st.st_size, mtime=st.st_mtime)

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:  # type: ignore[override]
        prefix = check_key(prefix, allow_empty=True)
        base = self.root.joinpath(*prefix.split("/")) if prefix else self.root

        def walk() -> list[ObjectInfo]:
            found: list[ObjectInfo] = []
            if not base.is_dir():
                return found
            for dirpath, _dirs, files in os.walk(base):
                for name in files:
                    if name.startswith(TMP_PREFIX):
                        continue
                    full = Path(dirpath, name)
                    try:
                        st = full.stat()
                    except FileNotFoundError:  # deleted while walking
                        continue
                    found.append(ObjectInfo(self._rel(full), st.st_size, st.st_mtime))
            return found

        for info in await anyio.to_thread.run_sync(walk):
            yield info

    async def delete(self, key: str) -> None:
        path = self._path(key)

        def remove() -> None:
            try:
                path.unlink()
            except FileNotFoundError:
                return
            except IsADirectoryError as exc:
                raise TransportError(f"{self.url}/{key} is a directory, not an object") from exc
            # Drop empty parents so listings stay cheap; a concurrent writer may refill one.
            parent = path.parent
            while parent != self.root:
                try:
                    parent.rmdir()
                except OSError:
                    break
                parent = parent.parent

        await anyio.to_thread.run_sync(remove)
