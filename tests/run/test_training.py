"""End to end on CPU: two real float32 vLLM replicas, the proxy, the rollout client, the trainer.

The central check: for every trained sample, the logprobs vLLM returned equal the logprobs of
the adapter version the sample is tagged with, recomputed with transformers + peft (within 1e-3
per token). It fails if any replica serves a stale or wrong version, which the second test
provokes on purpose.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml

from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.errors import AuditError
from asyncgrpo.run.metrics import read_metrics, summarize
from asyncgrpo.run.sync import ProxyLoader
from asyncgrpo.run.training import run_training
from asyncgrpo.sample import Sample
from asyncgrpo.serve import Replica
from asyncgrpo.store.adapters import AdapterStore
from asyncgrpo.store.checkpoints import CheckpointStore
from asyncgrpo.testing.verify import next_token_mass, served_logprob_errors
from asyncgrpo.trainer.audit import replica_key
from asyncgrpo.vllm.client import VLLMClient

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"
TOLERANCE = 1e-3


def tiny_config(
    tmp_path: Path, model: Path, urls: Sequence[str], *overrides: str, run_name: str = "t"
) -> TrainingConfig:
    data = yaml.safe_load(EXAMPLE.read_text())
    data.update(model=str(model), output_dir=str(tmp_path), run_name=run_name)
    data["trainer"]["max_staleness"] = 2  # the session's replicas hold 4 adapters
    data["serve"] = {"replicas": 0}
    data["proxy"]["upstreams"] = list(urls)
    return TrainingConfig.from_dict(data, overrides)


async def test_end_to_end_served_logprobs_equal_trainer_and_reward_rises(
    vllm_replicas: list[Replica], tiny_model: Path, tmp_path: Path
) -> None:
    cfg = tiny_config(
        tmp_path,
        tiny_model,
        [r.url for r in vllm_replicas],
        "trainer.max_steps=30",
        "trainer.max_staleness=0",
    )
    batches: list[tuple[int, list[Sample]]] = []
    result = await run_training(cfg, on_step=lambda step, s, v: batches.append((v, list(s))))

    assert result.steps == 30
    assert result.final_version == 30  # v0 at start, then one per step
    # the final version, as a plain PEFT directory in the run directory
    assert result.adapter_dir == result.run_dir / "adapter"
    published = AdapterStore(result.transport_url)
    final_dir = await published.fetch(result.adapter_prefix, 30, tmp_path / "final-cache")
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        assert (result.adapter_dir / f).read_bytes() == (final_dir / f).read_bytes()
    assert not (result.adapter_dir / ".asyncgrpo-manifest.json").exists()
    versions = {s.version for _, batch in batches for s in batch}
    assert len(versions) >= 4, versions
    diffs = await anyio.to_thread.run_sync(
        served_logprob_errors,
        tiny_model,
        result.transport_url,
        result.adapter_prefix,
        [s for _, batch in batches for s in batch],
        tmp_path / "check-cache",
    )
    assert len(diffs) == sum(len(b) for _, b in batches)
    assert max(diffs) < TOLERANCE, f"{sum(d >= TOLERANCE for d in diffs)} samples differ"

    records = read_metrics(result.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 31))
    for key in (
        "perf/step_s",
        "perf/fwd_bwd_s",
        "perf/rollout_wait_s",
        "perf/weight_sync_s",
        "sample/staleness_mean",
        "sample/staleness_max",
        "sample/dropped_stale_total",
        "sample/rollout_queue_size",
        "rollout/backpressure_s",
        "rollout/score_block_s",
        "rollout/inflight",
        "rollout/generated_tok_s",
        "batch/samples_per_row",
        "batch/microbatches_per_step",
        "ratio",
        "kl",
        "entropy",
        "reward",
        "reward_std",
        "rewards/digit_fraction",
        "adapter_version",
    ):
        assert key in records[-1], key
    # The served-policy audit ran after every sync and passed: float32 on both sides.
    audited = [r["audit/max_abs_logprob_diff"] for r in records if "audit/tokens" in r]
    assert len(audited) >= 25 and max(audited) < TOLERANCE, audited
    # max_staleness=0: the admission window starts no rollout the trainer would drop.
    assert records[-1]["sample/dropped_stale_total"] == 0
    # Learning. The reward is the share of digits; a random policy puts ~3 % of its mass on
    # the 12 digit tokens. Sampled rewards over 30 steps are too noisy for a sharp test, so
    # measure the policy itself: the exact probability that the first completion token is a
    # digit, at v0 and at the final version, against the same measure for 5 random classes of
    # 12 untargeted tokens (what drift alone does). In sweeps the digit mass grew 1.7-3.2x
    # while control classes moved 0.5-1.4x.
    gain, controls = await anyio.to_thread.run_sync(
        class_gains, tiny_model, result, [s.prompt_ids for _, b in batches for s in b], tmp_path
    )
    first, last = summarize(records, "reward", first=5)
    assert gain > 1.5 and gain > max(controls) + 0.2, (gain, controls, first, last)


def class_gains(
    model: Path, result: Any, prompts: list[list[int]], tmp_path: Path
) -> tuple[float, list[float]]:
    """Gain in first-token probability mass (final version / v0): digits, then 5 controls."""
    import random

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    digits = [i for i in range(len(tok)) if any(c.isdigit() for c in tok.decode([i]))]
    others = [i for i in range(len(tok)) if i not in digits and i not in tok.all_special_ids]
    unique = [list(p) for p in {tuple(p) for p in prompts}]
    store = AdapterStore(result.transport_url)
    first = anyio.run(store.fetch, result.adapter_prefix, 0, tmp_path / "gain-cache")
    final = anyio.run(
        store.fetch, result.adapter_prefix, result.final_version, tmp_path / "gain-cache"
    )

    classes = [digits] + [random.Random(seed).sample(others, len(digits)) for seed in range(5)]
    after = next_token_mass(model, final, unique, classes)
    before = next_token_mass(model, first, unique, classes)
    gains = [a / b for a, b in zip(after, before, strict=True)]
    return gains[0], gains[1:]


class SkipOneReplica(ProxyLoader):
    """Loads each new version correctly on replica 0 but makes replica 1 load the previous
    version's files under the new name: the replica serves a stale policy under the right name.
    (Path delivery: the fetching plugin refuses a name that is not its URI's version.)"""

    def __init__(self, client: VLLMClient, replicas: list[Replica]) -> None:
        super().__init__(client, fetching=False)
        self.replicas = replicas
        self.previous: str | None = None

    async def load(self, name: str, location: str) -> None:
        stale = self.previous or location
        self.previous = location
        for replica, source in zip(self.replicas, (location, stale), strict=True):
            async with VLLMClient(replica.url) as direct:
                await direct.load_lora_adapter(name, source)


async def test_a_replica_serving_a_stale_version_is_caught(
    vllm_replicas: list[Replica], tiny_model: Path, tmp_path: Path
) -> None:
    """With ``trainer.audit.action=warn`` the run trains on; its audit metrics name replica 1."""
    cfg = tiny_config(
        tmp_path,
        tiny_model,
        [r.url for r in vllm_replicas],
        "trainer.max_steps=8",
        "trainer.weight_sync_steps=2",
        "proxy.routing=round_robin",
        "serve.adapter_delivery=path",
        "trainer.audit.action=warn",
        "rollout.reward_funcs=asyncgrpo.testing.rewards:always_fails,"
        "asyncgrpo.testing.rewards:digit_fraction",
    )
    batches: list[tuple[int, list[Sample]]] = []
    result = await run_training(
        cfg,
        on_step=lambda step, s, v: batches.append((v, list(s))),
        loader_factory=lambda url: SkipOneReplica(VLLMClient(url), vllm_replicas),
    )
    diffs = await anyio.to_thread.run_sync(
        served_logprob_errors,
        tiny_model,
        result.transport_url,
        result.adapter_prefix,
        [s for _, batch in batches for s in batch],
        tmp_path / "check-cache",
    )
    assert max(diffs) > 1e-2, "a replica served the previous version and nothing noticed"
    # The same run had a reward function that always raises: counted, never fatal.
    records = read_metrics(result.run_dir / "metrics.jsonl")
    assert len(records) == 8
    assert records[-1]["rollout/reward_errors_total"] > 0
    assert not math.isnan(records[-1]["reward"])
    good, stale = (
        f"audit/replica/{replica_key(r.url)}/max_abs_logprob_diff" for r in vllm_replicas
    )
    audits = [r for r in records if stale in r]
    assert audits, "no audit covered replica 1"
    assert max(r[stale] for r in audits) > 1e-2
    assert max(r.get(good, 0.0) for r in records) < TOLERANCE


async def test_the_audit_stops_the_run_naming_the_replica_within_one_sync(
    vllm_replicas: list[Replica], tiny_model: Path, tmp_path: Path
) -> None:
    """Replica 1 serves v0's weights under v1's name: the audit after the sync that follows
    the first steps on v1's samples stops the run with one line naming v1 and replica 1."""
    cfg = tiny_config(
        tmp_path,
        tiny_model,
        [r.url for r in vllm_replicas],
        "trainer.max_steps=12",
        "trainer.weight_sync_steps=2",
        "trainer.max_staleness=0",
        "trainer.samples_per_step=8",
        "generation.request_mode=per_sample",
        "proxy.routing=round_robin",
        "serve.adapter_delivery=path",
    )
    steps: list[int] = []
    with pytest.raises(AuditError) as caught:
        await run_training(
            cfg,
            on_step=lambda step, s, v: steps.append(step),
            loader_factory=lambda url: SkipOneReplica(VLLMClient(url), vllm_replicas),
        )
    line = str(caught.value)
    assert "\n" not in line
    assert f"replica {vllm_replicas[1].url} serves other weights than version 1 " in line, line
    # v1 is loaded at the sync after step 2; steps 3-4 train on its samples; the sync after
    # step 4 audits them.
    assert max(steps) == 4, steps


def _write_config(tmp_path: Path, model: Path, urls: Sequence[str], **sections: Any) -> Path:
    data = yaml.safe_load(EXAMPLE.read_text())
    data.update(model=str(model), output_dir=str(tmp_path), run_name="t")
    data["trainer"]["max_staleness"] = 2  # the session's replicas hold 4 adapters
    data["serve"] = {"replicas": 0}
    data["proxy"]["upstreams"] = list(urls)
    for section, values in sections.items():
        data[section].update(values)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "asyncgrpo.cli.main", *args]


