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

from asyncgrpo.errors import AlreadyExists, ConfigError, IntegrityError, NotFound, TransportError
from asyncgrpo.transport.base import Transport, check_key, join_key
from asyncgrpo.transport.registry import open_transport

__all__ = [
    "LOCAL_MANIFEST",
    "MANIFEST",
    "BundleListing",
    "BundleStore",
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
        raise group.exceptions[0] from None


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
        manifest = {
            "format": FORMAT,
            **fields,
            "files_prefix": attempt,
            "files": entries,
            "created_at": time.time(),
        }
        await transport.put(manifest_key, json.dumps(manifest, indent=1).encode(), mode="create")
    except BaseException as exc:
        with anyio.CancelScope(shield=True):
            await _delete_files(transport, join_key(prefix, attempt))
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


async def read_manifest(transport: Transport, prefix: str) -> dict[str, Any]:
    """Return the manifest of the bundle at ``prefix``; :class:`NotFound` if unpublished."""
    key = join_key(check_key(prefix), MANIFEST)
    raw = await transport.get(key)
    try:
        manifest = json.loads(raw)
    except ValueError as exc:
        raise IntegrityError(f"{transport.url}/{key} is not valid JSON") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise IntegrityError(f"{transport.url}/{key} is not an {FORMAT} manifest")
    return manifest


async def download_bundle(
    transport: Transport,
    prefix: str,
    dest: str | os.PathLike[str],
    *,
    manifest: dict[str, Any] | None = None,
    concurrency: int = 8,
) -> tuple[Path, dict[str, Any]]:
    """Make ``dest`` a verified copy of the bundle; return it and the manifest.

    If ``dest`` already exists it was produced by this function (it only ever appears by rename
    after verification) and is returned as is. Raises :class:`IntegrityError` on a size or
    sha256 mismatch, leaving nothing at ``dest``.
    """
    dest = Path(dest)
    if (dest / LOCAL_MANIFEST).is_file():
        cached = json.loads((dest / LOCAL_MANIFEST).read_text())
        return dest, cached
    if manifest is None:
        manifest = await read_manifest(transport, prefix)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        files_prefix = join_key(prefix, manifest["files_prefix"])

        def fetch(entry: dict[str, Any]) -> Callable[[], Awaitable[None]]:
            async def job() -> None:
                rel = check_key(entry["path"])
                target = tmp.joinpath(*rel.split("/"))
                await transport.get_file(join_key(files_prefix, rel), target)
                size, sha = await anyio.to_thread.run_sync(_hash_file, target)
                if size != entry["size"] or sha != entry["sha256"]:
                    raise IntegrityError(
                        f"{transport.url}/{files_prefix}/{rel}: got {size} bytes "
                        f"sha256 {sha[:12]}, "
                        f"manifest says {entry['size']} bytes sha256 {entry['sha256'][:12]}"
                    )

            return job

        await _gather([fetch(e) for e in manifest["files"]], concurrency)
        (tmp / LOCAL_MANIFEST).write_text(json.dumps(manifest, indent=1))
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / LOCAL_MANIFEST).is_file():
                raise
            log.debug("%s appeared concurrently; using it", dest)
    finally:
        if tmp.exists():
            await anyio.to_thread.run_sync(shutil.rmtree, tmp, True)
    return dest, manifest


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

    ``keep_last`` (if set) is how many bundles the store keeps after each publish; a transport
    given as a URL is opened here.
    """

    default_prefix = ""

    def __init__(
        self,
        transport: Transport | str,
        *,
        prefix: str | None = None,
        keep_last: int | None = None,
        concurrency: int = 8,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ConfigError(f"keep_last must be >= 1 or None (keep all), got {keep_last}")
        self.transport = open_transport(transport) if isinstance(transport, str) else transport
        self.prefix = self.default_prefix if prefix is None else prefix
        self.keep_last = keep_last
        self._concurrency = concurrency
