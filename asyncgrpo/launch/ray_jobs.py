"""A Ray cluster as a launch backend: every job a Ray actor owning its role's process group.

The launcher is the Ray driver (``ray.init`` to ``launch.ray_address``, ``$RAY_ADDRESS`` or
``auto``: the same under ``ray job submit`` and on a KubeRay ``RayCluster``). Each job is one
:class:`~asyncgrpo.launch.ray_actor.RoleActor` with the role's resources
(:func:`actor_options`: CPUs, GPUs, custom resources such as ``{inference: 1}``, an accelerator
type), running the command of the same plans as every backend (:mod:`.plan`). The transport is
the only state the roles share: ``transport_url``, or without one a directory of the launch,
which only a cluster whose nodes are all on this host can share.

One recovery mechanism: the actors have ``max_restarts=0``, so an actor that dies (its node
lost, OOM, ``ray.kill``) stays dead and the launcher's replacement (``launch.replica_restarts``)
starts a new one; Ray restarting it too would be a second mechanism fighting the first. The
actors are not detached: Ray kills them with the driver, so a launcher killed outright leaves
none, and each actor's process group gets SIGTERM as the actor dies (``start_group``), for
which Ray's own cleanup is turned off (:data:`ROLE_RUNTIME_ENV`). Ctrl-C stops each process
group, then kills each actor.

Replica ``i`` listens on its node's address at ``launch.port + i`` with an API key made for the
launch: a replacement's port is known in advance, so the trainer's proxy is told which
addresses get the replicas' key (any host, those ports). The trainer's proxy listens on its
node's address at a port free there, with its own key, through which the launcher adds
replacements.

Secrets reach each actor as an argument of its ``start`` call, which adds them to its process's
environment: none is in a command line, nor in a ``runtime_env`` (Ray logs its ``env_vars`` in
``runtime_env_agent.log`` and shows them in its state API; the actors' holds one setting of
Ray's, no secret). The role's output goes to a file on
its node that the launcher streams into ``launch/<job>.log``, not through Ray's log forwarding
(which the driver turns off).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from asyncgrpo.config.launch import LaunchConfig
from asyncgrpo.config.redaction import redact_text
from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.errors import ConfigError, LaunchError
from asyncgrpo.launch.jobs import Job, JobSpec, JobStatus, Role
from asyncgrpo.launch.plan import trainer_metrics_path
from asyncgrpo.launch.ray_actor import (
    NODE_IP,
    PORT,
    PYTHON,
    RoleActor,
    current_node_id,
    node_address,
)
from asyncgrpo.launch.remote import RemoteBackend, first_line
from asyncgrpo.retry import poll_until

__all__ = [
    "NAMESPACE",
    "RayBackend",
    "actor_options",
    "import_ray",
    "ray_address",
    "role_requests",
    "unmet_resources",
]

logger = logging.getLogger(__name__)

#: The Ray namespace of a launch's actors (``ray list actors --filter namespace=asyncgrpo``).
NAMESPACE = "asyncgrpo"
STOP_GRACE_S = 30.0
#: Seconds one call to an actor may take before the launcher treats it as not answering.
CALL_TIMEOUT_S = 30.0


def import_ray() -> Any:
    """Ray, or one line saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--backend ray needs Ray: pip install 'asyncgrpo[ray]'") from None
    return ray


def ray_address(lcfg: LaunchConfig, environ: Mapping[str, str]) -> str:
    """The cluster to connect to: ``launch.ray_address``, else ``$RAY_ADDRESS``, else auto."""
    return lcfg.ray_address or environ.get("RAY_ADDRESS") or "auto"


def gcs_endpoint(address: str) -> tuple[str, int] | None:
    """(host, port) that must answer for ``address`` (``HOST:PORT``, ``ray://HOST[:PORT]``);
    None for ``auto`` (Ray looks for the cluster this machine belongs to)."""
    if address in ("auto", "local"):
        return None
    client = address.startswith("ray://")
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        host, port = address.removeprefix("ray://"), "10001" if client else "6379"
    return host.strip("[]"), int(port)


