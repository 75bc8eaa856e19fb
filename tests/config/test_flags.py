"""One configuration model for every entry point: the flags, and every command's answer to a
bad one (one line, status 2), derived from the fields."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from asyncgrpo.config.flags import parse_args
from asyncgrpo.config.proxy import ProxyConfig
from asyncgrpo.errors import UsageError
from asyncgrpo.proxy.__main__ import parse as parse_proxy
from asyncgrpo.serve.__main__ import parse as parse_serve

ROOT = Path(__file__).resolve().parents[2]
PROXY = [sys.executable, "-m", "asyncgrpo.proxy", "--upstream", "http://127.0.0.1:9"]
SERVE = [sys.executable, "-m", "asyncgrpo.serve", "--model", "m"]
TRAIN = [
    sys.executable,
    "-m",
    "asyncgrpo.cli.main",
    "train",
    str(ROOT / "examples" / "tiny_cpu.yaml"),
]
ROLLOUT = [
    sys.executable,
    "-m",
    "asyncgrpo.cli.main",
    "rollout",
    str(ROOT / "examples/tiny_cpu.yaml"),
]

# (command, bad arguments, what the one-line error must name): every CLI, every kind of field.
BAD_VALUES = [
    (PROXY, ["--port", "eighty"], "--port"),  # int
    (PROXY, ["--imbalance-ratio", "fast"], "--imbalance-ratio"),  # float
    (PROXY, ["--routing", "random"], "routing"),  # choice
    (PROXY, ["--lora-root", "relative/dir"], "lora_roots"),  # path
    (PROXY, ["--upstream", "localhost:8000"], "upstreams"),  # URL
    (PROXY, ["--upstream", "http://127.0.0.1:9/"], "upstreams"),  # tuple: listed twice
    (PROXY, ["--config", "/nonexistent/proxy.yaml"], "/nonexistent/proxy.yaml"),  # path
    (PROXY, ["--upstream-api-key-env", "ASYNCGRPO_TEST_UNSET"], "--upstream-api-key-env"),
    (SERVE, ["--replicas", "two"], "--replicas"),  # int
    (SERVE, ["--kv-cache-gib", "1.5"], "--kv-cache-gib"),  # int, not a fraction
    (SERVE, ["--startup-timeout-s", "soon"], "--startup-timeout-s"),  # float
    (SERVE, ["--spread-cpu-cores=maybe"], "--spread-cpu-cores"),  # bool
    (SERVE, ["--dtype", "half"], "--dtype"),  # choice
    (SERVE, ["--config", "/nonexistent/serve.yaml"], "/nonexistent/serve.yaml"),  # path
    (SERVE, ["--nice", "20"], "serve.nice"),  # range
    (SERVE, ["--host", "0.0.0.0"], "serve.api_key"),  # no key off loopback
    (SERVE[:3], [], "--model"),  # required
    (TRAIN, ["trainer.max_steps=1.5"], "trainer.max_steps"),  # int
    (TRAIN, ["trainer.learning_rate=fast"], "trainer.learning_rate"),  # float
    (TRAIN, ["logging.jsonl=maybe"], "logging.jsonl"),  # bool
    (TRAIN, ["trainer.lr_schedule=step"], "trainer.lr_schedule"),  # choice
    (TRAIN, ["proxy.lora_roots=[relative]"], "lora_roots"),  # path
    (TRAIN, ["proxy.upstreams=[localhost:8000]"], "upstreams"),  # URL
    (TRAIN, ["rollout.reward_weights=[a]"], "rollout.reward_weights"),  # list
    (TRAIN, ["serve.kv_cache_gib=1.5"], "serve.kv_cache_gib"),
    (TRAIN, ["serve.lora_rank=8"], "serve.lora_rank"),  # set from lora.r
    ([*TRAIN[:4], "/nonexistent/run.yaml"], [], "/nonexistent/run.yaml"),  # path
    (ROLLOUT, ["generation.num_generations=many"], "generation.num_generations"),
]


@pytest.mark.parametrize(
    ("command", "args", "names"), BAD_VALUES, ids=[" ".join(a) or n for _, a, n in BAD_VALUES]
)
def test_every_cli_refuses_a_bad_value_in_one_line(
    command: list[str], args: list[str], names: str
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ASYNCGRPO_PROXY_API_KEY": ""}
    env.pop("ASYNCGRPO_TEST_UNSET", None)
    p = subprocess.run([*command, *args], capture_output=True, text=True, env=env, timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1, p.stderr
    assert names in lines[0] and "error:" in lines[0], lines[0]


def test_a_config_file_with_a_removed_key_says_what_replaced_it(tmp_path) -> None:
    """The client-side balancer is gone; a file still capping it per replica is told why."""
    config = tmp_path / "run.yaml"
    data = yaml.safe_load((ROOT / "examples" / "tiny_cpu.yaml").read_text())
    data["rollout"]["max_inflight_per_replica"] = 3
    config.write_text(yaml.safe_dump(data))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [*TRAIN[:4], str(config), "--dry-run"], capture_output=True, text=True, env=env, timeout=120
    )
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert "rollout.max_inflight_per_replica was removed" in lines[0], lines[0]
    assert "the proxy balances load" in lines[0], lines[0]


def test_flags_are_typed_from_the_fields() -> None:
    config, level = parse_proxy(
        ["--upstream", "http://a:1", "--upstream", "http://b:2", "--imbalance-ratio", "2",
         "--block-size", "none", "--port", "0", "--log-level", "debug"]
    )  # fmt: skip
    assert config.upstreams == ("http://a:1", "http://b:2")
    assert config.imbalance_ratio == 2.0 and isinstance(config.imbalance_ratio, float)
    assert (config.block_size, config.port, level) == (None, 0, "DEBUG")
    serve = parse_serve(
        ["--model", "m", "--no-spread-cpu-cores", "--kv-cache-gib", "2", "--", "--seed", "1"]
    )
    assert (serve.spread_cpu_cores, serve.kv_cache_gib) == (False, 2)
    assert serve.extra_args == ["--seed", "1"]
    assert parse_serve(["--model", "m", "--spread-cpu-cores"]).spread_cpu_cores is True


def test_serve_register_reads_the_admin_key_from_the_environment(monkeypatch) -> None:
    from asyncgrpo.serve.__main__ import _parse

    monkeypatch.setenv("ASYNCGRPO_PROXY_ADMIN_API_KEY", "adm-default")
    monkeypatch.setenv("MY_ADMIN", "adm-mine")
    _, reg, _ = _parse(["--model", "m", "--register", "http://p:1/"])
    assert (reg.proxy, reg.key) == ("http://p:1", "adm-default") and "adm" not in repr(reg)
    _, reg, _ = _parse(
        ["--model", "m", "--register", "http://p:1", "--register-key-env", "MY_ADMIN"]
    )
    assert reg.key == "adm-mine"
    assert _parse(["--model", "m"])[1] is None
    for argv, message in [
        (["--register", "p:1"], "write the proxy's URL"),
        (["--register", "http://p:1", "--register-key-env", "UNSET_X"], "UNSET_X: that variable"),
        (["--register-key-env", "MY_ADMIN"], "without --register"),
        (
            ["--register", "http://p:1", "--host", "0.0.0.0", "--api-key-env", "MY_ADMIN"],
            "bind the address the proxy reaches",
        ),
    ]:
        with pytest.raises(UsageError, match=message) as info:
            _parse(["--model", "m", *argv])
        assert info.value.prog == "python -m asyncgrpo.serve"


def test_precedence_file_then_environment_then_flags(tmp_path, monkeypatch) -> None:
    path = tmp_path / "proxy.yaml"
    path.write_text("upstreams: [http://a:1]\nport: 1\nimbalance: 3\nrouting: round_robin\n")
    monkeypatch.setenv("ASYNCGRPO_PROXY_PORT", "2")
    monkeypatch.setenv("ASYNCGRPO_PROXY_IMBALANCE", "4")
    monkeypatch.setenv("ASYNCGRPO_PROXY_API_KEY", "from-env")
    config, _ = parse_args(
        ProxyConfig,
        ["--config", str(path), "--port", "5"],
        prog="p",
        description=None,
        env_prefix="ASYNCGRPO_PROXY_",
    )
    assert (config.port, config.imbalance, config.routing) == (5, 4, "round_robin")
    assert config.upstreams == ("http://a:1",) and config.api_key == "from-env"
    monkeypatch.setenv("MY_TOKEN", "tok")
    config, _ = parse_args(
        ProxyConfig,
        ["--upstream-api-key-env", "MY_TOKEN"],
        prog="p",
        description=None,
        env_prefix="ASYNCGRPO_PROXY_",
    )
    assert config.upstream_api_key == "tok"


def test_secrets_have_no_flag_and_help_works() -> None:
    with pytest.raises(UsageError, match="--api-key-env s3cret: that variable is not set"):
        parse_proxy(["--upstream", "http://a:1", "--api-key", "s3cret"])  # abbreviates -env
    docs = {
        "asyncgrpo.proxy": "Largest gap between two chunks",
        "asyncgrpo.serve": "Seconds to wait",
    }
    for module, doc in docs.items():
        out = subprocess.run(
            [sys.executable, "-m", module, "--help"],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=60,
            check=True,
        ).stdout
        assert "--api-key-env VAR" in out and "--api-key " not in out
        # each flag's help is its field's docstring, whitespace folded
        assert doc in " ".join(out.split())


def test_the_parser_raises_and_names_the_subcommand() -> None:
    """The config layer never exits: argparse's refusal is a UsageError the command reports."""
    from asyncgrpo.config.flags import ConfigParser

    parser = ConfigParser(prog="tool")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("go").add_argument("--n", type=int)
    with pytest.raises(UsageError, match="argument --n: invalid int value: 'x'") as info:
        parser.parse_args(["go", "--n", "x"])
    assert (info.value.prog, info.value.debug) == ("tool go", None)
    with pytest.raises(UsageError, match="--port='x': expected an integer") as info:
        parse_args(
            ProxyConfig, ["--port", "x", "--debug"], prog="p", description=None, env_prefix="P_"
        )
    assert (info.value.prog, info.value.debug) == ("p", True)


