"""Trainer checkpoints on any transport, without torch.

The trainer writes its state files (adapter, optimizer, scheduler, RNG states, ...) into a local
directory itself; this store only moves directories and a JSON ``meta`` dict (step, adapter
version, data position, rollout-channel cursor, ...). Same manifest-last rule as adapters::

    checkpoints/step-<N:09d>/manifest.json         written last; checkpoint N exists iff present
    checkpoints/step-<N:09d>/files-<attempt>/...   the trainer's files

Zero-padded steps keep listings in order for humans; the code parses the number.

A resume takes the newest checkpoint that verifies (:meth:`CheckpointStore.load_latest_verified`):
one whose manifest is malformed, or whose files are missing or do not match it, is set aside
with one log line, and the previous one is loaded, rather than failing a run whose older state
is intact.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Literal

from asyncgrpo.errors import ConfigError, IntegrityError, NotFound
from asyncgrpo.store.bundle import (
    MANIFEST,
    BundleStore,
    FetchLimits,
    delete_bundle,
    download_bundle,
    list_bundles,
    publish_bundle,
    read_manifest,
)
from asyncgrpo.transport.base import join_key

__all__ = ["CheckpointStore"]

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"step-([0-9]{1,18})")  # fullmatch, ASCII digits: one spelling per step


class CheckpointStore(BundleStore):
    """Save, list, load and prune checkpoints under one prefix of a transport.

    ``keep_last`` (if set) prunes after every save.
    """

    default_prefix = "checkpoints"
    #: The trainer's own state can be large (optimizer moments): no cap on the total by default.
    default_limits = FetchLimits(max_total_bytes=None)

    def _key(self, step: int) -> str:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"checkpoint step must be an int >= 0, got {step!r}")
        return join_key(self.prefix, f"step-{step:09d}")

    async def save(
        self, step: int, local_dir: str | os.PathLike[str], meta: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Upload ``local_dir`` as checkpoint ``step``; return its manifest.

        ``meta`` must be JSON-serialisable. Saving a step twice raises
        :class:`~asyncgrpo.errors.AlreadyExists`.
        """
        fields = {"kind": "checkpoint", "step": step, "meta": dict(meta or {})}
        manifest = await publish_bundle(
            self.transport, self._key(step), local_dir, fields, concurrency=self._concurrency
        )
        if self.keep_last is not None:
            await self.prune(keep_last=self.keep_last)
        return manifest

    async def steps(self) -> list[int]:
        """Steps with a complete checkpoint, ascending."""
        listing = await list_bundles(self.transport, self.prefix)
        return sorted(_parse_steps(listing.published))

    async def latest_checkpoint(self) -> int | None:
        """The newest complete checkpoint's step, or ``None``."""
        steps = await self.steps()
        return steps[-1] if steps else None

    async def meta(self, step: int) -> dict[str, Any]:
        """The ``meta`` saved with ``step`` (no file download)."""
        manifest = await read_manifest(
            self.transport, self._key(step), max_bytes=self.limits.max_manifest_bytes
        )
        return _checked_meta(manifest, step, f"{self.transport.url}/{self._key(step)}")

    async def load(
        self, step: int | Literal["latest"] | None, dest_dir: str | os.PathLike[str]
    ) -> tuple[Path, dict[str, Any]]:
        """Download checkpoint ``step`` (or the latest) verified into ``dest_dir/step-<N>``.

        Returns the directory and the saved ``meta`` (with ``step`` added). Raises
        :class:`~asyncgrpo.errors.NotFound` if there is no such checkpoint.
        """
        if step is None or step == "latest":
            latest = await self.latest_checkpoint()
            if latest is None:
                raise NotFound(f"no checkpoint under {self.transport.url}/{self.prefix}")
            step = latest
        assert isinstance(step, int)
        key = self._key(step)
        try:
            manifest = await read_manifest(
                self.transport, key, max_bytes=self.limits.max_manifest_bytes
            )
        except NotFound:
            steps = await self.steps()
            raise NotFound(
                f"checkpoint step {step} not found under {self.transport.url}/{self.prefix} "
                f"(complete checkpoints: {', '.join(map(str, steps[-10:])) or 'none'})"
            ) from None
        meta = _checked_meta(manifest, step, f"{self.transport.url}/{key}")
        path, manifest = await download_bundle(
            self.transport,
            key,
            Path(dest_dir) / f"step-{step:09d}",
            manifest=manifest,
            concurrency=self._concurrency,
            limits=self.limits,
        )
        return path, {**meta, "step": step}

    async def load_latest_verified(
        self, dest_dir: str | os.PathLike[str]
    ) -> tuple[Path, dict[str, Any]] | None:
        """:meth:`load` of the newest checkpoint that verifies; ``None`` if there is none.

        A newer one that does not verify (malformed manifest, a file missing or not matching
        it) is logged in one line and set aside: its manifest is deleted, so the resumed run
        can save that step again (its files go when it does, or when pruned). Network and
        permission errors are raised, not fallen back on. :class:`IntegrityError` if no
        checkpoint verifies: starting from scratch is not this method's call.
        """
        rejected: list[tuple[int, Exception]] = []
        for step in reversed(await self.steps()):
            try:
                path, meta = await self.load(step, dest_dir)
            except (IntegrityError, NotFound) as exc:
                rejected.append((step, exc))
                continue
            if rejected:
                await self._set_aside(rejected, step)
            return path, meta
        if rejected:
            newest, exc = rejected[0]
            raise IntegrityError(
                f"no checkpoint under {self.transport.url}/{self.prefix} verifies (newest, step "
                f"{newest}: {exc}); delete the prefix to start over"
            )
        return None

    async def _set_aside(self, rejected: list[tuple[int, Exception]], resumed: int) -> None:
        for step, _ in rejected:
            await self.transport.delete(join_key(self._key(step), MANIFEST))
        newest, exc = rejected[0]
        others = f" (and {len(rejected) - 1} newer)" if len(rejected) > 1 else ""
        log.warning(
            "checkpoint step %d does not verify (%s)%s: set aside, resuming from step %d, the "
            "newest that does",
            newest,
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
            others,
            resumed,
        )

    async def delete(self, step: int) -> None:
        """Delete checkpoint ``step`` (its manifest first, so it stops existing at once)."""
        await delete_bundle(self.transport, self._key(step))

    async def prune(self, *, keep_last: int) -> list[int]:
        """Delete all but the newest ``keep_last`` checkpoints (and older unfinished uploads)."""
        if keep_last < 1:
            raise ConfigError(f"keep_last must be >= 1, got {keep_last}")
        listing = await list_bundles(self.transport, self.prefix)
        steps = sorted(_parse_steps(listing.published))
        doomed = steps[:-keep_last]
        for step in doomed:
            await self.delete(step)
        newest = steps[-1] if steps else -1
        for step in _parse_steps(listing.unpublished):
            if step < newest:
                await self.delete(step)
        if doomed:
            log.info("pruned checkpoints %s", doomed)
        return doomed


def _checked_meta(manifest: dict[str, Any], step: int, where: str) -> dict[str, Any]:
    """The ``meta`` of a checkpoint manifest, refused unless the manifest names ``step`` and its
    meta is a JSON object (a storage writer decides what a manifest holds)."""
    meta, named = manifest.get("meta"), manifest.get("step")
    if not isinstance(meta, dict) or isinstance(named, bool) or named != step:
        raise IntegrityError(f"{where}: malformed checkpoint manifest (step or meta)")
    return dict(meta)


def _parse_steps(children: list[str]) -> list[int]:
    return [int(m.group(1)) for c in children if (m := _STEP_RE.fullmatch(c))]
