"""Job specs from a config: pure functions, no I/O."""

from __future__ import annotations

import pytest
import yaml

from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.errors import ConfigError
from asyncgrpo.launch.jobs import JobSpec
from asyncgrpo.launch.plan import (
    job_config,
    job_secrets,
    replica_args,
    trainer_args,
)
from asyncgrpo.run.job import load_config


def config(**extra) -> TrainingConfig:
    data = {"model": "m/m", "dataset": {"prompts": ["p"]}, **extra}
    return TrainingConfig.from_dict(data)


def test_replica_args_size_the_server_like_the_trainer_would() -> None:
    cfg = config(
        lora={"r": 16},
        trainer={"max_staleness": 3},
        serve={"max_model_len": 1024, "dtype": "bfloat16"},
    )
    args = replica_args(
        cfg, host="0.0.0.0", port=8000, transport_url="s3://b/p", api_key_env="HF_TOKEN"
    )
    pairs = dict(zip(args[2::2], args[3::2], strict=False))
    assert args[:2] == ["-m", "asyncgrpo.serve"]
    assert pairs["--lora-rank"] == "16" and pairs["--max-staleness"] == "3"
    assert pairs["--max-model-len"] == "1024" and pairs["--dtype"] == "bfloat16"
    assert pairs["--transport"] == "s3://b/p" and pairs["--api-key-env"] == "HF_TOKEN"


def test_trainer_config_and_secrets_round_trip_through_the_trainer_entry_point() -> None:
    """The job's config text holds no secret; each travels as a job secret under the variable
    the config loader reads, like every command's."""
    cfg = config(
        proxy={"api_key": "client-secret", "upstream_api_key": "up-secret"},
        serve={"api_key": "serve-secret"},
    )
    shipped = job_config(cfg)
    assert not any(s in shipped for s in ("client-secret", "up-secret", "serve-secret"))
    secrets = job_secrets(cfg)
    assert secrets == {
        "ASYNCGRPO_PROXY__API_KEY": "client-secret",
        "ASYNCGRPO_PROXY__UPSTREAM_API_KEY": "up-secret",
        "ASYNCGRPO_SERVE__API_KEY": "serve-secret",
    }
    urls = ["https://a--8000.hf.jobs", "https://b--8000.hf.jobs"]
    args = trainer_args(urls)
    assert not any("secret" in a for a in args)
    loaded = load_config(args[2:], {"ASYNCGRPO_CONFIG": shipped, **secrets})
    assert list(loaded.proxy.upstreams) == urls and loaded.serve.replicas == 0
    assert loaded.proxy.upstream_api_key == "up-secret" and loaded.proxy.api_key == "client-secret"
    assert loaded.model == "m/m"
    assert yaml.safe_load(shipped)["launch"]["replicas"] == cfg.launch.replicas
    bare = load_config(args[2:], {"ASYNCGRPO_CONFIG": shipped})
    assert bare.proxy.upstream_api_key is None and bare.serve.api_key is None
    with pytest.raises(ConfigError, match="ASYNCGRPO_CONFIG"):
        load_config([], {})
    with pytest.raises(ConfigError, match=r"\$ASYNCGRPO_CONFIG is not valid YAML"):
        load_config([], {"ASYNCGRPO_CONFIG": "a: [b"})


def test_describe_names_secrets_but_never_shows_their_values() -> None:
    spec = JobSpec(
        role="replica",
        name="r-0",
        command=("python3", "-m", "x"),
        env={"A": "1"},
        secrets={"HF_TOKEN": "hf_topsecret"},
        port=8000,
    )
    text = spec.describe()
    assert "HF_TOKEN" in text and "hf_topsecret" not in text and "hf_topsecret" not in repr(spec)
    assert "A=1" in text and "ports:   8000" in text


def test_launch_section_validates() -> None:
    assert config(launch={"timeout": "90m"}).launch.timeout_s == 5400
    assert config(launch={"timeout": "120"}).launch.timeout_s == 120
    for bad, field in [
        ({"timeout": "soon"}, "launch.timeout"),
        ({"replicas": 0}, "launch.replicas"),
        ({"jobs_url_template": "https://x"}, "jobs_url_template"),
    ]:
        with pytest.raises(ConfigError, match=field):
            config(launch=bad)


def test_replacements_back_off_doubling_up_to_ten_minutes() -> None:
    from asyncgrpo.launch.launcher import restart_delay

    assert [restart_delay(n, 30) for n in (1, 2, 3, 5, 6, 9)] == [30, 60, 120, 480, 600, 600]
    assert restart_delay(4, 0) == 0


def test_replacements_get_the_token_where_the_first_replicas_live() -> None:
    from asyncgrpo.launch.plan import key_origins

    jobs = ["https://6a1f--8000.hf.jobs", "https://77b2--8000.hf.jobs/"]
    assert key_origins(jobs) == ["https://*.hf.jobs"]
    assert key_origins(["http://127.0.0.1:9000/exposed/ab", "http://[::1]:80"]) == [
        "http://127.0.0.1:9000",
        "http://[::1]:80",
    ]
    assert key_origins(["http://hf.jobs:8000", "<replica-0 URL>"]) == ["http://hf.jobs:8000"]


def test_a_key_origin_with_host_star_matches_any_host_on_its_port_only() -> None:
    from asyncgrpo.config.proxy import ProxyConfig, token_allowed

    cfg = ProxyConfig(upstream_key_urls=("http://*:8000",))
    assert token_allowed("http://203.0.113.7:8000", cfg)
    assert token_allowed("http://replica.example:8000", cfg)
    assert not token_allowed("http://203.0.113.7:8001", cfg)
    assert not token_allowed("https://203.0.113.7:8000", cfg)


def test_a_skypilot_label_value_is_one_every_cloud_takes() -> None:
    from asyncgrpo.launch.skypilot_tasks import label_value

    assert label_value("sky-run") == "sky-run"
    assert label_value("My.Run_1/a") == "my-run_1-a"
    assert label_value("-x" * 40) == ("x-" * 32)[:63].rstrip("-")
    assert label_value("...") == "x"
