"""tinker-cookbook 0.6.1's own recipes, unchanged, against the service and a real vLLM replica.

``make test-cookbook`` runs this module in ``.venv-cookbook`` (tinker-cookbook beside the
project); elsewhere it is skipped, unless ``ASYNCGRPO_REQUIRE_COOKBOOK`` is set, where a missing
cookbook fails it. Everything a user would run is a process of its own: the service (one
replica of the tiny model taught the math recipes' answer format, served as
``Qwen/Qwen3-4B-Instruct-2507``) and each recipe, started from a workspace holding that model
and local copies of the datasets the recipes load by Hub name (``asyncgrpo.testing.cookbook``).
The recipes get only command-line options and environment variables. Each ends without closing
its session (none of them does), so the third finds the default ``--max-loras`` (two clients'
worth) booked by the first two unless their slots come back when their heartbeats stop.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

if os.environ.get("ASYNCGRPO_REQUIRE_COOKBOOK"):
    import tinker_cookbook  # noqa: F401  (make test-cookbook: it must be there)
else:
    pytest.importorskip("tinker_cookbook", reason="tinker-cookbook runs in make test-cookbook")

KEY = "tml-cookbook-test"
GSM8K = "tinker_cookbook.recipes.math_rl.math_env:Gsm8kDatasetBuilder"
RECIPE_TIMEOUT_S = 300
SERVICE_LOG: list[Path] = []  # the service's log, shown when a recipe fails


@pytest.fixture(scope="module")
def workspace(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from asyncgrpo.testing.cookbook import cached_boxed_model, write_workspace
    from asyncgrpo.testing.model_cache import default_cache_root

    root = tmp_path_factory.mktemp("cookbook")
    return write_workspace(root / "ws", cached_boxed_model(tiny_model, default_cache_root()))


def _env(home: Path) -> dict[str, str]:
    """What a user sets to run the recipes offline against the service."""
    env = {**os.environ, "TINKER_API_KEY": KEY, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(home),
           "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    env.pop("TINKER_BASE_URL", None)
    return env


@pytest.fixture(scope="module")
def service(workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``python -m asyncgrpo.tinker`` with one replica it starts itself, every default but what
    the tiny model needs (float32, a 1 GiB KV cache, LoRA rank 8); its URL. Stopped by SIGTERM,
    it exits 0 and stops its replica with itself, leaving no process and no copy of a version
    outside the transport."""
    import psutil

    from asyncgrpo.testing.cookbook import MODEL_NAME

    work = tmp_path_factory.mktemp("service")
    log = work / "service.log"
    SERVICE_LOG[:] = [log]
    args = [sys.executable, "-m", "asyncgrpo.tinker", "--model", str(workspace / MODEL_NAME),
            "--model-name", MODEL_NAME, "--replicas", "1", "--dtype", "float32",
            "--kv-cache-gib", "1", "--max-lora-rank", "8", "--port", "0",
            "--work-dir", str(work)]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=_env(work))
    replicas: list[psutil.Process] = []
    try:
        url = _ready(proc, log)
        replicas += [
            p
            for p in psutil.Process(proc.pid).children(recursive=True)
            if "vllm" in " ".join(p.cmdline())
        ]
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text()[-3000:]
    assert replicas, "no vLLM replica under the service"
    _, alive = psutil.wait_procs(replicas, timeout=30)
    assert not alive, f"replicas outlived the service: {[p.pid for p in alive]}"
    assert (work / "replica-logs").is_dir()
    copies = [
        f for d in ("cache", "replica-adapters") for f in (work / d).rglob("*") if f.is_file()
    ]
    assert not copies, f"copies outside the transport outlived the stop: {copies}"


def _ready(proc: subprocess.Popen, log: Path, timeout_s: float = 600) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("tinker service ready: "):
                return line.split(": ", 1)[1].strip()
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    raise AssertionError(f"the service did not get ready:\n{log.read_text()[-3000:]}")


def _recipe(module: str, workspace: Path, log_dir: Path, *args: str) -> float:
    """Run ``tinker_cookbook.recipes.<module>`` from the workspace; its start time."""
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", f"tinker_cookbook.recipes.{module}", *args, f"log_path={log_dir}"],
        cwd=workspace,
        env=_env(log_dir.parent),
        capture_output=True,
        text=True,
        timeout=RECIPE_TIMEOUT_S,
    )
    if out.returncode:
        service_log = [
            line
            for line in SERVICE_LOG[0].read_text().splitlines()
            if "/api/v1/" not in line and "aiohttp.access" not in line
        ]
        raise AssertionError(
            f"{module} failed:\n{out.stderr[-3000:]}\n--- the service's log:\n"
            + "\n".join(service_log[-60:])
        )
    return started


def _metrics(log_dir: Path) -> list[dict]:
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_sl_loop_rl_loop_and_rl_basic_run_unchanged_one_after_another(
    workspace: Path, service: str, tmp_path: Path
) -> None:
    from asyncgrpo.testing.cookbook import MODEL_NAME

    common = [f"base_url={service}", f"model_name={MODEL_NAME}", "lora_rank=8"]
    starts = [
        _recipe(
            "sl_loop",
            workspace,
            tmp_path / "sl",
            *common,
            "batch_size=16",
            "max_steps=3",
            "save_every=0",
        ),
        # rl_loop's default loss, stable_reinforce: its sampling client records what it samples
        _recipe(
            "rl_loop",
            workspace,
            tmp_path / "rl",
            *common,
            "batch_size=4",
            "group_size=4",
            "max_tokens=12",
            "max_steps=3",
            "save_every=0",
            "learning_rate=1e-3",
        ),
        # rl_basic builds its dataset builder in code: naming the builder's class on the command
        # line is how chz takes its fields (batch and group size) from there too
        _recipe(
            "rl_basic",
            workspace,
            tmp_path / "basic",
            *common,
            f"dataset_builder={GSM8K}",
            "dataset_builder.batch_size=4",
            "dataset_builder.group_size=4",
            f"dataset_builder.model_name_for_tokenizer={MODEL_NAME}",
            "dataset_builder.renderer_name=qwen3_instruct",
            "max_tokens=12",
            "max_steps=2",
            "save_every=0",
        ),
    ]
    waits = [line for line in SERVICE_LOG[0].read_text().splitlines() if "waits for LoRA" in line]
    rl_steps = [m["time/total"] for m in _metrics(tmp_path / "rl") if "time/total" in m]
    print(
        f"recipes started {[round(s - starts[0], 1) for s in starts]} s after the first; "
        f"rl_loop s/step {[round(t, 2) for t in rl_steps]}; slot waits: {waits or 'none'}"
    )

    sl = _metrics(tmp_path / "sl")
    assert len(sl) == 3 and all(math.isfinite(m["train_mean_nll"]) for m in sl), sl

    # rl_loop logs optim_step's metrics: the sampler-vs-trainer gap of the step's tokens
    rl = [m for m in _metrics(tmp_path / "rl") if "kl_sample_train_v1:mean" in m]
    assert rl, "no rl_loop step trained (every group had equal rewards?)"
    for m in rl:
        assert abs(m["kl_sample_train_v1:mean"]) < 1e-3 and m["kl_sample_train_v2:mean"] < 1e-3, m

    basic = [m for m in _metrics(tmp_path / "basic") if "optim/kl_sample_train_v1" in m]
    assert len(basic) == 2, basic
    for m in basic:
        assert abs(m["optim/kl_sample_train_v1"]) < 1e-3 and m["optim/kl_sample_train_v2"] < 1e-3, m
