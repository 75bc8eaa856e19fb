"""Secret fields and credentials inside URLs never leave their box: not to
trackio, reprs, dry runs, command lines, other jobs' environment or error messages; secrets
come only from the environment, and a secret of the wrong type is not echoed."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.errors import ConfigError
from asyncgrpo.launch.local import LocalBackend
from asyncgrpo.launch.plan import replica_args
from asyncgrpo.run.job import CONFIG_ENV, load_config
from asyncgrpo.serve.__main__ import parse as parse_serve
from asyncgrpo.serve.adapter_fetch import AdapterFetcher

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_cpu.yaml"
SIG = "sIgNaTuRe0123456789%2B%3D"
SAS_URL = (
    "https://acct.blob.core.windows.net/runs/r1?sv=2024-11-04&sp=racwdl&se=2030-01-01"
    f"&sr=c&sig={SIG}"
)
KEYS = {"proxy": "proxy-key-5f1e", "upstream": "hf_upstream9c2d", "serve": "serve-key-77aa"}


def _cfg(**extra: object) -> TrainingConfig:
    return TrainingConfig.from_dict(
        {
            "model": "m/m",
            "dataset": {"prompts": ["p"]},
            "transport_url": SAS_URL,
            "proxy": {"api_key": KEYS["proxy"], "upstream_api_key": KEYS["upstream"]},
            "serve": {"api_key": KEYS["serve"]},
            **extra,
        }
    )


def _leaks(text: str) -> list[str]:
    return [s for s in (SIG, *KEYS.values()) if s in text]


def test_trackio_gets_a_redacted_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """run.py hands trackio the run's config; before, it was cfg.to_dict() as is."""
    from asyncgrpo.run import training as run

    seen: dict[str, object] = {}
    stand_in = types.SimpleNamespace(
        init=lambda **kw: seen.update(kw), log=lambda *a, **k: None, finish=lambda: None
    )
    monkeypatch.setitem(sys.modules, "trackio", stand_in)
    cfg = _cfg(output_dir=str(tmp_path), logging={"trackio": True})
    run._metrics_writer(cfg, "prefix").close()
    assert seen["config"]["transport_url"].startswith("https://acct.blob.core.windows.net/runs/r1")
    assert _leaks(repr(seen["config"])) == []


def test_reprs_show_no_secret() -> None:
    cfg = _cfg()
    assert _leaks(repr(cfg)) == [] and "sv=2024-11-04" in repr(cfg)
    serve = cfg.serve.__class__(model="m", transports=(SAS_URL,), api_key=KEYS["serve"])
    assert _leaks(repr(serve)) == []


def test_a_fetcher_error_does_not_quote_the_url(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        AdapterFetcher([f"https://example.com/c/p?sv=1&sig={SIG}"], tmp_path / "cache")
    assert _leaks(str(info.value)) == []


def test_a_launch_passes_credentials_as_secrets_only(tmp_path: Path) -> None:
    """Replica argv and the trainer job's plain environment (its shipped config) carry no
    secret; the jobs get them as secrets and still end up with the same settings."""
    backend = LocalBackend(_cfg(output_dir=str(tmp_path)), tmp_path / "launch")
    replica = backend.replica_spec(0)
    trainer = backend.trainer_spec(["http://127.0.0.1:9"])
    for spec in (replica, trainer):
        assert _leaks(" ".join(spec.command)) == [], spec.command
        assert _leaks(repr(dict(spec.env))) == []
        assert _leaks(spec.describe()) == []
    assert SAS_URL not in " ".join(replica_args(_cfg(), host="h", port=1, transport_url=SAS_URL))
    # What each job starts from: its environment plus its secrets.
    env = {**dict(trainer.env), **dict(trainer.secrets)}
    loaded = load_config(list(trainer.command[3:]), env)
    assert loaded.transport_url == SAS_URL
    assert yaml.safe_load(env[CONFIG_ENV])["serve"]["api_key"] is None
    serve_env = {**dict(replica.env), **dict(replica.secrets)}
    old = dict(os.environ)
    try:
        os.environ.update(serve_env)
        serve = parse_serve(list(replica.command[replica.command.index("-m") + 2 :]))
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert serve.transports == (SAS_URL,)


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asyncgrpo.cli.main", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        timeout=120,
    )


def test_launch_dry_run_shows_no_credential(tmp_path: Path, tiny_model: Path) -> None:
    p = _cli(
        "launch",
        str(EXAMPLE),
        "--backend",
        "local",
        "--dry-run",
        f"model={tiny_model}",
        f"output_dir={tmp_path}",
        env={"ASYNCGRPO_TRANSPORT_URL": SAS_URL},
    )
    assert p.returncode == 0, p.stderr
    assert "acct.blob.core.windows.net" in p.stdout or "ASYNCGRPO_SERVE_TRANSPORTS" in p.stdout
    assert _leaks(p.stdout + p.stderr) == []


