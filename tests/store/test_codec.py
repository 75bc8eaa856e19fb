"""The AGRB batch encoding: exact round trips, malformed bytes refused as IntegrityError,
other format versions as ConfigError."""

from __future__ import annotations

import json
import math
import struct

import pytest

from asyncgrpo.errors import ConfigError, IntegrityError
from asyncgrpo.store.codec import decode_batch, encode_batch
from asyncgrpo.testing.samples import sample


def test_binary_encoding_roundtrips_exactly() -> None:
    batch = [
        sample(
            "a",
            temperature=0.7,
            rewards={"math": 1.0, "fmt": 0.5},
            finish_reason="stop",
            replica="http://127.0.0.1:8001",
            sample_id="3f2a9c01-17-4",
        ),
        sample("b", n=0, reward=-2.0, finish_reason=None),
        sample("c", n=3000, version=0),
    ]
    assert decode_batch(encode_batch(batch)) == batch
    assert decode_batch(encode_batch([])) == []
    nan = decode_batch(encode_batch([sample("n", reward=float("nan"))]))[0]
    assert math.isnan(nan.reward) and not nan.reward_ok


@pytest.mark.parametrize(
    "junk", [b"", b"XXXX\x01\x00\x00\x00\x00", encode_batch([sample("a")])[:-3]]
)
def test_malformed_batch_is_integrity_error(junk: bytes) -> None:
    with pytest.raises(IntegrityError):
        decode_batch(junk)


def test_multi_turn_fields_roundtrip_and_old_formats_are_refused() -> None:
    multi = sample(
        "m", n=4, version=2, completion_mask=[True, False, False, True], versions=[2, 2, 2, 3]
    )
    batch = [sample("a"), multi, sample("b", n=2, completion_mask=[True, True])]
    assert decode_batch(encode_batch(batch)) == batch
    # A batch from a release before masks (format 1): refused with what to do, not misread.
    head = json.dumps(
        [
            {
                "reward": 1.0,
                "advantage": 0.0,
                "version": 0,
                "group_id": "x",
                "temperature": 1.0,
                "rewards": {},
                "finish_reason": None,
                "np": 1,
                "nc": 1,
            }
        ]
    ).encode()
    old = struct.pack("<4sBI", b"AGRB", 1, len(head)) + head + b"\0" * 12
    with pytest.raises(
        ConfigError, match=r"format v1, this asyncgrpo reads v2 and v3.*same release"
    ):
        decode_batch(old)
    newer = bytearray(encode_batch(batch))
    newer[4] = 4
    with pytest.raises(ConfigError, match="format v4"):
        decode_batch(bytes(newer))


def test_format_2_batches_are_still_read_and_ids_are_checked() -> None:
    """v2 (before sample ids) differs from v3 only by the optional ``i``: still read."""
    v2 = bytearray(encode_batch([sample("a"), sample("b", n=2)]))
    v2[4] = 2
    assert [s.sample_id for s in decode_batch(bytes(v2))] == [None, None]
    for bad_id in ("", 7, "x" * 129):
        head = json.dumps(
            [
                {
                    "reward": 1.0,
                    "advantage": 0.0,
                    "version": 0,
                    "group_id": "x",
                    "temperature": 1.0,
                    "rewards": {},
                    "finish_reason": None,
                    "np": 1,
                    "nc": 1,
                    "i": bad_id,
                }
            ]
        ).encode()
        data = struct.pack("<4sBI", b"AGRB", 3, len(head)) + head + b"\0" * 12
        with pytest.raises(IntegrityError, match="its id"):
            decode_batch(data)


def test_a_negative_token_id_is_refused() -> None:
    """It decodes as bytes, then fails the trainer's embedding lookup at every resume."""
    bad = sample("neg")
    bad.prompt_ids[1] = -7
    with pytest.raises(IntegrityError, match="token id is negative"):
        decode_batch(encode_batch([bad]))
