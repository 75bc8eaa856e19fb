"""Rollout batches between machines through a transport: ordered, each batch exactly once.

Used when the rollout client runs on another machine than the trainer. Layout under ``prefix``::

    rollouts/batches/<seq:012d>.agrb    one batch of samples (asyncgrpo.store.codec), create-only
    rollouts/cursors/<consumer>.json    {"next": seq}: the first batch not yet committed

**Producers** write batch ``seq`` with a create-only put; if another producer took that number
the put fails with ``AlreadyExists`` and the producer tries the next one, so concurrent producers
never clobber each other and sequence numbers have no holes (a put is atomic, so a crashed
producer leaves either a whole batch or nothing). A fresh producer starts after the batches
``0..n-1`` it lists: batches are never deleted (compaction leaves tombstones), so they are what
the channel has ever held; a number past a gap was planted, and no cursor file moves a producer.

**Exactly once across a lost answer.** A create can land and still report ``AlreadyExists``:
its answer was lost and the transport's retry found the object (object stores say so). So an
``AlreadyExists`` is checked by reading the batch back: our bytes there mean our write landed
(done, no second copy under the next number); other bytes mean another producer took the
number (try the next); nothing there means the conflict wrote nothing (write the same number
again, or the consumer would wait at the gap forever). Two producers writing byte-identical
batches (the same samples, token for token and logprob for logprob) count as one.

**Consumers** read ``seq`` in order. :meth:`RolloutChannel.receive` returns the next batch and,
on the following call, commits the previous one (writes the cursor), like Kafka's auto-commit:
a consumer that crashes while working on batch ``k`` gets ``k`` again after restart, and never
anything it committed. For the trainer, store :attr:`~RolloutChannel.position` in the checkpoint
meta and :meth:`~RolloutChannel.seek` to it on restore, so the channel and the weights agree.
With ``compact=True`` a committed batch is overwritten by an empty tombstone (not deleted, so a
lagging producer's create on that number still fails and nothing is lost). A cursor file is
checked before it is used (:func:`parse_cursor`: a non-negative integer, at most the number of
batches the channel has held); one that is not raises an :class:`IntegrityError` naming the
file, rather than reading from batch 1e9 or from 0 again.

A batch that does not decode (a buggy or hostile writer), or decodes to samples the consumer's
model cannot train on (``check``: a token id past its vocabulary, an empty prompt or
completion, a sample longer than its context; :class:`~asyncgrpo.sample.SampleBounds`), is
**quarantined**: copied to ``rollouts/quarantine/<seq>.agrb`` for inspection, replaced by a
tombstone, counted (:attr:`RolloutChannel.quarantined`) and logged, and the consumer moves on.
Leaving it in place would stop the trainer at the same batch on every resume. A batch object
larger than ``max_batch_bytes`` is not read at all (its size is checked first: reading several
GB would fail for want of memory at every attempt): it is skipped, counted and logged, and left
where it is, byte for byte; producers refuse to write one. A batch of another **format version**
is not malformed but written by another asyncgrpo release: the consumer stops there with a
``ConfigError`` naming both versions (quarantining would skip every batch of a fleet that runs
mixed releases), and the batch stays for a reader of its version.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from asyncgrpo.config.bounded_json import JSONRefused, loads
from asyncgrpo.errors import AlreadyExists, ConfigError, IntegrityError, NotFound, TransportError
from asyncgrpo.sample import Sample
from asyncgrpo.store.codec import decode_batch, encode_batch
from asyncgrpo.transport import Transport, open_transport
from asyncgrpo.transport.base import join_key

__all__ = ["Batch", "RolloutChannel", "parse_cursor"]

log = logging.getLogger(__name__)

_BATCH_NAME = re.compile(r"([0-9]{1,18})\.agrb")  # fullmatch; ASCII digits only
#: A cursor is ~50 bytes; a larger one was not written by a consumer.
MAX_CURSOR_BYTES = 4096
#: Largest batch object a consumer reads (a producer writes one group of samples per batch:
#: 64 samples of 128k tokens are 110 MB); a larger one is skipped unread.
MAX_BATCH_BYTES = 1024**3
#: Times a create may report ``AlreadyExists`` with nothing readable at its key before append
#: gives up (something that is not a batch sits there: a directory, a link).
_EMPTY_CONFLICTS = 3


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_cursor(raw: bytes) -> int:
    """The ``next`` of a cursor file's bytes; ``ValueError`` saying what is wrong unless they
    are a JSON object whose ``next`` is an integer >= 0 (not 1e9, null, true or a string)."""
    try:
        doc = loads(raw, MAX_CURSOR_BYTES)
    except JSONRefused as exc:  # too large, nested too deep, not JSON
        raise ValueError(f"not a cursor ({exc})") from None
    if not isinstance(doc, dict) or "next" not in doc:
        raise ValueError('not a {"next": <batch number>} object')
    if not _is_count(doc["next"]):
        raise ValueError(f"next={str(doc['next'])[:40]} is not an integer >= 0")
    return doc["next"]


# ---- channel ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Batch:
    """One batch as the consumer receives it."""

    seq: int
    samples: list[Sample]


class RolloutChannel:
    """Producer and consumer ends of one ordered stream of sample batches.

    One instance can do both; each consumer name has its own cursor.
    """

    def __init__(
        self,
        transport: Transport | str,
        *,
        prefix: str = "rollouts",
        consumer: str = "trainer",
        poll_interval_s: float = 0.2,
        compact: bool = False,
        check: Callable[[Sequence[Sample]], None] | None = None,
        max_batch_bytes: int = MAX_BATCH_BYTES,
    ) -> None:
        """``check``: raises ``ValueError`` for a batch the consumer cannot use (the trainer's
        :meth:`~asyncgrpo.sample.SampleBounds.check`); such a batch is quarantined."""
        if poll_interval_s <= 0:
            raise ConfigError(f"poll_interval_s must be > 0, got {poll_interval_s}")
        if not consumer or "/" in consumer:
            raise ConfigError(f"consumer name {consumer!r} must be non-empty without '/'")
        self.transport = open_transport(transport) if isinstance(transport, str) else transport
        self.prefix = prefix
        self.consumer = consumer
        self.poll_interval_s = poll_interval_s
        self.compact = compact
        self.check = check
        self.max_batch_bytes = max_batch_bytes
        self._next_write: int | None = None
        self._cursor: int | None = None  # next seq to hand out
        self._pending: int | None = None  # handed out, not yet committed
        self.quarantined = 0
        """Batches this consumer found malformed and moved aside (see the module docstring)."""

    def _batch_key(self, seq: int) -> str:
        return join_key(self.prefix, "batches", f"{seq:012d}.agrb")

    def _cursor_key(self, consumer: str) -> str:
        return join_key(self.prefix, "cursors", f"{consumer}.json")

    def _quarantine_key(self, seq: int) -> str:
        return join_key(self.prefix, "quarantine", f"{seq:012d}.agrb")

    # ---- producer -----------------------------------------------------------------------------
    async def _held(self) -> int:
        """How many sequence numbers the channel has held: ``n`` when batches ``0..n-1`` are
        listed. Producers leave no holes, so a number past a gap was not written by one (a
        planted ``999999999999999999.agrb``): it is ignored, and does not move a producer."""
        held: set[int] = set()
        async for info in self.transport.list(join_key(self.prefix, "batches")):
            name = info.key.rsplit("/", 1)[-1]
            match = _BATCH_NAME.fullmatch(name)
            if match and name == f"{int(match.group(1)):012d}.agrb":  # one spelling per number
                held.add(int(match.group(1)))
        count = 0
        while count in held:
            count += 1
        if len(held) > count:
            log.warning(
                "%s/%s: %d batch numbers past the gap at %d ignored (no producer leaves gaps)",
                self.transport.url,
                self.prefix,
                len(held) - count,
                count,
            )
        return count

    async def append(self, samples: Sequence[Sample]) -> int:
        """Write one batch; return its sequence number (see the module docstring: exactly once
        also when a create's answer is lost)."""
        data = encode_batch(samples)
        if len(data) > self.max_batch_bytes:
            raise ConfigError(
                f"a rollout batch of {len(samples)} samples is {len(data)} bytes, more than "
                f"consumers read ({self.max_batch_bytes}): ship fewer samples per batch"
            )
        if self._next_write is None:
            self._next_write = await self._held()
        empty_conflicts = 0
        while True:
            seq = self._next_write
            key = self._batch_key(seq)
            try:
                await self.transport.put(key, data, mode="create")
            except AlreadyExists:
                landed = await self._landed(key, data)
                if landed is None:
                    empty_conflicts += 1
                    if empty_conflicts >= _EMPTY_CONFLICTS:
                        raise TransportError(
                            f"{self.transport.url}/{key} reports existing but reads as no "
                            "object; something other than a batch is there: remove it"
                        ) from None
                    continue  # the conflict wrote nothing: the same number again, no gap
                self._next_write = seq + 1
                if not landed:
                    continue  # another producer's batch
                log.info("rollout batch %d: our create landed, though it reported a conflict", seq)
            else:
                self._next_write = seq + 1
            log.debug(
                "appended rollout batch %d (%d samples, %d bytes)", seq, len(samples), len(data)
            )
            return seq

    async def _landed(self, key: str, data: bytes) -> bool | None:
        """After a create reported ``AlreadyExists``: whether ``key`` holds ``data`` (our write
        landed), other bytes (False), or nothing (None). Reads no more than ``data``'s size."""
        try:
            there = await self.transport.get(key, max_bytes=len(data))
        except NotFound:
            return None
        except IntegrityError:  # larger than ours
            return False
        return there == data

    # ---- consumer -----------------------------------------------------------------------------
    @property
    def position(self) -> int | None:
        """The first sequence number not yet committed (None before the first receive/seek)."""
        if self._pending is not None:
            return self._pending
        return self._cursor

    async def _load_cursor(self) -> int:
        key = self._cursor_key(self.consumer)
        try:
            raw = await self.transport.get(key, max_bytes=MAX_CURSOR_BYTES)
        except NotFound:
            return 0
        except IntegrityError:
            raw = None
        try:
            if raw is None:
                raise ValueError(f"larger than {MAX_CURSOR_BYTES} bytes")
            seq = parse_cursor(raw)
            if seq > 0 and seq > (held := await self._held()):
                raise ValueError(f"next={seq} is past the {held} batches the channel has held")
        except ValueError as exc:
            raise IntegrityError(
                f"consumer cursor {self.transport.url}/{key} is unusable ({exc}); it was not "
                "written by a consumer: delete it to read from batch 0, or seek() to a "
                "checkpoint's position"
            ) from None
        return seq

    async def seek(self, seq: int) -> None:
        """Move this consumer's cursor (persisted), e.g. to a position saved in a checkpoint:
        an integer from 0 to the number of batches the channel has held."""
        if not _is_count(seq):
            raise ConfigError(f"seek position must be an integer >= 0, got {seq!r}")
        if seq > 0 and seq > (held := await self._held()):
            raise ConfigError(
                f"seek position {seq} is past the {held} batches {self.transport.url}/"
                f"{self.prefix} has held: the position is from another channel"
            )
        self._pending = None
        await self._store_cursor(seq)

    async def _store_cursor(self, seq: int) -> None:
        body = json.dumps({"next": seq, "updated_at": time.time()}).encode()
        await self.transport.put(self._cursor_key(self.consumer), body)
        self._cursor = seq

    async def commit(self) -> None:
        """Persist that the last received batch is done; a no-op if nothing is pending."""
        if self._pending is None:
            return
        done = self._pending
        await self._store_cursor(done + 1)
        self._pending = None
        if self.compact:
            await self.transport.put(self._batch_key(done), b"")  # tombstone, see module doc

    async def receive(self, *, timeout_s: float | None = None) -> Batch:
        """Commit the previous batch, then wait for and return the next one.

        Raises ``TimeoutError`` if nothing arrives within ``timeout_s``.
        """
        await self.commit()
        if self._cursor is None:
            self._cursor = await self._load_cursor()
        with anyio.fail_after(timeout_s):
            while True:
                seq = self._cursor
                try:
                    data = await self.transport.get(
                        self._batch_key(seq), max_bytes=self.max_batch_bytes
                    )
                except NotFound:
                    await anyio.sleep(self.poll_interval_s)
                    continue
                except IntegrityError as exc:  # too large to read: its size was checked first
                    self.quarantined += 1
                    log.error(
                        "rollout batch %d is not read (%s): skipped and left in place (%d "
                        "quarantined)",
                        seq,
                        exc,
                        self.quarantined,
                    )
                    self._cursor = seq + 1
                    continue
                if not data:  # compacted by another consumer group sharing this stream
                    log.warning(
                        "rollout batch %d was compacted before %s read it", seq, self.consumer
                    )
                    self._cursor = seq + 1
                    continue
                try:
                    samples = decode_batch(data)
                    if self.check is not None:
                        self.check(samples)
                except ConfigError:  # another release's format: the batch is sound, stop
                    raise
                except (IntegrityError, ValueError) as exc:
                    await self._quarantine(seq, data, exc)
                    self._cursor = seq + 1
                    continue
                self._pending = seq
                self._cursor = seq + 1
                return Batch(seq=seq, samples=samples)

    async def _quarantine(self, seq: int, data: bytes, error: Exception) -> None:
        """Move a batch that does not decode, or fails ``check``, aside (kept for inspection)
        and leave a tombstone, so no consumer stops on it again and no producer reuses its
        number."""
        await self.transport.put(self._quarantine_key(seq), data)
        await self.transport.put(self._batch_key(seq), b"")
        self.quarantined += 1
        log.error(
            "rollout batch %d is unusable (%s): moved to %s/%s and skipped (%d quarantined)",
            seq,
            error,
            self.transport.url,
            self._quarantine_key(seq),
            self.quarantined,
        )

    async def __aiter__(self) -> AsyncIterator[Batch]:
        while True:
            yield await self.receive()
