"""Versioned LoRA adapters on any transport: publish once, fetch verified, prune old ones.

Key layout under the transport root (``prefix`` defaults to ``adapters``)::

    adapters/<name>/v<N>/manifest.json           written last; version N exists iff this exists
    adapters/<name>/v<N>/files-<attempt>/...     adapter_config.json, adapter_model.safetensors

``<name>`` is the run name; vLLM serves version N as ``<name>-v<N>`` (see
:attr:`AdapterVersion.adapter_name`). A name is never reused with other weights because vLLM
keys its prefix cache by adapter name. The manifest lists every file with size and sha256 plus
the version, base model, LoRA ``r``/``alpha``/target modules (from ``adapter_config.json``),
trainer step and publish time. Readers learn that a version is published from the manifest,
through the storage API, never by polling a mount (FUSE mounts cache misses for ~30 s).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from asyncgrpo.errors import AlreadyExists, ConfigError, IntegrityError, NotFound
from asyncgrpo.store.bundle import (
    LOCAL_MANIFEST,
    BundleStore,
    delete_bundle,
    download_bundle,
    list_bundles,
    publish_bundle,
    read_manifest,
)
from asyncgrpo.transport import Transport
from asyncgrpo.transport.base import join_key
from asyncgrpo.vllm.api import served_name

__all__ = [
    "AdapterStore",
    "AdapterVersion",
    "check_adapter_name",
    "describe_versions",
    "parse_version",
]

log = logging.getLogger(__name__)

# ASCII only and matched whole (``fullmatch``): ``$`` would accept a trailing newline and ``\d``
# other scripts' digits, so two spellings could name one version, or a key no listing finds.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_VERSION_RE = re.compile(r"v([0-9]{1,18})")  # at most 18 digits: int() refuses 4,300+


@dataclass(frozen=True, slots=True)
class AdapterVersion:
    """One published adapter version, as its manifest describes it."""

    name: str
    version: int
    step: int | None
    base_model: str | None
    lora_r: int | None
    lora_alpha: float | None
    target_modules: list[str] | None
    created_at: float
    files: list[dict[str, Any]]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def adapter_name(self) -> str:
        """The name vLLM serves this version under: ``<name>-v<N>``."""
        return served_name(self.name, self.version)

    @property
    def size_bytes(self) -> int:
        return sum(int(f["size"]) for f in self.files)

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> AdapterVersion:
        """The version a manifest describes; :class:`IntegrityError` if it lacks a field or
        holds one of the wrong type (a storage writer decides what a manifest holds)."""
        try:
            return cls._from_manifest(manifest)
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise IntegrityError(
                f"malformed adapter manifest ({type(exc).__name__}: {exc})"[:300]
            ) from None

    @classmethod
    def _from_manifest(cls, manifest: dict[str, Any]) -> AdapterVersion:
        lora = manifest.get("lora") or {}
        if not isinstance(manifest["name"], str) or not isinstance(manifest["files"], list):
            raise TypeError("name or files")
        return cls(
            name=manifest["name"],
            version=int(manifest["version"]),
            step=manifest.get("step"),
            base_model=manifest.get("base_model"),
            lora_r=lora.get("r"),
            lora_alpha=lora.get("alpha"),
            target_modules=lora.get("target_modules"),
            created_at=float(manifest["created_at"]),
            files=list(manifest["files"]),
            meta=dict(manifest.get("meta") or {}),
        )


def check_adapter_name(name: object) -> str:
    """``name`` if it is a valid adapter name, else :class:`ConfigError` saying what is."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ConfigError(
            f"adapter name {name!r} must be 1-128 characters of letters, digits, '.', '_' or '-' "
            "starting with a letter or digit (it becomes a storage key and a vLLM model name)"
        )
    return name


def describe_versions(versions: list[int]) -> str:
    """Versions with their runs of three or more as ranges: ``0-93, 95, 96, 98-103`` (every
    one counted, none cut), ``none`` if empty."""
    runs: list[list[int]] = []
    for v in sorted(set(versions)):
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    shown = [f"{a}-{b}" if b - a >= 2 else ", ".join(map(str, range(a, b + 1))) for a, b in runs]
    return ", ".join(shown) or "none"


