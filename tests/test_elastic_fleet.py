"""An elastic inference fleet, end to end on CPU with real vLLM replicas.

Processes as users run them: ``python -m asyncgrpo.serve`` (two replicas), ``python -m
asyncgrpo.proxy`` in front of them, and the trainer (``run_training`` here, ``serve.replicas=0``,
``proxy.upstreams=[PROXY]``). One replica's process group is SIGKILLed mid-run; the run must
finish every step with no rollout request failing and served logprobs equal to the trainer's;
a replica started later (``--register PROXY``) joins, is brought up to date by the proxy before
it takes a request, and serves its share.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest
import yaml

from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.run.metrics import read_metrics
from asyncgrpo.run.training import run_training
from asyncgrpo.sample import Sample
from asyncgrpo.testing.verify import served_logprob_errors

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny_cpu.yaml"
TOLERANCE = 1e-3
ADMIN_KEY = "elastic-admin-key-0123456789"
#: vLLM's request log line (``--enable-log-requests``): the adapter each request ran under.
REQUEST_LORA = re.compile(r"Received request .*lora_request: LoRARequest\(lora_name='([^']+)'")


class Background:
    """A command in its own session, its output in a file; stopped with SIGTERM, then killed."""

    def __init__(self, argv: Sequence[str], log: Path, env: dict[str, str]) -> None:
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, *argv], stdout=out, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,
            )  # fmt: skip

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, count: int = 1, timeout_s: float = 600) -> list[re.Match]:
        """The first ``count`` matches of ``pattern`` in the output, waiting for them."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = list(re.finditer(pattern, self.text()))
            if len(found) >= count:
                return found[:count]
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {pattern!r} in {self.log}:\n{self.text()[-3000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def get_json(url: str) -> dict:
    return json.loads(get_text(url))


def serve_argv(model: Path, store: Path, log_dir: Path, replicas: int, *extra: str) -> list[str]:
    cfg = yaml.safe_load(EXAMPLE.read_text())
    return [
        "-m", "asyncgrpo.serve", "--model", str(model), "--replicas", str(replicas),
        "--transport", str(store), "--dtype", "float32", "--kv-cache-gib", "1",
        "--max-model-len", str(cfg["serve"]["max_model_len"]), "--lora-rank", "1",
        "--max-staleness", str(cfg["trainer"]["max_staleness"]), "--log-dir", str(log_dir),
        *extra,
    ]  # fmt: skip


def config(tmp_path: Path, model: Path, proxy: str, store: Path, *overrides: str):
    data = yaml.safe_load(EXAMPLE.read_text())
    data.update(model=str(model), output_dir=str(tmp_path), run_name="elastic",
                transport_url=str(store))  # fmt: skip
    data["serve"] = {"replicas": 0}
    data["proxy"] = {"upstreams": [proxy], "admin_api_key": ADMIN_KEY}  # its book of runs
    return TrainingConfig.from_dict(data, list(overrides))


async def test_a_replica_killed_mid_run_costs_nothing_and_a_new_one_joins_and_serves(
    tiny_model: Path, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    store.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "ASYNCGRPO_PROXY_ADMIN_API_KEY": ADMIN_KEY}
    started: list[Background] = []
    try:
        fleet = Background(serve_argv(tiny_model, store, tmp_path / "fleet", 2),
                           tmp_path / "fleet.out", env)  # fmt: skip
        started.append(fleet)
        ready = fleet.wait_for(r"replica (\d) ready: (\S+) \(pid (\d+)", count=2)
        urls = [m[2] for m in ready]
        pids = [int(m[3]) for m in ready]
        upstreams = [arg for url in urls for arg in ("--upstream", url)]
        proxy_proc = Background(["-m", "asyncgrpo.proxy", *upstreams, "--port", "0",
                                 "--health-interval-s", "0.5"], tmp_path / "proxy.out", env)  # fmt: skip
        started.append(proxy_proc)
        proxy = proxy_proc.wait_for(r"asyncgrpo proxy on (\S+)")[0][1]

        cfg = config(tmp_path, tiny_model, proxy, store, "trainer.max_steps=12")
        batches: list[tuple[int, list[Sample]]] = []
        joined_at: list[int] = []

        async def on_step(step: int, samples: Sequence[Sample], version: int) -> None:
            batches.append((version, list(samples)))
            if step == 3:  # a machine lost mid-run: the replica's whole process group
                os.killpg(pids[1], signal.SIGKILL)
                joiner = Background(
                    serve_argv(tiny_model, store, tmp_path / "joiner", 1, "--register", proxy,
                               "--", "--enable-log-requests"),
                    tmp_path / "joiner.out", env,
                )  # fmt: skip
                started.append(joiner)
            if step == 4:  # training waits here until the new replica is in the proxy
                joiner = started[-1]
                await anyio.to_thread.run_sync(joiner.wait_for, "replica 0 joined the proxy")
                url = joiner.wait_for(r"replica 0 ready: (\S+)")[0][1]
                served = [m["id"] for m in get_json(url + "/v1/models")["data"]]
                # caught up before taking a request: it holds the version rollouts now use
                assert any(name.endswith(f"-v{version}") for name in served), served
                joined_at.append(version)

        result = await run_training(cfg, on_step=on_step)
        joiner = started[-1]

        # every step, no failed or retried rollout request, no sync retried
        assert result.steps == 12
        records = read_metrics(result.run_dir / "metrics.jsonl")
        assert records[-1]["rollout/retries_total"] == 0
        stats = get_json(proxy + "/proxy/stats")
        assert stats["rejected"] == {}
        metrics = get_text(proxy + "/metrics")
        assert not re.search(r'broadcasts_total\{[^}]*outcome="(failed|unreachable)"', metrics)
        # the fleet as the trainer logged it: two, one left, one joined, two at the end
        in_rotation = [r["fleet/in_rotation"] for r in records]
        assert in_rotation[0] == 2 and in_rotation[-1] == 2, in_rotation
        assert records[-1]["fleet/left_total"] == 1 and records[-1]["fleet/joins_total"] == 1
        # the new replica took traffic, and never a version older than the one current when
        # it joined (its first request included)
        joiner_url = joiner.wait_for(r"replica 0 ready: (\S+)")[0][1]
        by_url = {u["url"]: u for u in stats["upstreams"]}
        assert by_url[joiner_url]["routed"] > 0
        assert by_url[urls[1]]["circuit"] == "open"  # the dead one: out of the fleet
        log = (tmp_path / "joiner" / "replica-0.log").read_text()
        names = REQUEST_LORA.findall(log)
        assert names, "the joiner's log shows no request"
        assert min(int(n.rsplit("-v", 1)[1]) for n in names) >= joined_at[0]
        # served logprobs equal the trainer's for every sample, the joiner's included
        samples = [s for _, batch in batches for s in batch]
        errors = await anyio.to_thread.run_sync(
            served_logprob_errors, tiny_model, result.transport_url, result.adapter_prefix,
            samples, tmp_path / "verify",
        )  # fmt: skip
        assert max(errors) < TOLERANCE, max(errors)
        print(f"max |served - trainer| logprob {max(errors):.2e} over {len(errors)} samples; "
              f"the joiner served {len(names)} requests; fleet {stats['fleet']}")  # fmt: skip
    finally:
        for proc in reversed(started):
            proc.stop()
