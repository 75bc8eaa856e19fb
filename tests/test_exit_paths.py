"""Every command's exit paths, as a user meets them: one line naming the fix, the documented
exit status (docs/config.md, "Exit statuses"), no traceback; with ``--debug`` (or
``ASYNCGRPO_DEBUG=1``) the traceback too. Each runs the command in a subprocess, in a fresh
directory.

Which paths apply:

| command        | config error | missing model | replica cannot start | failed sync |
|----------------|--------------|---------------|----------------------|-------------|
| train          | yes          | yes           | yes                  | yes         |
| rollout        | yes          | yes           | yes                  | no: a rollout process never syncs, the trainer does |
| launch         | yes          | yes (local)   | yes                  | yes: the trainer job's own error line, carried as the replica job's is here |
| demo           | yes          | no: it builds its own model | yes    | yes: it is run_training, tested through train |
| check-serving  | yes          | no: it builds its own model | yes    | no: it loads one adapter by path, no sync |
| plot           | yes          | no: it reads files only | no: it starts nothing | no |
| serve          | yes          | yes           | yes                  | no: a replica answers a failed load to its caller and keeps serving |
| proxy          | yes          | no: it loads no model | no: it starts no replica; an unreachable one leaves rotation | no: it relays a failed broadcast to its caller |

"Replica cannot start" runs real vLLM once (``serve`` with a KV cache no host has: the issue's
command) and otherwise a stand-in ``vllm`` 0.11 package first on the path: a replica that
fetches adapters refuses it before starting any process (it lacks the internals asyncgrpo's
replica plugin needs), and one that does not (``check-serving``) starts and dies at once.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncgrpo.serve import Replica

REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = str(REPO / "examples" / "tiny_cpu.yaml")
ASYNCGRPO = [sys.executable, "-m", "asyncgrpo"]
SERVE = [sys.executable, "-m", "asyncgrpo.serve"]
PROXY = [sys.executable, "-m", "asyncgrpo.proxy"]
DEBUG = {"ASYNCGRPO_DEBUG": "1"}


def _env(pythonpath: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "ASYNCGRPO_DEBUG")}
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, str(REPO)])
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # a Hub this host cannot reach, deterministically
    return {**env, **extra}


def run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300):
    return subprocess.run(
        cmd, cwd=cwd, env=env or _env(), capture_output=True, text=True, timeout=timeout
    )


def check(p: subprocess.CompletedProcess, status: int, *causes: str, debug: bool = False) -> str:
    """Exit ``status``; exactly one ``<prog>: error:`` line of the command itself, holding every
    one of ``causes``; a traceback exactly when debugging. Returns the line."""
    tail = p.stderr[-4000:]
    assert p.returncode == status, tail
    prog = "asyncgrpo" if p.args[2] == "asyncgrpo" else f"python -m {p.args[2]}"
    own = re.compile(rf"^{re.escape(prog)}( [\w-]+)?: error: ")  # a subcommand: "asyncgrpo demo"
    lines = [line for line in p.stderr.splitlines() if own.match(line)]
    assert len(lines) == 1, tail
    for cause in causes:
        assert cause in lines[0], lines[0]
    assert ("Traceback (most recent call last)" in p.stderr) is debug, tail
    return lines[0]


@pytest.fixture
def old_vllm(tmp_path: Path) -> str:
    """A directory holding a stand-in ``vllm`` 0.11 package: first on the path, it is the vLLM
    a replica would run, and it lacks the serving internals asyncgrpo's plugin needs."""
    site = tmp_path / "old-vllm"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text('__version__ = "0.11.0"\n')
    (site / "vllm-0.11.0.dist-info").mkdir()
    (site / "vllm-0.11.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm\nVersion: 0.11.0\n"
    )
    return str(site)


OLD_VLLM_CAUSE = ("vLLM 0.11.0 here lacks vllm.entrypoints", "vLLM 0.32")


# -- a config error: status 2 ------------------------------------------------------------------


@pytest.mark.parametrize("debug", [False, True])
def test_train_config_error(tmp_path: Path, debug: bool) -> None:
    flag = ["--debug"] if debug else []
    p = run([*ASYNCGRPO, *flag, "train", TINY_CONFIG, "trainer.max_steps=0"], tmp_path)
    check(p, 2, "trainer.max_steps=0: must be >= 1", debug=debug)


