"""JSON request bodies: one decoder with a size limit (413) and a depth limit (400)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncgrpo.config.bounded_json import MAX_DEPTH, too_deep
from asyncgrpo.proxy.http.jsonbody import BodyError, decode_object


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


def _reference_depth(body: bytes) -> int:
    """Nesting depth by a plain state machine over every byte (strings and escapes tracked)."""
    depth = deepest = 0
    in_string = escaped = False
    for c in body:
        if in_string:
            if escaped:
                escaped = False
            elif c == ord("\\"):
                escaped = True
            elif c == ord('"'):
                in_string = False
        elif c == ord('"'):
            in_string = True
        elif c in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in b"]}":
            depth -= 1
    return deepest


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.sampled_from([b"[", b"]", b"{", b"}", b'"', b"\\", b"\\\\", b'\\"', b"a", b","]),
        max_size=60,
    ),
    st.integers(0, 8),
)
def test_depth_matches_a_byte_by_byte_scan(parts: list[bytes], limit: int) -> None:
    body = b"".join(parts)
    assert too_deep(body, limit) == (_reference_depth(body) > limit)


def test_depth_check_is_linear_in_the_body() -> None:
    """Escaped quotes in an unterminated string made the old regex backtrack (quadratic): a
    64 KiB body cost 11 s. One pass costs about the same per byte at any size."""
    import time

    def cost(n: int) -> float:
        body = b'{"prompt": "' + b"[" * 200 + b'\\"' * n
        t0 = time.perf_counter()
        too_deep(body)
        return time.perf_counter() - t0

    small, large = min(cost(50_000) for _ in range(3)), min(cost(800_000) for _ in range(3))
    assert large / max(small, 1e-6) < 16 * 4  # 16x the bytes: ~16x the time, not 256x
