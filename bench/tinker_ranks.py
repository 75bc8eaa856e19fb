"""Seconds per forward_backward + optim_step of the Tinker service on 1 process vs N ranks.

Each variant starts the real command on a tiny model made here (``python -m asyncgrpo.tinker``,
or ``torchrun --nproc-per-node N -m asyncgrpo.tinker``; gloo on CPU), and one SDK client sends
the same batch (``--datums`` datums of ``--length`` tokens, ``importance_sampling``) then an
AdamW step, ``--rounds`` times after a warm-up round; the median and min per round. Torch threads
per rank: ``OMP_NUM_THREADS`` as torchrun sets it (1 per rank with several ranks); the 1-process
variant runs at ``--threads`` (default: every core, as the service does by default) and at 1.

Run: ``python bench/tinker_ranks.py [--ranks 2] [--datums 32] [--length 128] [--rounds 5]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this file's directory comes first on sys.path and would shadow the SDK.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import argparse
import os
import signal
import statistics
import subprocess
import tempfile
import time

import numpy as np

from asyncgrpo.testing import make_tiny_model


def _start(
    model: Path, work: Path, ranks: int, threads: int | None
) -> tuple[subprocess.Popen, str]:
    """The service on ``ranks`` ranks; the process and its URL once ready."""
    args = ["-m", "asyncgrpo.tinker", "--model", str(model), "--port", "0", "--dtype", "float32",
            "--max-lora-rank", "8", "--work-dir", str(work), "--log-level", "WARNING"]  # fmt: skip
    if ranks > 1:
        args = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *args]
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    log = work / "service.log"
    with log.open("w") as sink:
        job = subprocess.Popen(
            [sys.executable, *args],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("tinker service ready: "):
                return job, line.removeprefix("tinker service ready: ")
        if job.poll() is not None:
            raise RuntimeError(log.read_text()[-2000:])
        time.sleep(0.3)
    raise RuntimeError("the service did not get ready in 10 minutes")


def _batch(datums: int, length: int, vocab: int) -> list:
    from tinker import TensorData, types

    rng = np.random.default_rng(0)
    out = []
    for _ in range(datums):
        inputs = {
            "target_tokens": rng.integers(0, vocab, length).tolist(),
            "logprobs": TensorData.from_numpy(-rng.uniform(4, 7, length).astype(np.float32)),
            "advantages": TensorData.from_numpy(
                np.full(length, rng.uniform(-1, 1), dtype=np.float32)
            ),
        }
        ids = rng.integers(0, vocab, length).tolist()
        out.append(types.Datum(model_input=types.ModelInput.from_ints(ids), loss_fn_inputs=inputs))
    return out


def _time_steps(url: str, model: Path, data: list, rounds: int) -> list[float]:
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=url)
    client = service.create_lora_training_client(base_model=str(model), rank=8, seed=0).result()
    times = []
    for _ in range(rounds + 1):  # the first is a warm-up
        start = time.perf_counter()
        client.forward_backward(data, "importance_sampling").result()
        client.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        times.append(time.perf_counter() - start)
    service.close("success").result()
    return times[1:]


def _variant(model: Path, ranks: int, threads: int | None, data: list, rounds: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        job, url = _start(model, Path(tmp), ranks, threads)
        try:
            return _time_steps(url, model, data, rounds)
        finally:
            os.killpg(job.pid, signal.SIGTERM)  # rank 0 stops and tells the others to exit
            job.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the data-parallel variant")
    parser.add_argument("--datums", type=int, default=32)
    parser.add_argument("--length", type=int, default=128, help="tokens per datum")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads of the 1-process variant",
    )
    parser.add_argument("--hidden-size", type=int, default=128, help="of the tiny model")
    parser.add_argument("--layers", type=int, default=2, help="of the tiny model")
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    os.environ.setdefault("TINKER_API_KEY", "tml-loopback-bench")
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(
            Path(tmp) / "model",
            hidden_size=args.hidden_size,
            num_layers=args.layers,
            num_heads=args.hidden_size // 64,
        )
        data = _batch(args.datums, args.length, vocab=384)
        print(
            f"{args.datums} datums x {args.length} tokens, hidden {args.hidden_size}, "
            f"{args.layers} layers, {os.cpu_count()} cores; s per forward_backward+optim_step"
        )
        variants = [(1, args.threads), (1, 1), (args.ranks, None)]
        for ranks, threads in dict.fromkeys(variants):
            times = _variant(model, ranks, threads, data, args.rounds)
            what = f"{ranks} rank(s), {threads or 1} thread(s) each"
            print(f"{what:<28} median {statistics.median(times):.3f}  min {min(times):.3f}")


if __name__ == "__main__":
    main()
