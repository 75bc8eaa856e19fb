"""What a launch is made of, for the launcher and every backend: job specs, started jobs, their
status, and the interface a backend implements. Backends import this module, never the launcher.

Secret values travel in :attr:`JobSpec.secrets` only, which nothing prints; commands and plain
environment variables hold none.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from asyncgrpo.config.launch import CONFIG_ENV
from asyncgrpo.config.redaction import redact_text

if TYPE_CHECKING:
    from asyncgrpo.config.training import TrainingConfig

Role = Literal["replica", "proxy", "trainer"]
Stage = Literal["starting", "running", "completed", "failed", "canceled"]
TERMINAL: frozenset[str] = frozenset({"completed", "failed", "canceled"})


@dataclass(frozen=True)
class JobSpec:
    """One job (or local process group): what runs, where, with which environment."""

    role: Role
    name: str
    command: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    #: name -> value; the values are never printed, logged or put in a command line
    secrets: Mapping[str, str] = field(default_factory=dict, repr=False)
    image: str | None = None
    flavor: str | None = None
    timeout_s: int | None = None
    port: int | None = None
    labels: Mapping[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """The spec as ``--dry-run`` prints it: secret *names* only, env names and values
        except the (long) config."""
        lines = [f"{self.role} job {self.name}"]
        if self.image is not None:
            lines.append(f"  image:   {self.image}")
        if self.flavor is not None:
            lines.append(f"  flavor:  {self.flavor}")
        if self.timeout_s is not None:
            lines.append(f"  timeout: {self.timeout_s} s")
        lines.append(f"  ports:   {self.port if self.port is not None else '-'}")
        lines.append(f"  command: {redact_text(shlex.join(self.command))}")
        env = [
            k if k == CONFIG_ENV else f"{k}={redact_text(v)}" for k, v in sorted(self.env.items())
        ]
        lines.append(f"  env:     {', '.join(env) or '-'}")
        lines.append(f"  secrets: {', '.join(sorted(self.secrets)) or '-'}")
        return "\n".join(lines)


@dataclass(eq=False)
class Job:
    """A started job: its spec, the backend's id for it, where its log is kept."""

    spec: JobSpec
    id: str
    log_path: Path
    url: str | None = None  #: replicas: the vLLM server's base URL; trainer: its proxy's
    stage: Stage = "starting"
    cancel_requested: bool = False
    #: why the launcher gave up on it before it ended by itself (a replacement never healthy)
    failure: str | None = None
    replaced_by: str | None = None  #: a replica job that ended: the name of its replacement
    replaces: str | None = None  #: a replacement: the name of the job it stands in for

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class JobStatus:
    stage: Stage
    url: str | None = None
    message: str | None = None


class Backend(Protocol):
    """Where jobs run. Implementations: the classes :data:`~.config.LAUNCH_BACKENDS` names
    (:mod:`.hf_jobs`, :mod:`.ray_jobs`, :mod:`.skypilot`, :mod:`.local`)."""

    name: str
    missing: list[str]  #: environment variables the launch needs and does not have
    transport_url: str | None  #: where the runs keep their state (a sweep: one root per point)
    #: True when each job writes ``job.log_path`` itself (local processes); else the launcher
    #: writes there what ``follow_logs`` reports
    writes_own_logs: bool

    @property
    def health_headers(self) -> dict[str, str]: ...
    @property
    def admin_key(self) -> str | None:
        """The key of the admin routes (``/proxy/upstreams``) of the proxy in front of the
        replicas (the trainer job's; a sweep's proxy job), which the launcher calls to add a
        replacement replica; None when no replica is ever replaced."""
        ...

    def replica_spec(self, index: int) -> JobSpec:
        """Replica ``index``: 0 .. ``launch.replicas`` - 1 at start, then each replacement."""
        ...

    def proxy_spec(self, urls: list[str]) -> JobSpec:
        """A sweep's standalone proxy in front of the replicas ``urls``; its runs use it, and
        with ``launch.replica_restarts`` the launcher adds replacements to it (``admin_key``)."""
        ...

    def trainer_spec(self, urls: list[str], cfg: TrainingConfig | None = None) -> JobSpec:
        """The trainer job of ``cfg`` (default: the launch's config; a sweep: each point's)
        sending to ``urls``. The launch's one trainer puts its proxy in front of the replicas
        ``urls``; with ``launch.replica_restarts`` that proxy is reachable by the launcher at
        the job's URL (``port``). A sweep's point sends to the sweep's proxy (``urls``: its
        URL)."""
        ...

    def check(self) -> None:
        """Refuse, before any job starts, what the launch cannot do (may ask the backend)."""
        ...

    def check_offline(self) -> None:
        """The part of :meth:`check` that sends no request: what ``--dry-run`` refuses too."""
        ...

    async def prepare(self) -> None: ...
    async def start(self, spec: JobSpec) -> str: ...
    async def status(self, job: Job) -> JobStatus: ...
    async def log_tail(self, job: Job, lines: int) -> str:
        """The job's last ``lines`` log lines; empty when it has printed none."""
        ...

    def metrics_path(self, job: Job) -> Path | None:
        """Where a trainer job's ``metrics.jsonl`` is on this host; None when it is not here."""
        ...

    async def follow_logs(self, job: Job, on_line: Callable[[str], None]) -> None: ...
    async def cancel(self, job: Job) -> None: ...
    async def aclose(self) -> None: ...