JOB = [sys.executable, "-m", "asyncgrpo.run.job"]
ASYNCGRPO = [sys.executable, "-m", "asyncgrpo"]
# (command line, status, what its one error line holds, what it must not hold): the commands'
# own parsers, which no other test runs
STATUSES = [
    (
        [*ASYNCGRPO, "train"],
        2,
        "asyncgrpo train: error: the following arguments are required: config",
        "overrides",
    ),
    ([*ASYNCGRPO, "rollout"], 2, "arguments are required: config", "overrides"),
    (
        [*ASYNCGRPO, "launch", "x.yaml"],
        2,
        "asyncgrpo launch: error: the following arguments are required: --backend",
        "overrides",
    ),
    ([*ASYNCGRPO, "frob"], 2, "asyncgrpo: error: argument command: invalid choice: 'frob'", None),
    ([*JOB, "--bad"], 2, "python -m asyncgrpo.run.job: error: unrecognized arguments: --bad", None),
    (JOB, 2, "python -m asyncgrpo.run.job: error: $ASYNCGRPO_CONFIG is empty", None),
    ([*PROXY[:3]], 2, "python -m asyncgrpo.proxy: error: give at least one --upstream URL", None),
    (
        [*SERVE, "--replicas", "0"],
        2,
        "python -m asyncgrpo.serve: error: --replicas=0: start 1 or more",
        None,
    ),
]


@pytest.mark.parametrize(
    ("command", "status", "line", "absent"), STATUSES, ids=[" ".join(c[2:]) for c, *_ in STATUSES]
)
def test_each_commands_parser_exits_2_with_one_line(
    tmp_path: Path, command: list[str], status: int, line: str, absent: str | None
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCGRPO_")}
    p = subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env={**env, "PYTHONPATH": str(ROOT)},
    )
    assert p.returncode == status, p.stderr
    assert p.stderr.strip().splitlines() == [p.stderr.strip()], p.stderr  # one line
    assert line in p.stderr and (absent is None or absent not in p.stderr), p.stderr


@pytest.mark.parametrize(
    "command",
    [
        [*ASYNCGRPO, "--help"],
        [*ASYNCGRPO, "train", "--help"],
        [*ASYNCGRPO, "launch", "--help"],
        [*JOB, "--help"],
    ],
)
def test_help_still_exits_0(command: list[str]) -> None:
    p = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert p.returncode == 0 and p.stdout.startswith("usage: "), p.stderr
