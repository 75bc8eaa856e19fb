"""``--backend ray`` on a real two-node Ray cluster started here: a head node with the resource
``trainer`` and a second raylet with ``inference``, both on loopback. A real launch of
``examples/tiny_cpu.yaml`` trains with real vLLM replicas in Ray actors; a replica actor killed
mid-run is replaced by the launcher; a launcher interrupted (Ctrl-C) or killed outright (SIGKILL)
as its replica's vLLM starts leaves no actor and no vLLM process; the same launch submitted as a
Ray job through the head's dashboard connects to the cluster from inside the job.

One cluster for the module (``ray stop`` at the end). Runs under ``make test-ray`` (its own
virtualenv with Ray); skipped where Ray is not installed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

ray = pytest.importorskip("ray", reason="runs under make test-ray")
from ray.job_submission import JobStatus, JobSubmissionClient  # noqa: E402
from ray.util.state import list_actors, list_nodes  # noqa: E402

from asyncgrpo.processes import WATCHDOG, alive, free_port  # noqa: E402
from asyncgrpo.run.progress import parse_progress  # noqa: E402
from asyncgrpo.testing.rewards import GATE_ENV  # noqa: E402

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_cpu.yaml"
RAY = str(Path(sys.executable).with_name("ray"))


#: A secret the launcher passes on to every actor (``HF_TOKEN``): nowhere in Ray's logs or state.
TOKEN = "hf_rayTestSecretToken42"


@dataclass
class Cluster:
    address: str  #: the head's GCS address
    dashboard: str  #: the state API's
    gate: Path  #: the reward gate every actor's environment names (GATE_ENV)
    temp: Path  #: Ray's session directories, logs and all

    def actors(self, state: str = "ALIVE") -> list:
        return list_actors(
            address=self.dashboard,
            detail=True,
            raise_on_missing_output=False,
            filters=[("ray_namespace", "=", "asyncgrpo"), ("state", "=", state)],
        )

    def node_with(self, resource: str) -> str:
        (node,) = [
            n
            for n in list_nodes(address=self.dashboard, detail=True)
            if resource in n.resources_total
        ]
        return node.node_id


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Two raylets on loopback: the head (1 CPU, ``trainer``), a worker (2 CPUs, 4 x
    ``inference``); their workers import this checkout."""
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths
    gate = Path(temp) / "reward-gate"
    gate.touch()
    port, dash = free_port(), free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "RAY_USAGE_STATS_ENABLED": "0",
        GATE_ENV: str(gate),
    }
    common = ["--node-ip-address", "127.0.0.1", "--object-store-memory", "100000000",
              "--temp-dir", temp, "--disable-usage-stats"]  # fmt: skip
    head = [RAY, "start", "--head", "--port", str(port), "--num-cpus", "1",
            "--resources", '{"trainer": 1}', "--dashboard-host", "127.0.0.1",
            "--dashboard-port", str(dash), *common]  # fmt: skip
    worker = [RAY, "start", "--address", f"127.0.0.1:{port}", "--num-cpus", "2",
              "--resources", '{"inference": 4}', *common]  # fmt: skip
    try:
        for argv in (head, worker):
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, f"{shlex.join(argv)}: {done.stderr[-2000:]}"
        found = Cluster(f"127.0.0.1:{port}", f"http://127.0.0.1:{dash}", gate, Path(temp))
        deadline = time.monotonic() + 60
        while len(list_nodes(address=found.dashboard)) < 2:
            assert time.monotonic() < deadline, "the second raylet did not join"
            time.sleep(1)
        yield found
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)


def launch_cmd(cluster: Cluster | None, model: Path, out: Path, *overrides: str) -> list[str]:
    """The launch on ``cluster``; with None, on the cluster Ray finds (``$RAY_ADDRESS``)."""
    address = [] if cluster is None else ["--ray-address", cluster.address]
    return [sys.executable, "-m", "asyncgrpo.cli.main", "launch", str(EXAMPLE), "--backend", "ray",
            f"model={model}", f"output_dir={out}", *address,
            "--replica-num-gpus", "0", "--trainer-num-gpus", "0", "--replica-num-cpus", "1",
            "launch.replica_resources={inference: 1}", "launch.trainer_resources={trainer: 1}",
            "--port", str(free_port()), "--poll-s", "1", "--replica-restart-backoff-s", "0",
            *overrides]  # fmt: skip


