"""The one bounded JSON decoder (request bodies, documents from storage): size and depth are
refused before anything is parsed; up to the limits it is plain JSON."""

from __future__ import annotations

import pytest

from asyncgrpo.config.bounded_json import MAX_DEPTH, JSONRefused, loads, loads_object
from asyncgrpo.errors import IntegrityError
from asyncgrpo.store.documents import field, parse_document


def test_the_bounded_decoder_refuses_size_and_depth_before_parsing() -> None:
    with pytest.raises(JSONRefused, match="too large") as info:
        loads(b"[1]" * 10, 20)
    assert info.value.too_large
    deep = b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1)
    with pytest.raises(JSONRefused, match=f"deeper than {MAX_DEPTH}"):
        loads(deep, 1 << 20)
    at_the_limit = loads(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH, 1 << 20)
    for _ in range(MAX_DEPTH - 1):
        (at_the_limit,) = at_the_limit
    assert at_the_limit == []


def test_a_document_is_an_object_and_its_fields_are_typed() -> None:
    with pytest.raises(JSONRefused, match="must be a JSON object"):
        loads_object(b"[]", 100)
    doc = parse_document(b'{"n": 3, "s": "x", "b": true, "big": 1000000000000000000}', "d.json")
    assert field(doc, "n", int, "d.json") == 3 and field(doc, "s", str, "d.json") == "x"
    for name, kind in (("b", int), ("big", int), ("missing", str), ("n", str)):
        with pytest.raises(IntegrityError, match=rf"d\.json: {name} is not a valid"):
            field(doc, name, kind, "d.json")
    with pytest.raises(IntegrityError, match=r"d\.json is unusable: the document nests deeper"):
        parse_document(b"[" * 1000, "d.json")
