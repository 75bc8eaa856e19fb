"""This host as a launch backend: each role a separate process group in its own directory.

The same roles as on Hugging Face Jobs, so the distributed layout can be tried without a cloud
account: replica ``i`` runs ``python -m asyncgrpo.serve`` in ``launch/replica-i/``, the trainer
``python -m asyncgrpo.run.job`` in ``launch/trainer/``; they share nothing but the
transport, which is ``transport_url`` if set, else (``launch.local_transport``) a directory
``launch/store`` no role works in, or an S3 protocol server (moto) on loopback that lives as
long as the launch. Replicas listen on loopback only; so does the trainer's proxy (a sweep's
proxy, ``launch/proxy/``, with one trainer per point in ``launch/trainer/<i>/``), on a port
chosen here, with an admin key made for the launch (the launcher adds replacement replicas to
it).
"""

from __future__ import annotations

import logging
import os
import secrets
import shlex
import sys
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import anyio
from anyio.abc import Process

from asyncgrpo.config.model_source import check_model
from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.errors import LaunchError
from asyncgrpo.launch.jobs import CONFIG_ENV, Job, JobSpec, JobStatus
from asyncgrpo.launch.plan import (
    JOB_OUTPUT_DIR,
    PROXY_ADMIN_KEY_ENV,
    job_config,
    job_spec,
    proxy_args,
    replica_args,
    trainer_args,
    trainer_metrics_path,
    trainer_secrets,
    transport_secret,
)
from asyncgrpo.processes import free_port, log_tail, start_group, stop_group
from asyncgrpo.retry import Backoff, retry

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
S3_BUCKET = "asyncgrpo"
STOP_GRACE_S = 30.0
#: moto accepts any key pair; these only satisfy the S3 client.
_MOTO_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
}