def until(proc: subprocess.Popen, err: Path, what: str, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 600
    while not done():
        assert proc.poll() is None, f"the launch ended before {what}: {err.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what}: {err.read_text()[-3000:]}"
        time.sleep(0.5)


def progress(log: Path) -> list[dict]:
    lines = log.read_text().splitlines() if log.exists() else []
    return [r for r in map(parse_progress, lines) if r is not None]


def refusal(address: str) -> str:
    """The one line a launch asking ``inference: 3`` per replica gets from the cluster."""
    return (
        f"asyncgrpo: error: the Ray cluster at {address} lacks what the launch asks for: "
        "inference: 6 asked (2 replicas x 3; launch.replica_resources), the cluster has 4"
    )


def vllm_processes(model: Path) -> list[int]:
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if str(model) in cmdline and ("vllm" in cmdline or "asyncgrpo.serve" in cmdline):
            found.append(p.info["pid"])
    return found


def test_what_the_cluster_lacks_is_refused_in_one_line_before_any_actor(
    cluster: Cluster, tiny_model: Path, tmp_path: Path
) -> None:
    cmd = launch_cmd(cluster, tiny_model, tmp_path, "launch.replica_resources={inference: 3}")
    done = subprocess.run(
        cmd,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [refusal(cluster.address)]
    assert cluster.actors() == [] and cluster.actors("DEAD") == []


def test_submitted_as_a_ray_job_the_launch_connects_to_its_cluster_from_inside(
    cluster: Cluster, tiny_model: Path, tmp_path: Path
) -> None:
    """``ray job submit -- asyncgrpo launch ...`` through the head's dashboard, with no address
    given: the launch inside the job finds the cluster (``$RAY_ADDRESS``, which Ray sets for a
    job's entrypoint), checks it and refuses in its one line, status 2, before any actor."""
    assert "RAY_ADDRESS" not in os.environ  # the address can only come from the job's own
    client = JobSubmissionClient(cluster.dashboard)
    cmd = launch_cmd(None, tiny_model, tmp_path, "launch.replica_resources={inference: 3}")
    job = client.submit_job(
        entrypoint=shlex.join(cmd), runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}}
    )
    deadline = time.monotonic() + 120
    while not (status := client.get_job_status(job)).is_terminal():
        assert time.monotonic() < deadline, client.get_job_logs(job)[-3000:]
        time.sleep(0.5)
    logs, info = client.get_job_logs(job), client.get_job_info(job)
    assert status == JobStatus.FAILED, logs[-3000:]
    assert "exit code 2" in (info.message or ""), info.message
    # the address Ray gave the job: the head's GCS port, on an address of this host
    (line,) = [x for x in logs.splitlines() if x.startswith("asyncgrpo:")]
    address = line.removeprefix("asyncgrpo: error: the Ray cluster at ").partition(" ")[0]
    assert address.rpartition(":")[2] == cluster.address.rpartition(":")[2], line
    assert line == refusal(address)
    assert "Traceback" not in logs, logs[-3000:]
    assert cluster.actors() == [] and cluster.actors("DEAD") == []


