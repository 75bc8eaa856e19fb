"""The rollout channel's batch encoding: ``AGRB``, a JSON header then packed arrays.

Layout (format version 3: sample ids; 2 added per-token versions and policy masks of multi-turn
episodes, and is still read)::

    b"AGRB" | format (u8) | header length (u32 LE) | header JSON
    | int32 token ids | float32 logprobs | int32 per-token versions | uint8 policy masks

The header holds one row of scalar fields and lengths per sample. Binary rather than JSON
because token ids and logprobs dominate a batch (docs/benchmarks.md has the sizes and times,
with the command that measures them). Logprobs are float32, exact for what vLLM returns.

:func:`decode_batch` reads bytes anyone with write access to the storage may have written, so
every way it can fail, ``RecursionError`` and ``MemoryError`` included, is one
:class:`~asyncgrpo.errors.IntegrityError` the channel quarantines on; a batch of another format
version is a :class:`~asyncgrpo.errors.ConfigError` instead (the fleet runs mixed releases).
"""

from __future__ import annotations

import array
import json
import math
import struct
import sys
from collections.abc import Sequence
from typing import Any

from asyncgrpo.errors import ConfigError, IntegrityError
from asyncgrpo.sample import Sample

__all__ = ["FORMAT_VERSION", "MAGIC", "READABLE", "check_format", "decode_batch", "encode_batch"]

MAGIC = b"AGRB"
#: 2: per-token versions and policy masks (multi-turn episodes); 3: sample ids (``"i"``). A
#: reader of v2 would quarantine a v3 row for its unknown key, so v3 is a new number: an older
#: trainer refuses the batch naming both releases instead of skipping it.
FORMAT_VERSION = 3
#: The versions this release reads (v2 batches simply have no sample ids).
READABLE = frozenset({2, 3})
#: Longest sample id (characters): ids are recorded per trained sample.
MAX_SAMPLE_ID = 128
_HEAD = struct.Struct("<4sBI")  # magic, format version, header JSON length
_SCALARS = ("reward", "advantage", "version", "group_id", "temperature", "rewards", "finish_reason")
_LITTLE = sys.byteorder == "little"


def _le(arr: array.array) -> bytes:
    if not _LITTLE:
        arr.byteswap()
    return arr.tobytes()


def encode_batch(samples: Sequence[Sample]) -> bytes:
    """Samples -> ``AGRB`` bytes: header JSON (scalars, lengths), int32 tokens, float32
    logprobs, then int32 per-token versions and uint8 policy masks of the samples that have
    them (multi-turn episodes)."""
    header: list[dict[str, Any]] = []
    tokens = array.array("i")
    logprobs = array.array("f")
    versions = array.array("i")
    masks = bytearray()
    for s in samples:
        row = {k: getattr(s, k) for k in _SCALARS}
        row["np"], row["nc"] = len(s.prompt_ids), len(s.completion_ids)
        if s.versions is not None:
            row["v"] = 1
            versions.extend(s.versions)
        if s.replica is not None:
            row["r"] = s.replica
        if s.sample_id is not None:
            row["i"] = s.sample_id
        if s.completion_mask is not None:
            row["m"] = 1
            masks.extend(map(bool, s.completion_mask))
        header.append(row)
        tokens.extend(s.prompt_ids)
        tokens.extend(s.completion_ids)
        logprobs.extend(s.logprobs)
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"".join(
        [
            _HEAD.pack(MAGIC, FORMAT_VERSION, len(head)),
            head,
            _le(tokens),
            _le(logprobs),
            _le(versions),
            bytes(masks),
        ]
    )


def check_format(fmt: Any, where: str) -> None:
    """Refuse a batch written by another release: its samples would be misread. A
    :class:`ConfigError`, not an :class:`IntegrityError`: the batch is sound, the fleet is not."""
    if fmt not in READABLE:
        raise ConfigError(
            f"{where} is rollout format v{fmt}, this asyncgrpo reads "
            f"v{' and v'.join(map(str, sorted(READABLE)))}: the "
            "rollout processes and the trainer run different asyncgrpo releases; install the "
            "same release on both"
        )


def decode_batch(data: bytes) -> list[Sample]:
    """Inverse of :func:`encode_batch`; :class:`IntegrityError` on anything malformed.

    Every failure but a foreign format version is caught here, whatever its type: a header
    nested 100,000 deep raises ``RecursionError`` in the JSON parser, a huge one
    ``MemoryError``, and a decoder that let either through would stop the consumer on the
    same batch at every resume instead of quarantining it.
    """
    try:
        return _decode(data)
    except ConfigError:
        raise
    except Exception as exc:  # RecursionError and MemoryError are Exceptions too
        detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise IntegrityError(f"cannot decode rollout batch: {detail}") from exc


