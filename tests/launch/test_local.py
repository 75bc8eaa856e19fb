"""``--backend local``: roles as separate process groups in their own directories.

The first tests swap the roles' commands for small Python programs (no vLLM), to check the
machinery: working directories, the S3 protocol server as transport, health, progress, logs,
failures and cancellation of whole process groups. The end-to-end run with real replicas is
``test_tiny_run_end_to_end`` (marked ``vllm``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import anyio
import psutil
import pytest

from asyncgrpo.cli.plot import find_metrics
from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.errors import LaunchError
from asyncgrpo.launch import launch
from asyncgrpo.launch.jobs import JobSpec
from asyncgrpo.launch.local import LocalBackend
from asyncgrpo.processes import WATCHDOG
from asyncgrpo.run.metrics import read_metrics
from asyncgrpo.run.progress import parse_progress
from asyncgrpo.trainer.audit import replica_key

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
    from asyncgrpo.run.progress import progress_line
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

    def replica_spec(self, index: int) -> JobSpec:
        port = self.port_of(index)
        return JobSpec(
            role="replica",
            name=f"{self.cfg.run_name}-replica-{index}",
            command=(sys.executable, "-c", REPLICA, str(port)),
            env=self.transport_env,
            port=port,
        )

    def trainer_spec(self, urls: list[str], cfg: TrainingConfig | None = None) -> JobSpec:
        return JobSpec(
            role="trainer",
            name=f"{self.cfg.run_name}-trainer",
            command=(sys.executable, "-c", TRAINER, ",".join(urls)),
            env={**self.transport_env, "TRANSPORT": self.transport_url},
        )


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


#: A trainer that counts its launches in the transport: what a resumed run's trainer relies on
#: (its checkpoints are where the previous launch left them).
RELAUNCHED_TRAINER = textwrap.dedent("""
    import os, anyio
    from asyncgrpo.run.progress import progress_line
    from asyncgrpo.transport import open_transport
    async def main():
        t = open_transport(os.environ["TRANSPORT"])
        before = int(await t.get("launches")) if await t.exists("launches") else 0
        await t.put("launches", str(before + 1).encode())
        await t.aclose()
        print("launches before this one", before, flush=True)
    anyio.run(main)
    print(progress_line(1, 1, {"reward": 0.5}), flush=True)
    os._exit(0)
""")


class RelaunchedRoles(ScriptedRoles):
    def trainer_spec(self, urls: list[str], cfg: TrainingConfig | None = None) -> JobSpec:
        return JobSpec(
            role="trainer",
            name=f"{self.cfg.run_name}-trainer",
            command=(sys.executable, "-c", RELAUNCHED_TRAINER),
            env={**self.transport_env, "TRANSPORT": self.transport_url},
        )


def test_a_second_launch_of_a_run_finds_what_the_first_left_in_its_transport(
    tmp_path: Path,
) -> None:
    """``asyncgrpo launch`` of a run that ran before resumes it: the trainer finds its last
    checkpoint in the run's transport, a directory under the launch's (``local_transport=dir``)
    that no launch empties. The trainer's own resume from that checkpoint:
    tests/run/test_training.py::test_killed_trainer_resumes_from_its_last_checkpoint."""
    cfg = config(tmp_path)
    launch_dir = cfg.run_dir / "launch"
    environ = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}

    async def main() -> None:
        backend = RelaunchedRoles(cfg, launch_dir, environ=environ)
        async with await launch(cfg, backend) as handle:
            await handle.wait()

    for launches in (0, 1):
        anyio.run(main)
        log = (launch_dir / "local-run-trainer.log").read_text()
        assert f"launches before this one {launches}" in log, log[-2000:]
    assert (launch_dir / "store" / "launches").read_text() == "2"


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


#: A launcher (the local backend in a process of its own): starts the S3 protocol server and a
#: role that notes the signal that stops it, prints "started" once the role is ready, then waits
#: to be killed.
LAUNCHER = textwrap.dedent("""
    import json, sys, anyio
    from pathlib import Path
    from asyncgrpo.config.training import TrainingConfig
    from asyncgrpo.launch.jobs import JobSpec
    from asyncgrpo.launch.local import LocalBackend
    ROLE = (
        "import signal, sys, time\\n"
        "def stop(sig, frame):\\n"
        "    open('stopped-by', 'w').write(signal.Signals(sig).name)\\n"
        "    sys.exit(0)\\n"
        "signal.signal(signal.SIGTERM, stop)\\n"
        "open('ready', 'w').close()\\n"
        "time.sleep(600)\\n"
    )
    async def main():
        cfg = TrainingConfig.from_dict(json.loads(sys.argv[1]), ["launch.local_transport=s3"])
        backend = LocalBackend(cfg, Path(sys.argv[2]))
        await backend.prepare()
        spec = JobSpec(role="trainer", name="local-run-trainer",
                       command=(sys.executable, "-c", ROLE))
        await backend.start(spec)
        while not (backend.launch_dir / "trainer" / "ready").exists():
            await anyio.sleep(0.05)
        print("started", flush=True)
        await anyio.sleep_forever()
    anyio.run(main)
