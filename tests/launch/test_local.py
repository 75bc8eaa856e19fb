"""``--backend local``: roles as separate process groups in their own directories.

The first tests swap the roles' commands for small Python programs (no vLLM), to check the
machinery: working directories, the S3 protocol server as transport, health, progress, logs,
failures and cancellation of whole process groups. The end-to-end run with real replicas is
``test_tiny_run_end_to_end`` (marked ``vllm``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import psutil
import pytest

from asyncgrpo.config import TrainingConfig
from asyncgrpo.errors import LaunchError
from asyncgrpo.launch import launch
from asyncgrpo.launch.jobs import JobSpec
from asyncgrpo.launch.local import LocalBackend
from asyncgrpo.launch.progress import parse_progress

#: Answers /health on the port given as argv[1], after writing its cwd and a child's pid.
REPLICA = textwrap.dedent("""
    import http.server, os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("cwd", os.getcwd(), "child", child.pid, flush=True)
    if os.environ.get("FAIL_REPLICA") == os.path.basename(os.getcwd()):
        # Fail once the other replica has a child for the launch to stop (slow start-ups).
        survivor = os.environ["SURVIVOR_LOG"]
        while not os.path.exists(survivor) or "child" not in open(survivor).read():
            time.sleep(0.05)
        print("vllm: CUDA out of memory", flush=True)
        sys.exit(3)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")

#: Writes through the transport (the S3 server), prints progress lines, exits 0.
TRAINER = textwrap.dedent("""
    import os, sys, anyio
    from asyncgrpo.launch.progress import progress_line
    from asyncgrpo.transport import open_transport
    print("cwd", os.getcwd(), "urls", sys.argv[1], flush=True)
    async def main():
        t = open_transport(os.environ["TRANSPORT"])
        await t.put("hello", b"world")
        assert await t.get("hello") == b"world"
        await t.aclose()
    anyio.run(main)
    for step in (1, 2, 3):
        print(progress_line(step, 3, {"reward": step / 10, "ratio": 1.0}), flush=True)
    os._exit(0)  # like the trainer entry point: obstore can abort during interpreter teardown
""")


class ScriptedRoles(LocalBackend):
    """The local backend with stand-in programs for vLLM and the trainer."""

    def replica_specs(self) -> list[JobSpec]:
        return [
            JobSpec(
                role="replica",
                name=f"{self.cfg.run_name}-replica-{i}",
                command=(sys.executable, "-c", REPLICA, str(port)),
                env=self.transport_env,
                port=port,
            )
            for i, port in enumerate(self.ports)
        ]

    def trainer_spec(self, urls: list[str], cfg: TrainingConfig | None = None) -> JobSpec:
        return JobSpec(role="trainer", name=f"{self.cfg.run_name}-trainer",
                       command=(sys.executable, "-c", TRAINER, ",".join(urls)),
                       env={**self.transport_env, "TRANSPORT": self.transport_url})  # fmt: skip


def config(tmp_path: Path, *overrides: str) -> TrainingConfig:
    data = {
        "model": str(tmp_path),  # the stand-ins load nothing; the launch checks it exists
        "run_name": "local-run",
        "output_dir": str(tmp_path / "runs"),
        "dataset": {"prompts": ["p"]},
        "launch": {"replicas": 2, "poll_s": 0.1, "health_timeout_s": 30},
    }
    return TrainingConfig.from_dict(data, list(overrides))


def log_field(path: Path, name: str) -> str:
    words = path.read_text().split()
    return words[words.index(name) + 1]


def test_roles_run_apart_share_only_the_s3_server_and_stop_with_the_launch(
    tmp_path: Path,
) -> None:
    cfg = config(tmp_path, "launch.local_transport=s3")
    launch_dir = cfg.run_dir / "launch"
    environ = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    backend = ScriptedRoles(cfg, launch_dir, environ=environ)
    seen: list[dict] = []

    async def main() -> list[dict]:
        handle = await launch(cfg, backend, on_progress=seen.append)
        async with handle:
            assert handle.urls == [f"http://127.0.0.1:{p}" for p in backend.ports]
            return await handle.wait()

    progress = anyio.run(main)
    assert [r["step"] for r in progress] == [1, 2, 3] and seen == progress
    logs = {p.name: p for p in launch_dir.glob("*.log")}
    cwds = {name: log_field(path, "cwd") for name, path in logs.items() if name != "transport.log"}
    assert cwds == {
        "local-run-replica-0.log": str(launch_dir / "replica-0"),
        "local-run-replica-1.log": str(launch_dir / "replica-1"),
        "local-run-trainer.log": str(launch_dir / "trainer"),
    }
    assert log_field(logs["local-run-trainer.log"], "urls") == ",".join(
        f"http://127.0.0.1:{p}" for p in backend.ports
    )
    # the replicas' whole process groups (children included) and the S3 server are gone
    for name in ("local-run-replica-0.log", "local-run-replica-1.log"):
        assert not psutil.pid_exists(int(log_field(logs[name], "child"))) or (
            psutil.Process(int(log_field(logs[name], "child"))).status() == psutil.STATUS_ZOMBIE
        )
    assert backend._moto is None


