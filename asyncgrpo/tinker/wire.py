"""The tinker SDK's wire format, translated to and from plain values at the edge.

JSON bodies are the SDK's own pydantic request and response types (``tinker.types``);
``forward_backward`` requests and ``ForwardBackwardOutput`` results travel as the SDK's
protobuf messages (``tinker.proto.tinker_public_pb2``). Reading the SDK's own schema, not a
copy of it, keeps this server on the exact format the pinned SDK version sends. Everything the
rest of the service sees is a :class:`WireDatum` or a :class:`FwdBwdResult`: numpy arrays, no
SDK type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from asyncgrpo.tinker.provenance import Span

__all__ = [
    "FwdBwdRequest",
    "FwdBwdResult",
    "SampleResult",
    "SampledSeq",
    "TargetLogprobs",
    "TopK",
    "WireDatum",
    "WireError",
    "decode_fwdbwd",
    "encode_fwdbwd",
    "encode_sample",
    "fwdbwd_json",
    "fwdbwd_shape",
    "parse_fwdbwd",
    "read_fwdbwd",
]

PROTO_CONTENT_TYPE = "application/x-protobuf"

_DTYPES = {
    pb.DTYPE_FLOAT32: np.dtype(np.float32),
    pb.DTYPE_INT64: np.dtype(np.int64),
    pb.DTYPE_INT32: np.dtype(np.int32),
}


class WireError(ValueError):
    """A request body the service cannot read; the message says what to send instead."""


@dataclass(frozen=True)
class WireDatum:
    """One ``Datum``: its input tokens and its ``loss_fn_inputs``, each a 1-D or N-D array;
    its provenance spans (tiling ``model_input`` and ``target_tokens``) when it has them, and
    ``trained``: 1.0 on the positions the policy term trains (None: those with a nonzero
    advantage)."""

    tokens: np.ndarray
    inputs: dict[str, np.ndarray]
    input_spans: tuple[Span, ...] | None = None
    target_spans: tuple[Span, ...] | None = None
    trained: np.ndarray | None = None


@dataclass(frozen=True)
class FwdBwdRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float]
    forward_only: bool
    data: list[WireDatum]


@dataclass
class FwdBwdResult:
    """Per datum the named float arrays (``logprobs``, ``elementwise_loss``), and metrics."""

    outputs: list[dict[str, np.ndarray]]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TopK:
    """The k most likely tokens at each of n positions, best first: ``(n, k)`` ids and
    logprobs, empty cells 0 and -99999.0 (the SDK's ``TopkLogprobs``)."""

    token_ids: np.ndarray
    logprobs: np.ndarray


@dataclass(frozen=True)
class TargetLogprobs:
    """A ``target_prompt_logprobs`` answer: float32 values of the asked tensor's shape, with
    its CSR indices when it was sparse."""

    values: np.ndarray
    shape: tuple[int, int]
    crow: np.ndarray | None = None
    col: np.ndarray | None = None


@dataclass(frozen=True)
class SampledSeq:
    tokens: np.ndarray
    logprobs: np.ndarray
    stop_reason: str
    topk: TopK | None = None


@dataclass(frozen=True)
class SampleResult:
    """A ``SampleResponse``: the samples, and the prompt's logprobs when asked (NaN at 0)."""

    sequences: list[SampledSeq]
    prompt_logprobs: np.ndarray | None = None
    topk_prompt: TopK | None = None
    target: TargetLogprobs | None = None


def _tensor(msg: pb.Tensor, where: str) -> np.ndarray:
    if msg.HasField("sparse_csr"):
        raise WireError(
            f"{where} is a sparse tensor: send one value per input token (a 1-D dense tensor)"
        )
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise WireError(f"{where} has dtype {pb.DType.Name(msg.dtype)}: send float32 or int64")
    if len(msg.dense) % dtype.itemsize:
        raise WireError(f"{where}: {len(msg.dense)} bytes is not a whole number of values")
    arr = np.frombuffer(msg.dense, dtype=dtype).copy()
    shape = list(msg.shape) or [arr.size]
    if int(np.prod(shape)) != arr.size:
        raise WireError(f"{where}: shape {shape} does not hold its {arr.size} values")
    return arr.reshape(shape)


def _tokens(chunks: Any, index: int, max_tokens: int | None) -> np.ndarray:
    parts = []
    for chunk in chunks:
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise WireError(
                f"datum {index}: only token chunks (EncodedTextChunk) are served "
                "here; images and audio are not"
            )
        parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
    size = sum(p.size for p in parts)
    if not size:  # a datum of no tokens trains nothing and cost a Python pass of its own
        raise WireError(f"datum {index} has no tokens: give model_input at least one token")
    if max_tokens is not None and size > max_tokens:
        raise WireError(
            f"datum {index} has {size} tokens, more than this service's "
            f"max_context_length {max_tokens}"
        )
    return np.concatenate(parts).astype(np.int64)


#: Most fields of one ``Datum`` on the wire (token chunks, loss inputs, provenance spans).
MAX_DATUM_PARTS = 4096
#: Most ``Datum`` fields of all datums of one request, together.
MAX_REQUEST_PARTS = 65536


def _fields(buf: memoryview, limit: int, what: str) -> list[tuple[int, memoryview]]:
    """The top-level fields of a protobuf message as ``(number, value)`` (a length-delimited
    value as its bytes, any other as an empty view); WireError past ``limit`` fields or on a
    malformed one. Why not protobuf's parser alone: it materialises every element of a
    repeated field before anything can count them, about a hundred bytes each, so 2.8 MB of
    empty datums grew the service by 470 MB before the request could be refused; this walk
    stops at the limit and holds only views of the body."""
    out, pos, end = [], 0, len(buf)
    while pos < end:
        if len(out) >= limit:
            raise WireError(f"{what} has more than {limit} fields: send fewer per request")
        key, pos = _varint(buf, pos)
        number, kind = key >> 3, key & 7
        if kind == 0:
            _, pos = _varint(buf, pos)
            value = buf[0:0]
        elif kind == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos : pos + size], pos + size
        elif kind in (1, 5):
            value, pos = buf[0:0], pos + (8 if kind == 1 else 4)
        else:
            raise WireError(f"{what} is not a protobuf message (wire type {kind})")
        if pos > end:
            raise WireError(f"{what} is truncated")
        out.append((number, value))
    return out


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    for i in range(pos, min(pos + 10, len(buf))):
        value |= (buf[i] & 0x7F) << shift
        if buf[i] < 0x80:
            return value, i + 1
        shift += 7
    raise WireError("the body is not a protobuf message (a malformed varint)")