def _kind(role: Role) -> str:
    """Whose resources a role's actor takes: a replica's, or the trainer's (a sweep's proxy
    runs with the trainers, without their GPUs)."""
    return "replica" if role == "replica" else "trainer"


def resources_of(role: Role, lcfg: LaunchConfig) -> dict[str, float]:
    """What one actor of ``role`` reserves, as Ray counts it in ``ray.cluster_resources()``
    (an accelerator type is a resource ``accelerator_type:NAME`` Ray asks 0.001 of)."""
    kind = _kind(role)
    gpus = 0.0 if role == "proxy" else getattr(lcfg, f"{kind}_num_gpus")
    out = {
        "CPU": getattr(lcfg, f"{kind}_num_cpus"),
        "GPU": gpus,
        **getattr(lcfg, f"{kind}_resources"),
    }
    accelerator = getattr(lcfg, f"{kind}_accelerator_type")
    if accelerator and role != "proxy":
        out[f"accelerator_type:{accelerator}"] = 0.001
    return {k: float(v) for k, v in out.items() if v}


#: By default Ray SIGKILLs an actor worker's direct children as the worker exits
#: (``RAY_kill_child_processes_on_worker_exit``): the role's process (``asyncgrpo.serve``) would
#: die without its shutdown and leave what it started, a vLLM server that, still starting, can
#: ignore the SIGTERM its own parent-death signal then sends. Without Ray's kill, the role's
#: parent-death SIGTERM (:func:`~asyncgrpo.processes.start_group`) runs that shutdown, which
#: stops its vLLM servers and SIGKILLs what ignores it. Ray merges a job's ``env_vars`` with an
#: actor's, so a ``ray job submit --runtime-env`` keeps its own.
ROLE_RUNTIME_ENV: Mapping[str, Any] = {
    "env_vars": {"RAY_kill_child_processes_on_worker_exit": "false"}
}


def actor_options(spec: JobSpec, lcfg: LaunchConfig) -> dict[str, Any]:
    """``RoleActor.options(...)`` for ``spec``: its name, its resources, no restart by Ray (the
    launcher replaces it), Ray's kill of its children off (:data:`ROLE_RUNTIME_ENV`). No secret
    in the ``runtime_env``: the environment goes to ``RoleActor.start``."""
    kind = _kind(spec.role)
    accelerator = getattr(lcfg, f"{kind}_accelerator_type")
    options: dict[str, Any] = {
        "name": spec.name,
        "namespace": NAMESPACE,
        "num_cpus": getattr(lcfg, f"{kind}_num_cpus"),
        "num_gpus": 0 if spec.role == "proxy" else getattr(lcfg, f"{kind}_num_gpus"),
        "resources": dict(getattr(lcfg, f"{kind}_resources")),
        "max_restarts": 0,
        "max_task_retries": 0,
        "runtime_env": {"env_vars": dict(ROLE_RUNTIME_ENV["env_vars"])},
    }
    if accelerator and spec.role != "proxy":
        options["accelerator_type"] = accelerator
    return options


def role_requests(lcfg: LaunchConfig, *, trainers: int = 1) -> dict[str, tuple[int, dict]]:
    """What the launch's actors reserve at once, by role: (how many, each one's resources).
    A sweep (``trainers`` > 1) adds its proxy."""
    out: dict[str, tuple[int, dict]] = {
        "replica": (lcfg.replicas, resources_of("replica", lcfg)),
        "trainer": (trainers, resources_of("trainer", lcfg)),
    }
    if lcfg.sweep:
        out["proxy"] = (1, resources_of("proxy", lcfg))
    return out


_FIELDS = {"CPU": "num_cpus", "GPU": "num_gpus"}


