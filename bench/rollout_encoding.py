"""Rollout batch encodings side by side: size and encode/decode time.

Compares asyncgrpo's binary ``AGRB`` layout with JSONL (and both compressed with zlib) on a
GRPO-shaped batch. Run: ``python bench/rollout_encoding.py [--samples 64] [--prompt 256]
[--completion 1024] [--rounds 20]``. The JSONL codec lives here, not in the package: it is the
measured alternative, which nothing at run time reads or writes.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import zlib
from collections.abc import Sequence
from dataclasses import fields

from asyncgrpo.sample import Sample
from asyncgrpo.store.codec import FORMAT_VERSION, check_format, decode_batch, encode_batch

# ---- defaults -------------------------------------------------------------------------------
SAMPLES, PROMPT, COMPLETION, ROUNDS = 64, 256, 1024, 20


def encode_jsonl(samples: Sequence[Sample]) -> bytes:
    """One JSON object per sample, each tagged with the format version (``"format"``)."""
    names = [f.name for f in fields(Sample)]
    rows = ({"format": FORMAT_VERSION, **{n: getattr(s, n) for n in names}} for s in samples)
    return b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in rows)


def decode_jsonl(data: bytes) -> list[Sample]:
    """Inverse of :func:`encode_jsonl`."""
    out = []
    for i, line in enumerate(data.splitlines()):
        if line:
            row = json.loads(line)
            check_format(row.pop("format", 1), f"JSONL row {i}")
            out.append(Sample(**row))
    return out


def make_batch(n: int, n_prompt: int, n_completion: int) -> list[Sample]:
    import array

    rng = random.Random(0)
    out = []
    for i in range(n):
        lps = array.array("f", (-abs(rng.gauss(0, 2)) for _ in range(n_completion))).tolist()
        out.append(
            Sample(
                prompt_ids=[rng.randrange(151_000) for _ in range(n_prompt)],
                completion_ids=[rng.randrange(151_000) for _ in range(n_completion)],
                logprobs=lps,
                reward=float(i % 2),
                advantage=rng.gauss(0, 1),
                version=3,
                group_id=f"g{i // 8}",
                rewards={"math": float(i % 2)},
                finish_reason="stop",
            )
        )
    return out


def timed(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--samples", type=int, default=SAMPLES)
    ap.add_argument("--prompt", type=int, default=PROMPT)
    ap.add_argument("--completion", type=int, default=COMPLETION)
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    args = ap.parse_args()
    batch = make_batch(args.samples, args.prompt, args.completion)
    variants = {
        "agrb (binary)": (encode_batch, decode_batch),
        "jsonl": (encode_jsonl, decode_jsonl),
        "agrb + zlib-1": (
            lambda b: zlib.compress(encode_batch(b), 1),
            lambda d: decode_batch(zlib.decompress(d)),
        ),
        "jsonl + zlib-1": (
            lambda b: zlib.compress(encode_jsonl(b), 1),
            lambda d: decode_jsonl(zlib.decompress(d)),
        ),
    }
    tokens = args.samples * (args.prompt + args.completion)
    print(f"batch: {args.samples} samples x ({args.prompt} prompt + {args.completion} completion)")
    print(f"{'encoding':<16} {'size MB':>9} {'B/token':>8} {'encode ms':>10} {'decode ms':>10}")
    for name, (enc, dec) in variants.items():
        data = enc(batch)
        assert dec(data) == batch, name  # every variant must round-trip exactly
        enc_ms = timed(lambda enc=enc: enc(batch), args.rounds)
        dec_ms = timed(lambda dec=dec, data=data: dec(data), args.rounds)
        print(
            f"{name:<16} {len(data) / 1e6:>9.2f} {len(data) / tokens:>8.2f} "
            f"{enc_ms:>10.1f} {dec_ms:>10.1f}"
        )


if __name__ == "__main__":
    main()