def fwdbwd_shape(body: bytes, *, max_datums: int) -> tuple[str, int]:
    """The ``model_id`` and number of datums of a ``forward_backward`` body, read without
    parsing it; WireError for more than ``max_datums`` datums or more parts (token chunks,
    loss inputs, spans) than :data:`MAX_DATUM_PARTS` per datum and :data:`MAX_REQUEST_PARTS`
    in all. Bounds what :func:`parse_fwdbwd` then allocates."""
    view = memoryview(body)
    model_id, datums, parts = b"", 0, 0
    for number, value in _fields(view, max_datums + 256, f"the body (max_datums {max_datums})"):
        if number == 1:
            model_id = bytes(value)
        elif number == 3:
            if datums >= max_datums:
                raise WireError(
                    f"forward_backward has more than {max_datums} datums, this "
                    "service's max_datums: send fewer per request"
                )
            n = len(_fields(value, MAX_DATUM_PARTS, f"datum {datums}"))
            parts += n
            if parts > MAX_REQUEST_PARTS:
                raise WireError(
                    f"forward_backward's datums have more than {MAX_REQUEST_PARTS} "
                    "parts (token chunks, inputs, spans) in all: send fewer"
                )
            datums += 1
    try:
        return model_id.decode(), datums
    except UnicodeDecodeError:
        raise WireError("model_id is not UTF-8") from None


