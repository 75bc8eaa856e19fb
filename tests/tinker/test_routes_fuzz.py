"""Every route of the service, fed the SDK's own request types and malformed variants of them,
answers a status below 500 with one line, and the service keeps answering (a property test
beside the proxy's, tests/proxy/test_front_strict.py).

The routes are read from the app's router, so a route added later is fuzzed without a new
test: its body is the SDK type named like it (``create_model`` -> ``CreateModelRequest``) or,
for a name with no such type, random JSON.
"""

from __future__ import annotations

import json
import types as pytypes
import typing
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

#: Routes whose SDK type is not named after them.
_TYPES = {
    "asample": "SampleRequest",
    "retrieve_future": "FutureRetrieveRequest",
    "telemetry": "TelemetrySendRequest",
}


def _routes() -> list[tuple[str, str]]:
    """``(method, path template)`` of every route the service serves."""
    from asyncgrpo.config.tinker import TinkerConfig
    from asyncgrpo.tinker.app import build_app

    app = build_app(TinkerConfig(model="m"), service=None)  # type: ignore[arg-type]
    out = []
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter")
        if route.method != "HEAD" and path:
            out.append((route.method, path))
    return sorted(set(out))


ROUTES = _routes()


def _sdk_type(path: str) -> Any:
    from tinker import types

    name = path.rstrip("/").rsplit("/", 1)[-1]
    name = _TYPES.get(name, "".join(p.title() for p in name.split("_")) + "Request")
    return getattr(types, name, None)


_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=20),
)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _value(annotation: Any, depth: int = 0) -> st.SearchStrategy[Any]:
    """Values of ``annotation`` (a field of an SDK type), or now and then anything."""
    import pydantic

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _value(args[0], depth)
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin in (typing.Union, pytypes.UnionType):
        return st.one_of([_value(a, depth) for a in args])
    if origin in (list, typing.List):  # noqa: UP006
        return st.lists(_value(args[0] if args else Any, depth + 1), max_size=4)
    if origin in (dict, typing.Dict):  # noqa: UP006
        return st.dictionaries(
            st.text(max_size=8), _value(args[1] if args else Any, depth + 1), max_size=3
        )
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return _object(annotation, depth + 1) if depth < 4 else st.just({})
    simple = {
        str: st.text(max_size=24),
        int: st.integers(-5, 2**40),
        bool: st.booleans(),
        float: st.floats(-10, 10),
        type(None): st.none(),
    }
    return simple.get(annotation, _JSON)


def _object(model: Any, depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    fields = {name: _value(f.annotation, depth) for name, f in model.model_fields.items()}
    return st.fixed_dictionaries({}, optional=fields)


def _mutate(body: Any) -> st.SearchStrategy[bytes]:
    """``body`` as sent, or malformed: a field of the wrong type, nested deep, truncated,
    not UTF-8, not JSON at all."""
    sent = json.dumps(body).encode()
    wrong = st.builds(
        lambda k, v: json.dumps({**body, k: v}).encode(),
        st.sampled_from(sorted(body) or ["x"]),
        _JSON,
    )
    deep = st.integers(100, 5000).map(lambda n: b'{"x": ' + b"[" * n + b"]" * n + b"}")
    return st.one_of(
        st.just(sent),
        wrong,
        deep,
        st.integers(0, max(0, len(sent) - 1)).map(lambda n: sent[:n]),
        st.just(b"\xff\xfe" + sent),
        st.binary(max_size=64),
        _JSON.map(lambda v: json.dumps(v).encode()),
    )


@st.composite
def _requests(draw: st.DrawFn) -> tuple[str, str, bytes, str]:
    method, template = draw(st.sampled_from(ROUTES))
    path = template
    while "{" in path:
        head, _, rest = path.partition("{")
        path = (
            head + quote(draw(st.text(min_size=1, max_size=12)), safe="") + rest.partition("}")[2]
        )
    if method in ("GET", "DELETE") and draw(st.booleans()):
        path += "?limit=" + quote(draw(st.text(max_size=6)))
    if path.endswith("/forward_backward"):
        return method, path, draw(_fwdbwd()), "application/x-protobuf"
    model = _sdk_type(path)
    body = draw(_object(model)) if model is not None else draw(_JSON)
    raw = draw(_mutate(body if isinstance(body, dict) else {"x": body}))
    return method, path, raw, draw(st.sampled_from(["application/json", "text/plain"]))


@st.composite
def _fwdbwd(draw: st.DrawFn) -> bytes:
    from tinker.proto import tinker_public_pb2 as pb

    msg = pb.ForwardBackwardRequest(
        model_id=draw(st.sampled_from(["", "s-x_m0", "nobody"])),
        loss_fn=draw(st.sampled_from(["cross_entropy", "ppo", "x"])),
    )
    for _ in range(draw(st.integers(0, 4))):
        d = msg.data.add()
        n = draw(st.integers(0, 8))
        d.model_input.add().encoded_text.tokens = draw(st.binary(min_size=4 * n, max_size=4 * n))
        t = d.loss_fn_inputs[draw(st.sampled_from(["target_tokens", "weights", "x"]))]
        t.dtype = draw(st.sampled_from([pb.DTYPE_INT64, pb.DTYPE_FLOAT32, 99]))
        t.dense = draw(st.binary(max_size=64))
    raw = msg.SerializeToString()
    cut = draw(st.integers(0, len(raw)))
    return draw(st.sampled_from([raw, raw[:cut], raw + draw(st.binary(max_size=16))]))


@pytest.fixture(scope="module")
def http(served) -> Iterator[Any]:
    import httpx

    with httpx.Client(base_url=served.url, timeout=30) as client:
        yield client


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=_requests())
def test_every_route_answers_malformed_input_with_one_line_below_500(http, request) -> None:
    method, path, body, content_type = request
    r = http.request(method, path, content=body, headers={"Content-Type": content_type})
    assert r.status_code < 500, (method, path, body[:200], r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert "Traceback" not in r.text and len(r.text.strip().splitlines()) <= 1, r.text[:300]
    assert http.get("/api/v1/healthz").status_code == 200


def test_a_path_with_a_line_break_is_quoted_back_on_one_line(http) -> None:
    """Found by the fuzz test above: a refusal quoting its request path answered two lines when
    the path carried a record separator (``%1E``), which ``str.splitlines`` breaks at, as a
    client's or a log's reader may. Every refusal escapes what is not printable."""
    deep = b'{"x": ' + b"[" * 200 + b"]" * 200 + b"}"
    for sep in ("%1E", "%0A", "%E2%80%A8"):
        r = http.put(
            f"/api/v1/training_runs/0/checkpoints/0/{sep}/ttl",
            content=deep,
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code == 400 and len(r.text.strip().splitlines()) == 1, r.text[:300]