def unmet_resources(
    requests: Mapping[str, tuple[int, Mapping[str, float]]], cluster: Mapping[str, float]
) -> list[str]:
    """Each resource the actors of ``requests`` ask more of, together, than ``cluster`` (Ray's
    ``cluster_resources()``) has, in one phrase naming who asks and the field that sets it."""
    out = []
    names = sorted({name for _, asks in requests.values() for name in asks})
    for name in names:
        parts = [(role, n, asks[name]) for role, (n, asks) in requests.items() if name in asks]
        total = sum(n * amount for _, n, amount in parts)
        have = float(cluster.get(name, 0.0))
        if total <= have + 1e-9:
            continue
        kinds = sorted({"trainer" if role == "proxy" else role for role, _, _ in parts})
        if name.startswith("accelerator_type:"):
            fields = ", ".join(f"launch.{kind}_accelerator_type" for kind in kinds)
            out.append(f"{name.split(':', 1)[1]} ({fields}): the cluster has no node with it")
            continue
        setting = _FIELDS.get(name, "resources")
        fields = ", ".join(f"launch.{kind}_{setting}" for kind in kinds)
        who = " + ".join(
            f"{n} {role}{'s' if n > 1 else ''} x {amount:g}" for role, n, amount in parts
        )
        out.append(f"{name}: {total:g} asked ({who}; {fields}), the cluster has {have:g}")
    return out


@dataclass
class _Actor:
    """A job's actor: its handle, the reference to its ``start`` call, and once started,
    where it runs (``RoleActor.start``'s answer)."""

    handle: Any
    started: Any
    workdir: Path
    info: dict[str, Any] | None = None