def parse_fwdbwd(body: bytes) -> Any:
    """The SDK's protobuf ``ForwardBackwardRequest`` of a ``forward_backward`` body, parsed
    (in C) but not yet read: its ``model_id`` and number of datums can be checked before the
    costlier :func:`read_fwdbwd`."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # protobuf's DecodeError; the message is what matters
        raise WireError(f"the body is not a ForwardBackwardRequest protobuf: {exc}") from None
    return msg


def decode_fwdbwd(
    body: bytes, *, max_datums: int | None = None, max_tokens: int | None = None
) -> FwdBwdRequest:
    """Read a ``forward_backward`` body (the SDK's protobuf ``ForwardBackwardRequest``)."""
    return read_fwdbwd(parse_fwdbwd(body), max_datums=max_datums, max_tokens=max_tokens)


def read_fwdbwd(
    msg: Any, *, max_datums: int | None = None, max_tokens: int | None = None
) -> FwdBwdRequest:
    """A parsed request (:func:`parse_fwdbwd`) as plain arrays; WireError for more than
    ``max_datums`` datums, a datum of no tokens or of more than ``max_tokens``."""
    if max_datums is not None and len(msg.data) > max_datums:
        raise WireError(
            f"forward_backward got {len(msg.data)} datums, more than this "
            f"service's max_datums {max_datums}: send fewer per request"
        )
    config: dict[str, float] = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text":
            raise WireError(f"loss_fn_config[{key!r}]={value.text!r}: give a number")
        config[key] = value.number
    data = []
    for i, datum in enumerate(msg.data):
        inputs = {
            k: _tensor(v, f"datum {i} loss_fn_inputs[{k!r}]")
            for k, v in datum.loss_fn_inputs.items()
        }
        input_spans, target_spans = (
            _spans(datum.model_input_spans),
            _spans(datum.loss_fn_input_spans),
        )
        if (input_spans is None) != (target_spans is None):
            raise WireError(
                f"datum {i}: provenance comes as a pair: give both model_input and "
                "loss_fn_inputs spans (Datum.with_provenance), or neither"
            )
        data.append(
            WireDatum(
                tokens=_tokens(datum.model_input, i, max_tokens),
                inputs=inputs,
                input_spans=input_spans,
                target_spans=target_spans,
            )
        )
    if not data:
        raise WireError("forward_backward got no data: send at least one Datum")
    return FwdBwdRequest(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        loss_fn=msg.loss_fn,
        loss_fn_config=config,
        forward_only=msg.forward_only,
        data=data,
    )


def _spans(msgs: Any) -> tuple[Span, ...] | None:
    """The provenance spans of one datum field (None: the datum carries none)."""
    if not len(msgs):
        return None
    spans = []
    for msg in msgs:
        kind = msg.WhichOneof("span")
        if kind is None:
            raise WireError("a provenance span names neither prompt nor sampled tokens")
        arm = getattr(msg, kind)
        spans.append(
            Span(
                "prompt" if kind == "prompt_tokens" else "sampled",
                arm.sequence_id,
                int(arm.offset),
                int(arm.length),
            )
        )
    return tuple(spans)


def _batched(arrays: list[np.ndarray]) -> pb.BatchedTensor:
    flat = [np.ascontiguousarray(a, dtype=np.float32).ravel() for a in arrays]
    offsets = np.zeros(len(flat) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([a.nbytes for a in flat])
    data = b"".join(a.tobytes() for a in flat)
    return pb.BatchedTensor(data=data, offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32)


def encode_fwdbwd(result: FwdBwdResult) -> bytes:
    """The SDK's protobuf ``ForwardBackwardOutput`` of ``result`` (one batched record)."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in result.metrics.items():
        msg.metrics[k] = float(v)
    if result.outputs:
        record = msg.loss_fn_outputs.add()
        record.num_datums = len(result.outputs)
        for name in result.outputs[0]:
            record.fields[name].CopyFrom(_batched([o[name] for o in result.outputs]))
    return msg.SerializeToString()


def fwdbwd_json(result: FwdBwdResult) -> dict[str, Any]:
    """``result`` as the JSON ``ForwardBackwardOutput`` (for clients that do not ask for
    protobuf)."""
    outputs = [
        {
            k: {"data": v.ravel().tolist(), "dtype": "float32", "shape": list(v.shape)}
            for k, v in o.items()
        }
        for o in result.outputs
    ]
    return {
        "loss_fn_output_type": "ArrayRecord",
        "loss_fn_outputs": outputs,
        "metrics": result.metrics,
    }


_STOP = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


def _topk_msg(topk: TopK) -> pb.TopkLogprobs:
    n, k = topk.token_ids.shape
    return pb.TopkLogprobs(
        token_ids=np.ascontiguousarray(topk.token_ids, np.int32).tobytes(),
        logprobs=np.ascontiguousarray(topk.logprobs, np.float32).tobytes(),
        k=k,
        length=n,
    )


def encode_sample(result: SampleResult) -> bytes:
    """The SDK's protobuf ``SampleResponse`` of ``result``."""
    msg = pb.SampleResponse()
    for seq in result.sequences:
        out = msg.sequences.add(
            stop_reason=_STOP[seq.stop_reason],
            tokens=np.ascontiguousarray(seq.tokens, dtype=np.int32).tobytes(),
            logprobs=np.ascontiguousarray(seq.logprobs, dtype=np.float32).tobytes(),
        )
        if seq.topk is not None:
            out.topk_sampled_logprobs.CopyFrom(_topk_msg(seq.topk))
    if result.prompt_logprobs is not None:
        msg.prompt_logprobs = np.ascontiguousarray(result.prompt_logprobs, np.float32).tobytes()
    if result.topk_prompt is not None:
        msg.topk_prompt_logprobs.CopyFrom(_topk_msg(result.topk_prompt))
    if (target := result.target) is not None:
        values = np.ascontiguousarray(target.values, np.float32).tobytes()
        tensor = msg.target_prompt_logprobs
        tensor.dtype = pb.DTYPE_FLOAT32
        tensor.shape.extend(target.shape)
        if target.crow is not None and target.col is not None:
            tensor.sparse_csr.CopyFrom(
                pb.SparseCsr(
                    values=values,
                    crow_indices=np.ascontiguousarray(target.crow, np.int64).tobytes(),
                    col_indices=np.ascontiguousarray(target.col, np.int64).tobytes(),
                )
            )
        else:
            tensor.dense = values
    return msg.SerializeToString()