""")


def test_a_launcher_killed_with_sigkill_takes_its_roles_and_s3_server_with_it(
    tmp_path: Path, leftovers: list[psutil.Process]
) -> None:
    """The roles run in sessions of their own (a process group each, to stop whole), so nothing
    signals them when the launcher is killed outright (OOM killer, ``kill -9``, a CI runner
    cancelling): each gets SIGTERM, its clean way out, as its parent dies."""
    launch_dir = tmp_path / "launch"
    data = {
        "model": str(tmp_path),
        "run_name": "local-run",
        "output_dir": str(tmp_path / "runs"),
        "dataset": {"prompts": ["p"]},
    }
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, json.dumps(data), str(launch_dir)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        text=True,
    )
    leftovers.append(psutil.Process(launcher.pid))
    assert launcher.stdout.readline() == "started\n"
    roles = psutil.Process(launcher.pid).children(recursive=True)
    leftovers += roles
    assert len([r for r in roles if r.name() != WATCHDOG]) == 2, roles  # moto and the role
    launcher.kill()
    launcher.wait()
    _, alive = psutil.wait_procs(roles, timeout=10)
    assert alive == [], f"outlived their launcher: {alive}"
    assert (launch_dir / "trainer" / "stopped-by").read_text() == "SIGTERM"


#: The trainer's proxy as far as the launcher sees it: answers the admin route on argv[1]'s
#: port, printing each call; completes its three steps once a replica was added with the key.
TRAINER_PROXY = textwrap.dedent("""
    import http.server, json, os, sys, threading
    from asyncgrpo.run.progress import progress_line
    key = os.environ["ASYNCGRPO_PROXY__ADMIN_API_KEY"]
    added = threading.Event()
    class H(http.server.BaseHTTPRequestHandler):
        def admin(self):
            url = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["url"]
            ok = self.headers.get("Authorization") == f"Bearer {key}"
            print("admin", self.command, url, "authorized" if ok else "refused", flush=True)
            self.send_response(200 if ok else 401); self.end_headers(); self.wfile.write(b"{}")
            if ok and self.command == "POST":
                added.set()
        do_POST = do_DELETE = admin
        def log_message(self, *a): pass
    server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    if not added.wait(60):
        sys.exit("no replica was added")
    for step in (1, 2, 3):
        print(progress_line(step, 3, {"reward": step / 10, "ratio": 1.0}), flush=True)
""")


class ElasticRoles(ScriptedRoles):
    """Stand-in replicas, and a trainer that stands in for its proxy's admin route."""

    def trainer_spec(self, urls: list[str], cfg: TrainingConfig | None = None) -> JobSpec:
        real = super(ScriptedRoles, self).trainer_spec(urls, cfg)  # the port and key it'd get
        script = (TRAINER_PROXY, str(real.port)) if real.port else ("import time; time.sleep(60)",)
        return JobSpec(
            role="trainer",
            name=real.name,
            port=real.port,
            command=(sys.executable, "-c", *script),
            secrets=real.secrets,
        )


