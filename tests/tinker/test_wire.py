"""The service's wire translation read back by the SDK's own decoders."""

from __future__ import annotations

import numpy as np
import pytest

from asyncgrpo.tinker.wire import (
    FwdBwdResult,
    SampledSeq,
    SampleResult,
    WireError,
    decode_fwdbwd,
    encode_fwdbwd,
    encode_sample,
)


def test_a_sample_response_reads_back_in_the_sdk() -> None:
    from tinker.proto.response_conv import deserialize_sample_response

    result = SampleResult(
        sequences=[
            SampledSeq(np.array([4, 5, 6]), np.array([-0.5, -1.5, -0.25]), "stop"),
            SampledSeq(np.array([7]), np.array([-2.0]), "length"),
        ],
        prompt_logprobs=np.array([np.nan, -1.0, -3.0], dtype=np.float32),
    )
    response = deserialize_sample_response(encode_sample(result))
    assert [list(s.tokens) for s in response.sequences] == [[4, 5, 6], [7]]
    assert list(response.sequences[0].logprobs) == [-0.5, -1.5, -0.25]
    assert [s.stop_reason for s in response.sequences] == ["stop", "length"]
    assert response.prompt_logprobs == [None, -1.0, -3.0]


def test_a_forward_backward_request_round_trips_through_the_sdks_encoder() -> None:
    from tinker import TensorData, types
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.proto.response_conv import deserialize_forward_backward_output

    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={
            "target_tokens": [2, 3, 4],
            "advantages": TensorData.from_numpy(np.array([0.5, -1.0, 2.0], dtype=np.float32)),
        },
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum], loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.7}
        ),
        model_id="m",
        seq_id=3,
    )
    decoded = decode_fwdbwd(forward_backward_request_to_proto(request).SerializeToString())
    assert (decoded.model_id, decoded.seq_id, decoded.loss_fn) == ("m", 3, "ppo")
    assert decoded.loss_fn_config == pytest.approx({"clip_low_threshold": 0.7})
    assert decoded.data[0].tokens.tolist() == [1, 2, 3]
    assert decoded.data[0].inputs["advantages"].tolist() == [0.5, -1.0, 2.0]
    out = FwdBwdResult(
        outputs=[
            {"logprobs": np.array([-1.0, -2.0], dtype=np.float32)},
            {"logprobs": np.array([-3.0], dtype=np.float32)},
        ],
        metrics={"loss:sum": 6.0},
    )
    back = deserialize_forward_backward_output(encode_fwdbwd(out))
    assert [o["logprobs"].tolist() for o in back.loss_fn_outputs] == [[-1.0, -2.0], [-3.0]]
    assert back.metrics == {"loss:sum": 6.0}
    with pytest.raises(WireError, match="not a ForwardBackwardRequest"):
        decode_fwdbwd(b"\xff\xff\xff")


def test_provenance_spans_are_read_with_the_datum() -> None:
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    from asyncgrpo.tinker.provenance import Span

    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "advantages": [0.0, 0.0, 1.0, 1.0]},
    ).with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id="s1", length=2),
            types.SampledProvenanceSpan(sequence_id="s1", length=2),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id="s1", offset=1, length=1),
            types.SampledProvenanceSpan(sequence_id="s1", length=3),
        ],
    )
    plain = types.Datum(
        model_input=types.ModelInput.from_ints([1]),
        loss_fn_inputs={"target_tokens": [2], "advantages": [1.0]},
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum, plain], loss_fn="importance_sampling"
        ),
        model_id="m",
        seq_id=1,
    )
    decoded = decode_fwdbwd(forward_backward_request_to_proto(request).SerializeToString())
    assert decoded.data[0].input_spans == (Span("prompt", "s1", 0, 2), Span("sampled", "s1", 0, 2))
    assert decoded.data[0].target_spans == (Span("prompt", "s1", 1, 1), Span("sampled", "s1", 0, 3))
    assert decoded.data[1].input_spans is None and decoded.data[1].target_spans is None
