"""verifiers 0.4 environments trained end to end on CPU: real vLLM replicas behind the proxy,
verifiers' own chat loop (the null harness's, in process: asyncgrpo-chat), interception server
and MCP tool server, asyncgrpo's token-exact model client, the trainer. The calculator (tools,
several turns) and the demo's digits task (single turn, a rubric reward), each two ways:

- in process, where the venv running the tests holds verifiers 0.4 and uv (``make test-vf4``);
- from a process and venv of its own (``rollout.environment.python``), where the trainer's venv
  holds verifiers 0.1.10 and the environment runs in the verifiers 0.4 venv (``make
  install-vf4``: .venv-vf4, or ASYNCGRPO_VF4_PYTHON); every model call comes back here and is
  answered token-exactly through the proxy.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import yaml

from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.run.metrics import read_metrics
from asyncgrpo.run.training import run_training
from asyncgrpo.sample import Sample
from asyncgrpo.serve import Replica, launch_replicas
from asyncgrpo.testing import tiny_serve_config
from asyncgrpo.testing.verify import served_logprob_errors

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "vf_v1_calculator.yaml"
PACKAGE = ROOT / "examples" / "envs" / "vf_v1_calculator"
DIGITS = ROOT / "examples" / "envs" / "vf_v1_digits"
VF4_PYTHON = os.environ.get("ASYNCGRPO_VF4_PYTHON") or str(ROOT / ".venv-vf4" / "bin" / "python")


def _has_v1() -> bool:
    try:
        return importlib.util.find_spec("verifiers.v1") is not None
    except ModuleNotFoundError:  # no verifiers at all
        return False


HAS_V1 = _has_v1()
WAYS = [
    pytest.param(
        None,
        id="in-process",
        marks=pytest.mark.skipif(
            not HAS_V1, reason="verifiers 0.4 is not in this venv: make test-vf4 runs it there"
        ),
    ),
    pytest.param(
        VF4_PYTHON,
        id="own-venv",
        marks=pytest.mark.skipif(
            HAS_V1 or not os.access(VF4_PYTHON, os.X_OK),
            reason="this venv holds verifiers 0.4 itself, or there is no verifiers 0.4 venv at "
            f"{VF4_PYTHON} (make install-vf4)",
        ),
    ),
]


def installed(monkeypatch: pytest.MonkeyPatch, package: Path) -> None:
    """The package, as `pip install -e` of it would: here, in the environment process and in
    the tool servers verifiers starts."""
    monkeypatch.syspath_prepend(str(package))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(p for p in (str(package), os.environ.get("PYTHONPATH")) if p)
    )


def config(example: Path, python: str | None, replicas: list[Replica], **run: str) -> dict:
    """The example's config on the session's replicas (and in ``python``'s venv, if given)."""
    data = yaml.safe_load(example.read_text())
    data.update(run)
    if python is not None:
        data["rollout"]["environment"]["python"] = python
    data["serve"] = {"replicas": 0}
    data["proxy"]["upstreams"] = [r.url for r in replicas]
    return data


@pytest.fixture(scope="module")
def tool_replica(tool_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replica]:
    """One replica of the tool-calling model (the session's replicas serve the tiny one)."""
    from anyio.from_thread import start_blocking_portal

    log_dir = os.environ.get("ASYNCGRPO_TEST_LOG_DIR") or str(tmp_path_factory.mktemp("tool-logs"))
    serve = tiny_serve_config(
        tool_model,
        log_dir=log_dir,
        transports=(str(tmp_path_factory.getbasetemp()),),
        adapter_cache_dir=str(tmp_path_factory.mktemp("tool-adapters")),
    )
    with (
        start_blocking_portal() as portal,
        portal.wrap_async_context_manager(launch_replicas(serve)) as replicas,
    ):
        yield replicas[0]


def model_turns(sample: Sample) -> int:
    """How many model turns a sample holds: its runs of policy tokens."""
    mask = sample.policy_mask()
    return sum(m and (i == 0 or not mask[i - 1]) for i, m in enumerate(mask))


@pytest.mark.parametrize("python", WAYS)
async def test_a_v1_tool_environment_trains_4_steps_token_exactly(
    python: str | None,
    tool_replica: Replica,
    tool_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The calculator with a model that calls its add tool (asyncgrpo.testing.tool_model):
    every episode is two model turns or more around the tool's result, each turn's ids the
    ones vLLM sampled, the environment's ids between them masked."""
    installed(monkeypatch, PACKAGE)
    data = config(
        EXAMPLE,
        python,
        [tool_replica],
        model=str(tool_model),
        output_dir=str(tmp_path),
        run_name="vf1",
    )
    data["dataset"]["path"] = str(ROOT / "examples" / "calculator_tasks.jsonl")
    data["rollout"].update(max_inflight=16, queue_maxsize=16)
    # a tool call is <= 73 tokens (+ end of turn); at temperature 0.5 the fine-tuned model writes
    # it every time (its wrong-token mass per episode <= 2e-5, docs/benchmarks.md)
    data["generation"].update(num_generations=4, max_completion_length=80, temperature=0.5)
    data["trainer"].update(samples_per_step=8, max_steps=4)
    batches: list[list[Sample]] = []
    result = await run_training(
        TrainingConfig.from_dict(data), on_step=lambda step, s, v: batches.append(list(s))
    )
    samples = [s for b in batches for s in b]
    assert result.steps == 4 and len(samples) == 32
    turns = [model_turns(s) for s in samples]
    assert min(turns) >= 2, f"model turns per sample: {sorted(turns)}"
    for s in samples:  # the tool's result, between the turns, is the environment's: no loss
        mask = s.policy_mask()
        first_end = mask.index(False)
        env = mask[first_end:].index(True)
        assert env > 0 and not any(mask[first_end : first_end + env])
    errors = await anyio.to_thread.run_sync(
        served_logprob_errors,
        tool_model,
        result.transport_url,
        result.adapter_prefix,
        samples,
        tmp_path / "check-cache",
    )
    # each policy token's served logprob equals the trainer's on the ids it trained on: those
    # are the ids vLLM sampled, at the version each was sampled under
    assert max(errors) < 1e-4, f"{sum(e >= 1e-4 for e in errors)} (sample, version) pairs differ"
    assert all(0.0 <= s.reward <= 1.5 for s in samples)
    records = read_metrics(result.run_dir / "metrics.jsonl")
    # a step with no sample of the current weights logs the ratio as NaN (nothing to measure)
    ratios = [r["ratio"] for r in records if not math.isnan(r.get("ratio", math.nan))]
    assert ratios and all(abs(x - 1.0) < 1e-3 for x in ratios), ratios
    for r, batch in zip(records, batches, strict=True):  # environment tokens carry no loss
        assert r["batch/completion_tokens"] == sum(s.num_policy_tokens for s in batch)
    assert records[-1]["rollout/env_failures_total"] == 0
    way = "in process" if python is None else "in its own venv"
    print(
        f"v1 {way}: max |logp error| {max(errors):.2e}, ratio {[round(x, 6) for x in ratios]}, "
        f"model turns {sorted(turns)}, rewards {sorted(round(s.reward, 3) for s in samples)}"
    )


@pytest.mark.parametrize("python", WAYS)
async def test_a_single_turn_v1_environment_trains_with_its_rubric_reward(
    python: str | None,
    tool_replica: Replica,
    tool_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """examples/vf_v1_digits.yaml (the demo's task, its reward a v1 rubric) for 4 steps at
    max_staleness 2: each sample one model turn, its reward the rubric's, the ratio ~1 at each
    token's version (the 40-step learning runs: docs/benchmarks.md). It trains the module's
    tool-calling model (the tiny model fine-tuned, its tokenizer the same): `make test-vf4`
    then starts one replica instead of three."""
    installed(monkeypatch, DIGITS)
    data = config(
        ROOT / "examples" / "vf_v1_digits.yaml",
        python,
        [tool_replica],
        model=str(tool_model),
        output_dir=str(tmp_path),
        run_name="digits",
    )
    data["rollout"].update(max_inflight=16, queue_maxsize=32)
    data["generation"].update(num_generations=4, max_completion_length=8)
    # asynchronous, as far as the replica allows (--max-loras 4: max_staleness + 2)
    data["trainer"].update(samples_per_step=8, max_steps=4, max_staleness=2)
    batches: list[list[Sample]] = []
    result = await run_training(
        TrainingConfig.from_dict(data), on_step=lambda step, s, v: batches.append(list(s))
    )
    samples = [s for b in batches for s in b]
    assert result.steps == 4 and len(samples) == 32
    errors = await anyio.to_thread.run_sync(
        served_logprob_errors,
        tool_model,
        result.transport_url,
        result.adapter_prefix,
        samples,
        tmp_path / "check-cache",
    )
    assert max(errors) < 1e-4, f"{sum(e >= 1e-4 for e in errors)} (sample, version) pairs differ"
    for s in samples:  # one turn, all of it the policy's, its reward the rubric's one part
        assert s.policy_mask() == [True] * len(s.completion_ids)
        assert set(s.rewards) == {"digits"} and 0.0 <= s.reward == s.rewards["digits"] <= 1.0
    records = read_metrics(result.run_dir / "metrics.jsonl")
    # a step with no sample of the current weights logs the ratio as NaN (nothing to measure)
    ratios = [r["ratio"] for r in records if not math.isnan(r.get("ratio", math.nan))]
    assert ratios and all(abs(x - 1.0) < 1e-3 for x in ratios), ratios
    assert records[-1]["rollout/env_failures_total"] == 0
