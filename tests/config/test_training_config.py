"""TrainingConfig: YAML + typed CLI overrides, unknown keys fatal, validation names the fix."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from asyncgrpo.config.coerce import config_from_dict
from asyncgrpo.config.fields import field_docs
from asyncgrpo.config.rollout import RolloutConfig
from asyncgrpo.config.trainer import LoraConfig, TrainerConfig
from asyncgrpo.config.training import LoggingConfig, TrainingConfig
from asyncgrpo.errors import ConfigError

BASE = {"model": "some/model", "dataset": {"prompts": ["hi", "there"]}}
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"


def _cfg(*overrides: str, **sections) -> TrainingConfig:
    return TrainingConfig.from_dict({**BASE, **sections}, list(overrides))


def test_from_yaml_with_typed_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "model: m\n"
        "dataset: {path: data.jsonl}\n"
        "trainer: {learning_rate: 3.0e-5, token_budget: 1024}\n"
        "lora: {r: 2}\n"
    )
    cfg = TrainingConfig.from_yaml(
        path,
        overrides=[
            "trainer.learning_rate=1e-4",  # YAML 1.1 would read this as a string
            "trainer.token_budget=none",
            "trainer.gradient_checkpointing=true",
            "lora.target_modules=[q_proj, v_proj]",
            "generation.stop=</s>,<|im_end|>",
            "serve.kv_cache_gib=3",
            "proxy.upstreams=[http://10.0.0.1:8000]",
            "seed=3",
        ],
    )
    assert cfg.trainer.learning_rate == 1e-4
    assert isinstance(cfg.trainer.learning_rate, float)
    assert cfg.trainer.token_budget is None
    assert cfg.trainer.gradient_checkpointing is True
    assert cfg.lora.r == 2
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.generation.stop == ["</s>", "<|im_end|>"]
    assert cfg.serve.kv_cache_gib == 3
    # The replicas' model, rank and slots come from the trainer's settings.
    assert (cfg.serve.model, cfg.serve.lora_rank, cfg.serve.max_staleness) == ("m", 2, 4)
    assert cfg.proxy.upstreams == ("http://10.0.0.1:8000",)
    assert cfg.seed == 3
    assert cfg.dataset.path == "data.jsonl"


def test_round_trip_to_dict():
    cfg = _cfg("lora.target_modules=[q_proj]", "proxy.upstreams=[http://a:1]")
    data = cfg.to_dict()
    assert isinstance(data["proxy"]["upstreams"], list)
    assert TrainingConfig.from_dict(data) == cfg


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.lr=1", "unknown key 'trainer.lr'; valid keys are: adam_beta1, adam_beta2"),
        ("nope=1", "unknown key 'nope'"),
        ("trainer.learning_rate=fast", "trainer.learning_rate='fast': expected a number"),
        ("trainer.max_steps=1.5", "trainer.max_steps='1.5': expected an integer"),
        ("trainer.gradient_checkpointing=maybe", "expected true or false"),
        ("trainer.lr_schedule=step", "lr_schedule='step'"),
        ("trainer.epsilon=0", "trainer.epsilon=0.0: must be > 0"),
        ("trainer.max_staleness=-1", "trainer.max_staleness=-1"),
        ("trainer.weight_sync_steps=0", "trainer.weight_sync_steps=0"),
        (
            "trainer.tis_cap=3",
            "trainer.tis_cap was removed: write trainer.off_policy=none trainer.importance_cap=C",
        ),
        ("trainer.off_policy=ppo", "trainer.off_policy='ppo': use one of 'none', 'decoupled'"),
        ("trainer.importance_cap=1", "trainer.importance_cap=1.0: must be a number > 1"),
        ("generation.top_p=0.9", "generation.top_p=0.9: vLLM's logprobs are then of the truncated"),
        ("generation.top_k=20", "generation.top_k=20: vLLM's logprobs"),
        ("generation.min_p=0.1", "generation.min_p=0.1: vLLM's logprobs"),
        ("generation.repetition_penalty=1.1", "generation.repetition_penalty=1.1: vLLM's"),
        ("trainer.dp_timeout_s=0", "trainer.dp_timeout_s=0.0: must be > 0"),
        ("lora.r=0", "lora.r=0"),
        ("lora.dropout=1", "lora.dropout"),
        ("run_name=a/b", "run_name='a/b'"),
        (
            "proxy.upstreams=[localhost:8000]",
            "is not an http(s)://HOST[:PORT] URL; write http://HOST:PORT",
        ),
        ("serve.kv_cache_gib=1.5", "serve.kv_cache_gib='1.5': expected an integer"),
        ("serve.kv_cache_gib=0", "serve.kv_cache_gib=0: must be >= 1, or None"),
        ("serve.lora_rank=8", "serve.lora_rank is set from lora.r"),
        ("serve.replicas=0", "proxy.upstreams is empty"),
        ("serve.dtype=half", "use one of 'auto'"),
        ("serve.nice=20", "serve.nice=20: must be <= 19"),
        ("rollout.max_inflight=4", "raise max_inflight to at least num_generations"),
        ("rollout.max_inflight_per_replica=3", "max_inflight_per_replica was removed: the proxy"),
        ("trainer.max_steps", "write it as section.field=value"),
        # numbers fit what consumes them: a seed of 2**70 failed in torch, at the start
        ("seed=1180591620717411303424", "seed=1180591620717411303424: must fit in 64 bits"),
        ("proxy.max_connections=99999999999999999999", "max_connections=9999"),
        ("trainer.max_steps.x=1", "has no fields"),
    ],
)
def test_bad_values_name_field_and_fix(override, message):
    with pytest.raises(ConfigError, match=None) as info:
        _cfg(override)
    assert message in str(info.value)


def test_yaml_type_errors_and_missing_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.samples_per_step=True: expected an integer"):
        _cfg(trainer={"samples_per_step": True})
    with pytest.raises(ConfigError, match=r"lora.target_modules=3"):
        _cfg(lora={"target_modules": 3})
    with pytest.raises(ConfigError, match=r"unknown key 'serve.replica'"):
        _cfg(serve={"replica": 2})
    with pytest.raises(ConfigError, match=r"serve.kv_cache_gib=1.5: expected an integer"):
        _cfg(serve={"kv_cache_gib": 1.5})  # refused at load, not when the replicas launch
    with pytest.raises(ConfigError, match=r"serve.model is set from model"):
        _cfg(serve={"model": "other"})
    with pytest.raises(ConfigError, match=r"missing required key.*model"):
        TrainingConfig.from_dict({"dataset": {"prompts": ["x"]}})
    with pytest.raises(ConfigError, match="trainer: expected a mapping"):
        _cfg(trainer=[1])
    with pytest.raises(ConfigError, match="does not exist"):
        TrainingConfig.from_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        TrainingConfig.from_yaml(bad)


def test_sections_validate_on_their_own():
    assert _cfg("serve.replicas=0", "proxy.upstreams=[http://a:1]").serve.replicas == 0
    with pytest.raises(ConfigError, match=r"logging\.log_every"):
        LoggingConfig(log_every=0)
    assert TrainerConfig(epsilon=0.2).clip_high == 0.2
    assert TrainerConfig(epsilon=0.2, epsilon_high=0.28).clip_high == 0.28
    assert config_from_dict(LoraConfig, {"alpha": 4}).alpha == 4.0  # int accepted as float


def _all_dataclasses(cls, seen):
    if cls in seen:
        return
    seen.add(cls)
    import typing

    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            _all_dataclasses(tp, seen)


def test_every_field_has_help_and_sections_are_keyword_only():
    seen: set = set()
    _all_dataclasses(TrainingConfig, seen)
    assert len(seen) >= 9
    for cls in seen:
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
            assert f.kw_only, f"{cls.__name__}.{f.name} is not keyword-only"


def test_example_config_loads():
    cfg = TrainingConfig.from_yaml(EXAMPLE)
    assert cfg.serve.replicas == 2
    assert cfg.trainer.dtype == "float32"
    assert cfg.run_dir == Path.cwd() / "runs" / "tiny-cpu"  # absolute from where it was loaded


def test_environment_overrides_between_file_and_arguments(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: m\ndataset: {path: d.jsonl}\ntrainer: {max_steps: 5}\n")
    env = {"ASYNCGRPO_TRAINER__MAX_STEPS": "7", "ASYNCGRPO_PROXY__API_KEY": "k"}
    cfg = TrainingConfig.from_yaml(path, environ=env)
    assert (cfg.trainer.max_steps, cfg.proxy.api_key) == (7, "k")
    assert TrainingConfig.from_yaml(path, ["trainer.max_steps=9"], env).trainer.max_steps == 9
    with pytest.raises(ConfigError, match="ASYNCGRPO_TRAINER__MAX_STEPS='x': expected an integer"):
        TrainingConfig.from_yaml(path, environ={"ASYNCGRPO_TRAINER__MAX_STEPS": "x"})


def test_the_dual_clip_of_off_policy_none_must_exceed_the_clip_range():
    with pytest.raises(ConfigError, match="with off_policy=none it must exceed 1 \\+ epsilon_high"):
        _cfg("trainer.off_policy=none", "trainer.importance_cap=1.1")
    assert _cfg("trainer.off_policy=decoupled", "trainer.importance_cap=1.1")


def test_a_trailing_newline_is_no_valid_value():
    """Checked with fullmatch: a ``$`` pattern accepts a value ending in a newline."""
    base = {"model": "m", "dataset": {"prompts": ["p"]}}
    with pytest.raises(ConfigError, match=r"launch\.timeout"):
        TrainingConfig.from_dict(base, ["launch.timeout=8h\n"])
    with pytest.raises(ConfigError, match="reward_funcs"):
        RolloutConfig(reward_funcs=["asyncgrpo.rollout.rewards:digit_fraction\n"])


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_a_number_setting_is_finite(value: float) -> None:
    """YAML's ``.inf`` and ``.nan`` are floats: an infinite timeout or backoff waits forever,
    a NaN passes every bound it is not compared against. Unset (None) is how a limit is off."""
    with pytest.raises(ConfigError, match=r"rollout.retry_backoff_s=.*must be a finite number"):
        TrainingConfig.from_dict(
            {"model": "m", "dataset": {"prompts": ["p"]}, "rollout": {"retry_backoff_s": value}}
        )
