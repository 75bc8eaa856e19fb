"""Datum provenance against the sampler's records (no vLLM: the records are filled by hand)."""

from __future__ import annotations

import numpy as np
import pytest

from asyncgrpo.tinker.provenance import ProvenanceError, Span, StabilityRecords
from asyncgrpo.tinker.service import with_provenance
from asyncgrpo.tinker.wire import FwdBwdRequest, WireDatum

PROMPT = np.array([10, 11, 12], np.int64)
TOKENS = np.array([20, 21], np.int32)
LOGPROBS = np.array([-0.25, -0.5], np.float32)


def _records(**kwargs: float) -> StabilityRecords:
    records = StabilityRecords(**kwargs)  # type: ignore[arg-type]
    records.record("sess", PROMPT, [("seq-a", TOKENS, LOGPROBS)], now=0.0)
    return records


def _datum(advantages: list[float]) -> WireDatum:
    """rl_loop's layout: input = prompt + sampled[:-1]; targets = prompt[1:] + sampled."""
    return WireDatum(
        tokens=np.array([10, 11, 12, 20]),
        inputs={
            "target_tokens": np.array([11, 12, 20, 21]),
            "logprobs": np.zeros(4, np.float32),
            "advantages": np.array(advantages, np.float32),
        },
        input_spans=(Span("prompt", "seq-a", 0, 3), Span("sampled", "seq-a", 0, 1)),
        target_spans=(Span("prompt", "seq-a", 1, 2), Span("sampled", "seq-a", 0, 2)),
    )


def _request(loss: str, datum: WireDatum) -> FwdBwdRequest:
    return FwdBwdRequest(
        model_id="m", seq_id=0, loss_fn=loss, loss_fn_config={}, forward_only=False, data=[datum]
    )


def test_stable_reinforce_reads_the_recorded_logprobs_and_trains_the_sampled_tokens() -> None:
    request = _request("stable_reinforce", _datum([0.0, 0.0, 1.0, 1.0]))
    (out,) = with_provenance(request, _records(), "sess", now=1.0).data
    assert out.inputs["logprobs"].tolist() == [0.0, 0.0, -0.25, -0.5]
    assert out.trained is not None and out.trained.tolist() == [0.0, 0.0, 1.0, 1.0]


def test_another_loss_takes_only_which_positions_were_sampled() -> None:
    """rl.train attaches spans to every datum whatever its loss; importance_sampling does not
    read records (the sequences need not have been recorded), only the sampled positions."""
    (out,) = with_provenance(
        _request("importance_sampling", _datum([0, 0, 1, 1])), StabilityRecords(), "sess", now=1.0
    ).data
    assert out.inputs["logprobs"].tolist() == [0.0] * 4  # the datum's own, untouched
    assert out.trained is not None and out.trained.tolist() == [0.0, 0.0, 1.0, 1.0]


def test_what_the_spans_claim_is_checked_against_the_record() -> None:
    records = _records()
    bad_token = _datum([0, 0, 1, 1])
    bad_token.inputs["target_tokens"][3] = 99
    with pytest.raises(ProvenanceError, match=r"target_tokens\[3\] is 99 .* sampled token 1 .*21"):
        with_provenance(_request("stable_reinforce", bad_token), records, "sess", now=1.0)
    with pytest.raises(ProvenanceError, match="nonzero on a prompt position"):
        with_provenance(_request("stable_reinforce", _datum([0, 1, 1, 1])), records, "sess", 1.0)
    with pytest.raises(ProvenanceError, match="sampled in another session"):
        with_provenance(_request("stable_reinforce", _datum([0, 0, 1, 1])), records, "other", 1.0)


def test_records_expire_a_day_after_their_last_use_and_leave_with_their_session() -> None:
    records = _records(ttl_s=10.0)
    request = _request("stable_reinforce", _datum([0, 0, 1, 1]))
    with_provenance(request, records, "sess", now=9.0)  # a use restarts the day
    with_provenance(request, records, "sess", now=18.0)
    with pytest.raises(ProvenanceError, match="record_stability_info=True"):
        with_provenance(request, records, "sess", now=29.0)
    records = _records()
    records.drop_session("sess")
    with pytest.raises(ProvenanceError, match="no record"):
        with_provenance(request, records, "sess", now=1.0)


def test_records_are_bounded_in_tokens_oldest_out() -> None:
    records = StabilityRecords(max_tokens=10)
    records.record("s", PROMPT, [("a", TOKENS, LOGPROBS), ("b", TOKENS, LOGPROBS)], now=0.0)
    assert len(records) == 2  # 3 prompt tokens once + 2 + 2
    records.record("s", PROMPT, [("c", TOKENS, LOGPROBS)], now=1.0)
    assert len(records) == 2  # a (its 2 tokens and the prompt's 3) left for c's 5
    with pytest.raises(ProvenanceError, match="no record"):
        records.resolve([Span("sampled", "a", 0, 2)], TOKENS, "s", 0, now=1.0)
    assert records.resolve([Span("sampled", "c", 0, 2)], TOKENS, "s", 0, now=1.0).tolist() == [
        -0.25,
        -0.5,
    ]


def test_padded_prompt_targets_are_not_compared_as_rl_loop_pads_them() -> None:
    """tinker-cookbook's rl_loop gives prompt positions target 0 (no loss there) under spans
    naming the prompt: taken; the sampled targets and every input token are still compared."""
    datum = _datum([0.0, 0.0, 1.0, 1.0])
    datum.inputs["target_tokens"][:2] = 0
    (out,) = with_provenance(_request("stable_reinforce", datum), _records(), "sess", 1.0).data
    assert out.inputs["logprobs"].tolist() == [0.0, 0.0, -0.25, -0.5]
    datum.tokens[1] = 99
    with pytest.raises(ProvenanceError, match=r"model_input\[1\] is 99 .* prompt token 1"):
        with_provenance(_request("stable_reinforce", datum), _records(), "sess", 1.0)
