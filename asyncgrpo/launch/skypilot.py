"""SkyPilot as a launch backend: every job a SkyPilot managed job, through SkyPilot's SDK.

Every call is the SDK's (``sky.jobs.launch``, ``sky.jobs.queue_v2``, ``sky.jobs.tail_logs``,
``sky.jobs.cancel``, ``enabled_clouds``), each a request to the SkyPilot API server
(``SKYPILOT_API_SERVER_ENDPOINT``, or the local one SkyPilot starts), run in a worker thread:
the SDK is synchronous. The tasks come from the same plans as on the other backends
(:mod:`.plan`), as SkyPilot task configs (:mod:`.skypilot_tasks`).

Managed jobs, not one SkyServe service: the proxy in front of the replicas needs each replica's
own address (it loads adapter versions onto each and routes by prefix), which a service's load
balancer hides, and a service's controller replaces replicas by itself, a second mechanism
beside the launcher's. A managed job that SkyPilot relaunches after a preemption
(``job_recovery``) reports RECOVERING, then RUNNING on a new machine: the launcher takes its old
address out of the proxy and adds the new one once it answers ``/health``, through the proxy's
admin route, as for a replacement. A managed job that ends for good is replaced by the
launcher (``launch.replica_restarts``).

Secrets, given to SkyPilot as task secrets at launch (never in the task YAML or a command):

* replica: the replicas' API key (made for the launch: each vLLM server listens on a public
  port), ``HF_TOKEN`` if set, the transport's credentials;
* trainer: the replicas' key as its proxy's upstream key; with ``launch.replica_restarts`` its
  proxy's client and admin key (made for the launch: the launcher adds recovered and
  replacement replicas through it); every secret of the config; ``HF_TOKEN``; the transport's;
* a sweep's proxy: the replicas' key (its clients' too) and the admin key.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from asyncgrpo.errors import ConfigError, LaunchError
from asyncgrpo.launch.jobs import Job, JobSpec, JobStatus, Stage
from asyncgrpo.launch.log_follower import follow_in_thread
from asyncgrpo.launch.remote import REPLICA_KEY_ENV, RemoteBackend, first_line
from asyncgrpo.launch.skypilot_tasks import any_host_origin, task_config, task_yaml

__all__ = ["REPLICA_KEY_ENV", "SkyPilotBackend", "import_sky"]


#: The managed-job fields a status poll asks for.
FIELDS = [
    "job_id",
    "job_name",
    "status",
    "recovery_count",
    "failure_reason",
    "details",
    "internal_external_ips",
]
_STAGES: dict[str, Stage] = {
    "PENDING": "starting",
    "SUBMITTED": "starting",
    "STARTING": "starting",
    "RECOVERING": "starting",
    "RUNNING": "running",
    "SUCCEEDED": "completed",
    "CANCELLING": "canceled",
    "CANCELLED": "canceled",
}


def import_sky() -> Any:
    """SkyPilot's SDK, or one line saying how to install it."""
    try:
        import sky
    except ImportError:
        raise ConfigError(
            "--backend skypilot needs SkyPilot: pip install 'asyncgrpo[skypilot]'"
        ) from None
    return sky


def stage_of(status: str) -> Stage:
    """Our stage for a managed job's status name (every FAILED_* is failed)."""
    return _STAGES.get(status, "failed" if status.startswith("FAILED") else "running")


def record_url(record: Any, port: int) -> str | None:
    """``http://<external address>:<port>`` of a managed job's first node, once it has one."""
    ips = record.internal_external_ips or []
    if not ips:
        return None
    internal, external = ips[0]
    host = external or internal
    return f"http://{host}:{port}" if host else None


