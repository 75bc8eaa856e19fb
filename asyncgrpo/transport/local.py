"""A directory as a transport: local disk or a shared mount (NFS, Lustre, a FUSE bucket).

Every write goes to a temp file beside its target and is renamed into place, so readers on any
host see the old object or the whole new one. ``mode="create"`` links the temp file to the
target (``link(2)`` fails if the target exists, atomically, also on NFS); where hard links are
unsupported it falls back to ``O_CREAT|O_EXCL`` plus an in-place write, which is exclusive but
lets a concurrent reader see a partial file (we log that once); a fallback create that fails
(a full disk) removes what it wrote, so no truncated object is left to be read as complete.

Keys are confined to the root: :func:`~asyncgrpo.transport.base.check_key` rejects ``..`` and
absolute keys before any path is built, and no symbolic link under the root is followed. Every
operation walks from the root one directory at a time with ``O_NOFOLLOW``, holding each
directory's descriptor, and acts relative to the last one (``openat``, ``mkdirat``,
``renameat``, ``linkat``, ``unlinkat``); reads open only regular files, temp files are created
``O_EXCL|O_NOFOLLOW``. So a link planted by someone who can write the directory cannot make a
reader return a file from elsewhere, nor a writer write there, also when it is swapped in
between two calls: no path is checked and then used. The root itself may be a link: it is the
user's choice. Temp files are named ``.~asyncgrpo.*`` and never listed.
"""

from __future__ import annotations

import contextlib
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

