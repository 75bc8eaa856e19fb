"""``asyncgrpo train CONFIG --dry-run`` on the reference recipe: passes offline, refuses bad edits;
the replica checks a run applies, against /server_info and plugin answers shaped like vLLM 0.32's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.errors import ConfigError
from asyncgrpo.run.preflight import check_adapter_fetching, check_lora_capacity, dry_run

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "math_sanity.yaml"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "asyncgrpo.cli.main", "train", str(RECIPE), *args, "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_recipe_dry_run_passes_offline():
    pytest.importorskip("math_verify")
    out = _cli()
    assert out.returncode == 0, out.stderr
    assert "recipe OK" in out.stdout
    assert "--max-lora-rank 1 --max-loras 6" in out.stdout
    assert "--max-model-len 4096" in out.stdout
    assert "16 prompts x G=8" in out.stdout
    assert "asyncgrpo.rewards.math:math_reward: imports" in out.stdout


def test_recipe_values():
    cfg = TrainingConfig.from_yaml(RECIPE)
    assert cfg.model == "Qwen/Qwen2.5-Math-1.5B"
    assert cfg.dataset.path == "sail/Sanity-Test-R1D-1.5B"
    assert (cfg.generation.num_generations, cfg.generation.max_completion_length) == (8, 3000)
    assert (cfg.lora.r, cfg.lora.alpha, cfg.lora.target_modules) == (1, 2.0, "all-linear")
    assert cfg.trainer.learning_rate == 4e-5
    assert (cfg.trainer.max_staleness, cfg.trainer.weight_sync_steps) == (4, 4)
    assert cfg.serve.max_model_len == 4096


def test_completion_too_long_for_context_is_refused_by_name():
    out = _cli("generation.max_completion_length=3500")
    assert out.returncode == 2  # a setting the user can fix: one line, status 2
    assert "set dataset.max_prompt_tokens to at most 596" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.reward_funcs=[no_such_pkg.rewards:fn]", "cannot import module 'no_such_pkg"),
        ("dataset.max_prompt_tokens=2000", "set dataset.max_prompt_tokens to at most 1096"),
        ("generation.max_completion_length=4096", "leaves no room for the prompt"),
    ],
)
def test_bad_recipes_name_the_field(override, message):
    pytest.importorskip("math_verify")
    with pytest.raises(ConfigError, match=message):
        dry_run(TrainingConfig.from_yaml(RECIPE, overrides=[override]))


def test_small_token_budget_is_reported():
    pytest.importorskip("math_verify")
    lines = dry_run(TrainingConfig.from_yaml(RECIPE, overrides=["trainer.token_budget=2048"]))
    assert any(line.startswith("warning: trainer.token_budget=2048") for line in lines)


def test_environment_is_imported_and_checked_by_the_dry_run():
    tool = TrainingConfig.from_yaml(RECIPE.parent / "tool_calculator.yaml")
    assert "environment asyncgrpo.testing.envs:CalculatorEnv: imports" in dry_run(tool)
    missing = TrainingConfig.from_yaml(
        RECIPE.parent / "tool_calculator.yaml",
        overrides=["rollout.environment=asyncgrpo.testing.envs:Nope"],
    )
    with pytest.raises(ConfigError, match="no attribute 'Nope'"):
        dry_run(missing)
    unscored = TrainingConfig.from_yaml(
        RECIPE.parent / "tool_calculator.yaml",
        overrides=["rollout.environment=asyncgrpo.rollout.environment:MultiTurnEnv"],
    )
    with pytest.raises(ConfigError, match="does not score its episodes"):
        dry_run(unscored)


def info(lora: dict | None, block_size: int = 128) -> dict:
    return {"vllm_config": {"lora_config": lora, "cache_config": {"block_size": block_size}}}


def test_accepts_enough_slots_and_returns_block_size() -> None:
    assert (
        check_lora_capacity(
            info({"max_lora_rank": 8, "max_loras": 4}), lora_rank=8, max_staleness=2
        )
        == 128
    )


@pytest.mark.parametrize(
    ("lora", "flag"),
    [
        (None, "--enable-lora"),
        ({"max_lora_rank": 8, "max_loras": 6}, "--max-lora-rank"),
        ({"max_lora_rank": 16, "max_loras": 3}, "--max-loras"),
    ],
)
def test_refuses_naming_the_flag(lora: dict | None, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        check_lora_capacity(info(lora), lora_rank=16, max_staleness=2)


def plugin(url: str, *roots: str, ok: bool = True) -> dict:
    info = {"plugin": "asyncgrpo", "ok": ok, "error": None if ok else "vLLM 9 lacks it"}
    return {"url": url, "status": 200, "info": {**info, "transports": list(roots)}}


def test_adapter_fetching_check_accepts_replicas_that_allow_the_transport() -> None:
    check_adapter_fetching(
        [plugin("http://a", "s3://b/runs"), plugin("http://b", "s3://b/runs/r1", "/data")],
        "s3://b/runs/r1",
    )


def test_adapter_fetching_check_leaves_out_a_replica_that_could_not_be_reached() -> None:
    """A replica that left the fleet is not taken for one without the plugin."""
    gone = {"url": "http://b", "status": 0, "body": "ConnectionRefusedError: ..."}
    check_adapter_fetching([plugin("http://a", "s3://b/runs"), gone], "s3://b/runs/r1")


@pytest.mark.parametrize(
    ("replicas", "message"),
    [
        (
            [plugin("http://a", "s3://b/runs"), {"url": "http://b", "status": 404, "body": "{}"}],
            "http://b has no asyncgrpo adapter plugin.*VLLM_PLUGINS=asyncgrpo",
        ),
        (
            [plugin("http://a", "s3://b/runs-other")],
            r"http://a may not fetch adapters from s3://b/runs/r1.*--transport s3://b/runs/r1",
        ),
        ([plugin("http://a")], "allows no transport"),
        ([plugin("http://a", "s3://b/runs", ok=False)], "vLLM 9 lacks it"),
        ([], "no replica"),
        ([{"url": "http://a", "status": 0, "body": "ConnectionRefusedError"}], "no replica"),
    ],
)
def test_adapter_fetching_check_names_the_replica_and_the_fix(
    replicas: list[dict], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        check_adapter_fetching(replicas, "s3://b/runs/r1")
