"""Multi-turn episodes trained end to end on CPU: real vLLM replicas behind the proxy, the
rollout client running an environment, the trainer on masked sequences.

For every policy token of every trained episode, the logprob vLLM returned equals the one
recomputed with transformers + peft at the adapter version that token was generated under, also
in episodes whose turns straddle a weight sync.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import yaml

from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.run.metrics import read_metrics
from asyncgrpo.run.training import run_training
from asyncgrpo.sample import Sample
from asyncgrpo.serve import Replica
from asyncgrpo.testing.verify import served_logprob_errors

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tool_calculator.yaml"


def model_turns(s: Sample) -> int:
    mask = s.policy_mask()
    return sum(m and (i == 0 or not mask[i - 1]) for i, m in enumerate(mask))


async def test_multi_turn_training_serves_every_token_at_its_version(
    vllm_replicas: list[Replica], tiny_model: Path, tmp_path: Path
) -> None:
    data = yaml.safe_load(EXAMPLE.read_text())
    data.update(model=str(tiny_model), output_dir=str(tmp_path), run_name="mt")
    data["serve"] = {"replicas": 0}
    data["proxy"]["upstreams"] = [r.url for r in vllm_replicas]
    data["dataset"] = {
        "prompts": [[{"role": "user", "content": f"talk {i}"}] for i in range(8)],
        "epochs": None,
    }
    data["rollout"] = {
        "environment": "asyncgrpo.testing.envs:ChatterEnv",
        # odd prompts' episodes hold their first reply for the next version
        "environment_args": {"max_turns": 3, "max_episode_tokens": 512, "straddle_s": 60},
        "max_inflight": 16,
        "queue_maxsize": 16,
    }
    data["generation"].update(num_generations=4, max_completion_length=8)
    data["trainer"].update(samples_per_step=8, max_steps=5, max_staleness=1)
    cfg = TrainingConfig.from_dict(data)
    batches: list[list[Sample]] = []
    result = await run_training(cfg, on_step=lambda step, s, v: batches.append(list(s)))

    samples = [s for b in batches for s in b]
    assert result.steps == 5 and len(samples) == 40
    assert all(model_turns(s) == 3 for s in samples)  # >= 3 model turns, environment between
    spanning = [s for s in samples if len(set(s.token_versions())) > 1]
    errors = await anyio.to_thread.run_sync(
        served_logprob_errors,
        tiny_model,
        result.transport_url,
        result.adapter_prefix,
        samples,
        tmp_path / "check-cache",
    )
    assert len(errors) == len(samples) + len(spanning)  # one check per (sample, version)
    assert max(errors) < 1e-4, f"{sum(e >= 1e-4 for e in errors)} (sample, version) pairs differ"
    assert spanning, "no episode straddled a weight sync: the per-version check went untested"
    records = read_metrics(result.run_dir / "metrics.jsonl")
    for r, batch in zip(records, batches, strict=True):  # the normaliser: policy tokens only
        assert r["batch/completion_tokens"] == sum(s.num_policy_tokens for s in batch)


def train_two_steps(
    example: Path, replicas: list[Replica], model: Path, out_dir: Path, *overrides: str
) -> list[dict]:
    """``asyncgrpo train EXAMPLE`` for 2 steps on the session's replicas; its metrics."""
    urls = ",".join(r.url for r in replicas)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncgrpo.cli.main",
            "train",
            str(example),
            f"model={model}",
            f"output_dir={out_dir}",
            "run_name=cli",
            "serve.replicas=0",
            f"proxy.upstreams=[{urls}]",
            "trainer.max_steps=2",
            f"dataset.path={ROOT / 'examples' / 'calculator_tasks.jsonl'}",
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    records = read_metrics(out_dir / "cli" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    return records


def test_the_calculator_example_trains_through_the_cli(
    vllm_replicas: list[Replica], tiny_model: Path, tmp_path: Path
) -> None:
    records = train_two_steps(EXAMPLE, vllm_replicas, tiny_model, tmp_path)
    assert {"rewards/tool_call", "rewards/answer", "rollout/model_turns_total"} <= set(records[-1])


VF_EXAMPLE = ROOT / "examples" / "vf_calculator.yaml"


async def test_a_verifiers_multi_turn_env_trains_token_exactly(
    vllm_replicas: list[Replica], tiny_model: Path, tmp_path: Path
) -> None:
    """verifiers' MultiTurnEnv through asyncgrpo's policy client: 3 model turns per episode,
    every policy token's served logprob equal to the trainer's on the ids it trained on (so
    those are the ids vLLM sampled), rewards from the verifiers rubric."""
    data = yaml.safe_load(VF_EXAMPLE.read_text())
    data.update(model=str(tiny_model), output_dir=str(tmp_path), run_name="vf")
    data["serve"] = {"replicas": 0}
    data["proxy"]["upstreams"] = [r.url for r in vllm_replicas]
    data["dataset"]["path"] = str(ROOT / "examples" / "calculator_tasks.jsonl")
    data["rollout"].update(max_inflight=16, queue_maxsize=16)
    data["generation"].update(num_generations=4, max_completion_length=8)
    data["trainer"].update(samples_per_step=8, max_steps=3)
    batches: list[list[Sample]] = []
    result = await run_training(
        TrainingConfig.from_dict(data), on_step=lambda step, s, v: batches.append(list(s))
    )
    samples = [s for b in batches for s in b]
    assert result.steps == 3 and len(samples) == 24
    # verifiers ends an episode whose model turn is empty (EmptyModelResponseError): the random
    # tiny model does that now and then, so a few episodes have fewer turns
    turns = [model_turns(s) for s in samples]
    assert all(1 <= t <= 3 for t in turns) and turns.count(3) >= len(turns) * 3 // 4, turns
    errors = await anyio.to_thread.run_sync(
        served_logprob_errors,
        tiny_model,
        result.transport_url,
        result.adapter_prefix,
        samples,
        tmp_path / "check-cache",
    )
    assert max(errors) < 1e-4, f"{sum(e >= 1e-4 for e in errors)} (sample, version) pairs differ"
    assert all(0.0 <= s.reward <= 1.5 for s in samples)
    assert any(s.reward > 0 for s in samples)  # the rubric's digit share, at least once


def test_a_verifiers_single_turn_env_trains_through_the_cli(
    vllm_replicas: list[Replica], tiny_model: Path, tmp_path: Path
) -> None:
    single = "{verifiers: asyncgrpo.testing.vf_calculator, args: {kind: single}}"
    records = train_two_steps(
        VF_EXAMPLE, vllm_replicas, tiny_model, tmp_path, f"rollout.environment={single}"
    )
    assert all(r["completions/mean_length"] <= 12 for r in records)  # one turn each
