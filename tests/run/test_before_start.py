"""What ``asyncgrpo train`` refuses or settles before anything starts, as a user runs it: a
separate process, the tiny example config, no vLLM (each case ends before a replica would
start, which is the point: a mistake costs seconds, not a replica start).

- every check of ``--dry-run`` runs first: a misspelt reward, a broken dataset line and an
  output directory that cannot be written are each refused in one line within seconds;
- one owner per run directory: a second ``train`` on a run directory in use is refused at once,
  naming the first one's PID and host;
- a run already at ``trainer.max_steps`` says so at once and publishes nothing, in one process
  and under torchrun.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import yaml

from asyncgrpo.store.adapters import AdapterStore
from asyncgrpo.store.checkpoints import CheckpointStore
from asyncgrpo.store.run_documents import RunStore
from asyncgrpo.transport import open_transport

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_cpu.yaml"
#: A refusal before anything starts, on a loaded 2-core machine: Python, the imports, the check.
SECONDS = 5.0


def _config(tmp_path: Path, model: Path, **changes: object) -> Path:
    """The example config (two local replicas), training ``model`` into ``tmp_path/runs``."""
    data = yaml.safe_load(EXAMPLE.read_text())
    data.update(model=str(model), output_dir=str(tmp_path / "runs"), **changes)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _train(
    *args: str, cwd: Path, timeout: float = 120
) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "asyncgrpo", "train", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done, time.monotonic() - started


def _one_line(done: subprocess.CompletedProcess, *words: str) -> str:
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for word in words:
        assert word in lines[0], lines[0]
    assert "unexpected" not in lines[0] and "Traceback" not in done.stderr
    return lines[0]


def _nothing_started(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "tiny-cpu"
    assert not (run_dir / "replica-logs").exists(), "a replica was started"
    assert not (run_dir / "store").exists(), "the run was opened"


def test_a_misspelt_reward_is_refused_in_seconds_before_any_replica(
    tmp_path: Path, tiny_model: Path
) -> None:
    config = _config(tmp_path, tiny_model)
    done, took = _train(
        str(config), "rollout.reward_funcs=[asyncgrpo.testing.rewards:digit_fractoin]", cwd=tmp_path
    )
    _one_line(done, "reward function 'asyncgrpo.testing.rewards:digit_fractoin'", "no attribute")
    assert took < SECONDS, f"refused after {took:.1f} s"
    _nothing_started(tmp_path)


def test_a_broken_dataset_line_is_refused_in_seconds_before_any_replica(
    tmp_path: Path, tiny_model: Path
) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "count to three"}\n{"prompt": "name a colour"}\n{"prompt": "x\n')
    config = _config(tmp_path, tiny_model, dataset={"path": str(data)})
    done, took = _train(str(config), cwd=tmp_path)
    _one_line(done, f"dataset {data}:3 is not valid JSON")
    assert took < SECONDS, f"refused after {took:.1f} s"
    _nothing_started(tmp_path)
    # a row without the prompt column, the same way
    data.write_text('{"prompt": "count to three"}\n{"question": "name a colour"}\n')
    _one_line(_train(str(config), cwd=tmp_path)[0], "dataset row 1 has no 'prompt' column")


@pytest.mark.parametrize("dry_run", [False, True], ids=["train", "dry-run"])
def test_an_output_dir_that_cannot_be_written_is_one_clear_line(
    tmp_path: Path, tiny_model: Path, dry_run: bool
) -> None:
    config = _config(tmp_path, tiny_model)
    args = [str(config), "output_dir=/proc/runs", *(["--dry-run"] if dry_run else [])]
    done, took = _train(*args, cwd=tmp_path)
    _one_line(done, "output_dir=/proc/runs: cannot create or write /proc/runs/tiny-cpu")
    assert took < SECONDS, f"refused after {took:.1f} s"


@pytest.fixture
def silent_upstream() -> Iterator[str]:
    """A URL that accepts connections and never answers: a run sending there waits (the first
    ``train`` below holds its run directory meanwhile)."""
    with socket.create_server(("127.0.0.1", 0), backlog=16) as server:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


def test_a_second_train_on_a_run_directory_in_use_is_refused_naming_the_first(
    tmp_path: Path, tiny_model: Path, silent_upstream: str
) -> None:
    config = _config(
        tmp_path, tiny_model, serve={"replicas": 0}, proxy={"upstreams": [silent_upstream]}
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.Popen(
        [sys.executable, "-m", "asyncgrpo", "train", str(config)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lock = tmp_path / "runs" / "tiny-cpu" / "run.lock"
    try:
        deadline = time.monotonic() + 60
        while not (lock.exists() and lock.read_text().endswith("\n")):
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the first train never took its run directory"
            time.sleep(0.1)
        done, took = _train(str(config), cwd=tmp_path)
        line = _one_line(
            done,
            f"run directory {tmp_path / 'runs' / 'tiny-cpu'} is in use by "
            f"asyncgrpo train (PID {first.pid} on host {socket.gethostname()}, since",
        )
        assert "another run_name or output_dir" in line
        assert took < SECONDS, f"refused after {took:.1f} s"
        # Ctrl-C: the first says what it does, then where a rerun starts
        first.send_signal(signal.SIGINT)
        out, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 130, err[-3000:]
    assert "SIGINT: stopping the run" in err and "the same command resumes from it" in err
    assert "interrupted, before the first checkpoint (trainer.save_steps=" in out, out
    assert "a rerun starts from step 0" in out
    assert not lock.exists()  # given up: the next train takes it


async def _finished_run(store: Path, adapter: Path, *, step: int) -> list[int]:
    """A run's transport as a finished run leaves it: run.json, versions 0-2, a checkpoint at
    ``step``. Returns the versions published."""
    async with open_transport(str(store)) as transport:
        run_id = await RunStore(transport).run_id("tiny-cpu")
        prefix = f"tiny-cpu-{run_id}"
        adapters = AdapterStore(transport)
        for v in (0, 1, 2):
            await adapters.publish(prefix, v, adapter, step=v)
        state = store.parent / "ckpt"
        state.mkdir()
        (state / "trainer.pt").write_bytes(b"state")
        await CheckpointStore(transport).save(step, state, {"version": 2, "position": 64})
        return await adapters.versions(prefix)


def _versions(store: Path) -> list[int]:
    async def read() -> list[int]:
        async with open_transport(str(store)) as transport:
            prefix = f"tiny-cpu-{await RunStore(transport).existing_run_id('tiny-cpu')}"
            return await AdapterStore(transport).versions(prefix)

    return anyio.run(read)


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            "-m", "asyncgrpo", "train", *args]  # fmt: skip


@pytest.mark.parametrize("ranks", [1, 2], ids=["one-process", "torchrun"])
def test_a_run_already_at_max_steps_says_so_at_once_and_publishes_nothing(
    tmp_path: Path, tiny_model: Path, lora_adapter: Path, ranks: int
) -> None:
    """A finished config run again (one process), and a run resumed at step 100 whose
    max_steps was lowered to 40 (torchrun, two ranks): nothing starts, nothing is published."""
    store = tmp_path / "runs" / "tiny-cpu" / "store"
    at = 40 if ranks == 1 else 100
    before = anyio.run(lambda: _finished_run(store, lora_adapter, step=at))
    config = _config(tmp_path, tiny_model)
    if ranks == 1:
        done, took = _train(str(config), "trainer.max_steps=40", cwd=tmp_path)
        assert took < SECONDS, f"took {took:.1f} s"
    else:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(
            _torchrun(str(config), "trainer.max_steps=40"),
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    said = (
        f"nothing to train: the run's checkpoint is at step {at} (trainer.max_steps=40); "
        "raise trainer.max_steps to train on (nothing was started or published)"
    )
    assert done.stdout.count(said) == 1, done.stdout  # rank 0 alone speaks
    assert "trained" not in done.stdout
    assert "final adapter: tiny-cpu-" in done.stdout and "-v2 in " in done.stdout
    assert _versions(store) == before == [0, 1, 2]
    assert not (tmp_path / "runs" / "tiny-cpu" / "replica-logs").exists()
    assert not (store / "done.json").exists()  # the run was not finished again


def test_serve_refuses_a_log_directory_it_cannot_write_before_vllm_starts(
    tmp_path: Path, tiny_model: Path
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncgrpo.serve",
            "--model",
            str(tiny_model),
            "--log-dir",
            "/proc/replica-logs",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    _one_line(done, "--log-dir /proc/replica-logs: cannot create or write /proc/replica-logs")
    assert time.monotonic() - started < SECONDS
