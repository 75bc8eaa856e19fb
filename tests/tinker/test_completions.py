"""A SampleRequest as vLLM completions and back, read by the SDK's own decoder (no vLLM)."""

from __future__ import annotations

import math

import pytest

from asyncgrpo.tinker.completions import (
    Limits,
    check_sample,
    completions_body,
    sample_result,
    target_body,
    target_result,
)
from asyncgrpo.tinker.wire import WireError, encode_sample


def _request(prompt: list[int], **kwargs: object):
    from tinker import types

    params = kwargs.pop("sampling_params", types.SamplingParams(max_tokens=4))
    return types.SampleRequest(
        prompt=types.ModelInput.from_ints(prompt), sampling_params=params, **kwargs
    )


def test_a_sample_request_becomes_one_completion_of_n() -> None:
    from tinker import types

    params = types.SamplingParams(max_tokens=5, temperature=0.7, top_k=20, seed=3, stop=[9])
    ask = check_sample(
        _request([1, 2], num_samples=8, sampling_params=params, prompt_logprobs=True), Limits()
    )
    assert completions_body("m-v2", ask) == {
        "model": "m-v2",
        "prompt": [1, 2],
        "n": 8,
        "temperature": 0.7,
        "top_p": 1,
        "top_k": 20,
        "logprobs": 0,
        "return_token_ids": True,
        "max_tokens": 5,
        "seed": 3,
        "stop_token_ids": [9],
        "prompt_logprobs": 0,
    }
    text = check_sample(_request([1], sampling_params=types.SamplingParams(stop="\n")), Limits())
    assert completions_body("m", text)["stop"] == ["\n"]
    no_stop = check_sample(_request([1], sampling_params=types.SamplingParams(stop=[])), Limits())
    assert completions_body("m", no_stop)["ignore_eos"]
    with pytest.raises(WireError, match="prompt is empty"):
        check_sample(_request([]), Limits())


def test_what_the_replicas_would_refuse_is_refused_naming_the_limit_and_the_fix() -> None:
    from tinker import types

    limits = Limits(max_model_len=16, max_logprobs=5)
    with pytest.raises(
        WireError,
        match=r"12 tokens and max_tokens=8 make 20: .*--max-model-len "
        r"is 16 .*lower max_tokens.*larger --max-model-len",
    ):
        check_sample(
            _request(list(range(12)), sampling_params=types.SamplingParams(max_tokens=8)), limits
        )
    with pytest.raises(WireError, match="the prompt has 16 tokens"):
        check_sample(_request(list(range(16))), limits)
    with pytest.raises(WireError, match=r"topk_prompt_logprobs=6: .*at most 5 .*--max-logprobs"):
        check_sample(_request([1, 2], topk_prompt_logprobs=6), limits)
    with pytest.raises(WireError, match="outside the model's vocabulary"):
        check_sample(_request([1, 400]), limits, vocab_size=384)
    with pytest.raises(WireError, match="prompt_alt_tokens_k is not served here"):
        check_sample(_request([1, 2], prompt_alt_tokens_k=2), limits)
    with pytest.raises(WireError, match="prompt_logprobs_last_n=5: give 1 to len"):
        check_sample(_request([1, 2, 3], prompt_logprobs=True, prompt_logprobs_last_n=5), limits)


def test_top_k_logprobs_of_prompt_and_samples_read_back_in_the_sdk() -> None:
    from tinker.proto.response_conv import deserialize_sample_response

    ask = check_sample(
        _request(
            [1, 2, 3],
            topk_prompt_logprobs=2,
            topk_sample_logprobs=2,
            prompt_logprobs=True,
            prompt_logprobs_last_n=1,
        ),
        Limits(),
    )
    body = completions_body("m", ask)
    assert (body["prompt_logprobs"], body["logprobs"], body["return_tokens_as_token_ids"]) == (
        2,
        2,
        True,
    )
    entry = {
        "3": {"logprob": -2.0, "rank": 3},
        "7": {"logprob": -0.5, "rank": 1},
        "8": {"logprob": -1.0, "rank": 2},
    }
    answer = {
        "choices": [
            {
                "index": 0,
                "token_ids": [5],
                "finish_reason": "length",
                "logprobs": {
                    "token_logprobs": [-0.3],
                    "top_logprobs": [{"token_id:5": -0.3, "token_id:6": -1.9, "token_id:4": -3.0}],
                },
                "prompt_logprobs": [None, entry, entry],
            }
        ]
    }
    response = deserialize_sample_response(encode_sample(sample_result(answer, ask)))
    # the last 1 prompt position is scored; position 0 never is
    assert response.prompt_logprobs == [None, None, -2.0]
    assert response.topk_prompt_logprobs == [None, None, [(7, -0.5), (8, -1.0)]]
    (row,) = response.sequences[0].topk_logprobs
    assert [t for t, _ in row] == [5, 6] and [lp for _, lp in row] == pytest.approx([-0.3, -1.9])


