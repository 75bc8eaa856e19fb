"""JSON request bodies: one decoder with a size limit (413) and a depth limit (400)."""

from __future__ import annotations

import pytest

from asyncgrpo.proxy.jsonbody import MAX_DEPTH, BodyError, decode_object


def test_objects_decode_and_lenient_json_still_parses() -> None:
    assert decode_object(b'{"prompt": [1, 2], "x": "[[[["}', 100) == {"prompt": [1, 2], "x": "[[[["}
    # orjson refuses NaN and ints over 64 bits; they are JSON all the same
    assert decode_object(b'{"a": NaN, "b": 123456789012345678901234567890}', 100)["b"] > 2**64


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{" + b'"a":' * 10 + b"1}", 400, "not valid JSON"),
        (b"[1, 2]", 400, "must be a JSON object"),
        (b'{"a": "' + b"x" * 200 + b'"}', 413, "too large"),
        (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, f"deeper than {MAX_DEPTH}"),
        (b'{"a": ' + b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1) + b"}", 400, "deeper"),
        (b'{"a": ' + b"{" * 5000, 400, "deeper"),
    ],
)
def test_refusals_say_why(body: bytes, status: int, message: str) -> None:
    limit = 100 if status == 413 else 10_000_000
    with pytest.raises(BodyError, match=message) as info:
        decode_object(body, limit)
    assert info.value.status == status


def test_brackets_inside_strings_do_not_count_as_depth() -> None:
    batch = b"[" + b"[1]," * 300 + b"[1]]"  # many brackets, depth 2
    body = b'{"p": "' + b"[" * 5000 + b'", "batch": ' + batch + b"}"
    parsed = decode_object(body, 1 << 20)
    assert parsed["p"] == "[" * 5000 and len(parsed["batch"]) == 301