def test_a_replica_that_dies_fails_the_launch_with_its_log(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    survivor = cfg.run_dir / "launch" / "local-run-replica-0.log"
    environ = {**os.environ, "FAIL_REPLICA": "replica-1", "SURVIVOR_LOG": str(survivor)}
    backend = ScriptedRoles(cfg, cfg.run_dir / "launch", environ=environ)

    async def main() -> None:
        async with await launch(cfg, backend) as handle:
            await handle.wait()

    with pytest.raises(LaunchError, match="CUDA out of memory") as info:
        anyio.run(main)
    assert "local-run-replica-1" in str(info.value) and "exit code 3" in str(info.value)
    child = int(log_field(survivor, "child"))
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"


#: Root can hide the trainer's directory from the replicas (private mount namespaces).
HIDE = os.geteuid() == 0 and shutil.which("unshare") is not None


def launch_tiny(tiny_model: Path, tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "asyncgrpo.cli", "launch", str(EXAMPLE), "--backend", "local",
           f"model={tiny_model}", f"output_dir={tmp_path}", f"launch.local_hide_trainer={HIDE}",
           *overrides]  # fmt: skip
    environ = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=1500)


@pytest.mark.vllm
def test_tiny_run_end_to_end_as_separate_processes_then_resumed(
    tiny_model: Path, tmp_path: Path
) -> None:
    """`asyncgrpo launch examples/tiny_cpu.yaml --backend local`: two replica processes and a
    trainer process in their own directories, meeting only in the transport directory (as root,
    the trainer's directory is an empty tmpfs to the replicas, so every adapter version must
    reach them through the transport); ratio 1, reward rising; a second launch of the same run
    continues from its last checkpoint."""
    out = launch_tiny(tiny_model, tmp_path)  # the example's 40 steps
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    launch_dir = tmp_path / "tiny-cpu" / "launch"
    trainer_log = (launch_dir / "tiny-cpu-trainer.log").read_text()
    records = [r for r in map(parse_progress, trainer_log.splitlines()) if r is not None]
    assert [r["step"] for r in records] == list(range(1, 41))
    # the ratio is reported on steps that trained on tokens of the trainer's current weights
    ratios = [r["ratio"] for r in records if "ratio" in r]
    assert ratios and all(abs(x - 1) < 1e-3 for x in ratios), ratios
    rewards = [r["reward"] for r in records]  # the demo measured 0.02 -> 0.99 over these steps
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.1, rewards
    assert "step 40/40" in out.stdout and "every job stopped" in out.stdout
    # the replicas worked in their own directories and never named a trainer's file
    trainer_dir = str(launch_dir / "trainer")
    for i in (0, 1):
        replica_log = (launch_dir / f"replica-{i}" / "replica-0.log").read_text()
        loaded = re.findall(r"Loaded new LoRA adapter: name '(\S+)', path '(\S+)'", replica_log)
        assert len(loaded) >= 40, loaded  # a version per step (and v0)
        own_cache = str(launch_dir / f"replica-{i}" / "adapters") + "/"
        assert all(path.startswith(own_cache) for _, path in loaded), loaded  # its own cache
        assert trainer_dir not in replica_log
    assert not [p for p in psutil.process_iter(["cmdline"])
                if str(tmp_path) in " ".join(p.info["cmdline"] or [])]  # fmt: skip

    again = launch_tiny(tiny_model, tmp_path, "trainer.max_steps=42")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    trainer_log = (launch_dir / "tiny-cpu-trainer.log").read_text()
    assert "resumed from checkpoint step 40" in trainer_log
    assert "step 42/42" in again.stdout and "step 1/42" not in again.stdout