def test_target_prompt_logprobs_score_each_asked_token_after_its_prefix() -> None:
    from tinker.proto.response_conv import deserialize_sample_response

    # rows score positions 1 and 2 of the prompt [1, 2, 3]; -1 asks for nothing
    targets = {"data": [4, -1, 5, 4], "dtype": "int64", "shape": [2, 2]}
    ask = check_sample(_request([1, 2, 3], target_prompt_logprobs=targets), Limits())
    body = target_body("m", ask)
    assert body["prompt"] == [[1, 4], [1, 2, 4], [1, 2, 5]]
    assert (body["max_tokens"], body["prompt_logprobs"]) == (1, 0)

    def scored(token: int, lp: float) -> dict:
        return {"prompt_logprobs": [None, {str(token): {"logprob": lp}}]}

    answer = {
        "choices": [
            dict(scored(4, -1.5), index=0),
            dict(scored(4, -2.5), index=1),
            dict(scored(5, -3.5), index=2),
        ]
    }
    result = sample_result({"choices": []}, ask)
    result = type(result)(sequences=[], target=target_result(answer, ask))
    back = deserialize_sample_response(encode_sample(result)).target_prompt_logprobs
    assert back.to_numpy().tolist() == [[-1.5, 0.0], [-3.5, -2.5]]
    csr = {
        "data": [5],
        "dtype": "int64",
        "shape": [2, 2],
        "sparse_crow_indices": [0, 0, 1],
        "sparse_col_indices": [1],
    }
    ask = check_sample(_request([1, 2, 3], target_prompt_logprobs=csr), Limits())
    assert target_body("m", ask)["prompt"] == [[1, 2, 5]]
    out = target_result({"choices": [dict(scored(5, -0.75), index=0)]}, ask)
    back = deserialize_sample_response(encode_sample(type(result)(sequences=[], target=out)))
    tensor = back.target_prompt_logprobs
    assert tensor.sparse_crow_indices == [0, 0, 1] and tensor.sparse_col_indices == [1]
    assert list(tensor.data) == [-0.75]


def test_vllms_answer_becomes_the_samples_in_choice_order() -> None:
    ask = check_sample(_request([1, 2], prompt_logprobs=True), Limits())
    answer = {
        "choices": [
            {
                "index": 1,
                "token_ids": [8],
                "finish_reason": "length",
                "logprobs": {"token_logprobs": [-0.1]},
            },
            {
                "index": 0,
                "token_ids": [5, 6],
                "finish_reason": "stop",
                "logprobs": {"token_logprobs": [-1.0, -2.0]},
                "prompt_logprobs": [None, {"2": {"logprob": -4.0, "rank": 3}}],
            },
        ]
    }
    result = sample_result(answer, ask)
    assert [s.tokens.tolist() for s in result.sequences] == [[5, 6], [8]]
    assert [s.stop_reason for s in result.sequences] == ["stop", "length"]
    assert result.prompt_logprobs is not None
    assert math.isnan(result.prompt_logprobs[0]) and result.prompt_logprobs[1] == -4.0


def test_a_replicas_error_text_stays_out_of_what_the_client_is_told() -> None:
    from asyncgrpo.errors import ReplicaHTTPError
    from asyncgrpo.tinker.sampling import replica_refusal

    body = (
        '{"error": {"message": "This model\'s maximum context length is 1024 tokens. However, '
        'you requested 1100 tokens", "type": "BadRequestError"}}'
    )
    long = replica_refusal(ReplicaHTTPError("x", url="u", status=400, body=body))
    assert isinstance(long, WireError) and "--max-model-len" in str(long)
    assert "1100" not in str(long) and "maximum context length" not in str(long)
    other = replica_refusal(
        ReplicaHTTPError("x", url="u", status=400, body='{"error": "secret detail"}')
    )
    assert isinstance(other, WireError) and "secret" not in str(other) and "(400)" in str(other)
    failed = replica_refusal(ReplicaHTTPError("x", url="u", status=503, body="overloaded detail"))
    assert not isinstance(failed, WireError) and "detail" not in str(failed)
