"""A long asynchronous run under a seeded fault schedule, checked for what must hold after it.

One run of the demo recipe (``examples/tiny_cpu.yaml``: the tiny model, 32 samples per step, a
sync every step, ``max_staleness`` 4) in the split layout, every role a process of its own as
on separate machines, meeting only in S3 (moto on loopback) and over HTTP:

    moto  <-  fault proxy  <-  trainer (asyncgrpo train --remote-rollouts)
                           <-  rollout process (asyncgrpo rollout)
                           <-  3 replicas (python -m asyncgrpo.serve --transport s3://...)
    trainer, rollout process -> proxy (python -m asyncgrpo.proxy) -> replicas

The bench is their launcher: it starts each with the command a user would type, restarts a
role that exits with an error as a supervisor would (same command; the trainer resumes from its
last checkpoint, which is the documented resume), and replaces a lost replica with a new one
started with ``--register`` (``docs/split-layout.md``). The schedule, printed before the run:

- each replica SIGKILLed once (process and vLLM server: a lost machine); a replacement joins;
- the trainer SIGKILLed twice mid-step; restarted with the same command;
- the proxy SIGKILLed once; restarted on the same port with the same command;
- storage, between every role and S3 (a fault proxy in front of moto,
  :mod:`asyncgrpo.testing.fault_proxy`): a window where 30 % of requests answer 500/503, one
  where requests hang past the clients' time-out (``timeout_s`` in the transport URL), one
  where storage is unreachable for 20 s;
- the trainer's disk full for a few seconds while it saves a checkpoint: its run directory is a
  small tmpfs (the bench runs in a private mount namespace, root only: ``unshare --mount``;
  the mount goes with the bench), filled by one file, then emptied.

Then the invariants (:mod:`asyncgrpo.testing.invariants`), on the run's own records (the
trainer's and rollout processes' sample ledgers, the batches and adapter manifests in S3, the
metrics): every sample trained at most once across the trainer's lives and none that was shipped
and acknowledged lost; every published version in the store and verifying, no number reused;
every served-policy audit passing outside fault windows; one metrics row per step; the final
reward (mean of the last 10 steps) and the held-out result (the final version's evaluation)
within the band of three clean runs of the same recipe (seeds 0, 1, 2), run by this bench
(``--clean``) and kept in ``--out/clean/``, widened by ``--band-margin``.

Run: ``python bench/chaos.py --seed 0`` (runs the missing clean runs first),
``python bench/chaos.py --clean --seed 2`` (one clean run, for chunked measuring),
``python bench/chaos.py --short --seed 0`` (the test suite's variant: 2 replicas, a few faults,
tens of steps, no band). Exit status 0 only if every invariant held.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny_cpu.yaml"
OUT = ROOT / "runs" / "chaos"
BUCKET = "chaos"
CLEAN_SEEDS = (0, 1, 2)
LAST = 10  #: the final reward is the mean of the last this many steps
NAMESPACE_ENV = "ASYNCGRPO_CHAOS_NAMESPACE"
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
}
#: The clients' storage settings (docs/transport.md: URL options): a time-out short enough that
#: a hang window outlasts it; retries patient enough to ride out a 20 s outage. obstore spends
#: its retries of a refused connection in a few seconds (12 took 2.7 s here), so the bound that
#: matters is retry_timeout_s.
TRANSPORT_QUERY = (
    "timeout_s=5&connect_timeout_s=2&max_retries=100&backoff_max_s=4&retry_timeout_s=60"
)
TRAINER_TMPFS_MB = 64
#: How long a replica's loss counts as in force when its replacement never joined.
UNJOINED_S = 60.0


# ---- the schedule -------------------------------------------------------------------------------
@dataclass
class Fault:
    """One scheduled fault and what it did."""

    kind: (
        str  #: replica | trainer | proxy | storage-errors | storage-hang | storage-down | disk-full
    )
    at_step: int  #: fires once the trainer has completed this step
    target: int = -1  #: replica index
    duration_s: float = 0.0  #: windows; for kills: seconds until the replacement / restart
    mid_step: float = 0.0  #: trainer: fraction of a step to wait after ``at_step`` before the kill
    started: float | None = None
    ended: float | None = None
    step_before: int | None = None  #: last step completed when it started
    next_step_s: float | None = None  #: from its start to the next new step completed
    notes: list[str] = field(default_factory=list)

    def window_end(self) -> float:
        """When it stopped acting: a window's end, a restart, a replacement joining (or a
        minute after a kill whose replacement never joined)."""
        assert self.started is not None
        return self.ended if self.ended is not None else self.started + UNJOINED_S

    def active(self, t: float, *, grace_s: float) -> bool:
        return self.started is not None and self.started <= t <= self.window_end() + grace_s

    def describe(self) -> str:
        what = {
            "replica": f"SIGKILL replica {self.target}; replacement after {self.duration_s:.0f} s",
            "trainer": f"SIGKILL the trainer {self.mid_step:.0%} into step {self.at_step + 1}",
            "proxy": f"SIGKILL the proxy; restart on its port after {self.duration_s:.0f} s",
            "storage-errors": f"{self.duration_s:.0f} s of 30 % of storage requests answering 500/503",
            "storage-hang": f"{self.duration_s:.0f} s of storage requests hanging past time-outs",
            "storage-down": f"{self.duration_s:.0f} s of storage unreachable",
            "disk-full": f"trainer's disk full for {self.duration_s:.0f} s over the checkpoint of "
            f"step {self.at_step + 1}",
        }[self.kind]
        return f"after step {self.at_step:>3}: {what}"


def make_schedule(
    seed: int, steps: int, replicas: int, short: bool, save_steps: int
) -> list[Fault]:
    """The faults of one run, drawn from ``seed``: spread over the run, some overlapping."""
    rng = random.Random(seed)
    if short:
        kinds = ["replica", "trainer", "proxy", "storage-errors", "storage-down"]
        durations = {"storage-errors": 8.0, "storage-down": 8.0}
    else:
        kinds = [
            *(["replica"] * replicas),
            "trainer",
            "trainer",
            "proxy",
            "storage-errors",
            "storage-hang",
            "storage-down",
            "disk-full",
        ]
        durations = {
            "storage-errors": 30.0,
            "storage-hang": 20.0,
            "storage-down": 20.0,
            "disk-full": 6.0,
        }
    lo, hi = (4, steps - 6) if short else (8, steps - 10)
    gap = max(1, (hi - lo) // (len(kinds) + 1))
    slots = [lo + i * gap + rng.randint(0, max(0, gap - 1)) for i in range(len(kinds))]
    rng.shuffle(kinds)
    if short:  # the replica first: its replacement needs a minute to start, and should join
        kinds.remove("replica")
        kinds.insert(0, "replica")
    faults, replica = [], 0
    for kind, at in zip(kinds, slots, strict=True):
        fault = Fault(kind=kind, at_step=at, duration_s=durations.get(kind, 0.0))
        if kind == "replica":
            fault.target, replica = replica, replica + 1
            fault.duration_s = rng.uniform(1, 3) if short else rng.uniform(3, 12)
        elif kind == "trainer":
            fault.mid_step = rng.uniform(0.2, 0.8)
        elif kind == "proxy":
            fault.duration_s = rng.uniform(2, 6)
        elif kind == "disk-full":  # the step before a checkpoint: it falls in the window
            fault.at_step = max(save_steps, (at // save_steps) * save_steps) - 1
        faults.append(fault)
    return sorted(faults, key=lambda f: f.at_step)


# ---- processes ----------------------------------------------------------------------------------
def _http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def _post_json(url: str, doc: dict[str, Any]) -> Any:
    body = json.dumps(doc).encode()
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        return json.loads(r.read())


@dataclass
class Role:
    """One process of the run and its lives (the bench restarts or replaces it)."""

    name: str
    argv: list[str]
    cwd: Path
    env: dict[str, str]
    restart: bool = True  #: restart it when it exits with an error (a supervisor's policy)
    url: str = ""  #: a replica's
    proc: subprocess.Popen[bytes] | None = None
    lives: list[dict[str, Any]] = field(default_factory=list)
    down: bool = False  #: killed on purpose, not to be restarted by the supervisor

    @property
    def log(self) -> Path:
        return self.cwd / "log.txt"

    def start(self) -> None:
        from asyncgrpo.processes import parent_death_argv

        self.cwd.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            out.write(f"\n==== life {len(self.lives) + 1} at {time.time():.3f}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                parent_death_argv(self.argv, self.env),
                cwd=self.cwd,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.lives.append({"start": time.time(), "pid": self.proc.pid})
        self.down = False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, cause: int | None = None) -> None:
        """SIGKILL the process and everything below it (a lost machine)."""
        from asyncgrpo.processes import kill_tree

        if self.proc is not None:
            self.down = True
            kill_tree(self.proc.pid)
            self.proc.wait()
            self.ended(killed=True, causes=[] if cause is None else [cause])

    def ended(self, killed: bool = False, causes: list[int] | None = None) -> None:
        if self.lives and "end" not in self.lives[-1]:
            assert self.proc is not None
            self.lives[-1].update(
                end=time.time(), code=self.proc.returncode, killed=killed, causes=causes or []
            )

    def stop(self, grace_s: float = 30.0) -> None:
        if not self.alive():
            return
        assert self.proc is not None
        self.down = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.kill()
        self.ended()

    def last_lines(self, n: int = 3) -> str:
        from asyncgrpo.processes import log_tail

        return log_tail(self.log, n).strip().replace("\n", " | ")[-400:]


class Run:
    """The processes of one run, its clock of steps, and the faults as they fire."""

    def __init__(self, args: argparse.Namespace, out: Path, faults: list[Fault]) -> None:
        from asyncgrpo.processes import free_port

        self.args, self.out, self.faults = args, out, faults
        self.steps = args.steps
        self.py = sys.executable
        self.ports = {k: free_port() for k in ("s3", "faults", "control", "proxy")}
        self.admin_key = secrets.token_urlsafe(24)
        self.env = {
            **os.environ,
            **S3_ENV,
            "PYTHONUNBUFFERED": "1",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.ports['faults']}",
            "ASYNCGRPO_PROXY_ADMIN_API_KEY": self.admin_key,  # the proxy's; a replica joins with it
            "ASYNCGRPO_PROXY__ADMIN_API_KEY": self.admin_key,  # a run's: its booking on the proxy
        }
        self.env.pop("VLLM_LOGGING_LEVEL", None)
        self.transport = f"s3://{BUCKET}/run?{TRANSPORT_QUERY}"
        self.proxy_url = f"http://127.0.0.1:{self.ports['proxy']}"
        self.roles: dict[str, Role] = {}
        self.replicas: list[Role] = []
        self.restarts: list[str] = []  #: unplanned: a role that exited with an error
        self.step_times: dict[int, float] = {}  #: step -> when its row first appeared
        self.max_step = 0
        self.trainer_dir = out / "trainer"
        self.t0 = time.time()
        self.filler: Path | None = None
        self.disk_peak = 0  #: bytes the trainer's run directory held at most (sampled)
        self._disk_seen = 0.0

    # -- set-up --------------------------------------------------------------------------------
    def config(self, role_dir: Path, model: Path) -> Path:
        import yaml

        data = yaml.safe_load(EXAMPLE.read_text())
        data.update(
            model=str(model),
            output_dir=str(role_dir),
            run_name="chaos",
            seed=self.args.seed,
            transport_url=self.transport,
        )
        data["serve"] = {"replicas": 0}
        data["proxy"] = {"upstreams": [self.proxy_url]}
        data["trainer"].update(
            max_steps=self.steps, save_steps=self.args.save_steps, audit={"action": "warn"}
        )
        path = role_dir / "run.yaml"
        role_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(data))
        return path

    def add(self, role: Role) -> Role:
        self.roles[role.name] = role
        role.start()
        return role

    def wait_http(self, url: str, role: Role, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not role.alive():
                raise RuntimeError(f"{role.name} exited: {role.last_lines(20)}")
            if _http_ok(url):
                return
            time.sleep(0.5)
        raise RuntimeError(f"{role.name}: {url} not up in {timeout_s:.0f} s: {role.last_lines(20)}")

    def replica(self, index: int, model: Path, *, register: bool) -> Role:
        from asyncgrpo.processes import free_port

        port = free_port()
        home = self.out / f"replica-{index}"
        argv = [
            self.py,
            "-m",
            "asyncgrpo.serve",
            "--model",
            str(model),
            "--replicas",
            "1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--max-model-len",
            "512",
            "--kv-cache-gib",
            "1",
            "--max-staleness",
            "4",
            "--nice",
            "10",
            "--transport",
            self.transport,
            "--adapter-cache-dir",
            str(home / "cache"),
            "--log-dir",
            str(home / "logs"),
        ]
        if register:
            argv += ["--register", self.proxy_url]
        role = Role(
            f"replica-{index}", argv, home, self.env, restart=False, url=f"http://127.0.0.1:{port}"
        )
        self.replicas.append(role)
        return self.add(role)

    def start(self, model: Path) -> None:
        py, ports = self.py, self.ports
        moto = self.add(
            Role(
                "s3",
                [py, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(ports["s3"])],
                self.out / "s3",
                self.env,
            )
        )
        self.wait_http(f"http://127.0.0.1:{ports['s3']}/moto-api/", moto, 60)
        urllib.request.urlopen(
            urllib.request.Request(f"http://127.0.0.1:{ports['s3']}/{BUCKET}", method="PUT"),
            timeout=10,
        ).read()
        faults = self.add(
            Role(
                "fault-proxy",
                [
                    py,
                    "-m",
                    "asyncgrpo.testing.fault_proxy",
                    "--upstream",
                    f"http://127.0.0.1:{ports['s3']}",
                    "--port",
                    str(ports["faults"]),
                    "--control-port",
                    str(ports["control"]),
                    "--seed",
                    str(self.args.seed),
                ],
                self.out / "fault-proxy",
                self.env,
            )
        )
        self.wait_http(f"http://127.0.0.1:{ports['control']}/stats", faults, 30)
        first = [self.replica(i, model, register=False) for i in range(self.args.replicas)]
        for r in first:
            self.wait_http(r.url + "/health", r, 900)
        upstreams = [a for r in first for a in ("--upstream", r.url)]
        proxy = self.add(
            Role(
                "proxy",
                [
                    py,
                    "-m",
                    "asyncgrpo.proxy",
                    "--port",
                    str(ports["proxy"]),
                    "--health-interval-s",
                    "1",
                    *upstreams,
                ],
                self.out / "proxy",
                self.env,
            )
        )
        self.wait_http(self.proxy_url + "/health", proxy, 60)
        rollout_dir = self.out / "rollout"
        self.add(
            Role(
                "rollout",
                [py, "-m", "asyncgrpo.cli.main", "rollout", str(self.config(rollout_dir, model))],
                rollout_dir,
                self.env,
            )
        )
        config = self.config(self.trainer_dir, model)
        # its log beside its disk, not on it: a full disk must not fail the trainer's prints
        self.add(
            Role(
                "trainer",
                [py, "-m", "asyncgrpo.cli.main", "train", str(config), "--remote-rollouts"],
                self.out / "trainer-log",
                self.env,
            )
        )

    # -- the clock -----------------------------------------------------------------------------
    @property
    def metrics_path(self) -> Path:
        return self.trainer_dir / "chaos" / "metrics.jsonl"

    def poll_steps(self) -> None:
        try:
            lines = self.metrics_path.read_text().splitlines()
        except OSError:
            return
        for line in lines:
            with contextlib.suppress(ValueError):
                step = json.loads(line)["step"]
                if step > self.max_step:
                    self.max_step = step
                    self.step_times[step] = time.time()
                    for f in self.faults:
                        if (
                            f.started is not None
                            and f.next_step_s is None
                            and step > (f.step_before or 0)
                        ):
                            f.next_step_s = time.time() - f.started

    def typical_step_s(self) -> float:
        times = sorted(self.step_times.items())
        gaps = [b[1] - a[1] for a, b in itertools.pairwise(times) if b[0] == a[0] + 1]
        return statistics.median(gaps[-20:]) if gaps else 1.0

    # -- supervision ---------------------------------------------------------------------------
    def supervise(self) -> None:
        for role in list(self.roles.values()):
            if role.alive() or role.down or role.proc is None:
                continue
            active = [i for i, f in enumerate(self.faults) if f.active(time.time(), grace_s=30)]
            role.ended(causes=active)
            code = role.proc.returncode
            if code == 0:
                role.down = True  # finished (the trainer, or the rollout process at done.json)
                continue
            if code == 2:  # a usage or configuration error: restarting cannot help
                raise RuntimeError(f"{role.name} refused its command: {role.last_lines(5)}")
            during = [self.faults[i].kind for i in active]
            why = (
                f"{role.name} exited {code} (during {', '.join(during) or 'no fault'}): "
                f"{role.last_lines(2)}"
            )
            self.restarts.append(why)
            print(f"  [{self.clock()}] unplanned: {why}", flush=True)
            if role.name.startswith("replica-"):
                role.down = True
                self.pending_replacements.append((time.time() + 5, role))
            elif role.restart:
                time.sleep(1)
                role.start()

    pending_replacements: list[tuple[float, Role]]

    def clock(self) -> str:
        return f"{time.time() - self.t0:7.1f} s, step {self.max_step:>3}"

    # -- faults ----------------------------------------------------------------------------------
    def control(self, mode: str, **kw: Any) -> None:
        _post_json(f"http://127.0.0.1:{self.ports['control']}/fault", {"mode": mode, **kw})

    def fire(self, fault: Fault, model: Path) -> None:
        fault.started, fault.step_before = time.time(), self.max_step
        print(f"  [{self.clock()}] {fault.describe()}", flush=True)
        if fault.kind == "replica":
            victim = self.replicas[fault.target]
            victim.kill(self.faults.index(fault))
            self.pending_replacements.append((time.time() + fault.duration_s, victim))
            fault.notes.append(f"killed {victim.url}")
        elif fault.kind == "trainer":
            time.sleep(fault.mid_step * self.typical_step_s())
            fault.started, fault.step_before = time.time(), self.max_step
            self.roles["trainer"].kill(self.faults.index(fault))
            time.sleep(1)  # a supervisor's restart delay
            self.roles["trainer"].start()
            fault.ended = time.time()
        elif fault.kind == "proxy":
            self.roles["proxy"].kill(self.faults.index(fault))
            time.sleep(fault.duration_s)
            self.roles["proxy"].start()
            fault.ended = time.time()
        elif fault.kind.startswith("storage-"):
            mode = fault.kind.removeprefix("storage-")
            self.control(mode, share=0.3 if mode == "errors" else 0.0)
        elif fault.kind == "disk-full":
            self.fill_disk(fault)

    def fill_disk(self, fault: Fault) -> None:
        target = self.trainer_dir
        if os.environ.get(NAMESPACE_ENV) != "1":
            fault.notes.append("skipped: the trainer's disk is not a tmpfs (not root)")
            fault.ended = fault.started
            return
        free = shutil.disk_usage(target).free
        self.filler = target / ".chaos-filler"
        with self.filler.open("wb") as f:
            with contextlib.suppress(OSError):
                os.posix_fallocate(f.fileno(), 0, free)
        fault.notes.append(f"filled {free >> 20} MiB; {shutil.disk_usage(target).free} B left")

    def end_window(self, fault: Fault) -> None:
        fault.ended = time.time()
        if fault.kind.startswith("storage-"):
            stats = _post_json(f"http://127.0.0.1:{self.ports['control']}/fault", {"mode": "pass"})
            fault.notes.append(
                f"{stats['requests']} requests so far, {stats['failed']} failed, "
                f"{stats['hung']} hung, {stats['dropped']} dropped"
            )
        elif fault.kind == "disk-full" and self.filler is not None:
            self.filler.unlink(missing_ok=True)
            self.filler = None
        print(f"  [{self.clock()}] end of {fault.kind}", flush=True)

    def replace(self, victim: Role, model: Path) -> None:
        index = len(self.replicas)
        new = self.replica(index, model, register=True)
        print(
            f"  [{self.clock()}] replacement replica-{index} for {victim.name} starting", flush=True
        )
        self.joins.append((new, time.time()))

    joins: list[tuple[Role, float]]

    # -- the run -------------------------------------------------------------------------------
    def drive(self, model: Path, timeout_s: float) -> None:
        self.pending_replacements, self.joins = [], []
        windows: list[Fault] = []
        pending = list(self.faults)
        trainer = self.roles["trainer"]
        deadline = time.monotonic() + timeout_s
        while not (trainer.down and trainer.proc is not None and trainer.proc.returncode == 0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the run did not finish in {timeout_s:.0f} s")
            self.poll_steps()
            self.supervise()
            now = time.time()
            if now - self._disk_seen > 10 and self.filler is None:
                self._disk_seen = now
                self.disk_peak = max(self.disk_peak, _du(self.trainer_dir))
            for due in [p for p in self.pending_replacements if p[0] <= now]:
                self.pending_replacements.remove(due)
                self.replace(due[1], model)
            for role, since in list(self.joins):
                if f"joined the proxy at {self.proxy_url}" in role.log.read_text(errors="replace"):
                    self.joins.remove((role, since))
                    for f in self.faults:
                        if f.kind == "replica" and f.ended is None and f.started:
                            f.ended = time.time()
                            f.notes.append(
                                f"{role.name} joined {time.time() - since:.0f} s after its start"
                            )
                            break
                    print(f"  [{self.clock()}] {role.name} joined", flush=True)
            for w in [w for w in windows if now >= (w.started or 0) + w.duration_s]:
                windows.remove(w)
                self.end_window(w)
            for fault in [f for f in pending if self.max_step >= f.at_step]:
                pending.remove(fault)
                self.fire(fault, model)
                if fault.kind.startswith("storage-") or fault.kind == "disk-full":
                    windows.append(fault)
            time.sleep(0.25)
        self.poll_steps()
        for w in windows:
            self.end_window(w)
        for fault in pending:
            fault.notes.append("never fired: the run ended first")

    def stop(self) -> None:
        order = [
            "rollout",
            "trainer",
            *(r.name for r in reversed(self.replicas)),
            "proxy",
            "fault-proxy",
            "s3",
        ]
        rollout = self.roles.get("rollout")
        if rollout is not None and rollout.alive():
            with contextlib.suppress(subprocess.TimeoutExpired):
                rollout.proc.wait(60)  # type: ignore[union-attr]
        for name in order:
            if name in self.roles:
                self.roles[name].stop()


def _du(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


# ---- records and invariants ----------------------------------------------------------------------
async def _store_records(endpoint: str) -> dict[str, Any]:
    """Everything the invariants need from S3, read from moto itself (not through the faults)."""
    from asyncgrpo.errors import IntegrityError, NotFound
    from asyncgrpo.store.adapters import AdapterStore
    from asyncgrpo.store.codec import decode_batch
    from asyncgrpo.transport.s3 import S3Transport

    t = S3Transport(
        BUCKET,
        "run",
        endpoint=endpoint,
        region="us-east-1",
        access_key_id="testing",
        secret_access_key="testing",
    )
    run = json.loads(await t.get("run.json"))
    prefix = f"{run['run_name']}-{run['run_id']}"
    batches: dict[int, list[str | None]] = {}
    quarantined: set[int] = set()
    async for info in t.list("rollouts/batches"):
        seq = int(info.key.rsplit("/", 1)[-1].split(".")[0])
        data = await t.get(info.key)
        if data:
            batches[seq] = [s.sample_id for s in decode_batch(data)]
    async for info in t.list("rollouts/quarantine"):
        quarantined.add(int(info.key.rsplit("/", 1)[-1].split(".")[0]))
    for seq in quarantined:
        with contextlib.suppress(Exception):
            batches[seq] = [
                s.sample_id
                for s in decode_batch(await t.get(f"rollouts/quarantine/{seq:012d}.agrb"))
            ]
    store = AdapterStore(t)
    versions: dict[int, dict[str, str]] = {}
    errors: dict[int, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for v in await store.versions(prefix):
            info = await store.info(prefix, v)
            versions[v] = {str(f["path"]): str(f["sha256"]) for f in info.files}
            try:
                await store.fetch(prefix, v, Path(tmp))
            except (IntegrityError, NotFound) as exc:
                errors[v] = str(exc)[:200]
    await t.aclose()
    return {
        "prefix": prefix,
        "batches": batches,
        "quarantined": quarantined,
        "versions": versions,
        "verify_errors": errors,
    }


def _jsonl(path: Path) -> list[dict[str, Any]]:
    from asyncgrpo.run.ledger import read_ledger

    return read_ledger(path)


def fault_windows(run: Run) -> list[Any]:
    from asyncgrpo.testing.invariants import FaultWindow

    out = []
    for f in run.faults:
        if f.started is None:
            continue
        end = f.window_end()
        name = f.kind + (f" {f.target}" if f.kind == "replica" else "")
        out.append(FaultWindow(name, f.started, end))
    return out


def check(run: Run, clean: list[dict[str, Any]], margin: float) -> dict[str, Any]:
    """Every invariant on the run's records; the figures of the report."""
    import anyio

    from asyncgrpo.config.trainer import AUDIT_TOLERANCE
    from asyncgrpo.run.ledger import lineage
    from asyncgrpo.testing.invariants import (
        check_audits,
        check_band,
        check_metrics,
        check_samples,
        check_versions,
    )

    store = anyio.run(_store_records, f"http://127.0.0.1:{run.ports['s3']}")
    run_dir = run.trainer_dir / "chaos"
    trained = _jsonl(run_dir / "samples.jsonl")
    shipped = _jsonl(run.out / "rollout" / "chaos" / "shipped.jsonl")
    rows = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    # as written: a resumed trainer drops the rows of the steps it trains again
    # (asyncgrpo.run.metrics.trim_metrics), so any duplicate, gap or disorder is a violation
    violations = []
    samples = check_samples(store["batches"], shipped, trained, quarantined=store["quarantined"])
    violations += samples.violations
    version_violations, unclaimed = check_versions(
        [r for r in trained if r.get("event") == "published"],
        store["versions"],
        store["verify_errors"],
    )
    violations += version_violations
    violations += check_metrics(rows, run.steps)
    audits = check_audits(rows, fault_windows(run), AUDIT_TOLERANCE["float32"])
    violations += audits.violations
    rewards = [
        r["reward"]
        for r in sorted(rows, key=lambda r: r["step"])[-LAST:]
        if isinstance(r.get("reward"), int | float)
    ]
    final_reward = statistics.fmean(rewards) if rewards else math.nan
    evals = _jsonl(run_dir / "eval_metrics.jsonl")
    held_out = evals[-1].get("eval/reward", math.nan) if evals else math.nan
    if clean:
        violations += check_band(
            "final reward", final_reward, [c["final_reward"] for c in clean], margin=margin
        )
        violations += check_band(
            "held-out reward", held_out, [c["held_out"] for c in clean], margin=margin
        )
    kept, rolled_back = lineage(trained)
    return {
        "violations": [str(v) for v in violations],
        "samples": {k: v for k, v in asdict(samples).items() if k != "violations"},
        "versions": len(store["versions"]),
        "unclaimed_versions": unclaimed,
        "audits": {
            "audits": audits.audits,
            "passed": audits.passed,
            "explained": audits.explained,
        },
        "final_reward": final_reward,
        "held_out": held_out,
        "kept": kept,
        "rolled_back": rolled_back,
    }