from asyncgrpo.config.redaction import redact_url
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
                    f"file URL {redact_url(url)!r} names host {parts.hostname!r}; use "
                    "file:///abs/path (three slashes) or a plain path"
                )
            if parts.query or parts.fragment:
                raise ConfigError(f"file URL {redact_url(url)!r} must not have a query or fragment")
            path = unquote(parts.path)
            if not path:
                raise ConfigError(f"file URL {redact_url(url)!r} has no path; use file:///abs/path")
            return cls(path, **options)
        return cls(url, **options)

    # ---- helpers ------------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def _link_on(self, parts: list[str]) -> Path | None:
        """Which of root/parts... is a symbolic link, if any: the diagnosis of an open the
        kernel refused (``ELOOP``, or ``ENOTDIR`` for a link opened as a directory); nothing
        relies on it for safety."""
        current = self.root
        for part in parts:
            current = current / part
            try:
                if stat.S_ISLNK(os.lstat(current).st_mode):
                    return current
            except OSError:
                break
        return None

    def _link_error(self, path: Path) -> TransportError:
        return TransportError(
            f"{self.url}/{self._rel(path)} is a symbolic link; a local transport follows no "
            "links under its root (someone with write access to it planted one, or a tool "
            "copied the store without -P)"
        )

    def _walk(self, parts: list[str], *, create: bool = False) -> list[int]:
        """Descriptors of the root and of each directory ``parts`` names below it, opened one
        at a time relative to the previous with ``O_NOFOLLOW`` (made when missing if
        ``create``): no link is followed, and a link swapped in after a check cannot redirect
        the operation, as it could if a path were checked and then used. The caller closes
        them (:func:`_close`). ``NotFound`` when a directory is missing (or is a file)."""
        try:
            fds = [os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)]
        except FileNotFoundError as exc:
            raise NotFound(f"{self.url} does not exist") from exc
        try:
            for part in parts:
                try:
                    fds.append(os.open(part, _DIR_FLAGS, dir_fd=fds[-1]))
                    continue
                except FileNotFoundError:
                    if not create:
                        raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, dir_fd=fds[-1])
                fds.append(os.open(part, _DIR_FLAGS, dir_fd=fds[-1]))
        except OSError as exc:
            _close(fds)
            i = len(fds) - 1  # parts[i] is the one that failed
            link = self._link_on(parts[: i + 1])
            if link is not None:
                raise self._link_error(link) from None
            where = f"{self.url}/{'/'.join(parts[: i + 1])}"
            if exc.errno == errno.ENOTDIR and create:  # a write below an object
                raise TransportError(f"{where} is not a directory") from None
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):  # (a write: removed as we walked)
                raise NotFound(f"{where} does not exist as a directory") from exc
            raise
        return fds

    def _open_object(self, key: str) -> tuple[int, os.stat_result]:
        """An open descriptor of the regular file at ``key`` and its stat, reached from the root
        without following any link: ``O_NOFOLLOW`` on every directory and on the file."""
        parts = check_key(key).split("/")
        try:
            fds = self._walk(parts[:-1])
        except NotFound as exc:
            raise NotFound(f"{self.url}/{key} does not exist") from exc
        try:
            file_fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=fds[-1])
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise NotFound(f"{self.url}/{key} does not exist") from exc
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise self._link_error(self._path(key)) from None
            raise
        finally:
            _close(fds)
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

    def _finish(self, dir_fd: int, tmp: str, name: str, mode: PutMode, key: str) -> None:
        """Move a fully written temp file to ``name`` in ``dir_fd`` (rename, or link for
        create). Neither follows a link at ``name``: rename replaces it, link fails on it."""
        if mode == "overwrite":
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            return
        try:
            os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        except FileExistsError:
            raise AlreadyExists(f"{self.url}/{key} already exists") from None
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise
            self._create_without_link(dir_fd, tmp, name, key)
        finally:
            _unlink_quiet(tmp, dir_fd)

    def _create_without_link(self, dir_fd: int, tmp: str, name: str, key: str) -> None:
        if not self._warned_no_link:
            log.warning(
                "%s: hard links unsupported; create-only writes are exclusive but not atomic",
                self.root,
            )
            self._warned_no_link = True
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC
        try:
            fd = os.open(name, flags, 0o644, dir_fd=dir_fd)
        except FileExistsError:
            raise AlreadyExists(f"{self.url}/{key} already exists") from None
        try:
            with os.fdopen(fd, "wb") as dst, _open_in(dir_fd, tmp, os.O_RDONLY, "rb") as src:
                shutil.copyfileobj(src, dst)
                if self._fsync:
                    os.fsync(dst.fileno())
        except BaseException:
            # A partial object must not stay: it would read as complete (a truncated manifest
            # listed as a published version). We created it exclusively, so it is ours.
            _unlink_quiet(name, dir_fd)
            raise

    def _rel(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()

    def _write(self, key: str, data: bytes | None, src: Path | None, mode: PutMode) -> None:
        """Write ``data`` (or the local file ``src``) to ``key``: a temp file created with
        ``O_EXCL|O_NOFOLLOW`` in the directory reached by :meth:`_walk`, then renamed or
        linked into place relative to that same descriptor."""
        parts = check_key(key).split("/")
        name = parts[-1]
        source = None
        if src is not None:
            try:
                source = open(src, "rb")  # closed below
            except FileNotFoundError as exc:
                raise NotFound(f"local file {src} does not exist") from exc
        try:
            for attempt in range(3):  # a concurrent delete may rmdir an empty parent under us
                try:
                    fds = self._walk(parts[:-1], create=True)
                except NotFound:
                    if attempt == 2:
                        raise
                    continue
                try:
                    if self._write_in(fds[-1], name, key, data, source, mode):
                        return
                finally:
                    _close(fds)
                if attempt == 2:
                    raise NotFound(f"{self.url}/{key}: its directory kept vanishing while written")
        finally:
            if source is not None:
                source.close()

    def _write_in(
        self,
        dir_fd: int,
        name: str,
        key: str,
        data: bytes | None,
        source: BinaryIO | None,
        mode: PutMode,
    ) -> bool:
        """One attempt of :meth:`_write` in an open directory; False if it was removed."""
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISLNK(st.st_mode):  # would be replaced, not followed
            raise self._link_error(self._path(key))
        if st is not None and mode == "create":
            raise AlreadyExists(f"{self.url}/{key} already exists")
        tmp = f"{TMP_PREFIX}{name}.{uuid.uuid4().hex[:12]}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC
        try:
            f = _open_in(dir_fd, tmp, flags, "wb")
        except FileNotFoundError:  # the directory was removed after we opened it
            return False
        try:
            with f:
                if source is not None:
                    _copy_file(source, f)
                else:
                    f.write(data or b"")
                if self._fsync:
                    f.flush()
                    os.fsync(f.fileno())
            self._finish(dir_fd, tmp, name, mode, key)
        except BaseException:
            _unlink_quiet(tmp, dir_fd)
            raise
        if self._fsync:
            os.fsync(dir_fd)  # the rename itself survives power loss too
        return True

    # ---- Transport ----------------------------------------------------------------------------
    async def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        def read() -> bytes:
            buffer = io.BytesIO()
            self._copy_object(key, buffer, max_bytes)
            return buffer.getvalue()

        return await anyio.to_thread.run_sync(read)

    async def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> None:
        await anyio.to_thread.run_sync(self._write, key, bytes(data), None, mode)

    async def put_file(
        self, key: str, path: str | os.PathLike[str], *, mode: PutMode = "overwrite"
    ) -> None:
        await anyio.to_thread.run_sync(self._write, key, None, Path(path), mode)

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
        parts = prefix.split("/") if prefix else []

        def walk() -> list[ObjectInfo]:
            found: list[ObjectInfo] = []
            try:
                fds = self._walk(parts)
            except NotFound:
                return found
            try:
                # fwalk descends by descriptor and enters no linked directory; linked files
                # are skipped by their lstat.
                for dirpath, _dirs, files, dir_fd in os.fwalk(".", dir_fd=fds[-1]):
                    rel = [*parts, *Path(dirpath).parts]
                    for name in files:
                        if name.startswith(TMP_PREFIX):
                            continue
                        try:
                            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                        except FileNotFoundError:  # deleted while walking
                            continue
                        if stat.S_ISREG(st.st_mode):
                            key = "/".join([*rel, name])
                            found.append(ObjectInfo(key, st.st_size, st.st_mtime))
            finally:
                _close(fds)
            return found

        for info in await anyio.to_thread.run_sync(walk):
            yield info

    async def delete(self, key: str) -> None:
        parts = check_key(key).split("/")

        def remove() -> None:
            try:
                fds = self._walk(parts[:-1])  # the link itself may go: unlink does not follow it
            except NotFound:
                return
            try:
                try:
                    os.unlink(parts[-1], dir_fd=fds[-1])
                except FileNotFoundError:
                    return
                except (IsADirectoryError, PermissionError) as exc:
                    if not stat.S_ISDIR(os.stat(parts[-1], dir_fd=fds[-1]).st_mode):
                        raise
                    raise TransportError(f"{self.url}/{key} is a directory, not an object") from exc
                # Drop empty parents so listings stay cheap; a concurrent writer may refill one.
                for depth in range(len(parts) - 1, 0, -1):
                    try:
                        os.rmdir(parts[depth - 1], dir_fd=fds[depth - 1])
                    except OSError:
                        break
            finally:
                _close(fds)

        await anyio.to_thread.run_sync(remove)


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _copy_file(source: BinaryIO, sink: BinaryIO) -> None:
    """Copy all of ``source`` into the empty ``sink`` in the kernel (``sendfile``, as
    ``shutil.copyfile`` does, which is what ``put_file`` used before writes went through
    directory descriptors), or through Python where the kernel cannot."""
    offset = 0
    try:
        while sent := os.sendfile(sink.fileno(), source.fileno(), offset, CHUNK_BYTES):
            offset += sent
        return
    except (AttributeError, OSError) as exc:
        if offset or getattr(exc, "errno", errno.ENOSYS) not in _NO_SENDFILE:
            raise
    source.seek(0)
    shutil.copyfileobj(source, sink, CHUNK_BYTES)


_NO_SENDFILE = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOTSOCK}


def _unlink_quiet(name: str, dir_fd: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)


def _open_in(dir_fd: int, name: str, flags: int, mode: str) -> BinaryIO:
    """A file object for ``name`` in the directory ``dir_fd`` (its ``name`` stays a str)."""
    return open(name, mode, opener=lambda path, _: os.open(path, flags, 0o666, dir_fd=dir_fd))  # type: ignore[return-value]