@pytest.mark.parametrize(
    ("override", "variable"),
    [
        (f"proxy.api_key={KEYS['proxy']}", "ASYNCGRPO_PROXY__API_KEY"),
        (f"serve.api_key={KEYS['serve']}", "ASYNCGRPO_SERVE__API_KEY"),
    ],
)
def test_a_secret_on_the_command_line_is_refused_in_one_line(override: str, variable: str) -> None:
    p = _cli("train", str(EXAMPLE), override, "--dry-run")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert variable in lines[0] and "secret" in lines[0]
    assert _leaks(p.stdout + p.stderr) == []


def test_a_secret_in_a_config_file_is_refused_naming_the_variable(tmp_path: Path) -> None:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["proxy"] = {"upstream_api_key": KEYS["upstream"]}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="ASYNCGRPO_PROXY__UPSTREAM_API_KEY") as info:
        TrainingConfig.from_yaml(path)
    assert _leaks(str(info.value)) == []
    # from the environment it is taken
    cfg = TrainingConfig.from_yaml(
        EXAMPLE, environ={"ASYNCGRPO_PROXY__UPSTREAM_API_KEY": KEYS["upstream"]}
    )
    assert cfg.proxy.upstream_api_key == KEYS["upstream"]


def test_a_wrongly_typed_secret_is_not_echoed() -> None:
    for section in ("proxy", "serve"):
        with pytest.raises(ConfigError, match=f"{section}.api_key") as info:
            TrainingConfig.from_dict(
                {"model": "m", "dataset": {"prompts": ["p"]}, section: {"api_key": 90817263}}
            )
        assert "90817263" not in str(info.value)


def test_launch_dry_run_errors_show_no_credential(tmp_path: Path) -> None:
    """A transport the backend cannot use was refused naming the URL whole, SAS token and
    all (``asyncgrpo launch --backend hf-jobs --dry-run``), although dry-run output and errors
    promise redaction. The command's path in-process: its config, its dry run, its error line.
    An Azure SAS URL is now one the backend takes (its token travels as a secret): its dry run
    shows no credential either."""
    from asyncgrpo.console import error_lines
    from asyncgrpo.launch.launcher import dry_run

    cfg = TrainingConfig.from_yaml(
        EXAMPLE, overrides=[f"output_dir={tmp_path}"], environ={"ASYNCGRPO_TRANSPORT_URL": SAS_URL}
    )
    assert _leaks(dry_run(cfg, "hf-jobs")) == []
    local = f"file://{tmp_path}/store?sig={SIG}"
    cfg = TrainingConfig.from_yaml(
        EXAMPLE, overrides=[f"output_dir={tmp_path}"], environ={"ASYNCGRPO_TRANSPORT_URL": local}
    )
    with pytest.raises(ConfigError, match="share no disk") as info:
        dry_run(cfg, "hf-jobs")
    (line,) = error_lines("asyncgrpo", info.value)
    assert "sig=REDACTED" in line and _leaks(line) == []


@pytest.mark.parametrize(
    "url",
    [
        f"s3://bucket/run?X-Amz-Signature={SIG}&X-Amz-Credential=AKIAIOSFODNN7EXAMPLE",
        f"s3://bucket/run#sig={SIG}",
        f"hf://buckets/ns/b/run?token={SIG}",
        f"hf://datasets/ns/d?sig={SIG}",
        f"ftp://host/run?sig={SIG}",
    ],
)
def test_a_transport_url_refused_is_shown_without_its_credentials(url: str) -> None:
    from asyncgrpo.transport import check_transport_url

    with pytest.raises(ConfigError) as info:
        check_transport_url(url)
    assert _leaks(str(info.value)) == [] and "REDACTED" in str(info.value)


@pytest.mark.parametrize(
    "url", [f"http://user:{SIG}@replica:8000", f"http://replica:8000/?sig={SIG}"]
)
def test_a_replica_url_refused_is_shown_without_its_credentials(url: str) -> None:
    from asyncgrpo.config.proxy import split_url

    with pytest.raises(ValueError, match="no credentials") as info:
        split_url(url)
    assert _leaks(str(info.value)) == []


def test_every_error_line_a_command_prints_is_redacted() -> None:
    """An error asyncgrpo did not word itself (a library's, quoting the URL it was given)."""
    from asyncgrpo.console import error_lines

    for exc in (
        OSError(f"cannot reach {SAS_URL}"),
        ConfigError(f"bad {SAS_URL}"),
        ValueError(f"signed url%3Fsig%3D{SIG}"),
    ):
        (line,) = error_lines("asyncgrpo", exc)
        assert _leaks(line) == [] and "REDACTED" in line, line