@pytest.mark.parametrize("env", [{}, DEBUG])
def test_rollout_config_error(tmp_path: Path, env: dict[str, str]) -> None:
    p = run(
        [*ASYNCGRPO, "rollout", TINY_CONFIG, "generation.temperature=hot"], tmp_path, _env(**env)
    )
    check(p, 2, "generation.temperature='hot': expected a number", debug=bool(env))


@pytest.mark.parametrize("debug", [False, True])
def test_launch_config_error(tmp_path: Path, debug: bool) -> None:
    flag = ["--debug"] if debug else []
    p = run(
        [*ASYNCGRPO, "launch", TINY_CONFIG, "--backend", "local", "--replicas", "0", *flag],
        tmp_path,
    )  # --debug after the subcommand works too
    check(p, 2, "launch.replicas=0: set it to 1 or more", debug=debug)


@pytest.mark.parametrize(
    ("command", "cause"),
    [
        (["demo", "--max-steps", "0"], "--max-steps: 0: must be from 1 to 100000"),
        (["check-serving", "--replicas", "0"], "--replicas: 0: must be from 1 to 32"),
    ],
)
def test_demo_and_check_serving_argument_errors(
    tmp_path: Path, command: list[str], cause: str
) -> None:
    """Refused by the argument parser, before anything is built (no traceback exists)."""
    check(run([*ASYNCGRPO, *command], tmp_path), 2, cause)


def test_export_of_a_version_too_long_for_an_adapter_name(tmp_path: Path) -> None:
    """A 19-digit ``--version`` reached the adapter store and ended as an "unexpected
    ValueError" (status 1); every number a command takes is range-checked by its parser."""
    store = tmp_path / "run" / "store"
    store.mkdir(parents=True)
    (store / "run.json").write_text('{"run_name": "r", "run_id": "ab"}')
    (store / "policy.json").write_text('{"adapter": "r-ab-v1", "version": 1}')
    p = run([*ASYNCGRPO, "export", "run", "out", "--version", "1234567890123456789"], tmp_path)
    check(p, 2, "--version: 1234567890123456789: must be from 0 to 999999999999999999")


@pytest.mark.parametrize("command", ["demo", "check-serving"])
def test_an_output_dir_the_demo_cannot_use_is_refused_and_kept(
    tmp_path: Path, command: str
) -> None:
    """A directory of the user's (the demo used to empty any --output-dir), or a path under a
    file: status 2 before anything is built, and the user's file is still there."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("years of work")
    check(run([*ASYNCGRPO, command, "--output-dir", "mine"], tmp_path), 2, "holds files no demo")
    assert (tmp_path / "mine" / "thesis.tex").read_text() == "years of work"
    (tmp_path / "a-file").write_text("")
    check(run([*ASYNCGRPO, command, "--output-dir", "a-file/sub"], tmp_path), 2, "Not a directory")


@pytest.mark.parametrize("debug", [False, True])
def test_plot_of_a_directory_without_metrics(tmp_path: Path, debug: bool) -> None:
    flag = ["--debug"] if debug else []
    p = run([*ASYNCGRPO, *flag, "plot", "runs/nothing"], tmp_path)
    check(p, 2, "runs/nothing has no metrics.jsonl", debug=debug)


@pytest.mark.parametrize("debug", [False, True])
def test_serve_config_error(tmp_path: Path, debug: bool) -> None:
    flag = ["--debug"] if debug else []
    p = run([*SERVE, "--model", "m", "--kv-cache-gib", "1.5", *flag], tmp_path)
    check(p, 2, "--kv-cache-gib='1.5': expected an integer", debug=debug)


@pytest.mark.parametrize("debug", [False, True])
def test_proxy_config_error(tmp_path: Path, debug: bool) -> None:
    flag = ["--debug"] if debug else []
    p = run([*PROXY, "--upstream", "http://127.0.0.1:9", "--port", "abc", *flag], tmp_path)
    check(p, 2, "--port='abc': expected an integer", debug=debug)


@pytest.mark.parametrize("debug", [False, True])
def test_proxy_on_a_busy_port(tmp_path: Path, debug: bool) -> None:
    flag = ["--debug"] if debug else []
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = str(held.getsockname()[1])
        p = run([*PROXY, "--upstream", "http://127.0.0.1:9", "--port", port, *flag], tmp_path)
    check(p, 2, f"cannot listen on 127.0.0.1:{port}", "choose another --port", debug=debug)


# -- a transport no transport opens: status 2 before anything starts ------------------------

FTP = "unknown transport scheme 'ftp' in 'ftp://x'; accepted: /abs/or/relative/path"


def test_train_dry_run_refuses_an_unknown_transport_scheme(tmp_path: Path) -> None:
    p = run([*ASYNCGRPO, "train", TINY_CONFIG, "--dry-run", "transport_url=ftp://x"], tmp_path)
    line = check(p, 2, "transport_url: " + FTP)
    assert "s3://bucket[/prefix]" in line and "hf://buckets/" in line  # every scheme shown
    assert "recipe OK" not in p.stdout


def test_serve_refuses_an_unknown_transport_scheme_before_vllm_starts(tmp_path: Path) -> None:
    started = time.monotonic()
    p = run(
        [
            *SERVE,
            "--model",
            str(tmp_path),
            "--transport",
            "ftp://x",
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        tmp_path,
        timeout=60,
    )
    assert time.monotonic() - started < 5
    check(p, 2, "--transport: " + FTP)
    assert not (tmp_path / "logs").exists()  # no replica was started


def test_launch_refuses_an_unknown_transport_scheme_before_any_job(tmp_path: Path) -> None:
    p = run(
        [*ASYNCGRPO, "launch", TINY_CONFIG, "--backend", "local", "transport_url=ftp://x"], tmp_path
    )
    check(p, 2, "transport_url: " + FTP)
    assert not (tmp_path / "runs" / "tiny-cpu-launch").exists()


# -- a model directory that does not exist: status 2, before any replica starts -----------------

TINY_FIX = "build the tiny test model there with `python -m asyncgrpo.testing.tiny runs/tiny-model`"


@pytest.mark.parametrize("debug", [False, True])
def test_train_in_a_fresh_directory_names_the_missing_model(tmp_path: Path, debug: bool) -> None:
    """The README's command typed where runs/tiny-model was never built."""
    flag = ["--debug"] if debug else []
    p = run([*ASYNCGRPO, *flag, "train", TINY_CONFIG, "trainer.max_steps=1"], tmp_path)
    line = check(p, 2, "model='runs/tiny-model': no such directory here", TINY_FIX, debug=debug)
    assert "Hugging Face Hub cannot be reached from this host" in line
    assert not (tmp_path / "runs" / "tiny-cpu" / "replica-logs").exists()  # nothing started