def parse_version(segment: str) -> int | None:
    """The N of a ``v<N>`` key segment (ASCII digits only), else None."""
    match = _VERSION_RE.fullmatch(segment)
    return int(match.group(1)) if match else None


def _check_version(version: int) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ConfigError(f"adapter version must be an int >= 0, got {version!r}")
    return version


def _lora_fields(local_dir: Path) -> tuple[dict[str, Any], str | None]:
    config_path = local_dir / "adapter_config.json"
    if not config_path.is_file():
        return {}, None
    config = json.loads(config_path.read_text())
    targets = config.get("target_modules")
    if isinstance(targets, str):  # peft allows a regex or "all-linear"
        targets = [targets]
    lora = {"r": config.get("r"), "alpha": config.get("lora_alpha"), "target_modules": targets}
    return lora, config.get("base_model_name_or_path")


class AdapterStore(BundleStore):
    """Publish, list, fetch and prune adapter versions on one transport.

    ``keep_last`` (if set) prunes after every publish, keeping the newest ``keep_last`` versions
    of that name plus any in ``pinned``.
    """

    default_prefix = "adapters"

    def __init__(self, transport: Transport | str, **options: Any) -> None:
        super().__init__(transport, **options)  # prefix, keep_last, concurrency, limits
        self.pinned: set[tuple[str, int]] = set()

    def _key(self, name: str, version: int | None = None) -> str:
        name = check_adapter_name(name)
        if version is None:
            return join_key(self.prefix, name)
        return join_key(self.prefix, name, f"v{_check_version(version)}")

    async def publish(
        self,
        name: str,
        version: int,
        local_dir: str | os.PathLike[str],
        *,
        step: int | None = None,
        base_model: str | None = None,
        **meta: Any,
    ) -> AdapterVersion:
        """Upload ``local_dir`` as ``name`` version ``version``; manifest written last.

        Raises :class:`~asyncgrpo.errors.AlreadyExists` if that version exists (also when another
        publisher wins a race for it) and ``NotFound`` if ``local_dir`` is missing or empty.
        """
        key = self._key(name, version)
        local_dir = Path(local_dir)
        lora, config_base = _lora_fields(local_dir) if local_dir.is_dir() else ({}, None)
        fields = {
            "kind": "adapter",
            "name": name,
            "version": version,
            "step": step,
            "base_model": base_model or config_base,
            "lora": lora,
            "meta": meta,
        }
        manifest = await publish_bundle(
            self.transport, key, local_dir, fields, concurrency=self._concurrency
        )
        published = AdapterVersion.from_manifest(manifest)
        if self.keep_last is not None:
            await self.prune(name, keep_last=self.keep_last)
        return published

    async def versions(self, name: str) -> list[int]:
        """Published versions of ``name``, ascending."""
        listing = await list_bundles(self.transport, self._key(name))
        return sorted(_parse_versions(listing.published))

    async def latest(self, name: str) -> int | None:
        """The newest published version of ``name``, or ``None`` if there is none."""
        versions = await self.versions(name)
        return versions[-1] if versions else None

    async def info(self, name: str, version: int) -> AdapterVersion:
        """The manifest of one version; :class:`NotFound` naming the versions that exist."""
        try:
            return AdapterVersion.from_manifest(
                await read_manifest(
                    self.transport,
                    self._key(name, version),
                    max_bytes=self.limits.max_manifest_bytes,
                )
            )
        except NotFound:
            raise await self._missing(name, version) from None

    async def fetch(
        self, name: str, version: int, cache_dir: str | os.PathLike[str], *, reuse: bool = True
    ) -> Path:
        """Return a local directory holding the verified files of ``name`` version ``version``.

        The directory is ``<cache_dir>/<name>-v<N>``; it appears atomically and only after every
        sha256 matched, so concurrent fetchers (threads or processes) are safe and a tampered
        file raises :class:`~asyncgrpo.errors.IntegrityError` without leaving a usable copy.
        A version beyond the store's :class:`~asyncgrpo.store.bundle.FetchLimits` is refused
        the same way. ``reuse=False``: fetch again even if the directory exists (for a cache
        that other processes could have written).
        """
        key = self._key(name, version)
        dest = Path(cache_dir) / served_name(name, version)
        try:
            path, _ = await download_bundle(
                self.transport,
                key,
                dest,
                concurrency=self._concurrency,
                limits=self.limits,
                reuse=reuse,
            )
        except NotFound:
            if await self.transport.exists(join_key(key, "manifest.json")):
                raise  # a file vanished under a published manifest (pruned meanwhile?)
            raise await self._missing(name, version) from None
        return path

    async def export(self, name: str, version: int, dest: str | os.PathLike[str]) -> Path:
        """Write ``name`` version ``version`` to ``dest`` as a plain PEFT directory (loadable by
        ``PeftModel.from_pretrained`` and ``vllm serve --lora-modules``): the verified files and
        nothing of asyncgrpo's. ``dest`` must not exist, or be an empty directory; it appears
        whole or not at all (fetched beside it, then renamed)."""
        dest = Path(dest)
        if dest.is_symlink() or (dest.exists() and (not dest.is_dir() or any(dest.iterdir()))):
            raise AlreadyExists(f"{dest} exists and is not an empty directory")
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(
            await anyio.to_thread.run_sync(
                lambda: tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent)
            )
        )
        try:
            fetched = await self.fetch(name, version, staging)
            (fetched / LOCAL_MANIFEST).unlink(missing_ok=True)
            await anyio.to_thread.run_sync(_replace_empty, fetched, dest)
        finally:
            await anyio.to_thread.run_sync(lambda: shutil.rmtree(staging, ignore_errors=True))
        return dest

    async def _missing(self, name: str, version: int) -> NotFound:
        shown = describe_versions(await self.versions(name))
        return NotFound(
            f"adapter {name} version {version} is not published at {self.transport.url}/"
            f"{self._key(name)} (published versions: {shown})"
        )

    def pin(self, name: str, version: int) -> None:
        """Keep this version whatever ``keep_last`` says."""
        self.pinned.add((check_adapter_name(name), _check_version(version)))

    def unpin(self, name: str, version: int) -> None:
        self.pinned.discard((name, version))

    async def delete(self, name: str, version: int) -> None:
        """Delete version ``version`` of ``name`` (its manifest first: gone at once)."""
        await delete_bundle(self.transport, self._key(name, version))

    async def prune(
        self, name: str, *, keep_last: int, pinned: set[int] | None = None
    ) -> list[int]:
        """Delete all but the newest ``keep_last`` versions and the pinned ones; return deleted.

        Unpublished leftovers (a publisher killed mid-upload) older than the newest published
        version are removed too; newer ones may be uploads in progress and are left alone.
        """
        if keep_last < 1:
            raise ConfigError(f"keep_last must be >= 1, got {keep_last}")
        keep_pinned = {v for (n, v) in self.pinned if n == name} | set(pinned or ())
        listing = await list_bundles(self.transport, self._key(name))
        published = sorted(_parse_versions(listing.published))
        keep = set(published[-keep_last:]) | keep_pinned
        doomed = [v for v in published if v not in keep]
        for version in doomed:
            await self.delete(name, version)
        newest = published[-1] if published else -1
        for version in _parse_versions(listing.unpublished):
            if version < newest:
                await self.delete(name, version)
        if doomed:
            log.info("pruned %s versions %s", name, doomed)
        return doomed


def _parse_versions(children: list[str]) -> list[int]:
    return [v for child in children if (v := parse_version(child)) is not None]


def _replace_empty(src: Path, dest: Path) -> None:
    """Rename ``src`` to ``dest``, which is absent or an empty directory."""
    if dest.is_dir():
        dest.rmdir()  # empty: checked by the caller; rmdir refuses otherwise
    src.rename(dest)
