"""The sample ledgers: which samples a rollout process shipped, and which the trainer trained or
dropped, by sample id (:attr:`~asyncgrpo.sample.Sample.sample_id`), one JSON line per event in
each role's run directory::

    shipped.jsonl   a rollout process, per batch once its append landed:
                    {"event": "shipped", "seq": N, "life": L, "time": t, "ids": [...]}
    samples.jsonl   the trainer, per optimizer step, and per adapter version it published:
                    {"event": "trained", "step": N, "life": L, "time": t, "version": V,
                     "trained": [...], "dropped_stale": [[id, version], ...]}
                    {"event": "published", "version": V, "name": P, "step": N, "life": L,
                     "time": t, "files": {path: sha256}}

``life`` names the process that wrote the line (random per start): a trainer resumed from the
checkpoint of step 10 trains steps 11, 12, ... again, and its lines of those steps replace the
dead life's, whose weights were lost with it (:func:`lineage`). So "no sample trained twice,
none lost" is a property of these records and the channel, checked without the processes
(:mod:`asyncgrpo.testing.invariants`).

A line that cannot be written (a full disk) is kept and written before the next one: a record
is late, never missing.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncgrpo.sample import Sample
from asyncgrpo.store.metrics_file import append_whole

if TYPE_CHECKING:
    from asyncgrpo.store.adapters import AdapterVersion

__all__ = ["SHIPPED_FILE", "TRAINED_FILE", "Ledger", "lineage", "read_ledger"]

logger = logging.getLogger(__name__)

SHIPPED_FILE = "shipped.jsonl"
TRAINED_FILE = "samples.jsonl"


class Ledger:
    """Appends JSON lines to ``path``; ``life`` names this process in every line."""

    def __init__(self, path: str | Path, *, enabled: bool = True) -> None:
        self.path = Path(path)
        self.life = secrets.token_hex(4)
        self.enabled = enabled
        self._unwritten: list[str] = []

    def shipped(self, seq: int, samples: Sequence[Sample]) -> None:
        """Batch ``seq`` of the rollout channel holds ``samples`` (its append landed)."""
        self._write({"event": "shipped", "seq": seq, "ids": _ids(samples)})

    def trained(
        self, step: int, version: int, samples: Sequence[Sample], dropped: Sequence[Sample]
    ) -> None:
        """Optimizer step ``step`` (at adapter ``version``) trained ``samples``; ``dropped``
        were taken on the way and dropped as staler than ``trainer.max_staleness`` (each with
        the version that sampled it: how stale, and so why)."""
        stale = [[s.sample_id, s.version] for s in dropped]
        self._write(
            {
                "event": "trained",
                "step": step,
                "version": version,
                "trained": _ids(samples),
                "dropped_stale": stale,
            }
        )

    def published(self, version: AdapterVersion | None) -> None:
        """This process published ``version`` (its manifest landed): its files' checksums, so
        the store can be checked against what was published, and no number used twice."""
        if version is None:
            return
        files = {str(f["path"]): str(f["sha256"]) for f in version.files}
        self._write(
            {
                "event": "published",
                "version": version.version,
                "name": version.name,
                "step": version.step,
                "files": files,
            }
        )

    def _write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._unwritten.append(
            json.dumps({**record, "life": self.life, "time": round(time.time(), 3)})
        )
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            append_whole(self.path, "".join(f"{line}\n" for line in self._unwritten))
        except OSError as exc:
            logger.warning(
                "%s: %d lines kept for the next write: %s", self.path, len(self._unwritten), exc
            )
            return
        self._unwritten.clear()


def _ids(samples: Iterable[Sample]) -> list[str | None]:
    return [s.sample_id for s in samples]


def read_ledger(path: str | Path) -> list[dict[str, Any]]:
    """The lines of a ledger, in the order written; a torn last line (a crash mid-write) is
    skipped, any other line that does not parse raises ``ValueError`` naming it."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    out = []
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if n == len(lines) - 1:
                continue
            raise ValueError(f"{path}: line {n + 1} is not JSON") from None
    return out


def lineage(
    records: Iterable[dict[str, Any]], *, event: str | None = "trained"
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The ``trained`` lines of a trainer ledger that the final weights descend from, in step
    order, and those that were rolled back (written by a life that died after them: the next
    life resumed from an earlier checkpoint and trained those steps again).

    A line for step N after lines of steps >= N means the writer of those lines died and its
    successor resumed at N - 1 or before: they are rolled back. ``event=None``: every record
    has a ``step`` (the rows of a ``metrics.jsonl``, which a resumed trainer appends too)."""
    kept: list[dict[str, Any]] = []
    rolled_back: list[dict[str, Any]] = []
    for record in records:
        if event is not None and record.get("event") != event:
            continue
        step = record["step"]
        while kept and kept[-1]["step"] >= step:
            rolled_back.append(kept.pop())
        kept.append(record)
    return kept, rolled_back
