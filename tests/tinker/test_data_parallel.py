"""The service on two data-parallel ranks (gloo, CPU) serves a client's steps exactly as one
process does: the same outputs through the SDK, the same adapter after a few optim_steps.

The ranks are real processes: torchrun running ``python -m asyncgrpo.tinker``, and for the
dead-rank test the two ranks started by hand (torchrun would stop rank 0 itself).
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

import numpy as np
import pytest
import torch

LENGTHS = (6, 31, 5, 7, 4)  # odd, one much longer: the ranks get 31 and 22 tokens
STEPS = 3
TOL = 1e-5  # absolute and relative: float32 noise of a loss near 40 is ~1e-5 absolute


def _command(model: Path, work: Path, *extra: str) -> list[str]:
    return ["-m", "asyncgrpo.tinker", "--model", str(model), "--port", "0", "--dtype", "float32",
            "--max-lora-rank", "8", "--work-dir", str(work), *extra]  # fmt: skip


def _wait_ready(job: subprocess.Popen, log: Path, timeout_s: float = 300) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("tinker service ready: "):
                return line.removeprefix("tinker service ready: ")
        assert job.poll() is None, log.read_text()[-3000:]
        time.sleep(0.3)
    raise AssertionError("the service did not get ready")


def _rank_pid(launcher: subprocess.Popen, rank: int) -> int:
    import psutil

    for child in psutil.Process(launcher.pid).children(recursive=True):
        if child.environ().get("RANK") == str(rank) and "asyncgrpo.tinker" in child.cmdline():
            return child.pid
    raise AssertionError(f"no rank {rank} under torchrun")


def _data(vocab: int) -> list:
    from tinker import TensorData, types

    rng = np.random.default_rng(0)
    data = []
    for n in LENGTHS:
        inputs = {
            "target_tokens": rng.integers(0, vocab, n).tolist(),
            "logprobs": TensorData.from_numpy(-rng.uniform(1, 5, n).astype(np.float32)),
            "advantages": TensorData.from_numpy(rng.normal(0, 1, n).astype(np.float32)),
        }
        ids = rng.integers(0, vocab, n).tolist()
        data.append(types.Datum(model_input=types.ModelInput.from_ints(ids), loss_fn_inputs=inputs))
    return data


def _train(url: str, model: str, vocab: int) -> dict:
    """A client's steps: each forward_backward's outputs, then its saved adapter's path."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=url)
    client = service.create_lora_training_client(base_model=model, rank=4, seed=3).result()
    data, steps = _data(vocab), []
    for _ in range(STEPS):
        out = client.forward_backward(data, "importance_sampling").result()
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        steps.append(
            {
                "loss": out.metrics["loss:sum"],
                "outputs": [{k: v.to_numpy() for k, v in o.items()} for o in out.loss_fn_outputs],
            }
        )
    final = client.forward(data, "importance_sampling").result()
    steps.append(
        {
            "loss": final.metrics["loss:sum"],
            "outputs": [{k: v.to_numpy() for k, v in o.items()} for o in final.loss_fn_outputs],
        }
    )
    client.save_state("end").result()
    service.close("success").result()
    return {"steps": steps}


def _adapter(work: Path) -> dict[str, torch.Tensor]:
    (state,) = work.rglob("tinker_state.pt")
    return torch.load(state, weights_only=True)["adapter"]


@pytest.fixture(scope="module")
def vocab(tiny_model: Path) -> int:
    import json

    return int(json.loads((tiny_model / "config.json").read_text())["vocab_size"])


@pytest.fixture(scope="module")
def one_process(tiny_model: Path, vocab: int, tmp_path_factory: pytest.TempPathFactory) -> dict:
    from anyio.from_thread import start_blocking_portal

    from asyncgrpo.tinker import TinkerConfig, serve_tinker

    work = tmp_path_factory.mktemp("one")
    config = TinkerConfig(
        model=str(tiny_model), port=0, max_lora_rank=8, dtype="float32", work_dir=str(work)
    )
    with (
        start_blocking_portal() as portal,
        portal.wrap_async_context_manager(serve_tinker(config)) as url,
    ):
        out = _train(url, config.served_name, vocab)
    return {**out, "adapter": _adapter(work)}


@pytest.fixture(scope="module")
def two_ranks(tiny_model: Path, vocab: int, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("two")
    log = work / "torchrun.log"
    with log.open("w") as sink:
        job = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=2",
                *_command(tiny_model, work),
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        url = _wait_ready(job, log)
        out = _train(url, str(tiny_model), vocab)
        os.kill(_rank_pid(job, 0), signal.SIGTERM)  # rank 0 stops; it tells rank 1 to exit
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    return {**out, "adapter": _adapter(work), "returncode": job.returncode, "log": log.read_text()}


def test_two_ranks_give_the_outputs_of_one_process(one_process: dict, two_ranks: dict) -> None:
    assert two_ranks["returncode"] == 0, two_ranks["log"][-3000:]  # both ranks exited cleanly
    for one, two in zip(one_process["steps"], two_ranks["steps"], strict=True):
        assert two["loss"] == pytest.approx(one["loss"], abs=TOL, rel=TOL)
        assert len(two["outputs"]) == len(LENGTHS)
        for a, b in zip(one["outputs"], two["outputs"], strict=True):
            assert set(a) == set(b) == {"logprobs", "elementwise_loss"}
            for key in a:
                np.testing.assert_allclose(b[key], a[key], rtol=TOL, atol=TOL)
    losses = [s["loss"] for s in one_process["steps"]]
    assert abs(losses[-1] - losses[0]) > 100 * TOL  # the steps moved the adapter


def test_two_ranks_step_the_adapter_of_one_process(one_process: dict, two_ranks: dict) -> None:
    one, two = one_process["adapter"], two_ranks["adapter"]
    assert set(one) == set(two)
    assert max(float(t.abs().max()) for n, t in one.items() if "lora_B" in n) > 1e-3
    for name in one:  # a rank that stepped its own share's gradient alone would differ here
        torch.testing.assert_close(two[name], one[name], rtol=TOL, atol=TOL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def hand_started_ranks(tiny_model: Path, tmp_path: Path) -> Iterator[list]:
    port = _free_port()
    jobs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
        log = tmp_path / f"rank{rank}.log"
        with log.open("w") as sink:
            cmd = [sys.executable, *_command(tiny_model, tmp_path, "--dp-timeout-s", "8")]
            jobs.append(
                (
                    subprocess.Popen(
                        cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, text=True
                    ),
                    log,
                )
            )
    yield jobs
    for job, _ in jobs:
        if job.poll() is None:
            job.kill()
            job.wait()


def test_a_dead_rank_stops_rank_0_naming_it(hand_started_ranks: list) -> None:
    (rank0, log0), (rank1, _) = hand_started_ranks
    _wait_ready(rank0, log0)
    rank1.send_signal(signal.SIGKILL)
    rank1.wait()
    rank0.wait(timeout=60)  # with no request at all: its keepalive finds rank 1 gone
    out = log0.read_text()
    assert rank0.returncode != 0, out[-3000:]
    assert "rank 0 of 2:" in out and "another rank died" in out, out[-3000:]
    assert "tinker.dp_timeout_s=8" in out, out[-3000:]