def test_the_arithmetic_recipe_in_a_fresh_directory_names_its_build_command(
    tmp_path: Path,
) -> None:
    p = run([*ASYNCGRPO, "train", str(REPO / "examples" / "arithmetic.yaml")], tmp_path)
    check(
        p,
        2,
        "model='runs/arithmetic-model': no such directory here",
        "build the arithmetic test model there with "
        "`python -m asyncgrpo.testing.arithmetic runs/arithmetic-model`",
    )
    assert not (tmp_path / "runs" / "arithmetic").exists()  # nothing started


def test_a_missing_model_of_ones_own_is_not_offered_the_tiny_model(tmp_path: Path) -> None:
    p = run([*ASYNCGRPO, "train", TINY_CONFIG, "model=models/my-qwen"], tmp_path)
    line = check(
        p,
        2,
        "model='models/my-qwen': no such directory here",
        "set model to an existing model directory or a Hugging Face id",
    )
    assert "asyncgrpo.testing.tiny" not in line


def test_rollout_names_the_missing_model(tmp_path: Path) -> None:
    check(run([*ASYNCGRPO, "rollout", TINY_CONFIG], tmp_path), 2, TINY_FIX)


def test_launch_names_the_missing_model(tmp_path: Path) -> None:
    p = run([*ASYNCGRPO, "launch", TINY_CONFIG, "--backend", "local"], tmp_path)
    check(p, 2, TINY_FIX)
    assert not (tmp_path / "runs" / "tiny-cpu-launch" / "jobs.json").exists()


@pytest.mark.parametrize("env", [{}, DEBUG])
def test_serve_names_the_missing_model(tmp_path: Path, env: dict[str, str]) -> None:
    p = run([*SERVE, "--model", "runs/tiny-model"], tmp_path, _env(**env))
    check(p, 2, TINY_FIX, debug=bool(env))


# -- a replica that cannot start: status 1 ---------------------------------------------------


@pytest.mark.parametrize("debug", [False, True])
def test_train_with_a_vllm_the_plugin_does_not_support(
    tmp_path: Path, tiny_model: Path, old_vllm: str, debug: bool
) -> None:
    flag = ["--debug"] if debug else []
    p = run(
        [*ASYNCGRPO, *flag, "train", TINY_CONFIG, f"model={tiny_model}"],
        tmp_path,
        _env((old_vllm,)),
    )
    check(p, 1, *OLD_VLLM_CAUSE, debug=debug)