def test_tiny_run_on_two_nodes_a_replica_actor_killed_is_replaced(
    cluster: Cluster, tiny_model: Path, tmp_path: Path
) -> None:
    """12 steps with two replica actors on the inference node and the trainer's on the head;
    replica 1's actor is killed (``ray.kill``) at step 3 while scoring is held, the launcher's
    replacement joins the trainer's proxy, and every step trains with ratio 1 and the served
    logprobs audited equal to the trainer's."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_TOKEN": TOKEN}
    cmd = launch_cmd(
        cluster,
        tiny_model,
        tmp_path,
        "trainer.max_steps=12",
        "rollout.reward_funcs=[asyncgrpo.testing.rewards:gated_digit_fraction]",
    )
    out, err = tmp_path / "launch.out", tmp_path / "launch.err"
    launch_dir = tmp_path / "tiny-cpu-launch"
    trainer_log = launch_dir / "tiny-cpu-trainer.log"
    started = time.monotonic()
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr)
    ray.init(address=cluster.address, namespace="asyncgrpo", log_to_driver=False)
    try:
        until(proc, err, "step 3", lambda: any(r["step"] >= 3 for r in progress(trainer_log)))
        cluster.gate.unlink()  # hold scoring until the replacement is in
        actors = {a.name: a for a in cluster.actors()}
        inference, head = cluster.node_with("inference"), cluster.node_with("trainer")
        assert actors["tiny-cpu-replica-0"].node_id == inference
        assert actors["tiny-cpu-replica-1"].node_id == inference
        assert actors["tiny-cpu-trainer"].node_id == head
        assert all(a.class_name == "RoleActor" for a in actors.values())
        assert TOKEN not in repr(actors)  # not in the state API (no runtime_env)
        ray.kill(ray.get_actor("tiny-cpu-replica-1", namespace="asyncgrpo"))
        until(
            proc,
            err,
            "the replacement in the trainer's proxy",
            lambda: (
                "tiny-cpu-replica-2 (replacing tiny-cpu-replica-1) is in the trainer's proxy"
                in err.read_text()
            ),
        )
        cluster.gate.touch()
        proc.wait(timeout=600)
    finally:
        cluster.gate.touch()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
        replacement = {a.name: a.node_id for a in cluster.actors("DEAD")}.get("tiny-cpu-replica-2")
        ray.shutdown()
    took = time.monotonic() - started
    stderr_text = err.read_text()
    assert proc.returncode == 0, out.read_text()[-3000:] + stderr_text[-3000:]
    records = progress(trainer_log)
    assert [r["step"] for r in records] == list(range(1, 13)), records
    ratios = [r["ratio"] for r in records if "ratio" in r]
    assert ratios and all(abs(x - 1) < 1e-3 for x in ratios), ratios
    assert records[-1]["replicas"] == 2, records
    assert replacement == cluster.node_with("inference")
    assert "failed during the run (its Ray actor died" in stderr_text, stderr_text[-3000:]
    # the served-policy audit: served logprobs equal the trainer's at each sample's version
    metrics = [
        json.loads(line)
        for line in (launch_dir / "trainer" / "runs" / "tiny-cpu" / "metrics.jsonl").open()
    ]
    audits = [m for m in metrics if "audit/mean_abs_logprob_diff" in m]
    assert audits and all(m["audit/mean_abs_logprob_diff"] < 1e-3 for m in audits), audits
    assert "step 12/12" in out.read_text() and "every job stopped" in out.read_text()
    # the secret reached no log: not Ray's (its session directory), not the launcher's
    logged = [
        p
        for p in [*cluster.temp.rglob("*"), *launch_dir.rglob("*.log"), out, err]
        if p.is_file() and TOKEN.encode() in p.read_bytes()
    ]
    assert logged == []
    # the launch's end left no actor alive and no vLLM process
    assert cluster.actors() == []
    deadline = time.monotonic() + 30
    while vllm_processes(tiny_model) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert vllm_processes(tiny_model) == []
    print(
        f"\nray launch: {len(records)} steps, ratios {min(ratios):.6f}..{max(ratios):.6f}, "
        f"{len(audits)} audits (max mean diff "
        f"{max(m['audit/mean_abs_logprob_diff'] for m in audits):.2e}), "
        f"replicas on node {inference[:12]}, trainer on {head[:12]}, {took:.0f} s"
    )


def session_of(pid: int) -> list[int]:
    """The processes of the session ``pid`` leads (a role's process group, ``start_group``),
    however deep, reparented or not."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.info["pid"]) == pid:
                found.append(p.info["pid"])
        except OSError:
            pass
    return found


def working(pids: list[int]) -> list[int]:
    """``pids`` but the watchdogs (one beside each role and each vLLM server, idle)."""
    found = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).name() != WATCHDOG:
                found.append(pid)
    return found


def role_sessions(model: Path) -> list[int]:
    """The replicas' serve processes: those of :func:`vllm_processes` that lead a session."""
    found = []
    for pid in vllm_processes(model):
        try:
            if os.getsid(pid) == pid:
                found.append(pid)
        except OSError:
            pass
    return found


