"""Directories published as immutable bundles: files first, manifest last.

The adapter store and the checkpoint store share this. A bundle at ``<prefix>/`` is laid out as::

    <prefix>/manifest.json            written LAST, create-only: the bundle exists iff this exists
    <prefix>/files-<attempt>/<rel>    the files, under a prefix unique to one publish attempt

Uploading under a per-attempt prefix means two publishers racing for the same bundle never
overwrite each other's files: both upload, exactly one wins the create-only manifest write, the
loser deletes its own files. A publisher killed mid-upload leaves files but no manifest, i.e. no
bundle; :func:`list_bundles` reports such leftovers so retention can delete them.

Downloads go to a temp directory beside the destination, every file is checked against the
manifest's size and sha256, and only then is the directory renamed into place, so a destination
directory that exists is complete and verified, also with several processes fetching at once.

A reader trusts the storage no further than :class:`FetchLimits` says: the manifest, the number
of files and their total size are capped before anything is downloaded, and each file is read
no further than the size its manifest entry declares, so a writer to the storage cannot fill a
reader's disk. An integrity error names the file and what the manifest declares, never what was
found (that could describe a file the reader was tricked into reading).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from asyncgrpo.config.store import FetchLimits
from asyncgrpo.errors import (
    AlreadyExists,
    ConfigError,
    IntegrityError,
    NotFound,
    TransportError,
    leaves,
)
from asyncgrpo.store.documents import read_document
from asyncgrpo.transport.base import Transport, check_key, join_key
from asyncgrpo.transport.registry import open_transport

__all__ = [
    "LOCAL_MANIFEST",
    "MANIFEST",
    "BundleListing",
    "BundleStore",
    "FetchLimits",
    "delete_bundle",
    "download_bundle",
    "list_bundles",
    "publish_bundle",
    "read_manifest",
]

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LOCAL_MANIFEST = ".asyncgrpo-manifest.json"
"""Copy of the manifest inside a downloaded directory (hidden: vLLM and peft ignore it)."""
FORMAT = "asyncgrpo.bundle/1"
_SHA256_HEX = frozenset("0123456789abcdef")


_DEFAULT_LIMITS = FetchLimits()


def _hash_file(path: Path) -> tuple[int, str]:
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256")
    return path.stat().st_size, digest.hexdigest()


def _local_files(local_dir: Path) -> list[Path]:
    if not local_dir.is_dir():
        raise NotFound(f"local directory {local_dir} does not exist")
    files = sorted(
        p
        for p in local_dir.rglob("*")
        if p.is_file() and p.name != LOCAL_MANIFEST and not p.name.startswith(".~asyncgrpo.")
    )
    if not files:
        raise NotFound(f"local directory {local_dir} has no files to publish")
    return files


async def _gather(jobs: list[Callable[[], Awaitable[None]]], concurrency: int) -> None:
    limiter = anyio.Semaphore(max(1, concurrency))

    async def run(job: Callable[[], Awaitable[None]]) -> None:
        async with limiter:
            await job()

    try:
        async with anyio.create_task_group() as tg:
            for job in jobs:
                tg.start_soon(run, job)
    except BaseExceptionGroup as group:  # callers expect our error types, not a group
        raise leaves(group)[0] from None


async def publish_bundle(
    transport: Transport,
    prefix: str,
    local_dir: str | os.PathLike[str],
    fields: dict[str, Any],
    *,
    concurrency: int = 8,
) -> dict[str, Any]:
    """Upload ``local_dir`` under ``prefix`` and write its manifest last; return the manifest.

    Raises :class:`AlreadyExists` if the bundle exists or another publisher won the race.
    """
    prefix = check_key(prefix)
    manifest_key = join_key(prefix, MANIFEST)
    if await transport.exists(manifest_key):
        raise AlreadyExists(f"{transport.url}/{prefix} is already published")
    local_dir = Path(local_dir)
    paths = await anyio.to_thread.run_sync(_local_files, local_dir)
    attempt = f"files-{uuid.uuid4().hex[:12]}"
    entries: list[dict[str, Any]] = []
    for path in paths:
        size, sha = await anyio.to_thread.run_sync(_hash_file, path)
        entries.append(
            {"path": path.relative_to(local_dir).as_posix(), "size": size, "sha256": sha}
        )

    def upload(path: Path, rel: str) -> Callable[[], Awaitable[None]]:
        return lambda: transport.put_file(join_key(prefix, attempt, rel), path)

    started = time.perf_counter()
    try:
        await _gather(
            [upload(p, e["path"]) for p, e in zip(paths, entries, strict=True)], concurrency
        )
    except BaseException:
        with anyio.CancelScope(shield=True):
            await _delete_files(transport, join_key(prefix, attempt))
        raise
    manifest = {
        "format": FORMAT,
        **fields,
        "files_prefix": attempt,
        "files": entries,
        "created_at": time.time(),
    }
    try:
        await transport.put(manifest_key, json.dumps(manifest, indent=1).encode(), mode="create")
    except BaseException as exc:
        # A create can land and still fail: its answer lost, then the retry told AlreadyExists,
        # or a timeout after the write. Our files are deleted only once the manifest is known
        # not to be ours; else they are leftovers that retention removes.
        with anyio.CancelScope(shield=True):
            winner = await _manifest_attempt(transport, prefix)
            if winner == attempt:
                log.info(
                    "%s/%s: our create landed, though it reported %r", transport.url, prefix, exc
                )
            elif winner is not _UNKNOWN:
                await _delete_files(transport, join_key(prefix, attempt))
        if winner == attempt and isinstance(exc, Exception):
            await _delete_stale_attempts(transport, prefix, keep=attempt)
            return manifest
        if isinstance(exc, AlreadyExists):
            raise AlreadyExists(
                f"{transport.url}/{prefix} was published by someone else first"
            ) from exc
        raise
    await _delete_stale_attempts(transport, prefix, keep=attempt)
    log.info(
        "published %s/%s: %d files, %.1f MB in %.2fs",
        transport.url,
        prefix,
        len(entries),
        sum(e["size"] for e in entries) / 1e6,
        time.perf_counter() - started,
    )
    return manifest


_UNKNOWN = object()


async def _manifest_attempt(transport: Transport, prefix: str) -> str | object | None:
    """The ``files_prefix`` the bundle's manifest names; None when there is no manifest;
    ``_UNKNOWN`` when it cannot be read (then nothing may be deleted)."""
    try:
        manifest = await read_manifest(transport, prefix)
    except NotFound:
        return None
    except (TransportError, OSError) as exc:
        log.warning("cannot tell whether %s/%s is ours: %s", transport.url, prefix, exc)
        return _UNKNOWN
    return manifest.get("files_prefix")


async def _delete_stale_attempts(transport: Transport, prefix: str, *, keep: str) -> None:
    """After winning, drop files of killed or losing attempts (best effort, never fatal)."""
    try:
        stale = [
            info.key
            async for info in transport.list(prefix)
            if info.key[len(prefix) + 1 :].startswith("files-")
            and not info.key[len(prefix) + 1 :].startswith(keep + "/")
        ]
        await _gather([_deleter(transport, k) for k in stale], 16)
    except TransportError as exc:
        log.warning("could not delete stale uploads under %s/%s: %s", transport.url, prefix, exc)


async def read_manifest(
    transport: Transport, prefix: str, *, max_bytes: int | None = None
) -> dict[str, Any]:
    """Return the manifest of the bundle at ``prefix``; :class:`NotFound` if unpublished,
    :class:`IntegrityError` if it is not a manifest or holds more than ``max_bytes`` (default
    :attr:`FetchLimits.max_manifest_bytes`)."""
    key = join_key(check_key(prefix), MANIFEST)
    limit = max_bytes or _DEFAULT_LIMITS.max_manifest_bytes
    manifest = await read_document(transport, key, max_bytes=limit)
    if manifest.get("format") != FORMAT:
        raise IntegrityError(f"{transport.url}/{key} is not an {FORMAT} manifest")
    return manifest


def _manifest_files(
    manifest: Any, limits: FetchLimits, where: str
) -> tuple[str, list[tuple[str, int, str]]]:
    """The files prefix and ``(path, size, sha256)`` of each file a manifest lists, checked
    against ``limits`` and for shape (relative paths without '..', each once; sizes; hex
    digests) before anything is downloaded. ``where`` names the bundle in errors."""
    bad = f"{where}: malformed manifest"
    if not isinstance(manifest, dict):
        raise IntegrityError(f"{bad} (not an object)")
    files, files_prefix = manifest.get("files"), manifest.get("files_prefix")
    if not isinstance(files, list) or not isinstance(files_prefix, str):
        raise IntegrityError(f"{bad} (no files or files_prefix)")
    if len(files) > limits.max_files:
        raise IntegrityError(
            f"{where} lists {len(files)} files, more than this reader accepts "
            f"({limits.max_files}; raise the max files limit if the bundle is legitimate)"
        )
    try:
        files_prefix = check_key(files_prefix)
        if "/" in files_prefix:
            raise ValueError("files_prefix must be one key segment")
        out: list[tuple[str, int, str]] = []
        for entry in files:
            path, size, sha = entry["path"], entry["size"], entry["sha256"]
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ValueError(f"size {size!r} of {path!r}")
            if not isinstance(sha, str) or len(sha) != 64 or not _SHA256_HEX.issuperset(sha):
                raise ValueError(f"sha256 of {path!r}")
            out.append((check_key(path), size, sha))
    except (ValueError, KeyError, TypeError) as exc:
        raise IntegrityError(f"{bad} ({exc})") from None
    if len({p for p, _, _ in out}) != len(out) or any(p == LOCAL_MANIFEST for p, _, _ in out):
        raise IntegrityError(f"{bad} (a path listed twice or reserved)")
    total = sum(size for _, size, _ in out)
    if limits.max_total_bytes is not None and total > limits.max_total_bytes:
        raise IntegrityError(
            f"{where} lists {total} bytes, more than this reader accepts "
            f"({limits.max_total_bytes}; raise the max bytes limit if the bundle is legitimate)"
        )
    return files_prefix, out


async def download_bundle(
    transport: Transport,
    prefix: str,
    dest: str | os.PathLike[str],
    *,
    manifest: dict[str, Any] | None = None,
    concurrency: int = 8,
    limits: FetchLimits | None = None,
    reuse: bool = True,
) -> tuple[Path, dict[str, Any]]:
    """Make ``dest`` a verified copy of the bundle; return it and the manifest.

    With ``reuse``, an existing ``dest`` is returned as is: this function only ever makes one
    appear by rename after verification, so a caller that alone writes under ``dest``'s parent
    may trust it. Without, an existing ``dest`` is deleted and fetched again. Raises
    :class:`IntegrityError` on a size or sha256 mismatch or a bundle beyond ``limits`` (default
    :class:`FetchLimits`'s), leaving nothing at ``dest``.
    """
    dest = Path(dest)
    limits = limits or _DEFAULT_LIMITS
    if reuse and (dest / LOCAL_MANIFEST).is_file():
        cached = json.loads((dest / LOCAL_MANIFEST).read_text())
        if manifest is None or cached == manifest:
            return dest, cached
        reuse = False  # a copy of an earlier publish under this name (a re-saved checkpoint)
    if manifest is None:
        manifest = await read_manifest(transport, prefix, max_bytes=limits.max_manifest_bytes)
    where = f"{transport.url}/{prefix}"
    attempt, files = _manifest_files(manifest, limits, where)
    files_prefix = join_key(prefix, attempt)
    if not reuse and (dest.exists() or dest.is_symlink()):
        await anyio.to_thread.run_sync(_remove_tree, dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:

        def fetch(rel: str, size: int, sha256: str) -> Callable[[], Awaitable[None]]:
            async def job() -> None:
                target = tmp.joinpath(*rel.split("/"))
                try:
                    await transport.get_file(join_key(files_prefix, rel), target, max_bytes=size)
                    got = await anyio.to_thread.run_sync(_hash_file, target)
                except IntegrityError:
                    got = None  # more bytes than declared: the transport stopped reading
                if got != (size, sha256):
                    raise IntegrityError(
                        f"{files_prefix}/{rel} under {transport.url} does not match its "
                        f"manifest entry ({size} bytes, sha256 {sha256[:12]}...)"
                    )

            return job

        await _gather([fetch(*f) for f in files], concurrency)
        (tmp / LOCAL_MANIFEST).write_text(json.dumps(manifest, indent=1))
        try:
            os.rename(tmp, dest)
        except OSError:
            if not reuse or not (dest / LOCAL_MANIFEST).is_file():
                raise
            log.debug("%s appeared concurrently; using it", dest)
    finally:
        if tmp.exists():
            await anyio.to_thread.run_sync(shutil.rmtree, tmp, True)
    return dest, manifest


def _remove_tree(path: Path) -> None:
    """Delete a file, link or directory tree; a failure raises (never trust what remains)."""
    if path.is_symlink() or not path.is_dir():
        path.unlink()
    else:
        shutil.rmtree(path)


async def _delete_files(transport: Transport, prefix: str) -> None:
    keys = [info.key async for info in transport.list(prefix)]
    await _gather([_deleter(transport, k) for k in keys], 16)


def _deleter(transport: Transport, key: str) -> Callable[[], Awaitable[None]]:
    return lambda: transport.delete(key)


async def delete_bundle(transport: Transport, prefix: str) -> None:
    """Delete the manifest first (the bundle vanishes at once), then every file under it."""
    prefix = check_key(prefix)
    await transport.delete(join_key(prefix, MANIFEST))
    try:
        await _delete_files(transport, prefix)
    except TransportError as exc:  # leftovers are harmless without a manifest; retried later
        log.warning("could not delete all files of %s/%s: %s", transport.url, prefix, exc)


@dataclass(frozen=True, slots=True)
class BundleListing:
    """Children of a bundle root: which have a manifest and which are unfinished leftovers."""

    published: list[str]
    unpublished: list[str]


async def list_bundles(transport: Transport, root: str) -> BundleListing:
    """Name every child of ``root`` that holds objects, split by whether its manifest exists."""
    root = check_key(root, allow_empty=True)
    cut = len(root) + 1 if root else 0
    children: dict[str, bool] = {}
    async for info in transport.list(root):
        rest = info.key[cut:]
        child, _, tail = rest.partition("/")
        if not tail:
            continue
        children[child] = children.get(child, False) or tail == MANIFEST
    return BundleListing(
        published=sorted(c for c, ok in children.items() if ok),
        unpublished=sorted(c for c, ok in children.items() if not ok),
    )


class BundleStore:
    """Bundles under one prefix of a transport: what the adapter and checkpoint stores share.

    ``keep_last`` (if set) is how many bundles the store keeps after each publish; ``limits``
    caps what one download may take; a transport given as a URL is opened here.
    """

    default_prefix = ""

    default_limits = _DEFAULT_LIMITS

    def __init__(
        self,
        transport: Transport | str,
        *,
        prefix: str | None = None,
        keep_last: int | None = None,
        concurrency: int = 8,
        limits: FetchLimits | None = None,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ConfigError(f"keep_last must be >= 1 or None (keep all), got {keep_last}")
        self.transport = open_transport(transport) if isinstance(transport, str) else transport
        self.prefix = self.default_prefix if prefix is None else prefix
        self.keep_last = keep_last
        self.limits = self.default_limits if limits is None else limits
        self._concurrency = concurrency
