"""A directory as a transport: local disk or a shared mount (NFS, Lustre, a FUSE bucket).

Every write goes to a temp file beside its target and is renamed into place, so readers on any
host see the old object or the whole new one. ``mode="create"`` links the temp file to the
target (``link(2)`` fails if the target exists, atomically, also on NFS); where hard links are
unsupported it falls back to ``O_CREAT|O_EXCL`` plus an in-place write, which is exclusive but
lets a concurrent reader see a partial file (we log that once); a fallback create that fails
(a full disk) removes what it wrote, so no truncated object is left to be read as complete.

Keys are confined to the root: :func:`~asyncgrpo.transport.base.check_key` rejects ``..`` and
absolute keys before any path is built, and no symbolic link under the root is followed. Reads
walk from the root one directory at a time with ``O_NOFOLLOW`` (and open only regular files),
so a link planted by someone who can write the directory cannot make a reader return a file from
elsewhere; writes, deletes and listings refuse a path with a link on it. The root itself may be
a link: it is the user's choice. Temp files are named ``.~asyncgrpo.*`` and never listed.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import shutil
import stat
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import unquote, urlsplit

import anyio
import anyio.to_thread

from asyncgrpo.errors import AlreadyExists, ConfigError, NotFound, TransportError
from asyncgrpo.transport.base import (
    CHUNK_BYTES,
    ObjectInfo,
    PutMode,
    Transport,
    check_key,
    too_large,
)

__all__ = ["LocalTransport"]

log = logging.getLogger(__name__)

TMP_PREFIX = ".~asyncgrpo."
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
# O_NONBLOCK: a FIFO planted as an object must not hang the reader (refused after fstat).
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC


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

    def _refuse_links(self, path: Path) -> None:
        """Raise if ``path`` or a directory between it and the root is a symbolic link."""
        current = path
        while current != self.root:
            try:
                if stat.S_ISLNK(os.lstat(current).st_mode):
                    raise self._link_error(current)
            except (FileNotFoundError, NotADirectoryError):
                pass
            current = current.parent

    def _link_error(self, path: Path) -> TransportError:
        return TransportError(
            f"{self.url}/{self._rel(path)} is a symbolic link; a local transport follows no "
            "links under its root (someone with write access to it planted one, or a tool "
            "copied the store without -P)"
        )

    def _open_object(self, key: str) -> tuple[int, os.stat_result]:
        """An open descriptor of the regular file at ``key`` and its stat, reached from the root
        without following any link: ``O_NOFOLLOW`` on every directory and on the file."""
        parts = check_key(key).split("/")
        where = self._path(key)
        self._refuse_links(where)  # the walk below would refuse it too, less clearly
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
        except FileNotFoundError as exc:
            raise NotFound(f"{self.url}/{key} does not exist") from exc
        try:
            for part in parts[:-1]:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = child
            file_fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=fd)
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise NotFound(f"{self.url}/{key} does not exist") from exc
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise self._link_error(where) from None
            raise
        finally:
            os.close(fd)
        st = os.fstat(file_fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(file_fd)
            raise NotFound(f"{self.url}/{key} is not a regular file, not an object")
        os.set_blocking(file_fd, True)
        return file_fd, st

    def _copy_object(self, key: str, sink: BinaryIO, max_bytes: int | None) -> int:
        """Copy ``key`` into ``sink``; return the byte count. Reads at most ``max_bytes`` (+1,
        to notice a file that grew while it was read)."""
        fd, st = self._open_object(key)
        with open(fd, "rb") as f:
            if max_bytes is not None and st.st_size > max_bytes:
                raise too_large(f"{self.url}/{key}", max_bytes)
            copied = 0
            while chunk := f.read(CHUNK_BYTES):
                copied += len(chunk)
                if max_bytes is not None and copied > max_bytes:
                    raise too_large(f"{self.url}/{key}", max_bytes)
                sink.write(chunk)
            return copied

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
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            tmp.unlink(missing_ok=True)
            raise AlreadyExists(f"{self.url}/{self._rel(path)} already exists") from None
        try:
            with os.fdopen(fd, "wb") as dst, tmp.open("rb") as src:
                shutil.copyfileobj(src, dst)
                if self._fsync:
                    os.fsync(dst.fileno())
        except BaseException:
            # A partial object must not stay: it would read as complete (a truncated manifest
            # listed as a published version). We created it exclusively, so it is ours.
            path.unlink(missing_ok=True)
            raise
        finally:
            tmp.unlink(missing_ok=True)

    def _rel(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()

    def _write(self, path: Path, data: bytes | None, src: Path | None, mode: PutMode) -> None:
        self._refuse_links(path)
        if mode == "create" and (path.exists() or path.is_symlink()):
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
    async def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        def read() -> bytes:
            buffer = io.BytesIO()
            self._copy_object(key, buffer, max_bytes)
            return buffer.getvalue()

        return await anyio.to_thread.run_sync(read)

    async def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> None:
        await anyio.to_thread.run_sync(self._write, self._path(key), bytes(data), None, mode)

    async def put_file(
        self, key: str, path: str | os.PathLike[str], *, mode: PutMode = "overwrite"
    ) -> None:
        await anyio.to_thread.run_sync(self._write, self._path(key), None, Path(path), mode)

    async def get_file(
        self, key: str, path: str | os.PathLike[str], *, max_bytes: int | None = None
    ) -> int:
        dst = Path(path)

        def copy() -> int:
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._tmp_for(dst)
            try:
                with tmp.open("xb") as sink:
                    size = self._copy_object(key, sink, max_bytes)
                os.replace(tmp, dst)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            return size

        return await anyio.to_thread.run_sync(copy)

    async def head(self, key: str) -> ObjectInfo:
        def stat_object() -> os.stat_result:
            fd, st = self._open_object(key)
            os.close(fd)
            return st

        st = await anyio.to_thread.run_sync(stat_object)
        return ObjectInfo(key=check_key(key), size=st.st_size, mtime=st.st_mtime)

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:  # type: ignore[override]
        prefix = check_key(prefix, allow_empty=True)
        base = self.root.joinpath(*prefix.split("/")) if prefix else self.root

        def walk() -> list[ObjectInfo]:
            found: list[ObjectInfo] = []
            self._refuse_links(base)
            if not base.is_dir():
                return found
            # os.walk descends no linked directory; linked files are skipped by lstat.
            for dirpath, _dirs, files in os.walk(base):
                for name in files:
                    if name.startswith(TMP_PREFIX):
                        continue
                    full = Path(dirpath, name)
                    try:
                        st = os.lstat(full)
                    except FileNotFoundError:  # deleted while walking
                        continue
                    if stat.S_ISREG(st.st_mode):
                        found.append(ObjectInfo(self._rel(full), st.st_size, st.st_mtime))
            return found

        for info in await anyio.to_thread.run_sync(walk):
            yield info

    async def delete(self, key: str) -> None:
        path = self._path(key)

        def remove() -> None:
            self._refuse_links(path.parent)  # the link itself may go: unlink does not follow it
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