#: A launcher (a Ray driver) with one role actor whose process records the signal it gets; the
#: actor is made as the launcher makes it (``actor_options``).
PROBE_DRIVER = """
import sys, time, ray
from asyncgrpo.config.launch import LaunchConfig
from asyncgrpo.launch.jobs import JobSpec
from asyncgrpo.launch.ray_actor import RoleActor
from asyncgrpo.launch.ray_jobs import NAMESPACE, actor_options

address, workdir, role = sys.argv[1:]
ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
lcfg = LaunchConfig(replica_num_gpus=0, replica_resources={"inference": 1})
spec = JobSpec(role="replica", name="signal-probe", command=())
actor = ray.remote(RoleActor).options(**actor_options(spec, lcfg)).remote()
ray.get(actor.start.remote([sys.executable, "-c", role], {}, workdir=workdir, launcher_ip=None,
                           fallback="signal-probe"))
print("started", flush=True)
time.sleep(600)
"""

#: The role: records SIGTERM (its clean shutdown would run there) in ``got``, then exits.
PROBE_ROLE = """
import os, signal, sys, time
def on_term(sig, frame):
    with open("{got}", "w") as f:
        f.write("SIGTERM")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
with open("{pid}", "w") as f:
    f.write(str(os.getpid()))
while True:
    time.sleep(0.1)
"""


def test_a_role_gets_its_clean_shutdown_when_its_launcher_is_killed_outright(
    cluster: Cluster, tmp_path: Path
) -> None:
    """By default Ray SIGKILLs an actor worker's children as the worker exits, so a serve process
    would die without stopping the vLLM server it started (which, still starting, can ignore the
    SIGTERM its parent-death signal then sends). The role's process must get SIGTERM instead:
    its own parent-death signal, Ray's kill turned off in the actor's runtime_env."""
    got, pid = tmp_path / "got", tmp_path / "pid"
    role = PROBE_ROLE.format(got=got, pid=pid)
    driver = subprocess.Popen(
        [sys.executable, "-c", PROBE_DRIVER, cluster.address, str(tmp_path), role],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert driver.stdout is not None and driver.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 60  # the role runs (its parent-death signal is set)
        while not pid.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pid.exists(), "the role did not start"
        driver.kill()
        driver.wait(timeout=30)
        deadline = time.monotonic() + 30
        while not got.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert got.exists() and got.read_text() == "SIGTERM", "the role was killed without SIGTERM"
    finally:
        if driver.poll() is None:
            driver.kill()
        with contextlib.suppress(OSError, ValueError):  # a failure must leave no probe behind
            os.kill(int(pid.read_text()), signal.SIGKILL)


@pytest.mark.parametrize(
    "sig",
    [
        pytest.param(signal.SIGINT, id="ctrl-c"),
        pytest.param(signal.SIGKILL, id="sigkill"),
    ],
)
def test_a_launcher_interrupted_or_killed_leaves_no_actor_and_no_vllm_process(
    cluster: Cluster, tiny_model: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    """The launcher gets ``sig`` as soon as its replica's vLLM server runs (its engine core beside
    it): on Ctrl-C it stops each process group and kills each actor itself; killed outright, Ray
    kills its (non-detached) actors with the driver, each process group gets SIGTERM as its actor
    dies, and a watchdog SIGKILLs what is left 30 s after its parent died. Either way nothing of
    the launch is left within 60 s (the serve process's grace for its vLLM server is 15 s)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = launch_cmd(cluster, tiny_model, tmp_path, "trainer.max_steps=100", "--replicas", "1")
    out, err = tmp_path / "launch.out", tmp_path / "launch.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr)
    sessions: set[int] = set()
    try:
        until(
            proc,
            err,
            "a vLLM engine",
            lambda: any(len(working(session_of(pid))) > 1 for pid in role_sessions(tiny_model)),
        )
        assert "tiny-cpu-replica-0" in {a.name for a in cluster.actors()}
        sessions = set(role_sessions(tiny_model))
        proc.send_signal(sig)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    if sig == signal.SIGINT:
        assert "interrupted: every job of the launch was cancelled" in err.read_text()
        assert cluster.actors() == []
    started = time.monotonic()

    def left() -> tuple[list, list, list]:
        return (
            cluster.actors(),
            [p for s in sessions for p in alive(session_of(s))],
            vllm_processes(tiny_model),
        )

    while any(left()) and time.monotonic() - started < 60:
        time.sleep(0.5)
    leftover = left()
    for pid in {*leftover[1], *leftover[2]}:  # a failure must not leak into the session's guard
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert leftover == ([], [], []), err.read_text()[-3000:]
    print(
        f"\n{sig.name}: {len(sessions)} vLLM session(s) gone {time.monotonic() - started:.1f} s "
        "after the launcher ended"
    )
