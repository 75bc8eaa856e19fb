"""Reading generation bodies (asyncgrpo.proxy.intake): the pure reader, and the worker process
that reads large ones, which must answer exactly what the reader answers on the event loop."""

from __future__ import annotations

import json

import pytest

from asyncgrpo.proxy.intake import Intake, Offload, read_generation
from asyncgrpo.proxy.router import MAX_KEY_BLOCKS, request_hashes

pytestmark = pytest.mark.anyio


def test_the_reader_checks_the_model_and_bounds_the_routing_key() -> None:
    assert read_generation(b"[1]", 1024, 16).status == 400
    assert read_generation(b"{}" + b" " * 2000, 1024, 16).status == 413
    long = read_generation(json.dumps({"model": "m" * 257}).encode(), 1 << 20, 16)
    assert long.status == 400 and "256 characters" in long.message
    assert read_generation(json.dumps({"model": 3}).encode(), 1024, 16).status == 400
    body = {"model": "a-v1", "prompt": [[1, 2, 3]] * 4, "n": 2, "stream": True}
    got = read_generation(json.dumps(body).encode(), 1 << 20, 16)
    assert (got.status, got.model, got.stream, got.cost) == (0, "a-v1", True, 8)
    assert list(got.chains) == request_hashes(body, 16)
    assert read_generation(json.dumps(body).encode(), 1 << 20, None).chains == ()
    many = {"model": "m", "prompt": [[7]] * (3 * MAX_KEY_BLOCKS)}
    assert sum(map(len, request_hashes(many, 16))) <= MAX_KEY_BLOCKS
    one = {"model": "m", "prompt": list(range(40 * MAX_KEY_BLOCKS))}
    assert len(request_hashes(one, 16)[0]) == MAX_KEY_BLOCKS
    assert (
        request_hashes(one, 16)[0] == request_hashes({**one, "prompt": one["prompt"][:-1]}, 16)[0]
    )


def _timeless(intake: Intake) -> Intake:
    return intake._replace(hash_s=0.0)


async def test_the_worker_answers_what_the_loop_would_and_outlives_a_crash() -> None:
    bodies = [
        {"model": "a-v1", "prompt": [[1, 2, 3], [4, 5]], "n": 3},
        {"model": "b-v2", "messages": [{"role": "user", "content": "hi " * 300}]},
        {"model": "c", "prompt": "some text " * 100, "stream": True},
    ]
    offload = Offload()
    try:
        for body in bodies:
            raw = json.dumps(body).encode()
            want = read_generation(raw, 1 << 20, 16)
            pieces = [raw[i : i + 100] for i in range(0, len(raw), 100)]
            assert _timeless(await offload.read(pieces, 1 << 20, 16)) == _timeless(want)
        assert (await offload.read([b"[1, 2"], 1 << 20, 16)).status == 400
        proc = offload._proc
        assert proc is not None
        proc.kill()
        await proc.wait()
        assert (await offload.read([b"{}"], 1 << 20, 16)).status == 503  # the dead one
        assert _timeless(await offload.read([b"{}"], 1 << 20, 16)) == Intake(0, "")  # a new one
    finally:
        await offload.aclose()