def attribute(run: Run, result: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's rows: per fault, time to the next step, steps redone, stale drops and why."""
    rows = []
    kept, rolled_back = result.pop("kept"), result.pop("rolled_back")
    lives = run.roles["trainer"].lives
    # the first 3 steps of each trainer life after the first (where a resume drops samples)
    first_lines: set[tuple[str, int]] = set()
    seen_lives: list[str] = []
    for r in kept:
        if r["life"] not in seen_lives:
            seen_lives.append(r["life"])
    counts: dict[str, int] = {}
    for r in kept:
        counts[r["life"]] = counts.get(r["life"], 0) + 1
        if r["life"] != seen_lives[0] and counts[r["life"]] <= 3:
            first_lines.add((r["life"], r["step"]))
    for i, f in enumerate(run.faults):
        nxt = run.faults[i + 1].started if i + 1 < len(run.faults) else None
        redone = sum(
            1
            for life in lives
            if i in life.get("causes", ())
            for r in rolled_back
            if life["start"] <= r["time"] <= life["end"]
        )
        start, end = f.started or 0, nxt or math.inf
        lines = [r for r in kept if start <= r["time"] < end]
        dropped = sum(len(r["dropped_stale"]) for r in lines)
        lags = [r["version"] - v for r in lines for _, v in r["dropped_stale"]]
        resumed = sum(
            len(r["dropped_stale"]) for r in lines if (r["life"], r["step"]) in first_lines
        )
        why = []
        if resumed:
            why.append(
                f"{resumed} read by a resumed trainer (its first version follows the "
                "dead one's last)"
            )
        if dropped - resumed:
            why.append(f"{dropped - resumed} generated ahead while the trainer was slowed")
        why = "; ".join(why) + (f" (lag {min(lags)}-{max(lags)} > 4)" if lags else "")
        rows.append(
            {
                "fault": f.describe(),
                "next_step_s": f.next_step_s,
                "redone": redone,
                "dropped": dropped,
                "why": why,
                "notes": "; ".join(f.notes),
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| fault | to next step (s) | steps redone | dropped stale | why | notes |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        nxt = "-" if r["next_step_s"] is None else f"{r['next_step_s']:.1f}"
        out.append(
            f"| {r['fault']} | {nxt} | {r['redone']} | {r['dropped']} | {r['why']} | {r['notes']} |"
        )
    return "\n".join(out)


# ---- main ---------------------------------------------------------------------------------------
def _model(out: Path) -> Path:
    from asyncgrpo.testing import make_tiny_model

    path = out / "tiny-model"
    if not (path / "config.json").is_file():
        make_tiny_model(path, seed=0)
    return path


def one_run(args: argparse.Namespace, clean_runs: list[dict[str, Any]]) -> dict[str, Any]:
    name = f"clean-seed{args.seed}" if args.clean else f"chaos-seed{args.seed}"
    out = args.out / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    model = _model(args.out)
    faults = (
        []
        if args.clean
        else make_schedule(args.seed, args.steps, args.replicas, args.short, args.save_steps)
    )
    print(
        f"{name}: {args.steps} steps, {args.replicas} replicas; schedule (seed {args.seed}):",
        flush=True,
    )
    for f in faults:
        print(f"  {f.describe()}")
    if not faults:
        print("  (none: a clean run)")
    run = Run(args, out, faults)
    tmpfs = False
    try:
        if os.environ.get(NAMESPACE_ENV) == "1":
            run.trainer_dir.mkdir(parents=True)
            subprocess.run(
                [
                    "mount",
                    "-t",
                    "tmpfs",
                    "-o",
                    f"size={TRAINER_TMPFS_MB}m",
                    "chaos-trainer",
                    str(run.trainer_dir),
                ],
                check=True,
            )
            tmpfs = True
        run.start(model)
        started = time.time()
        run.drive(model, timeout_s=args.timeout_min * 60)
        wall = time.time() - started
        result = check(run, clean_runs, args.band_margin)
        result["wall_s"] = wall
        result["restarts"] = run.restarts
        result["trainer_disk_peak_mb"] = round(run.disk_peak / 2**20, 2)
        result["faults"] = attribute(run, result)
    finally:
        run.stop()
        if tmpfs:  # keep the trainer's records: the tmpfs goes with this namespace
            saved = out / "trainer-records"
            shutil.copytree(
                run.trainer_dir,
                saved,
                ignore=shutil.ignore_patterns(".chaos-filler", ".scratch-*", "adapter-cache"),
                dirs_exist_ok=True,
            )
            subprocess.run(["umount", "-l", str(run.trainer_dir)], check=False)
    result.update(seed=args.seed, steps=args.steps, clean=args.clean, name=name)
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def report(result: dict[str, Any], clean: list[dict[str, Any]]) -> None:
    print(f"\n{result['name']}: wall {result['wall_s']:.0f} s", end="")
    if clean:
        walls = [c["wall_s"] for c in clean]
        print(
            f" (clean runs {', '.join(f'{w:.0f}' for w in walls)} s: "
            f"x{result['wall_s'] / statistics.fmean(walls):.2f})",
            end="",
        )
    print(
        f"; final reward {result['final_reward']:.3f}, held-out {result['held_out']:.3f}; "
        f"trainer's disk at most {result['trainer_disk_peak_mb']} MiB"
    )
    if clean:
        print(
            "clean band: final reward "
            + ", ".join(f"{c['final_reward']:.3f}" for c in clean)
            + "; held-out "
            + ", ".join(f"{c['held_out']:.3f}" for c in clean)
        )
    s = result["samples"]
    print(
        f"samples: {s['shipped']} shipped, {s['trained']} trained, {s['dropped_stale']} dropped "
        f"stale, {s['quarantined']} quarantined, {s['left_over']} left over, {s['unread']} "
        f"unread at the end; {s['rolled_back_steps']} steps rolled back; "
        f"{result['versions']} versions; audits {result['audits']['passed']}/"
        f"{result['audits']['audits']} passed"
    )
    for line in result["audits"]["explained"]:
        print(f"  audit failure explained: {line}")
    for line in result["restarts"]:
        print(f"  unplanned restart: {line}")
    if result["faults"]:
        print(table(result["faults"]))
    if result["violations"]:
        print("VIOLATIONS:")
        for v in result["violations"]:
            print(f"  {v}")
    else:
        print("every invariant held")


BANDED = ("final reward", "held-out reward")


def report_again(args: argparse.Namespace) -> int:
    """The report of a run made earlier, its band taken from the clean runs in ``--out`` now."""
    from asyncgrpo.testing.invariants import check_band

    name = f"clean-seed{args.seed}" if args.clean else f"chaos-seed{args.seed}"
    path = args.out / name / "result.json"
    if not path.is_file():
        print(f"no run at {path}: run it first (without --report)")
        return 2
    result = json.loads(path.read_text())
    clean = [] if args.clean else _clean_results(args.out, result["steps"])
    violations = [v for v in result["violations"] if not v.startswith(BANDED)]
    if clean:
        for label, key in zip(BANDED, ("final_reward", "held_out"), strict=True):
            values = [c[key] for c in clean]
            violations += map(str, check_band(label, result[key], values, margin=args.band_margin))
    elif not args.clean:
        print(f"no clean runs of {result['steps']} steps in {args.out}: the band is not checked")
    result["violations"] = violations
    report(result, clean)
    return 1 if violations else 0


def _clean_results(out: Path, steps: int) -> list[dict[str, Any]]:
    found = []
    for seed in CLEAN_SEEDS:
        path = out / f"clean-seed{seed}" / "result.json"
        if path.is_file() and (doc := json.loads(path.read_text())).get("steps") == steps:
            found.append(doc)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="150; 24 with --short")
    parser.add_argument("--short", action="store_true", help="the test suite's variant")
    parser.add_argument("--clean", action="store_true", help="one run without faults")
    parser.add_argument("--no-band", action="store_true", help="skip the clean band")
    parser.add_argument("--replicas", type=int, default=None, help="3; 2 with --short")
    parser.add_argument("--save-steps", type=int, default=None, help="10; 5 with --short")
    parser.add_argument("--band-margin", type=float, default=0.05)
    parser.add_argument("--timeout-min", type=float, default=90)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--report",
        action="store_true",
        help="run nothing: the report of the run --seed already made, against "
        "the clean runs in --out now (for runs measured in chunks)",
    )
    args = parser.parse_args()
    args.steps = args.steps or (24 if args.short else 150)
    args.replicas = args.replicas or (2 if args.short else 3)
    args.save_steps = args.save_steps or (5 if args.short else 10)
    args.out = args.out.resolve()
    if args.report:
        sys.exit(report_again(args))
    if os.geteuid() == 0 and os.environ.get(NAMESPACE_ENV) is None and shutil.which("unshare"):
        # Root: run in a private mount namespace, where the trainer's disk can be a small tmpfs
        # (the disk-full fault); it goes with the namespace, whatever happens to the bench.
        env = {**os.environ, NAMESPACE_ENV: "1"}
        argv = ["unshare", "--mount", "--propagation", "private", sys.executable, *sys.argv]
        os.execvpe("unshare", argv, env)
    clean: list[dict[str, Any]] = []
    if not (args.clean or args.short or args.no_band):
        clean = _clean_results(args.out, args.steps)
        for seed in CLEAN_SEEDS:
            if not any(c["seed"] == seed for c in clean):
                one = argparse.Namespace(**{**vars(args), "clean": True, "seed": seed})
                report(one_run(one, []), [])
        clean = _clean_results(args.out, args.steps)
    result = one_run(args, clean)
    report(result, clean)
    sys.exit(1 if result["violations"] else 0)


if __name__ == "__main__":
    main()
