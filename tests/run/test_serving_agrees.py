"""Serving and training agree or the run refuses before its first step, naming the flag to
change: what a replica reports in ``/server_info`` (a document shaped like vLLM 0.32's) against
what the trainer will use; the served-policy audit, when it fires, says what it compared."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.errors import ConfigError, ReplicaError
from asyncgrpo.run.endpoint import request_timeout
from asyncgrpo.run.preflight import check_serving_agrees, preflight_fleet
from asyncgrpo.trainer.audit import AuditTally

SHAPE = {
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def info(**model_config: Any) -> dict[str, Any]:
    """A ``/server_info`` document: vLLM 0.32 dumps its config as JSON, torch dtypes and the
    Hugging Face config as their text."""
    hf = "Qwen2Config " + json.dumps({"architectures": ["Qwen2ForCausalLM"], **SHAPE}, indent=2)
    base = {
        "model": "/models/tiny",
        "dtype": "torch.float32",
        "max_model_len": 512,
        "hf_config": hf,
    }
    return {
        "vllm_config": {
            "model_config": {**base, **model_config},
            "lora_config": {"max_lora_rank": 8, "max_loras": 6},
        },
        "vllm_env": {},
        "system_env": {},
    }


def cfg(*overrides: str) -> TrainingConfig:
    return TrainingConfig.from_dict(
        {"model": "/models/tiny", "dataset": {"prompts": ["p"]}}, list(overrides)
    )


def test_a_replica_that_agrees_is_reported() -> None:
    lines = check_serving_agrees(info(), cfg(), trainer_dtype="float32")
    assert lines == [
        "dtype: float32 on the replicas and in the trainer",
        "context: 512 tokens on the replicas >= completions of 256",
    ]


def test_replicas_in_another_dtype_are_refused_naming_both_flags() -> None:
    with pytest.raises(ConfigError) as refused:
        check_serving_agrees(info(dtype="torch.bfloat16"), cfg(), trainer_dtype="float32")
    text = str(refused.value)
    assert "the replicas serve bfloat16 (vLLM --dtype) but the trainer computes in float32" in text
    assert "--dtype float32" in text and "trainer.dtype=bfloat16" in text
    # with the audit off it trains on, warned
    lines = check_serving_agrees(
        info(dtype="torch.bfloat16"), cfg("trainer.audit.action=off"), trainer_dtype="float32"
    )
    assert lines[0].startswith("warning: the replicas serve bfloat16")


def test_a_context_too_short_for_the_completions_is_refused_naming_max_model_len() -> None:
    with pytest.raises(
        ConfigError,
        match=r"context is 256 tokens \(vLLM --max-model-len\).*"
        r"generation.max_completion_length=256",
    ):
        check_serving_agrees(info(max_model_len=256), cfg(), trainer_dtype="float32")
    with pytest.raises(ConfigError, match=r"needs 400 \+ generation.max_completion_length=256"):
        check_serving_agrees(info(), cfg("dataset.max_prompt_tokens=400"), trainer_dtype=None)


def test_another_model_is_refused_and_the_same_one_elsewhere_is_not() -> None:
    other = {**SHAPE, "hidden_size": 896, "num_hidden_layers": 24}
    with pytest.raises(ConfigError) as refused:
        check_serving_agrees(
            info(model="Qwen/Qwen2.5-0.5B"), cfg(), trainer_dtype=None, trainer_shape=lambda: other
        )
    text = str(refused.value)
    assert (
        "the replicas serve model Qwen/Qwen2.5-0.5B, not the trainer's model=/models/tiny" in text
    )
    assert "hidden_size 64 != 896" in text and "--model /models/tiny" in text
    lines = check_serving_agrees(
        info(model="/mnt/elsewhere/tiny"),
        cfg(),
        trainer_dtype=None,
        trainer_shape=lambda: dict(SHAPE),
    )
    assert (
        lines[0] == "served model: /mnt/elsewhere/tiny (the trainer loads /models/tiny; same shape)"
    )


def test_the_audit_says_what_it_compared() -> None:
    from asyncgrpo.sample import Sample

    sample = Sample(
        prompt_ids=[1],
        completion_ids=[2, 3],
        logprobs=[-1.0, -1.0],
        reward=0.0,
        advantage=0.0,
        version=3,
        group_id="g",
        replica="http://r1",
    )
    tally = AuditTally()
    tally.add(sample, 3, [-1.5, -1.5])
    line = tally.verdict(1e-3, prefix="run-ab", dtype="float32")
    assert line is not None
    assert "served-policy audit: replica http://r1 serves other weights than version 3" in line
    assert (
        "Compared: the logprobs it returned with 2 sampled tokens against the trainer's "
        "float32 logprobs of the same tokens, recomputed from the adapter saved when version "
        "3 was published"
    ) in line
    assert "a replica serving another dtype or model than the trainer differs this way" in line


@pytest.fixture
def silent_proxy() -> Iterator[str]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


def test_first_requests_wait_by_what_the_start_took_and_a_time_out_names_the_setting(
    silent_proxy: str,
) -> None:
    import anyio

    from asyncgrpo.proxy.admin_client import ProxyClient

    # twice the replicas' start, at least 60 s, at most serve.startup_timeout_s
    assert request_timeout(None, 600) == 60 and request_timeout(10, 600) == 60
    assert request_timeout(288, 600) == 576 and request_timeout(400, 600) == 600

    async def main() -> None:
        async with ProxyClient(silent_proxy, timeout_s=0.5) as client:
            await preflight_fleet(cfg(), client, "/tmp/store")

    with pytest.raises(ReplicaError) as late:
        anyio.run(main)
    assert f"GET /server_info through {silent_proxy} got no answer within 0 s" in str(
        late.value
    ) or "got no answer within 1 s" in str(late.value)
    assert "raise serve.startup_timeout_s" in str(late.value)