def _adapter_prefix(store: Path) -> str:
    run = json.loads((store / "run.json").read_text())
    return f"{run['run_name']}-{run['run_id']}"


def _until(trainer: subprocess.Popen, what: str, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 600
    while not done():
        assert trainer.poll() is None, f"the trainer exited before {what}"
        assert time.monotonic() < deadline, f"no {what} within 10 minutes"
        time.sleep(0.2)


def test_interrupted_then_killed_trainer_resumes_each_step_once_and_leaves_no_scratch(
    vllm_replicas: list[Replica], tiny_model: Path, tmp_path: Path
) -> None:
    """Ctrl-C after a step beyond a checkpoint: the first signal says what the command does,
    the last line where a rerun resumes; no scratch directory is left. The rerun is then killed
    outright (SIGKILL: its scratch directory stays), and the next one resumes, trains to the
    end, and leaves each step once in metrics.jsonl and no scratch directory."""
    config = _write_config(
        tmp_path,
        tiny_model,
        [r.url for r in vllm_replicas],
        trainer={"max_steps": 10, "save_steps": 3, "weight_sync_steps": 2},
    )
    run_dir = tmp_path / "t"
    store = run_dir / "store"
    checkpoints = CheckpointStore(str(store))

    def logged() -> list[int]:
        path = run_dir / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line)["step"] for line in lines if line.endswith("}")]

    # 1. Ctrl-C once a step beyond the first checkpoint is logged
    trainer = subprocess.Popen(
        _cli("train", str(config)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _until(
            trainer,
            "a step after a checkpoint",
            lambda: (
                (ckpt := anyio.run(checkpoints.latest_checkpoint)) is not None
                and max(logged(), default=0) > ckpt
            ),
        )
        trainer.send_signal(signal.SIGINT)
        out, err = trainer.communicate(timeout=120)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    assert trainer.returncode == 130, err[-3000:]
    assert "SIGINT: stopping the run: rollouts end, adapters are unloaded" in err, err[-3000:]
    kept = anyio.run(checkpoints.latest_checkpoint)
    stopped = max(logged())
    assert stopped > kept
    said = re.search(
        r"interrupted at step (\d+): the checkpoint of step (\d+) is kept, and the "
        r"same command resumes from it(; steps (\d+)-(\d+) are trained again)?",
        out,
    )
    assert said is not None, out[-3000:]
    at, ckpt = int(said[1]), int(said[2])
    assert ckpt == kept and at == stopped
    if at > ckpt:
        assert (int(said[4]), int(said[5])) == (kept + 1, at), said[0]
    assert not list(run_dir.glob(".scratch-*")), "Ctrl-C left a scratch directory"

    # 2. the rerun resumes and is killed outright after its next checkpoint
    trainer = subprocess.Popen(_cli("train", str(config)), stderr=subprocess.DEVNULL)
    try:
        _until(
            trainer,
            "a checkpoint after the resume",
            lambda: (anyio.run(checkpoints.latest_checkpoint) or 0) > kept,
        )
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    prefix = _adapter_prefix(store)
    before = anyio.run(AdapterStore(str(store)).versions, prefix)
    resumed = anyio.run(checkpoints.latest_checkpoint)
    assert resumed is not None and list(run_dir.glob(".scratch-*")), "SIGKILL leaves its scratch"

    # 3. the next resumes from there and trains to the end
    done = subprocess.run(_cli("train", str(config)), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    # Under a pipe: the phases, one line per step trained this time, a summary that says so.
    assert f"resumed from the checkpoint of step {resumed}" in done.stdout
    steps = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == [f"{s}/10" for s in range(resumed + 1, 11)]
    assert all(" reward " in line and " v " in line for line in steps), steps
    trained = f"{10 - resumed} step{'s' if 10 - resumed != 1 else ''}"
    assert (
        f"trained {trained} in " in done.stdout
        and f"(resumed from the checkpoint of step {resumed}; 10 steps in all)" in done.stdout
    )
    assert f"PEFT directory: {run_dir / 'adapter'}" in done.stdout
    assert "\r" not in done.stdout  # no progress bar off a terminal
    after = anyio.run(AdapterStore(str(store)).versions, prefix)
    assert after == list(range(len(after))), "version numbers must be contiguous"
    assert set(before) < set(after), "a published version was lost"
    assert after[-1] > before[-1]
    # each step once in the file itself, not only as read_metrics dedups it
    assert logged() == list(range(1, 11))
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(1, 11))
    assert anyio.run(checkpoints.steps)[-1] == 10
    assert not list(run_dir.glob(".scratch-*")), "the killed run's scratch directory is left"
    assert not (run_dir / "run.lock").exists()


def test_split_mode_rollouts_ship_through_the_transport(
    vllm_replicas: list[Replica], tiny_model: Path, tmp_path: Path
) -> None:
    config = _write_config(
        tmp_path,
        tiny_model,
        [r.url for r in vllm_replicas],
        trainer={"max_steps": 4, "weight_sync_steps": 2, "max_staleness": 1},
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    rollout = subprocess.Popen(
        _cli("rollout", str(config)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        trainer = subprocess.run(
            _cli("train", str(config), "--remote-rollouts"),
            capture_output=True,
            text=True,
            timeout=900,
            env=env,
        )
        assert trainer.returncode == 0, trainer.stderr[-3000:]
        out, err = rollout.communicate(timeout=120)
        assert rollout.returncode == 0, err[-3000:]
    finally:
        if rollout.poll() is None:
            rollout.kill()
    shipped = int(out.split("shipped ")[1].split()[0])
    assert shipped >= 4 * 32
    # its phases: the trainer's first version, then each new one it switched to
    assert "waiting for the trainer's first version" in out and "generating under " in out, out
    records = read_metrics(tmp_path / "t" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # `ratio` covers the tokens sampled from the trainer's current weights (NaN on a step
    # without any; step 1 always has them): there it is the serving check
    ratios = [r["ratio"] for r in records if not math.isnan(r["ratio"])]
    assert ratios and all(abs(x - 1) < 1e-3 for x in ratios), ratios
    assert records[-1]["adapter_version"] == 2
    assert {r["sample/staleness_max"] for r in records} <= {0, 1, 2}


async def test_a_run_starts_its_own_replicas_trains_on_them_and_stops_them(
    tiny_model: Path, tmp_path: Path
) -> None:
    """``serve.replicas: 1`` (the demo's way, ``make demo``): the run starts its own replica
    behind its in-process proxy, says so with the count and how long it took before the first
    version, trains every step on served logprobs equal to the trainer's, and stops the replica
    with itself. (A replica lost mid-run: tests/launch/test_local.py's end-to-end run and
    tests/proxy/test_failover_vllm.py; the proxy is the same in-process one.)"""
    import psutil

    data = yaml.safe_load(EXAMPLE.read_text())
    data.update(model=str(tiny_model), output_dir=str(tmp_path), run_name="t")
    cfg = TrainingConfig.from_dict(data, ["trainer.max_steps=4", "serve.replicas=1"])
    batches: list[list[Sample]] = []

    def api_servers() -> list[psutil.Process]:
        return [
            p
            for p in psutil.Process().children()
            if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline())
        ]

    others = {p.pid for p in api_servers()}  # the session's replicas, when other tests started them
    servers: list[psutil.Process] = []

    def on_step(step: int, samples: Sequence[Sample], version: int) -> None:
        batches.append(list(samples))
        if step == 1:
            servers.extend(p for p in api_servers() if p.pid not in others)

    class Phases:
        """Hears the run's phases (a RunProgress); the steps are the hook's."""

        def __init__(self) -> None:
            self.said: list[str] = []

        def phase(self, text: str) -> None:
            self.said.append(text)

        def step(self, step: int, metrics: dict[str, float]) -> None:
            pass

    heard = Phases()
    result = await run_training(cfg, on_step=on_step, progress=heard)
    # the replica's start, with its count and how long it took, before the first version
    starting = next(i for i, t in enumerate(heard.said) if t.startswith("starting 1 vLLM replica "))
    waiting = [t for t in heard.said[starting + 1 :] if t.startswith("replicas still starting")]
    healthy = starting + 1 + len(waiting)  # a line every 30 s while it starts
    assert re.fullmatch(r"1 replica healthy after \d+ s", heard.said[healthy]), heard.said
    assert any(t.startswith("version 0 (") for t in heard.said[healthy + 1 :]), heard.said
    assert result.steps == 4 and result.final_version == 4
    records = read_metrics(result.run_dir / "metrics.jsonl")
    # `ratio` covers the tokens sampled from the trainer's current weights (NaN on a step
    # without any; step 1 always has them): there it is the serving check
    ratios = [r["ratio"] for r in records if not math.isnan(r["ratio"])]
    assert ratios and all(abs(x - 1) < 1e-3 for x in ratios), ratios
    assert records[-1]["rollout/retries_total"] == 0
    diffs = await anyio.to_thread.run_sync(
        served_logprob_errors,
        tiny_model,
        result.transport_url,
        result.adapter_prefix,
        [s for batch in batches for s in batch],
        tmp_path / "check-cache",
    )
    assert max(diffs) < TOLERANCE, f"{sum(d >= TOLERANCE for d in diffs)} samples differ"
    # its replica, a child of this process while the run trained, stopped with the run
    assert len(servers) == 1, servers
    _, alive = psutil.wait_procs(servers, timeout=10)
    assert alive == []


def _on_a_terminal(argv: list[str], timeout_s: float) -> tuple[int, str]:
    """Run ``argv`` with a pseudo-terminal (160 columns) as stdin, stdout and stderr; its exit
    status and everything it wrote."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 1.0)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every writer closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
        else:
            proc.kill()
    finally:
        os.close(master)
    return proc.wait(timeout=60), out.decode(errors="replace")


#: What a run directory may hold (docs/runs.md, "The run directory").
RUN_DIR_ENTRIES = {"metrics.jsonl", "store", "adapter-cache", "replica-logs", "replica-adapters",
                   "resume", "plot.png", "adapter", "eval.jsonl", "eval_metrics.jsonl",
                   "proxy-booking-token", "wandb", "run.lock", "samples.jsonl"}  # fmt: skip


def test_train_on_a_terminal_shows_phases_a_progress_bar_and_a_summary(
    vllm_replicas: list[Replica], tiny_model: Path, tmp_path: Path
) -> None:
    config = _write_config(
        tmp_path,
        tiny_model,
        [r.url for r in vllm_replicas],
        trainer={"max_steps": 2, "save_steps": 0, "weight_sync_steps": 1},
    )
    status, out = _on_a_terminal(_cli("train", str(config)), timeout_s=600)
    assert status == 0, out[-3000:]
    phases = [f"model {tiny_model}: found", "2 remote replica(s) behind the run's proxy",
              "dtype: float32 on the replicas and in the trainer",  # what /server_info said
              "loading the trainer's model", "version 0 (", "loaded on every replica"]  # fmt: skip
    for phase in phases:
        assert phase in out, out[-3000:]
    assert "training: 100%" in out and "2/2 [" in out and "reward " in out, out[-3000:]
    assert "step 1/2 " not in out  # the bar, not a line per step
    summary = out[out.index("trained 2 steps in ") :]
    assert "resumed" not in summary and f"metrics: {tmp_path / 't' / 'metrics.jsonl'}" in summary
    assert "final adapter: t-" in summary and "-v2 in " in summary
    # Only what the docs describe is left in the run directory: no scratch files.
    left = {p.name for p in (tmp_path / "t").iterdir()}
    assert left <= RUN_DIR_ENTRIES, left - RUN_DIR_ENTRIES


def _torchrun(*args: str, ranks: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", *args]  # fmt: skip


def _rank_pid(launcher: subprocess.Popen, rank: int) -> int | None:
    import psutil

    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "asyncgrpo" in child.cmdline():
                return child.pid
        except psutil.Error:
            continue
    return None


def test_two_ranks_a_killed_rank_fails_the_job_and_a_restart_resumes(
    vllm_replicas: list[Replica], tiny_model: Path, tmp_path: Path
) -> None:
    config = _write_config(
        tmp_path,
        tiny_model,
        [r.url for r in vllm_replicas],
        trainer={"max_steps": 6, "save_steps": 2, "weight_sync_steps": 2, "dp_timeout_s": 120},
    )
    store = tmp_path / "t" / "store"
    checkpoints = CheckpointStore(str(store))
    # 1. the real entry point, two ranks; rank 1 is killed after the first checkpoint
    job = subprocess.Popen(
        _torchrun("-m", "asyncgrpo", "train", str(config)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 600
        while (anyio.run(checkpoints.latest_checkpoint) or 0) < 2:
            assert job.poll() is None, "the job exited before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 10 minutes"
            time.sleep(0.5)
        rank1 = _rank_pid(job, 1)
        assert rank1 is not None, "no rank 1 under torchrun"
        os.kill(rank1, signal.SIGKILL)
        out, err = job.communicate(timeout=180)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode != 0
    assert not re.search(r"^trained \d+ step", out, re.M), out[-3000:]  # no summary
    # torchrun's summary names the dead rank and how it died
    assert "rank      : 1 (local_rank: 1)" in err and "Signal 9 (SIGKILL)" in err, err[-3000:]
    prefix = _adapter_prefix(store)
    before = anyio.run(AdapterStore(str(store)).versions, prefix)

    # 2. the restart resumes from the latest checkpoint; only rank 0 writes the transport
    writes = tmp_path / "writes.log"
    recorder = Path(__file__).with_name("torchrun_recording_writes.py")
    done = subprocess.run(
        _torchrun(str(recorder), "train", str(config)),
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "ASYNCGRPO_WRITE_LOG": str(writes)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("6 steps in all") == 1  # rank 0 alone reports
    after = anyio.run(AdapterStore(str(store)).versions, prefix)
    assert after == list(range(len(after))), "version numbers must be contiguous"
    assert set(before) < set(after), "a published version was lost"
    records = read_metrics(tmp_path / "t" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 7))
    assert records[-1]["batch/ranks"] == 2
    assert anyio.run(checkpoints.steps)[-1] == 6
    writers = {line.split()[0] for line in writes.read_text().splitlines()}
    assert writers == {"0"}, f"ranks {writers} wrote to the transport"
    # every rank resumed from the same checkpoint: rank 1 downloaded it too
    assert list((tmp_path / "t" / "resume" / "rank-1").iterdir())