def _decode(data: bytes) -> list[Sample]:
    magic, fmt, head_len = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"not an AGRB batch (magic {magic!r})")
    check_format(fmt, "the batch")
    offset = _HEAD.size
    header = json.loads(data[offset : offset + head_len])
    offset += head_len
    _check_header(header)
    n_tok = sum(r["np"] + r["nc"] for r in header)
    n_lp = sum(r["nc"] for r in header)
    n_ver = sum(r["nc"] for r in header if r.get("v"))
    n_mask = sum(r["nc"] for r in header if r.get("m"))
    if len(data) != offset + 4 * (n_tok + n_lp + n_ver) + n_mask:
        raise ValueError(f"size {len(data)} does not match header ({n_tok} tokens, {n_lp} lp)")
    arrays = []
    for code, count in (("i", n_tok), ("f", n_lp), ("i", n_ver)):
        arr = array.array(code)
        arr.frombytes(data[offset : offset + 4 * count])
        if not _LITTLE:
            arr.byteswap()
        arrays.append(arr)
        offset += 4 * count
    tokens, logprobs, versions = arrays
    if tokens and min(tokens) < 0:  # an embedding lookup would raise at every resume
        raise ValueError("a token id is negative")
    masks = data[offset:]
    samples, t, lp, v, m = [], 0, 0, 0, 0
    for row in header:
        n_p, n_c = row.pop("np"), row.pop("nc")
        extra: dict[str, Any] = {}
        if row.pop("v", 0):
            extra["versions"] = versions[v : v + n_c].tolist()
            v += n_c
        if "r" in row:
            extra["replica"] = row.pop("r")
        if "i" in row:
            extra["sample_id"] = row.pop("i")
        if row.pop("m", 0):
            extra["completion_mask"] = [bool(b) for b in masks[m : m + n_c]]
            m += n_c
        samples.append(
            Sample(
                prompt_ids=tokens[t : t + n_p].tolist(),
                completion_ids=tokens[t + n_p : t + n_p + n_c].tolist(),
                logprobs=logprobs[lp : lp + n_c].tolist(),
                **row,
                **extra,
            )
        )
        t += n_p + n_c
        lp += n_c
    return samples


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


_ROW_CHECKS: dict[str, tuple[str, Any]] = {
    "np": ("a count", _is_count),
    "nc": ("a count", _is_count),
    "reward": ("a number", _is_number),
    "advantage": ("a finite number", lambda v: _is_number(v) and math.isfinite(v)),
    "version": ("a version", _is_count),
    "group_id": ("a string", lambda v: isinstance(v, str)),
    "temperature": ("a number > 0", lambda v: _is_number(v) and v > 0),
    "rewards": (
        "a mapping of numbers",
        lambda v: isinstance(v, dict) and all(_is_number(x) for x in v.values()),
    ),
    "finish_reason": ("a string or null", lambda v: v is None or isinstance(v, str)),
}


#: Present (= 1) when the sample carries per-token versions ("v") / a policy mask ("m").
_ROW_FLAGS = frozenset({"v", "m"})
#: Present when known: the replica that served the sample ("r", a string), its id ("i").
_ROW_OPTIONAL = frozenset({"r", "i"})
_ROW_KEYS = _ROW_FLAGS | _ROW_OPTIONAL | set(_ROW_CHECKS)


def _check_header(header: Any) -> None:
    """Each row holds exactly the fields a :class:`Sample` needs, each of the right type, so a
    batch that decodes cannot crash the trainer later (a string version, a NaN advantage)."""
    if not isinstance(header, list):
        raise ValueError("the header is not a list of samples")
    for i, row in enumerate(header):
        if not isinstance(row, dict) or not set(_ROW_CHECKS) <= set(row) <= _ROW_KEYS:
            raise ValueError(f"sample {i}: expected the fields {sorted(_ROW_CHECKS)}")
        for key, (what, ok) in _ROW_CHECKS.items():
            if not ok(row[key]):
                raise ValueError(f"sample {i}: {key} is not {what}")
        for key in _ROW_FLAGS.intersection(row):
            if row[key] != 1:
                raise ValueError(f"sample {i}: {key} is not 1")
        if "r" in row and not isinstance(row["r"], str):
            raise ValueError(f"sample {i}: r (its replica) is not a string")
        if "i" in row and not (isinstance(row["i"], str) and 0 < len(row["i"]) <= MAX_SAMPLE_ID):
            raise ValueError(f"sample {i}: i (its id) is not a string of 1-{MAX_SAMPLE_ID} chars")