class SkyPilotBackend(RemoteBackend):
    """Replicas, a sweep's proxy and the trainers as SkyPilot managed jobs; the transport an
    object store (S3, GCS, Azure Blob or an HF bucket)."""

    name = "skypilot"
    secrets_as = "as SkyPilot secrets"
    import_sdk = staticmethod(import_sky)

    def _key_urls(self, urls: list[str]) -> list[str] | None:
        return [any_host_origin(self.cfg.launch.port)]

    def task(self, spec: JobSpec, *, with_secrets: bool) -> Any:
        """``spec`` as a ``sky.Task``, loaded and validated by SkyPilot (resources and all);
        a setting SkyPilot refuses (an unknown ``infra``) is a :class:`ConfigError`."""
        overrides = list(spec.secrets.items()) if with_secrets else None
        try:
            return self.sdk.Task.from_yaml_config(
                task_config(spec, self.cfg.launch), secrets_overrides=overrides
            )
        except Exception as exc:  # SkyPilot's schema errors: ValueError and its own
            raise ConfigError(
                f"SkyPilot refuses the {spec.role} task {spec.name}: {first_line(exc)}"
            ) from None

    def dry_run_text(self, spec: JobSpec) -> str:
        """``spec``'s task as YAML, validated by SkyPilot and written to
        ``launch/skypilot/<job>.yaml``; no secret value in it."""
        self.task(spec, with_secrets=False)
        text = task_yaml(spec, self.cfg.launch)
        path = self.launch_dir / "skypilot" / f"{spec.name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return f"# {spec.role} job {spec.name}: {path}\n{text}"

    def check(self) -> None:
        """Refuse, before any job, what no job could use; then ask SkyPilot which infra is
        enabled (one request)."""
        self.check_offline()
        try:
            enabled = self._call_sync(self.sdk.client.sdk.enabled_clouds)
        except Exception as exc:  # no API server, a refused login: SkyPilot's own errors
            raise ConfigError(
                f"SkyPilot could not list its enabled infra: {first_line(exc)}"
            ) from None
        self._check_infra(enabled)

    def check_offline(self) -> None:
        """Refuse, sending no request, what no job could use (``--dry-run`` too)."""
        self._refuse_unset_transport()
        self._refuse_missing()
        self._refuse_local_files()
        self.task(self.replica_spec(0), with_secrets=False)  # an unknown infra, named

    def _check_infra(self, enabled: list[Any]) -> None:
        names = [str(c).lower() for c in enabled]
        if not names:
            raise ConfigError(
                "SkyPilot has no enabled infra: run `sky check` and set up "
                "credentials for a cloud, Kubernetes or Slurm"
            )
        infra = self.cfg.launch.infra
        if infra:
            cloud = infra.split("/")[0].lower()
            cloud = {"k8s": "kubernetes"}.get(cloud, cloud)
            if cloud not in names:
                raise ConfigError(
                    f"launch.infra={infra!r}: {cloud} is not enabled in SkyPilot "
                    f"(enabled: {', '.join(names)}; see `sky check`)"
                )

    # -- calls -------------------------------------------------------------------------------

    def _call_sync(self, fn: Callable[..., Any], **kwargs: Any) -> Any:
        """One SDK request and its result."""
        return self.sdk.get(fn(**kwargs))

    async def _call(self, fn: Callable[..., Any], **kwargs: Any) -> Any:
        return await anyio.to_thread.run_sync(lambda: self._call_sync(fn, **kwargs))

    async def prepare(self) -> None:
        pass

    async def start(self, spec: JobSpec) -> str:
        task = self.task(spec, with_secrets=True)
        try:
            job_ids, _ = await self._call(self.sdk.jobs.launch, task=task, name=spec.name)
        except Exception as exc:
            raise LaunchError(f"could not start {spec.role} job {spec.name}: {exc}") from exc
        if not job_ids:
            raise LaunchError(f"could not start {spec.role} job {spec.name}: no job id")
        return str(job_ids[0])

    async def status(self, job: Job) -> JobStatus:
        try:
            records, *_ = await self._call(
                self.sdk.jobs.queue_v2, refresh=False, job_ids=[int(job.id)], fields=FIELDS
            )
        except Exception as exc:
            raise LaunchError(
                f"could not get the status of {job.spec.role} job {job.name} ({job.id}): {exc}"
            ) from exc
        record = next((r for r in records if str(r.job_id) == job.id), None)
        if record is None:
            return JobStatus(stage="failed", message="SkyPilot no longer lists it")
        status = str(getattr(record.status, "value", record.status))
        stage = stage_of(status)
        url = record_url(record, job.spec.port) if job.spec.port and stage == "running" else None
        message = record.failure_reason or record.details
        if status == "RECOVERING":
            message = f"SkyPilot is recovering it (recovery {record.recovery_count or 0})"
        return JobStatus(stage=stage, url=url, message=message)

    def _tail_sync(self, job: Job, lines: int) -> str:
        out = io.StringIO()
        self.sdk.jobs.tail_logs(job_id=int(job.id), follow=False, tail=lines, output_stream=out)
        return "\n".join(out.getvalue().splitlines()[-lines:])

    async def log_tail(self, job: Job, lines: int) -> str:
        return await anyio.to_thread.run_sync(self._tail_sync, job, lines)

    def metrics_path(self, job: Job) -> Path | None:
        """None: a trainer job's run directory is on its machine."""
        return None

    async def follow_logs(self, job: Job, on_line: Callable[[str], None]) -> None:
        """Stream the job's log until it ends (the SDK blocks in ``requests`` and writes the
        log to a text stream)."""

        def stream(emit: Callable[[str], None]) -> None:
            class Lines(io.TextIOBase):
                def write(self, text: str) -> int:
                    for line in text.splitlines():
                        emit(line)
                    return len(text)

            self.sdk.jobs.tail_logs(job_id=int(job.id), follow=True, output_stream=Lines())

        await follow_in_thread(job, stream, on_line)

    async def cancel(self, job: Job) -> None:
        await self._call(self.sdk.jobs.cancel, job_ids=[int(job.id)])

    async def aclose(self) -> None:
        pass
