"""Datum provenance: which sampled sequence each position of a training datum came from, and
the sampler's record of those sequences.

A ``sample`` with ``record_stability_info`` records, for each sequence it returns, its prompt,
its sampled tokens and the sampler's logprob of each (under the ``sequence_id`` the SDK hands
back). A training ``Datum`` names them with provenance spans tiling its ``target_tokens``
(``PromptProvenanceSpan``: positions of a request's prompt; ``SampledProvenanceSpan``:
positions of a sequence's sampled tokens). Every loss accepts spans; they mark the sampled
positions (the ones the policy is trained on). ``stable_reinforce`` also reads the record: its
sampler logprobs are the recorded ones, not the datum's. Every span is checked against the
record it names (its tokens must be the datum's), but for the prompt spans of
``target_tokens``: tinker-cookbook's ``rl_loop`` pads those targets with 0 (they carry no
loss), so they are not compared. Records are kept per session, for a day after their last
use, within a bound on the tokens held (oldest first out). Pure: no I/O; the caller passes
the clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

__all__ = [
    "ProvenanceError",
    "Recorded",
    "Span",
    "StabilityRecords",
    "check_tiling",
    "sampled_mask",
]

#: How long a record may be trained on after its last use (Tinker's: a day).
RECORD_TTL_S = 24 * 3600.0
#: The most tokens (prompts counted once per request, samples once each) records hold.
RECORD_TOKENS = 16_000_000


class ProvenanceError(ValueError):
    """A datum's provenance that does not tile it, or names what was not recorded."""


@dataclass(frozen=True)
class Span:
    """``length`` consecutive positions, from ``offset`` on, of sequence ``sequence_id``'s
    request prompt (``prompt``) or sampled tokens (``sampled``)."""

    kind: Literal["prompt", "sampled"]
    sequence_id: str
    offset: int
    length: int


@dataclass
class Recorded:
    """One sampled sequence as the sampler produced it."""

    session_id: str
    prompt: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    used: float
    size: int = field(default=0)


def check_tiling(spans: Sequence[Span], length: int, what: str, index: int) -> None:
    """Refuse spans whose lengths do not sum to the ``length`` positions they tile."""
    total = sum(s.length for s in spans)
    if total != length or any(s.length < 0 or s.offset < 0 for s in spans):
        raise ProvenanceError(
            f"datum {index}: its {what} provenance spans cover {total} positions but it has "
            f"{length}: the spans must tile it exactly (Datum.with_provenance checks this)"
        )


def sampled_mask(spans: Sequence[Span]) -> np.ndarray:
    """1.0 on the positions the spans say were sampled, 0.0 on prompt positions."""
    return np.concatenate(
        [np.full(s.length, 1.0 if s.kind == "sampled" else 0.0, np.float32) for s in spans]
        or [np.zeros(0, np.float32)]
    )


class StabilityRecords:
    """The sequences sampled with ``record_stability_info``, by ``sequence_id``."""

    def __init__(self, *, ttl_s: float = RECORD_TTL_S, max_tokens: int = RECORD_TOKENS) -> None:
        self.ttl_s = ttl_s
        self.max_tokens = max_tokens
        self._records: OrderedDict[str, Recorded] = OrderedDict()
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._records)

    def record(
        self,
        session_id: str,
        prompt: np.ndarray,
        samples: Sequence[tuple[str, np.ndarray, np.ndarray]],
        now: float,
    ) -> None:
        """Record the ``(sequence_id, tokens, logprobs)`` sampled from ``prompt``; the prompt
        array is shared by them, so it counts once."""
        for i, (sequence_id, tokens, logprobs) in enumerate(samples):
            size = len(tokens) + (len(prompt) if i == 0 else 0)
            self._records[sequence_id] = Recorded(session_id, prompt, tokens, logprobs, now, size)
            self._records.move_to_end(sequence_id)
            self._tokens += size
        self._trim(now)

    def drop_session(self, session_id: str) -> None:
        """Forget the records of a session that ended."""
        for sequence_id in [k for k, r in self._records.items() if r.session_id == session_id]:
            self._tokens -= self._records.pop(sequence_id).size

    def _trim(self, now: float) -> None:
        while self._records:
            oldest_id, oldest = next(iter(self._records.items()))
            if self._tokens <= self.max_tokens and now - oldest.used <= self.ttl_s:
                break
            self._tokens -= oldest.size
            del self._records[oldest_id]

    def _get(self, sequence_id: str, session_id: str, index: int, now: float) -> Recorded:
        found = self._records.get(sequence_id)
        if found is None or now - found.used > self.ttl_s:
            raise ProvenanceError(
                f"datum {index} names sequence {sequence_id!r}, which this service has no record "
                "of: sample it with record_stability_info=True (save_weights_and_get_sampling_"
                "client(record_stability_info=True)) in this session and train on it within a "
                "day; records of ended sessions, of a restarted service, and the oldest past "
                f"{self.max_tokens} tokens are gone"
            )
        if found.session_id != session_id:
            raise ProvenanceError(
                f"datum {index} names sequence {sequence_id!r}, sampled in another session: "
                "provenance works within one session (sample and train in the same "
                "ServiceClient)"
            )
        return found

    def resolve(
        self,
        spans: Sequence[Span],
        targets: np.ndarray,
        session_id: str,
        index: int,
        now: float,
        *,
        check_prompt: bool = True,
        what: str = "target_tokens",
    ) -> np.ndarray:
        """The sampler's recorded logprob of every position the spans tile (0 on prompt
        positions), after checking each span's tokens are the datum's (a prompt span's only
        with ``check_prompt``); each record used is kept for another day."""
        check_tiling(spans, len(targets), what, index)
        out = np.zeros(len(targets), np.float32)
        at = 0
        for span in spans:
            rec = self._get(span.sequence_id, session_id, index, now)
            source = rec.tokens if span.kind == "sampled" else rec.prompt
            end = span.offset + span.length
            if end > len(source):
                raise ProvenanceError(
                    f"datum {index}: a {span.kind} span names positions {span.offset} to "
                    f"{end - 1} of sequence {span.sequence_id!r}, whose {span.kind} tokens are "
                    f"{len(source)}"
                )
            mine = targets[at : at + span.length]
            theirs = source[span.offset : end]
            checked = check_prompt or span.kind == "sampled"
            if checked and not np.array_equal(mine, theirs):
                bad = int(np.flatnonzero(mine != theirs)[0])
                raise ProvenanceError(
                    f"datum {index}: {what}[{at + bad}] is {int(mine[bad])} but its span "
                    f"says it is {span.kind} token {span.offset + bad} of sequence "
                    f"{span.sequence_id!r}, which is {int(theirs[bad])}"
                )
            if span.kind == "sampled":
                out[at : at + span.length] = rec.logprobs[span.offset : end]
            rec.used = now
            self._records.move_to_end(span.sequence_id)
            at += span.length
        return out
