"""A verifiers 0.4 environment trained end to end on CPU: real vLLM replicas behind the proxy,
verifiers' own harness program, interception server and MCP tool server, asyncgrpo's
token-exact model client, the trainer. Needs verifiers 0.4 and uv in the venv running the
tests (docs/environments.md, "verifiers 0.4"); skipped beside verifiers 0.1.10."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
import pytest
import yaml

pytest.importorskip("verifiers.v1")

from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.run.metrics import read_metrics
from asyncgrpo.run.training import run_training
from asyncgrpo.sample import Sample
from asyncgrpo.serve import Replica
from asyncgrpo.testing.verify import served_logprob_errors

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "vf_v1_calculator.yaml"
PACKAGE = ROOT / "examples" / "envs" / "vf_v1_calculator"


async def test_a_v1_tool_environment_trains_4_steps_token_exactly(
    vllm_replicas: list[Replica], tiny_model: Path, tmp_path: Path
) -> None:
    sys.path.insert(0, str(PACKAGE))  # as `pip install -e` of the package would, here and
    os.environ["PYTHONPATH"] = os.pathsep.join(  # in the tool servers verifiers starts
        p for p in (str(PACKAGE), os.environ.get("PYTHONPATH")) if p
    )
    data = yaml.safe_load(EXAMPLE.read_text())
    data.update(model=str(tiny_model), output_dir=str(tmp_path), run_name="vf1")
    data["serve"] = {"replicas": 0}
    data["proxy"]["upstreams"] = [r.url for r in vllm_replicas]
    data["dataset"]["path"] = str(ROOT / "examples" / "calculator_tasks.jsonl")
    data["rollout"].update(max_inflight=16, queue_maxsize=16)
    data["generation"].update(num_generations=4, max_completion_length=8)
    data["trainer"].update(samples_per_step=8, max_steps=4)
    batches: list[list[Sample]] = []
    result = await run_training(
        TrainingConfig.from_dict(data), on_step=lambda step, s, v: batches.append(list(s))
    )
    samples = [s for b in batches for s in b]
    assert result.steps == 4 and len(samples) == 32
    errors = await anyio.to_thread.run_sync(
        served_logprob_errors, tiny_model, result.transport_url, result.adapter_prefix, samples,
        tmp_path / "check-cache",
    )  # fmt: skip
    # each policy token's served logprob equals the trainer's on the ids it trained on: those
    # are the ids vLLM sampled, at the version each was sampled under
    assert max(errors) < 1e-4, f"{sum(e >= 1e-4 for e in errors)} (sample, version) pairs differ"
    assert all(0.0 <= s.reward <= 1.5 for s in samples)
    records = read_metrics(result.run_dir / "metrics.jsonl")
    assert all(abs(r["ratio"] - 1.0) < 1e-3 for r in records)
    for r, batch in zip(records, batches, strict=True):  # environment tokens carry no loss
        assert r["batch/completion_tokens"] == sum(s.num_policy_tokens for s in batch)
    assert records[-1]["rollout/env_failures_total"] == 0
    turns = [sum(m and (i == 0 or not s.policy_mask()[i - 1]) for i, m in enumerate(s.policy_mask()))
             for s in samples]  # fmt: skip
    print(f"v1 in process: max |logp error| {max(errors):.2e}, ratio "
          f"{[round(r['ratio'], 6) for r in records]}, model turns {sorted(turns)}")  # fmt: skip
