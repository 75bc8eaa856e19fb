"""Paths resolved once, where a config is loaded: a sweep point, a backend and a launched job
read the path the user meant, whatever directory they run in."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from asyncgrpo.config.paths import resolve_paths
from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.launch.local import LocalBackend
from asyncgrpo.launch.plan import job_config
from asyncgrpo.launch.sweep import sweep_points
from asyncgrpo.run.job import load_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh directory to type commands in, holding the README's tiny-model directory."""
    (tmp_path / "runs" / "tiny-model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_readmes_sweep_points_name_the_model_the_user_built(here: Path) -> None:
    """The issue's sweep: each point's job runs in its own directory, so its config must name
    the model directory absolutely, like the single launch's."""
    cfg = TrainingConfig.from_yaml(
        "examples/tiny_cpu.yaml",
        ["launch.sweep=['trainer.learning_rate=1e-3,3e-3']", "launch.replicas=1"],
        environ={},
    )
    model = str(here / "runs" / "tiny-model")
    assert cfg.model == model and cfg.serve.model == model
    backend = LocalBackend(cfg, cfg.run_dir / "launch")
    points = sweep_points(cfg, backend.transport_url)
    assert [p.cfg.model for p in points] == [model, model]
    for point in points:  # what the point's trainer job loads, in its own directory
        shipped = backend.trainer_spec(["http://127.0.0.1:1"], point.cfg).env["ASYNCGRPO_CONFIG"]
        assert yaml.safe_load(shipped)["model"] == model
        assert yaml.safe_load(shipped)["output_dir"] == "runs"  # the job's own directory


def test_each_path_field_and_what_is_not_a_path(here: Path) -> None:
    (here / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    data = {
        "model": "runs/tiny-model",
        "dataset": {"path": "prompts.jsonl"},
        "transport_url": "store",
        "serve": {"log_dir": "logs", "adapter_cache_dir": "~/c"},
    }
    cfg = TrainingConfig.from_dict(data)
    assert cfg.model == str(here / "runs" / "tiny-model")
    assert cfg.dataset.path == str(here / "prompts.jsonl")
    assert cfg.transport_url == str(here / "store")
    assert cfg.output_dir == str(here / "runs") and cfg.run_dir == here / "runs" / "asyncgrpo"
    assert cfg.serve.log_dir == str(here / "logs")
    assert cfg.serve.adapter_cache_dir == str(Path.home() / "c")
    # not paths here: a Hugging Face id, a `datasets` name, URLs; kept as typed
    for name in ("Qwen/Qwen2.5-0.5B", "runs/missing-model"):
        assert TrainingConfig.from_dict({**data, "model": name}).model == name
    named = {**data, "dataset": {"path": "openai/gsm8k"}}
    assert TrainingConfig.from_dict(named).dataset.path == "openai/gsm8k"
    for url in ("s3://bucket/run", "file:///abs/store", "hf://buckets/me/b"):
        assert TrainingConfig.from_dict({**data, "transport_url": url}).transport_url == url


def test_once_a_loaded_config_travels_its_paths_stay_put(here: Path, tmp_path_factory) -> None:
    """Loaded again in another directory (a launched job's), or round-tripped, nothing moves."""
    cfg = TrainingConfig.from_dict(
        {"model": "runs/tiny-model", "dataset": {"prompts": ["hi"]}, "transport_url": "store"}
    )
    assert TrainingConfig.from_dict(cfg.to_dict()) == cfg
    elsewhere = tmp_path_factory.mktemp("job")
    loaded = load_config([], {"ASYNCGRPO_CONFIG": job_config(cfg)})
    assert (loaded.model, loaded.transport_url) == (cfg.model, cfg.transport_url)
    moved = resolve_paths(TrainingConfig, yaml.safe_load(job_config(cfg)), elsewhere)
    assert moved["output_dir"] == str(elsewhere / "runs") and moved["model"] == cfg.model


def test_a_value_of_the_wrong_type_is_left_for_the_loader_to_name(here: Path) -> None:
    from asyncgrpo.errors import ConfigError

    with pytest.raises(ConfigError, match="output_dir=3: expected a string"):
        TrainingConfig.from_dict({"model": "m", "dataset": {"prompts": ["hi"]}, "output_dir": 3})
    with pytest.raises(ConfigError, match="missing required key"):
        TrainingConfig.from_dict({"dataset": {"prompts": ["hi"]}})