def kill_machine(job_id: str) -> None:
    """SIGKILL a job's process group and every process under it: a lost machine takes its vLLM
    servers at once too. They run in sessions of their own: with the group alone they would get
    SIGTERM as their parent dies and drain, not vanish."""
    pid = int(job_id.removeprefix("pid-"))
    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        below = []
    os.killpg(pid, signal.SIGKILL)
    for proc in below:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def kill_replica(handle, index: int) -> str:
    """Lose replica ``index``'s machine (:func:`kill_machine`); its URL."""
    job = handle.replicas[index]
    kill_machine(job.id)
    return job.url


def test_a_replica_killed_mid_run_is_replaced_and_added_to_the_trainers_proxy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config(tmp_path, "launch.replica_restart_backoff_s=0")
    launch_dir = cfg.run_dir / "launch"
    environ = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    backend = ElasticRoles(cfg, launch_dir, environ=environ)

    async def main() -> tuple[list[dict], str, list[str]]:
        async with await launch(cfg, backend) as handle:
            dead = kill_replica(handle, 1)
            progress = await handle.wait()
            return progress, dead, handle.urls

    caplog.set_level("INFO", logger="asyncgrpo.launch")
    progress, dead, urls = anyio.run(main)
    assert [r["step"] for r in progress] == [1, 2, 3]
    new = f"http://127.0.0.1:{backend.ports[2]}"
    assert urls[1:] == [new] and dead not in urls
    trainer_log = (launch_dir / "local-run-trainer.log").read_text()
    assert f"admin DELETE {dead} authorized" in trainer_log
    assert f"admin POST {new} authorized" in trainer_log
    assert "refused" not in trainer_log
    assert log_field(launch_dir / "local-run-replica-2.log", "cwd") == str(launch_dir / "replica-2")
    jobs = {j["name"]: j for j in json.loads((launch_dir / "jobs.json").read_text())["jobs"]}
    assert jobs["local-run-replica-1"]["replaced_by"] == "local-run-replica-2"
    assert jobs["local-run-replica-2"]["replaces"] == "local-run-replica-1"
    assert jobs["local-run-replica-2"]["url"] == new
    said = caplog.text
    assert "replica job local-run-replica-1" in said and "failed during the run" in said
    assert "replacement 1 of launch.replica_restarts=3 (local-run-replica-2)" in said
    assert "local-run-replica-2 (replacing local-run-replica-1) is in the trainer's proxy" in said


def test_with_no_restarts_a_replica_killed_mid_run_stops_the_launch_naming_it(
    tmp_path: Path,
) -> None:
    cfg = config(tmp_path, "launch.replica_restarts=0")
    environ = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    backend = ElasticRoles(cfg, cfg.run_dir / "launch", environ=environ)
    assert backend.admin_key is None and backend.proxy_port is None  # nothing to reach

    async def main() -> None:
        async with await launch(cfg, backend) as handle:
            kill_replica(handle, 1)
            await handle.wait()

    with pytest.raises(
        LaunchError,
        match=r"replica job local-run-replica-1 \(pid-\d+\) failed "
        r"during the run \(exit code -9\)",
    ):
        anyio.run(main)
    assert not (cfg.run_dir / "launch" / "local-run-replica-2.log").exists()


#: A sweep's trainer: asks the proxy it was given which replicas it fronts, writes through its
#: own storage, prints progress lines; with HANG set, stays after step 1 until it is stopped.
SWEEP_TRAINER = textwrap.dedent("""
    import json, os, sys, time, urllib.request, anyio
    from asyncgrpo.run.progress import progress_line
    from asyncgrpo.transport import open_transport
    url = sys.argv[1]
    with urllib.request.urlopen(url + "/proxy/upstreams", timeout=10) as resp:
        fronted = sorted(u["url"] for u in json.load(resp)["upstreams"])
    print("cwd", os.getcwd(), "urls", url, "fronts", ",".join(fronted), flush=True)
    async def main():
        t = open_transport(os.environ["TRANSPORT"])
        await t.put("hello", os.environ["TRANSPORT"].encode())
        await t.aclose()
    anyio.run(main)
    for step in (1, 2, 3):
        print(progress_line(step, 3, {"reward": step / 10}), flush=True)
        while os.environ.get("HANG"):
            time.sleep(1)
    os._exit(0)
""")