class RayBackend(RemoteBackend):
    """Replicas, a sweep's proxy and the trainers as Ray actors on one cluster."""

    name = "ray"
    secrets_as = "in their environment"
    shares_directories = True  # a directory every node mounts at the same path

    import_sdk = staticmethod(import_ray)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.launch_dir = self.launch_dir.resolve()
        #: without transport_url: a directory of the launch (a one-host cluster shares it)
        self.shared_dir = not self.cfg.transport_url
        self.address = ray_address(self.cfg.launch, self.environ)
        self._actors: dict[str, _Actor] = {}
        self._launcher_ip: str | None = None
        self._connected = False

    def transport_for(self, cfg: TrainingConfig, launch_dir: Path) -> str | None:
        return cfg.transport_url or str(launch_dir.resolve() / "store")

    # -- specs: actors on the cluster's nodes, the node's Python --------------------------------

    listen_host = NODE_IP
    replica_extra = ("--log-dir", ".", "--adapter-cache-dir", "adapters")

    def _replica_port(self, index: int) -> int:
        """A replacement's port is known in advance: the trainer's proxy gives it the key."""
        return self.cfg.launch.port + index

    def _own_port(self) -> tuple[int | str, int | None]:
        return PORT, None  # a port free on its node, which its actor reports

    def _key_urls(self, urls: list[str]) -> list[str] | None:
        """The addresses of every replica the launch may start (any node, its port)."""
        lcfg = self.cfg.launch
        n = lcfg.replicas + lcfg.replica_restarts
        return [f"http://*:{self._replica_port(i)}" for i in range(n)]

    def _command(self, role: Role, args: list[str]) -> tuple[list[str], dict[str, str]]:
        return [PYTHON, *args], {}  # the node's Python, asyncgrpo installed there

    def _placement(self, role: Role) -> dict[str, Any]:
        return {}  # the actor's resources: actor_options

    def dry_run_text(self, spec: JobSpec) -> str:
        """``spec`` as every backend describes it, and its actor's resources."""
        opts = actor_options(spec, self.cfg.launch)
        shown = {
            k: v for k, v in opts.items() if k not in ("name", "namespace") and v not in ({}, None)
        }
        text = spec.describe().replace(f"{spec.role} job", f"{spec.role} actor", 1)
        return text + "\n  ray:     " + ", ".join(f"{k}={v}" for k, v in shown.items())

    # -- the cluster -------------------------------------------------------------------------

    def check_offline(self) -> None:
        """Refuse, without the cluster, what the launch would refuse: secrets not set."""
        self._refuse_missing()

    def check(self) -> None:
        """Connect to the cluster and refuse, before any actor starts, what the launch cannot
        get there: secrets not set, resources the cluster lacks, a directory transport other
        hosts cannot share."""
        self.check_offline()
        ray = self.sdk
        endpoint = gcs_endpoint(self.address)
        if endpoint is not None:  # Ray retries an address nothing answers at for minutes
            try:
                socket.create_connection(endpoint, timeout=5).close()
            except OSError as exc:
                raise ConfigError(
                    f"no Ray cluster at {self.address}: {exc.strerror or exc}; start one (ray "
                    "start --head) or set launch.ray_address (or RAY_ADDRESS)"
                ) from None
        try:
            ray.init(
                address=self.address,
                namespace=NAMESPACE,
                log_to_driver=False,
                logging_level=logging.ERROR,
            )
        except Exception as exc:  # ConnectionError, and Ray's own for a bad address
            raise ConfigError(
                f"no Ray cluster at {self.address}: {first_line(exc)}; start one (ray start "
                "--head) or set launch.ray_address (or RAY_ADDRESS)"
            ) from None
        self._connected = True
        self._launcher_ip = node_address(current_node_id())
        trainers = len(self.cfg.launch.sweep and _points(self.cfg)) or 1
        unmet = unmet_resources(
            role_requests(self.cfg.launch, trainers=trainers), ray.cluster_resources()
        )
        if unmet:
            raise ConfigError(
                f"the Ray cluster at {self.address} lacks what the launch asks "
                f"for: {'; '.join(unmet)}"
            )
        if self.shared_dir:
            hosts = sorted({n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")})
            if hosts != [self._launcher_ip]:
                raise ConfigError(
                    f"transport_url is unset and the cluster's nodes are on other hosts "
                    f"({', '.join(hosts)}): set transport_url=s3://... or hf://buckets/..., "
                    "or a directory every node mounts at the same path"
                )

    def _workdir(self, spec: JobSpec) -> Path:
        return self.launch_dir / spec.name.removeprefix(f"{self.cfg.run_name}-")

    async def prepare(self) -> None:
        pass

    async def _get(self, ref: Any, wait_s: float = CALL_TIMEOUT_S) -> Any:
        """``ray.get(ref)`` in a worker thread, giving up after ``wait_s``."""
        return await anyio.to_thread.run_sync(lambda: self.sdk.get(ref, timeout=wait_s))

    async def start(self, spec: JobSpec) -> str:
        """Create the actor and ask it to start the command; returns at once (the actor may
        wait for resources: :meth:`status` says ``starting`` meanwhile)."""
        options = actor_options(spec, self.cfg.launch)
        workdir = self._workdir(spec)
        fallback = f"{self.cfg.run_name}/{workdir.name}"
        try:
            handle = self.sdk.remote(RoleActor).options(**options).remote()
            started = handle.start.remote(
                list(spec.command),
                {**spec.env, **spec.secrets},
                workdir=str(workdir),
                launcher_ip=self._launcher_ip,
                fallback=fallback,
            )
        except Exception as exc:  # a name still taken by a live actor, a bad option
            raise LaunchError(
                f"could not start {spec.role} actor {spec.name}: {first_line(exc)}"
            ) from None
        self._actors[spec.name] = _Actor(handle, started, workdir)
        return spec.name

    async def _info(self, actor: _Actor) -> dict[str, Any] | None:
        """Where the actor's process runs, once it started; None before; raises the Ray
        error if the actor died first."""
        if actor.info is None:
            ready, _ = await anyio.to_thread.run_sync(
                lambda: self.sdk.wait([actor.started], timeout=0)
            )
            if not ready:
                return None
            actor.info = await self._get(actor.started)
            logger.debug("actor %s on node %s", actor.handle, actor.info["node_id"])
        return actor.info

    async def status(self, job: Job) -> JobStatus:
        actor = self._actors[job.id]
        ended = "canceled" if job.cancel_requested else "failed"
        try:
            info = await self._info(actor)
            if info is None:
                return JobStatus("starting", message="waiting for its Ray actor")
            code = await self._get(actor.handle.returncode.remote())
        except self.sdk.exceptions.GetTimeoutError:
            return JobStatus(job.stage, job.url, "its Ray actor did not answer in time")
        except self.sdk.exceptions.RayTaskError as exc:  # start raised on the node
            return JobStatus(ended, None, f"its Ray actor failed: {first_line(exc.cause)}")
        except self.sdk.exceptions.RayError as exc:
            return JobStatus(ended, None, f"its Ray actor died: {first_line(exc)}")
        port = job.spec.port or info["port"]  # a replica's is planned; else the node's pick
        url = f"http://{info['node_ip']}:{port}" if port else None
        if code is None:
            return JobStatus("running", url)
        if job.cancel_requested:
            return JobStatus("canceled", url)
        return JobStatus(
            "completed" if code == 0 else "failed", url, None if code == 0 else f"exit code {code}"
        )

    async def log_tail(self, job: Job, lines: int) -> str:
        """From the actor; once it is gone, what the launcher streamed of it."""
        actor = self._actors.get(job.id)
        if actor is not None and actor.info is not None:
            try:
                return redact_text(await self._get(actor.handle.tail.remote(lines), 10))
            except Exception:
                pass
        try:
            text = await anyio.Path(job.log_path).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def metrics_path(self, job: Job) -> Path | None:
        """A trainer's ``metrics.jsonl`` when its node is on this host (its working directory
        is the launch's); None when it ran elsewhere."""
        if job.spec.role != "trainer":
            return None
        actor = self._actors.get(job.id)
        if actor is not None and actor.info is not None:
            if actor.info["node_ip"] != self._launcher_ip:
                return None
        return trainer_metrics_path(self._workdir(job.spec), job.name)

    async def follow_logs(self, job: Job, on_line: Callable[[str], None]) -> None:
        """Read the role's log from its actor until the process ended (or the actor died)."""
        actor = self._actors[job.id]
        ray = self.sdk
        offset, pending = 0, ""
        try:
            await poll_until(lambda: self._info(actor), every=0.5)  # a poll of Ray, no event
            while True:
                chunk, ended = await self._get(actor.handle.read.remote(offset))
                offset += len(chunk)
                pending += chunk.decode(errors="replace")
                *lines, pending = pending.split("\n")
                for line in lines:
                    on_line(line)
                if ended:
                    break
                if not chunk:
                    await anyio.sleep(0.5)
        except ray.exceptions.RayError as exc:
            logger.debug("log of %s ended: %s", job.name, first_line(exc))
        if pending:
            on_line(pending)

    async def cancel(self, job: Job) -> None:
        """Stop the actor's process group (SIGTERM, then SIGKILL after the grace), then kill
        the actor."""
        actor = self._actors[job.id]
        ray = self.sdk
        try:
            if actor.info is not None or await self._info(actor) is not None:
                await self._get(actor.handle.stop.remote(STOP_GRACE_S, job.name), STOP_GRACE_S + 15)
        except ray.exceptions.RayError:
            pass  # dead already, or not answering: ray.kill ends it and its processes
        await anyio.to_thread.run_sync(lambda: ray.kill(actor.handle, no_restart=True))

    async def aclose(self) -> None:
        if self._connected:
            self._connected = False
            await anyio.to_thread.run_sync(self.sdk.shutdown)


def _points(cfg: TrainingConfig) -> list[Any]:
    from asyncgrpo.launch.sweep import sweep_points

    return sweep_points(cfg, None)