class LocalBackend:
    """Roles as local process groups with disjoint working directories."""

    name = "local"
    missing: list[str] = []  # noqa: RUF012 (never mutated: a local launch needs no secret)
    writes_own_logs = True

    def __init__(
        self, cfg: TrainingConfig, launch_dir: Path, *, environ: Mapping[str, str] | None = None
    ) -> None:
        self.cfg = cfg  # its paths are absolute since loading: each role has its own cwd
        self.launch_dir = launch_dir.resolve()
        self.environ = dict(os.environ if environ is None else environ)
        self.ports = [free_port(HOST) for _ in range(cfg.launch.replicas)]
        elastic = cfg.launch.replica_restarts > 0
        self.proxy_port = free_port(HOST) if elastic else None
        self._admin_key = secrets.token_urlsafe(32) if elastic else None
        self.transport_env: dict[str, str] = {}
        self._moto: Process | None = None
        self._moto_port: int | None = None
        if cfg.transport_url:
            self.transport_url = cfg.transport_url
        elif cfg.launch.local_transport == "dir":
            self.transport_url = str(self.launch_dir / "store")
        else:
            self._moto_port = free_port(HOST)
            self.transport_url = f"s3://{S3_BUCKET}/{cfg.run_name}"
            self.transport_env = {
                **_MOTO_ENV,
                "AWS_ENDPOINT_URL": f"http://{HOST}:{self._moto_port}",
            }
        self._processes: dict[str, Process] = {}

    @property
    def health_headers(self) -> dict[str, str]:
        return {}

    @property
    def admin_key(self) -> str | None:
        return self._admin_key

    def port_of(self, index: int) -> int:
        """Replica ``index``'s port (a replacement gets a fresh one)."""
        while len(self.ports) <= index:
            self.ports.append(free_port(HOST))
        return self.ports[index]

    def replica_spec(self, index: int) -> JobSpec:
        port = self.port_of(index)
        args = replica_args(self.cfg, host=HOST, port=port, transport_url=self.transport_url)
        command = self._hidden(
            sys.executable, *args, "--log-dir", ".", "--adapter-cache-dir", "adapters"
        )
        return job_spec(
            self.cfg,
            "replica",
            f"replica-{index}",
            command,
            env=dict(self.transport_env),
            port=port,
            secrets=transport_secret("replica", self.transport_url),
        )

    def _hidden(self, *argv: str) -> tuple[str, ...]:
        """``argv``, in a private mount namespace hiding the trainer's directory if asked."""
        if not self.cfg.launch.local_hide_trainer:
            return argv
        trainer_dir = self._workdir_of("trainer")
        script = (
            f"mount -t tmpfs -o size=1m asyncgrpo-hidden {shlex.quote(str(trainer_dir))} "
            f"&& exec {shlex.join(argv)}"
        )
        return ("unshare", "--mount", "--propagation", "private", "sh", "-c", script)

    def proxy_spec(self, urls: list[str]) -> JobSpec:
        """A sweep's proxy, on loopback; the launcher adds replacement replicas to it with the
        launch's admin key."""
        port = free_port(HOST)
        admin = {PROXY_ADMIN_KEY_ENV: self._admin_key} if self._admin_key is not None else {}
        args = proxy_args(
            urls, host=HOST, port=port, admin_key_env=PROXY_ADMIN_KEY_ENV if admin else None
        )
        return job_spec(
            self.cfg, "proxy", "proxy", (sys.executable, *args), secrets=admin, port=port
        )

    def trainer_spec(self, urls: list[str], cfg: TrainingConfig | None = None) -> JobSpec:
        import dataclasses

        point = cfg is not None  # a sweep's: it sends to the sweep's proxy, which grows
        cfg = cfg or self.cfg
        transport = cfg.transport_url or self.transport_url  # a sweep's point has its own
        shipped = dataclasses.replace(cfg, transport_url=transport, output_dir=JOB_OUTPUT_DIR)
        port = None if point else self.proxy_port
        # the admin key: the proxy's book of LoRA slots is behind it too
        secrets = trainer_secrets(
            shipped, {}, upstream_key=None, admin_key=self._admin_key, listens=False
        )
        return job_spec(
            cfg,
            "trainer",
            "trainer",
            (sys.executable, *trainer_args(urls, proxy_port=port)),
            env={**self.transport_env, CONFIG_ENV: job_config(shipped)},
            secrets=secrets,
            port=port,
        )

    def check(self) -> None:
        self.check_offline()

    def check_offline(self) -> None:
        """Refuse, before any process starts, a model this host cannot serve (``--dry-run``
        too)."""
        check_model(self.cfg.model)

    def _workdir(self, spec: JobSpec) -> Path:
        role_name = spec.name.removeprefix(f"{self.cfg.run_name}-")
        if spec.role == "trainer" and role_name != "trainer":  # a sweep's point <i>-trainer:
            # under trainer/, so that what hides it from the replicas hides every point's
            return self._workdir_of("trainer") / role_name.removesuffix("-trainer")
        return self._workdir_of(role_name)

    def _workdir_of(self, role_name: str) -> Path:
        return self.launch_dir / role_name

    async def prepare(self) -> None:
        if self.cfg.launch.local_hide_trainer:  # the mount point must exist before replicas
            await anyio.Path(self._workdir_of("trainer")).mkdir(parents=True, exist_ok=True)
        if self._moto_port is not None:
            await self._start_s3_server()

    async def _start_s3_server(self) -> None:
        log = self.launch_dir / "transport.log"
        workdir = self.launch_dir / "transport"
        argv = [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self._moto_port)]
        self._moto = await _start_logged(argv, log, cwd=workdir)
        endpoint = self.transport_env["AWS_ENDPOINT_URL"]
        moto = self._moto

        async def create_bucket(attempt: int) -> None:
            await anyio.to_thread.run_sync(_create_bucket, endpoint)

        try:  # while the server is starting: not after it exited, at most a minute
            await retry(
                create_bucket,
                attempts=None,
                backoff=Backoff(0.2, factor=1.0),
                retry_on=lambda exc: isinstance(exc, OSError) and moto.returncode is None,
                timeout_s=60,
            )
        except OSError as exc:
            raise LaunchError(
                f"the S3 protocol server (moto) did not start: {exc}; log {log}, last "
                f"lines:\n{await anyio.to_thread.run_sync(log_tail, log, 20) or '(none)'}"
            ) from exc
        logger.info("S3 protocol server at %s, transport %s", endpoint, self.transport_url)

    async def start(self, spec: JobSpec) -> str:
        log_path = self.launch_dir / f"{spec.name}.log"
        env = {**self.environ, **spec.env, **spec.secrets}
        process = await _start_logged(spec.command, log_path, cwd=self._workdir(spec), env=env)
        job_id = f"pid-{process.pid}"
        self._processes[job_id] = process
        return job_id

    async def status(self, job: Job) -> JobStatus:
        code = self._processes[job.id].returncode
        url = f"http://{HOST}:{job.spec.port}" if job.spec.port is not None else None
        if code is None:
            return JobStatus("running", url)
        if job.cancel_requested:
            return JobStatus("canceled", url)
        if code == 0:
            return JobStatus("completed", url)
        return JobStatus("failed", url, f"exit code {code}")

    async def log_tail(self, job: Job, lines: int) -> str:
        return await anyio.to_thread.run_sync(log_tail, job.log_path, lines)

    def metrics_path(self, job: Job) -> Path | None:
        """A trainer job's ``metrics.jsonl``: in its working directory, under the
        ``output_dir`` it is shipped with (:data:`JOB_OUTPUT_DIR`)."""
        if job.spec.role != "trainer":
            return None
        return trainer_metrics_path(self._workdir(job.spec), job.name)

    async def follow_logs(self, job: Job, on_line: Callable[[str], None]) -> None:
        """The process writes its own log file (``job.log_path``); read new lines from it."""
        process = self._processes[job.id]
        path = anyio.Path(job.log_path)
        offset = (await path.stat()).st_size if await path.exists() else 0
        pending = ""
        while True:
            done = process.returncode is not None
            async with await anyio.open_file(job.log_path, "rb") as f:
                await f.seek(offset)
                chunk = await f.read()
            offset += len(chunk)
            pending += chunk.decode(errors="replace")
            *lines, pending = pending.split("\n")
            for line in lines:
                on_line(line)
            if done:
                if pending:
                    on_line(pending)
                return
            await anyio.sleep(0.5)

    async def cancel(self, job: Job) -> None:
        await stop_group(self._processes[job.id], STOP_GRACE_S, job.name)

    async def aclose(self) -> None:
        if self._moto is not None:
            await stop_group(self._moto, STOP_GRACE_S, "the S3 protocol server")
            self._moto = None


async def _start_logged(
    argv: Sequence[str], log: Path, *, cwd: Path, env: Mapping[str, str] | None = None
) -> Process:
    """Start ``argv`` in ``cwd`` (made if missing), its output appended to ``log``."""
    await anyio.Path(cwd).mkdir(parents=True, exist_ok=True)
    out = await anyio.to_thread.run_sync(log.open, "ab")
    try:
        return await start_group(argv, stdout=out, stderr=out, cwd=cwd, env=env)
    finally:
        await anyio.to_thread.run_sync(out.close)


def _create_bucket(endpoint: str) -> None:
    request = urllib.request.Request(f"{endpoint}/{S3_BUCKET}", method="PUT")
    urllib.request.urlopen(request, timeout=5).read()