def test_rollout_with_a_vllm_the_plugin_does_not_support(
    tmp_path: Path, tiny_model: Path, old_vllm: str
) -> None:
    p = run(
        [*ASYNCGRPO, "rollout", TINY_CONFIG, f"model={tiny_model}"], tmp_path, _env((old_vllm,))
    )
    check(p, 1, *OLD_VLLM_CAUSE)


def test_launch_fails_with_the_replica_jobs_own_line_before_the_trainer_starts(
    tmp_path: Path, tiny_model: Path, old_vllm: str
) -> None:
    p = run(
        [
            *ASYNCGRPO,
            "launch",
            TINY_CONFIG,
            "--backend",
            "local",
            "--poll-s",
            "0.5",
            f"model={tiny_model}",
        ],
        tmp_path,
        _env((old_vllm,)),
    )
    line = check(
        p, 1, "replica job tiny-cpu-replica-", "failed before it was healthy", *OLD_VLLM_CAUSE
    )
    assert "trainer" not in line
    launch_dir = tmp_path / "runs" / "tiny-cpu-launch"
    assert not (launch_dir / "trainer").exists()  # the trainer job never started


def test_demo_with_a_vllm_the_plugin_does_not_support(tmp_path: Path, old_vllm: str) -> None:
    p = run(
        [*ASYNCGRPO, "demo", "--output-dir", "out", "--max-steps", "1"],
        tmp_path,
        _env((old_vllm,), **DEBUG),
    )
    check(p, 1, *OLD_VLLM_CAUSE, debug=True)


@pytest.mark.vllm
def test_serve_quotes_vllms_root_cause_in_one_line(tmp_path: Path, tiny_model: Path) -> None:
    """The issue's command: vLLM fails allocating the KV cache; its worker's error is the line.
    vLLM's API server ends its log with "See root cause above": the line must carry the
    worker's own line from far above, and the log it names must still exist afterwards."""
    env = _env()
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: the worker's own process
    p = run(
        [
            *SERVE,
            "--model",
            str(tiny_model),
            "--replicas",
            "1",
            "--kv-cache-gib",
            "100000",
            "--log-dir",
            "logs",
        ],
        tmp_path,
        env,
    )
    line = check(
        p,
        1,
        "vLLM replica 0",
        "root cause: (Worker pid=",
        "ValueError: Available memory on node",
        "requested memory for kv (100000.0 GiB)",
        "full log: logs/replica-0.log",
    )
    assert "See root cause above" not in line  # the engine's pointer adds nothing
    log = tmp_path / "logs" / "replica-0.log"
    assert log.is_file()
    tail = log.read_text().splitlines()[-20:]
    assert not any("requested memory for kv" in x and "ValueError" in x for x in tail)


@pytest.mark.vllm  # a replica process is spawned (the stand-in's), which the mark promises
def test_check_serving_whose_replica_cannot_start(tmp_path: Path, old_vllm: str) -> None:
    """Its replicas load adapters by path (no plugin check): the stand-in vLLM has no API
    server, so the replica process itself exits and its own error is the line."""
    p = run(
        [*ASYNCGRPO, "--debug", "check-serving", "--replicas", "1", "--output-dir", "out"],
        tmp_path,
        _env((old_vllm,)),
    )
    check(
        p,
        1,
        "vLLM replica 0",
        "exited with code 1 before becoming healthy",
        "root cause: ModuleNotFoundError: No module named 'vllm.entrypoints'",
        debug=True,
    )


# -- a failed sync: status 1 -------------------------------------------------------------------


@pytest.mark.vllm
def test_train_whose_adapter_vllm_refuses(
    tmp_path: Path, tiny_model: Path, vllm_replicas: list[Replica]
) -> None:
    """LoRA on lm_head: vLLM refuses to load the version, and the sync stops the run."""
    p = run(
        [
            *ASYNCGRPO,
            "train",
            TINY_CONFIG,
            f"model={tiny_model}",
            "serve.replicas=0",
            f"proxy.upstreams=[{vllm_replicas[0].url}]",
            "lora.target_modules=[lm_head]",
            f"transport_url={tmp_path / 'store'}",
            "trainer.max_steps=1",
            "trainer.max_staleness=0",
        ],  # the session replicas hold 4 adapters
        tmp_path,
        timeout=600,
    )
    check(p, 1, "could not be loaded on every replica", "lm_head")