class SweepRoles(ScriptedRoles):
    """Stand-in replicas and trainers; the sweep's proxy is the real one."""

    def trainer_spec(self, urls: list[str], cfg: TrainingConfig | None = None) -> JobSpec:
        real = LocalBackend.trainer_spec(self, urls, cfg)  # its name, port, storage
        assert cfg is not None and cfg.transport_url and real.port is None
        return JobSpec(
            role="trainer",
            name=real.name,
            command=(sys.executable, "-c", SWEEP_TRAINER, *urls),
            env={**self.transport_env, "TRANSPORT": cfg.transport_url},
        )


SWEEP = "launch.sweep=['trainer.learning_rate=1e-5,1e-4']"


def test_a_sweep_runs_one_trainer_per_point_through_one_proxy_each_with_its_progress(
    tmp_path: Path,
) -> None:
    cfg = config(tmp_path, SWEEP, "launch.local_transport=s3")
    launch_dir = cfg.run_dir / "launch"
    environ = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    backend = SweepRoles(cfg, launch_dir, environ=environ)
    seen: list[dict] = []

    async def main() -> tuple[list[dict], list[str], str]:
        async with await launch(cfg, backend, on_progress=seen.append) as handle:
            roles = [j.spec.role for j in handle.jobs]
            assert handle.front is not None and handle.front.spec.role == "proxy"
            return await handle.wait(), roles, str(handle.front.url)

    progress, roles, proxy_url = anyio.run(main)
    assert roles == ["replica", "replica", "proxy", "trainer", "trainer"]
    # one progress line per run and step, each naming its run
    assert sorted((r["run"], r["step"]) for r in progress) == [
        (f"local-run-{i}", s) for i in (0, 1) for s in (1, 2, 3)
    ]
    assert seen == progress
    replicas = ",".join(sorted(f"http://127.0.0.1:{p}" for p in backend.ports))
    for i in (0, 1):
        log = launch_dir / f"local-run-{i}-trainer.log"
        # each point in its own directory under trainer/ (hidden from replicas as a whole),
        # sending to the sweep's proxy, which fronts both replicas
        assert log_field(log, "cwd") == str(launch_dir / "trainer" / str(i))
        assert log_field(log, "urls") == proxy_url
        assert log_field(log, "fronts") == replicas
    jobs = json.loads((launch_dir / "jobs.json").read_text())["jobs"]
    pids = [int(j["id"].removeprefix("pid-")) for j in jobs]
    for pid in pids:  # every process group stopped
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_cancelling_a_sweep_stops_every_process_it_started(tmp_path: Path) -> None:
    """What Ctrl-C or SIGTERM does to ``asyncgrpo launch`` (the command turns them into this
    cancellation): the replicas and their children, the proxy and every point's trainer stop."""
    cfg = config(tmp_path, SWEEP)
    launch_dir = cfg.run_dir / "launch"
    environ = {**os.environ, "HANG": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    backend = SweepRoles(cfg, launch_dir, environ=environ)
    seen: list[dict] = []

    async def main() -> list[int]:
        with anyio.CancelScope() as scope:
            async with await launch(cfg, backend, on_progress=seen.append) as handle:
                pids = [int(j.id.removeprefix("pid-")) for j in handle.jobs]
                async with anyio.create_task_group() as tg:
                    tg.start_soon(handle.wait)
                    with anyio.fail_after(60):
                        while len({r["run"] for r in seen}) < 2:  # noqa: ASYNC110
                            await anyio.sleep(0.1)
                    scope.cancel()
        return pids

    pids = anyio.run(main)
    assert len(pids) == 5
    children = [int(log_field(launch_dir / f"local-run-replica-{i}.log", "child")) for i in (0, 1)]
    for pid in pids + children:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not [
        p
        for p in psutil.process_iter(["cmdline"])
        if str(tmp_path) in " ".join(p.info["cmdline"] or [])
    ]


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"


#: Root can hide the trainer's directory from the replicas (private mount namespaces).
HIDE = os.geteuid() == 0 and shutil.which("unshare") is not None


def launch_tiny(
    tiny_model: Path, tmp_path: Path, *overrides: str, kill_replica_at: int | None = None
) -> subprocess.CompletedProcess:
    """``asyncgrpo launch examples/tiny_cpu.yaml --backend local``. With ``kill_replica_at``,
    replica 1's machine is lost (:func:`kill_machine`) once the trainer reports that step, and the run's
    scoring is held (a reward gate) until the launcher says the replacement is in the trainer's
    proxy: the replacement then serves the rest of the run, however slow its start."""
    from asyncgrpo.testing.rewards import GATE_ENV

    cmd = [sys.executable, "-m", "asyncgrpo.cli.main", "launch", str(EXAMPLE), "--backend", "local",
           f"model={tiny_model}", f"output_dir={tmp_path}", f"launch.local_hide_trainer={HIDE}",
           *overrides]  # fmt: skip
    environ = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    gate = tmp_path / "reward-gate"
    if kill_replica_at is not None:
        cmd.append("rollout.reward_funcs=[asyncgrpo.testing.rewards:gated_digit_fraction]")
        environ[GATE_ENV] = str(gate)
        gate.touch()
    out, err = tmp_path / "launch.out", tmp_path / "launch.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(cmd, env=environ, stdout=stdout, stderr=stderr, text=True)
    try:
        if kill_replica_at is not None:
            launch_dir = tmp_path / "tiny-cpu-launch"
            trainer_log = launch_dir / "tiny-cpu-trainer.log"

            def until(what: str, done: Callable[[], bool]) -> None:
                deadline = time.monotonic() + 900
                while not done():
                    assert proc.poll() is None, f"the launch ended before {what}: {err.read_text()}"
                    assert time.monotonic() < deadline, f"no {what}: {err.read_text()[-3000:]}"
                    time.sleep(0.2)

            until(
                f"step {kill_replica_at}",
                lambda: any(
                    r is not None and r["step"] >= kill_replica_at
                    for r in map(
                        parse_progress,
                        (trainer_log.read_text().splitlines() if trainer_log.exists() else []),
                    )
                ),
            )
            gate.unlink()
            jobs = json.loads((launch_dir / "jobs.json").read_text())["jobs"]
            job = next(j for j in jobs if j["name"] == "tiny-cpu-replica-1")
            kill_machine(job["id"])
            until(
                "the replacement in the trainer's proxy",
                lambda: "is in the trainer's proxy" in err.read_text(),
            )
            gate.touch()
        proc.wait(timeout=1500)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(cmd, proc.returncode, out.read_text(), err.read_text())


def loaded_adapters(replica_dir: Path) -> list[tuple[str, str]]:
    """(name, path) of every adapter a replica's vLLM loaded."""
    log = (replica_dir / "replica-0.log").read_text()
    return re.findall(r"Loaded new LoRA adapter: name '(\S+)', path '(\S+)'", log)


#: Steps of the end-to-end run. Replica 1 is lost at step 2 and the run's scoring is held until
#: the replacement is in, by step 7 at the latest (a queue of 4 steps' samples and one step in
#: flight are generated before it); at max_staleness 4 the samples of steps 13 and 14 are all
#: generated after the join, by both replicas.
E2E_STEPS = 14


@pytest.mark.skipif(not HIDE, reason="a private mount namespace needs root and unshare")
def test_a_replica_job_sees_the_trainers_directory_empty(tmp_path: Path) -> None:
    """``launch.local_hide_trainer``: a replica job runs in a private mount namespace where the
    trainer's directory is an empty tmpfs, so a path on the trainer's disk reaches no replica, as
    on another machine (what makes the end-to-end run below show that every version reached the
    replicas through the transport; a version a replica cannot load stops the run:
    tests/test_exit_paths.py::test_train_whose_adapter_vllm_refuses)."""
    cfg = config(tmp_path, "launch.local_hide_trainer=true")
    backend = LocalBackend(cfg, cfg.run_dir / "launch")
    anyio.run(backend.prepare)  # the mount point exists before any replica starts
    trainer_dir = cfg.run_dir / "launch" / "trainer"
    (trainer_dir / "secret.txt").write_text("only the trainer host has this")
    command = backend.replica_spec(0).command
    assert command[:2] == ("unshare", "--mount") and str(trainer_dir) in command[-1], command
    assert "-m asyncgrpo.serve" in command[-1], command
    ls = ["ls", "-A", str(trainer_dir)]
    assert subprocess.run(ls, capture_output=True, text=True).stdout == "secret.txt\n"
    hidden = subprocess.run(backend._hidden(*ls), capture_output=True, text=True, check=True)
    assert hidden.stdout == ""


@pytest.mark.vllm
def test_tiny_run_end_to_end_as_separate_processes_a_replica_lost_and_replaced(
    tiny_model: Path, tmp_path: Path
) -> None:
    """`asyncgrpo launch examples/tiny_cpu.yaml --backend local`: an S3 protocol server (moto),
    two replica processes and a trainer process in their own directories, meeting only in S3 (as
    root, the trainer's directory is an empty tmpfs to the replicas, so every adapter version
    must reach them from S3: each replica fetches and verifies it itself). Replica 1's machine
    is lost at step 2: the launcher
    starts a replacement, which joins the trainer's proxy and is brought up to date; every step
    trains, ratio 1 where reported, no rollout request fails or is retried (the proxy sends it
    to the survivor), and the served-policy audit finds every replica, the replacement too,
    serving exactly the trainer's weights. The one test that loses a replica of a training run:
    docs/testing.md names where the rest of what a lost replica touches is tested."""
    out = launch_tiny(
        tiny_model,
        tmp_path,
        "launch.replica_restart_backoff_s=0",
        "launch.local_transport=s3",
        f"trainer.max_steps={E2E_STEPS}",
        kill_replica_at=2,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    launch_dir = tmp_path / "tiny-cpu-launch"
    trainer_log = (launch_dir / "tiny-cpu-trainer.log").read_text()
    records = [r for r in map(parse_progress, trainer_log.splitlines()) if r is not None]
    assert [r["step"] for r in records] == list(range(1, E2E_STEPS + 1))
    # the ratio is reported on steps that trained on tokens of the trainer's current weights
    ratios = [r["ratio"] for r in records if "ratio" in r]
    assert ratios and all(abs(x - 1) < 1e-3 for x in ratios), ratios
    assert f"step {E2E_STEPS}/{E2E_STEPS}" in out.stdout and "every job stopped" in out.stdout
    # it ends with train's summary, naming the launched run's own directory
    run_dir = launch_dir / "trainer" / "runs" / "tiny-cpu"
    summary = out.stdout[out.stdout.index(f"trained {E2E_STEPS} steps in ") :]
    assert re.search(r"\nreward \d\.\d+ -> \d\.\d+ \(mean of the first and last 5 steps", summary)
    assert "\nheld-out reward: " in summary and " (version 0) -> " in summary, summary
    assert re.search(r"\nfinal adapter: tiny-cpu-\w+-v\d+ in ", summary), summary
    assert f"\nPEFT directory: {run_dir / 'adapter'}\n" in summary, summary
    assert f"\nmetrics: {run_dir / 'metrics.jsonl'}\n" in summary, summary
    assert (run_dir / "adapter" / "adapter_config.json").is_file()
    # the trainer's proxy: two replicas, and two again once the replacement is in
    replicas = [r["replicas"] for r in records]
    assert replicas[:2] == [2, 2] and replicas[-1] == 2, replicas
    # the log says what happened
    assert re.search(
        r"replica job tiny-cpu-replica-1 \(pid-\d+\) failed during the run "
        r"\(exit code -9\); training continues",
        out.stderr,
    ), out.stderr[-3000:]
    assert "tiny-cpu-replica-2 (replacing tiny-cpu-replica-1) is in the trainer's proxy" in (
        out.stderr
    ), out.stderr[-3000:]
    # the trainer's metrics: the loss cost no rollout request, the replacement joined caught up
    jobs = {j["name"]: j for j in json.loads((launch_dir / "jobs.json").read_text())["jobs"]}
    metrics = read_metrics(launch_dir / jobs["tiny-cpu-trainer"]["metrics"])
    assert [m["step"] for m in metrics] == list(range(1, E2E_STEPS + 1))
    last = metrics[-1]
    assert last["rollout/retries_total"] == 0, last
    # (the lost replica leaves by the launcher's removal, or the proxy's failure count first)
    assert last["fleet/joins_total"] == 1 and last["fleet/catch_up_failures_total"] == 0, last
    assert last["fleet/in_rotation"] == 2 and last["fleet/replicas"] == 2, last
    # the audit after every sync compared served logprobs with the trainer's, per replica: the
    # survivor and the replacement both served exactly the trainer's weights
    for name in ("tiny-cpu-replica-0", "tiny-cpu-replica-2"):
        key = f"audit/replica/{replica_key(jobs[name]['url'])}/max_abs_logprob_diff"
        audited = [m[key] for m in metrics if key in m]
        assert audited and max(audited) < 1e-3, (name, audited)
    # the replicas worked in their own directories and never named a trainer's file
    trainer_dir = str(launch_dir / "trainer")
    loaded = {i: loaded_adapters(launch_dir / f"replica-{i}") for i in (0, 1, 2)}
    assert len(loaded[0]) >= E2E_STEPS, loaded[0]  # a version per step (and v0)
    # the replacement got the current version replayed, then every later one, and generated
    assert len(loaded[2]) >= 2 and loaded[2][-1][0] == loaded[0][-1][0], loaded[2]
    stats = (launch_dir / "replica-2" / "replica-0.log").read_text()
    assert any(float(x) > 0 for x in re.findall(r"Avg generation throughput: ([\d.]+)", stats))
    for i in (0, 1, 2):
        own_cache = str(launch_dir / f"replica-{i}" / "adapters") + "/"
        assert all(path.startswith(own_cache) for _, path in loaded[i]), loaded[i]
        assert trainer_dir not in (launch_dir / f"replica-{i}" / "replica-0.log").read_text()
    # S3 was the only medium: no transport directory, and the S3 server's log has a GET of a
    # version's weights for each replica that loaded it (each fetched it itself)
    assert not (launch_dir / "store").exists()
    s3_log = (launch_dir / "transport.log").read_text()
    fetched = Counter(
        re.findall(r'"GET /\S+/adapters/\S+/(v\d+)/\S+/adapter_model\.safetensors ', s3_log)
    )
    loaders = Counter(name.rpartition("-")[2] for i in loaded for name, _ in loaded[i])
    assert loaders and all(fetched[v] >= n for v, n in loaders.items()), (loaders, fetched)
    assert not [
        p
        for p in psutil.process_iter(["cmdline"])
        if str(tmp_path) in " ".join(p.info["cmdline"] or [])
    ]


@pytest.mark.vllm
def test_the_docs_two_point_sweep_runs_as_typed_and_shares_one_replica(tmp_path: Path) -> None:
    """docs/shared-fleet.md's local sweep, typed in a fresh directory: the tiny model built there
    with the docs' command, then `asyncgrpo launch examples/tiny_cpu.yaml --backend local --sweep
    trainer.learning_rate=1e-3,3e-3 launch.replicas=1 trainer.max_steps=3` (and max_staleness 1,
    so that the numbers below are small). One replica process sized for both points' adapter
    windows, the sweep's proxy process in front of it, and a trainer process per point; each
    point books its LoRA slots on the proxy, trains its steps with its own adapter names and
    storage, and the command prints a progress line per run and step. Each point's trainer job
    runs in a directory of its own: the relative model path it was given (``runs/tiny-model``,
    from the example config) must still name the directory built here, not one in the job's
    directory (every trainer job used to exit 2 naming it)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    build = [sys.executable, "-m", "asyncgrpo.testing.tiny", "runs/tiny-model"]
    subprocess.run(build, cwd=tmp_path, env=env, check=True, capture_output=True, timeout=300)
    sweep = [sys.executable, "-m", "asyncgrpo", "launch", "examples/tiny_cpu.yaml",
             "--backend", "local", "--sweep", "trainer.learning_rate=1e-3,3e-3",
             "launch.replicas=1", "trainer.max_steps=3", "trainer.max_staleness=1",
             f"launch.local_hide_trainer={HIDE}"]  # fmt: skip
    out = subprocess.run(sweep, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for i in (0, 1):
        assert [f"tiny-cpu-{i}: step {s}/3" in out.stdout for s in (1, 2, 3)] == [True] * 3
    assert "every trainer completed" in out.stdout and "every job stopped" in out.stdout
    launch_dir = tmp_path / "runs" / "tiny-cpu-launch"
    # the replica holds both windows: 2 x (max_staleness 1 + 2) LoRA slots
    assert "'max_loras': 6," in (launch_dir / "replica-0" / "replica-0.log").read_text()
    proxy_log = (launch_dir / "tiny-cpu-proxy.log").read_text()
    loaded = loaded_adapters(launch_dir / "replica-0")
    for i in (0, 1):
        assert re.search(rf"run tiny-cpu-{i}-\w+ holds 3 LoRA slots", proxy_log), proxy_log[-3000:]
        assert re.search(rf"run tiny-cpu-{i}-\w+ released its LoRA slots", proxy_log)
        log = (launch_dir / f"tiny-cpu-{i}-trainer.log").read_text()
        records = [r for r in map(parse_progress, log.splitlines()) if r is not None]
        assert [r["step"] for r in records] == [1, 2, 3], log[-3000:]
        # its versions, from its own storage, and none of the other point's
        mine = [(n, p) for n, p in loaded if n.startswith(f"tiny-cpu-{i}-")]
        assert len(mine) >= 4, loaded  # v0 and a version per step
        assert all(f"tiny-cpu-{1 - i}" not in p for _, p in mine), mine
    assert not [
        p
        for p in psutil.process_iter(["cmdline"])
        if str(tmp_path) in " ".join(p.info["cmdline"] or [])
    ]


#: A trainer that writes its metrics where a launched run's trainer does (``runs/<run>`` in its
#: working directory) and prints a progress line per step.
METRICS_TRAINER = textwrap.dedent("""
    import os, sys
    from asyncgrpo.run.progress import progress_line
    from asyncgrpo.run.metrics import MetricsWriter
    with MetricsWriter(os.path.join("runs", sys.argv[1])) as metrics:
        for step in (1, 2, 3):
            record = {"reward": step / 10, "ratio": 1.0, "perf/step_s": 0.5}
            metrics.log(record, step=step)
            print(progress_line(step, 3, record), flush=True)
""")


class MetricsRoles(ScriptedRoles):
    def trainer_spec(self, urls: list[str], cfg: TrainingConfig | None = None) -> JobSpec:
        return JobSpec(
            role="trainer",
            name=f"{self.cfg.run_name}-trainer",
            command=(sys.executable, "-c", METRICS_TRAINER, self.cfg.run_name),
        )


def test_the_launch_says_where_the_metrics_are_and_plot_finds_them_from_its_directory(
    tmp_path: Path,
) -> None:
    cfg = config(tmp_path, "launch.local_transport=dir")
    launch_dir = cfg.run_dir / "launch"
    environ = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    backend = MetricsRoles(cfg, launch_dir, environ=environ)

    async def main() -> dict[str, Path | None]:
        async with await launch(cfg, backend) as handle:
            await handle.wait()
            return handle.metrics

    metrics = anyio.run(main)
    where = launch_dir.resolve() / "trainer" / "runs" / "local-run" / "metrics.jsonl"
    assert metrics == {"local-run": where} and where.is_file()
    jobs = json.loads((launch_dir / "jobs.json").read_text())["jobs"]
    # relative to the launch directory: it can be moved
    assert [j.get("metrics") for j in jobs if j["role"] == "trainer"] == [
        "trainer/runs/local-run/metrics.jsonl"
    ]
    # from the launch directory, or the run's above it
    assert find_metrics(cfg.run_dir) == find_metrics(launch_dir) == {"local-run": where}
    out = subprocess.run(
        [sys.executable, "-m", "asyncgrpo.cli.main", "plot", str(launch_dir)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    png = where.parent / "plot.png"
    assert out.stdout.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
