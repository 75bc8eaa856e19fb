"""The service's wire translation read back by the SDK's own decoders."""

from __future__ import annotations

import math

import numpy as np
import pytest

from asyncgrpo.tinker.sampling import completions_body, sample_result
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
        sequences=[SampledSeq(np.array([4, 5, 6]), np.array([-0.5, -1.5, -0.25]), "stop"),
                   SampledSeq(np.array([7]), np.array([-2.0]), "length")],
        prompt_logprobs=np.array([np.nan, -1.0, -3.0], dtype=np.float32),
    )  # fmt: skip
    response = deserialize_sample_response(encode_sample(result))
    assert [list(s.tokens) for s in response.sequences] == [[4, 5, 6], [7]]
    assert list(response.sequences[0].logprobs) == [-0.5, -1.5, -0.25]
    assert [s.stop_reason for s in response.sequences] == ["stop", "length"]
    assert response.prompt_logprobs == [None, -1.0, -3.0]


def test_a_forward_backward_request_round_trips_through_the_sdks_encoder() -> None:
    from tinker import TensorData, types
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.proto.response_conv import deserialize_forward_backward_output

    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                        loss_fn_inputs={"target_tokens": [2, 3, 4],
                                        "advantages": TensorData.from_numpy(
                                            np.array([0.5, -1.0, 2.0], dtype=np.float32))})  # fmt: skip
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
    out = FwdBwdResult(outputs=[{"logprobs": np.array([-1.0, -2.0], dtype=np.float32)},
                                {"logprobs": np.array([-3.0], dtype=np.float32)}],
                       metrics={"loss:sum": 6.0})  # fmt: skip
    back = deserialize_forward_backward_output(encode_fwdbwd(out))
    assert [o["logprobs"].tolist() for o in back.loss_fn_outputs] == [[-1.0, -2.0], [-3.0]]
    assert back.metrics == {"loss:sum": 6.0}
    with pytest.raises(WireError, match="not a ForwardBackwardRequest"):
        decode_fwdbwd(b"\xff\xff\xff")


def test_a_sample_request_becomes_one_completion_of_n() -> None:
    from tinker import types

    params = types.SamplingParams(max_tokens=5, temperature=0.7, top_k=20, seed=3, stop=[9])
    body = completions_body("m-v2", [1, 2], 8, params, prompt_logprobs=True)
    assert body == {"model": "m-v2", "prompt": [1, 2], "n": 8, "temperature": 0.7, "top_p": 1,
                    "top_k": 20, "logprobs": 0, "return_token_ids": True, "max_tokens": 5,
                    "seed": 3, "stop_token_ids": [9], "prompt_logprobs": 0}  # fmt: skip
    text_stops = completions_body("m", [1], 1, types.SamplingParams(stop="\n"), False)
    assert text_stops["stop"] == ["\n"]
    assert completions_body("m", [1], 1, types.SamplingParams(stop=[]), False)["ignore_eos"]
    with pytest.raises(WireError, match="prompt is empty"):
        completions_body("m", [], 1, params, False)


def test_vllms_answer_becomes_the_samples_in_choice_order() -> None:
    answer = {"choices": [
        {"index": 1, "token_ids": [8], "finish_reason": "length",
         "logprobs": {"token_logprobs": [-0.1]}},
        {"index": 0, "token_ids": [5, 6], "finish_reason": "stop",
         "logprobs": {"token_logprobs": [-1.0, -2.0]},
         "prompt_logprobs": [None, {"2": {"logprob": -4.0, "rank": 3}}]},
    ]}  # fmt: skip
    result = sample_result(answer, [1, 2], prompt_logprobs=True)
    assert [s.tokens.tolist() for s in result.sequences] == [[5, 6], [8]]
    assert [s.stop_reason for s in result.sequences] == ["stop", "length"]
    assert result.prompt_logprobs is not None
    assert math.isnan(result.prompt_logprobs[0]) and result.prompt_logprobs[1] == -4.0
