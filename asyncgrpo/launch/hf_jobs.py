"""Hugging Face Jobs as a launch backend, through ``huggingface_hub``'s Jobs API.

Every call is ``HfApi``'s (``run_job``, ``inspect_job``, ``fetch_job_logs``, ``cancel_job``,
``create_bucket``, ``whoami``), run in a worker thread: the client is synchronous. The Hub is
``HF_ENDPOINT`` (read by ``huggingface_hub`` at import) or the ``api`` passed in.

Secrets per role, passed as job *secrets* (encrypted by the Hub, never in a command):

* replica: ``HF_TOKEN`` (model download; and vLLM's API key, so the server refuses requests
  that do not carry the token the Jobs gateway already demanded), the transport's credentials;
* trainer: ``HF_TOKEN`` (model and dataset downloads) and, as
  ``ASYNCGRPO_PROXY__UPSTREAM_API_KEY``, the proxy's outbound bearer token through the Jobs
  gateway (the same token); every secret set in the config (``job_secrets``); the transport's
  credentials.
* a sweep's proxy (``launch.sweep``: the points' trainers send to it): ``HF_TOKEN``, its clients'
  key, its upstream key, and with ``launch.replica_restarts`` its admin key (the reason below).

With ``launch.replica_restarts`` the trainer's proxy (a sweep's proxy job) listens on ``launch.port`` behind the Jobs
gateway too, so that the launcher can add replacement replicas to it (``/proxy/upstreams``). The
gateway lets through only requests that carry the token, and passes the ``Authorization``
header on, so the token is also the proxy's client key and admin key: one header has to satisfy
both, and whoever holds the token can start and cancel the run's jobs anyway.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.errors import LaunchError
from asyncgrpo.launch.jobs import Job, JobSpec, JobStatus, Role, Stage
from asyncgrpo.launch.log_follower import follow_in_thread
from asyncgrpo.launch.plan import key_origins
from asyncgrpo.launch.remote import TOKEN_ENV, RemoteBackend

logger = logging.getLogger(__name__)

_STAGES: dict[str, Stage] = {
    "SCHEDULING": "starting",
    "RUNNING": "running",
    "COMPLETED": "completed",
    "ERROR": "failed",
    "DELETED": "failed",
    "CANCELED": "canceled",
}


class HfJobsBackend(RemoteBackend):
    """Replicas and trainer as Hugging Face Jobs; the transport an object store."""

    name = "hf-jobs"

    def __init__(
        self,
        cfg: TrainingConfig,
        launch_dir: Path,
        *,
        api: Any = None,
        token: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        from huggingface_hub import HfApi, get_token

        env = os.environ if environ is None else environ
        self.token = token or env.get(TOKEN_ENV) or get_token()
        super().__init__(cfg, launch_dir, environ=environ, hub_token=self.token)
        self.api = api if api is not None else HfApi(token=self.token)
        self.namespace = cfg.launch.namespace
        self._admin_key = None  # no key of its own: the token is (admin_key)
        if not self.token:
            self.missing.insert(0, TOKEN_ENV)

    # -- specs: the token is the replicas' key, the gateway's ----------------------------------

    key_env = TOKEN_ENV

    def _key(self) -> str | None:
        return self.token

    @property
    def admin_key(self) -> str | None:
        """The token: the Jobs gateway passes only requests that carry it (module docstring)."""
        return self.token if self.cfg.launch.replica_restarts else None

    def _key_urls(self, urls: list[str]) -> list[str] | None:
        # replacements, added at run time, pass the gateway only with the token
        return key_origins(urls) if self.token else None

    def _proxy_admin_env(self) -> str | None:
        return TOKEN_ENV if self.cfg.launch.replica_restarts > 0 else None

    def _trainer_admin_key(self, elastic: bool) -> str | None:
        return self.token if elastic else None

    def _placement(self, role: Role) -> dict[str, Any]:
        return {**super()._placement(role), "flavor": getattr(self.cfg.launch, f"{role}_flavor")}

    def check(self) -> None:
        self.check_offline()

    def check_offline(self) -> None:
        """Refuse, before any request, what no job could use (``--dry-run`` too)."""
        self._refuse_unset_transport()
        self._refuse_missing(
            f"{TOKEN_ENV}: a Hugging Face token with write access, or `hf auth login`"
        )
        self._refuse_local_files()

    # -- calls -------------------------------------------------------------------------------

    async def _call(self, fn: Callable[..., Any], **kwargs: Any) -> Any:
        return await anyio.to_thread.run_sync(lambda: fn(**kwargs))

    async def prepare(self) -> None:
        if self.namespace is None:
            who = await self._call(self.api.whoami, token=self.token)
            self.namespace = str(who["name"])
        url = self.transport_url or ""
        if url.startswith("hf://"):
            from asyncgrpo.transport.hf import parse_hf_url

            namespace, bucket, _, _ = parse_hf_url(url)
            await self._call(
                self.api.create_bucket,
                bucket_id=f"{namespace}/{bucket}",
                private=True,
                exist_ok=True,
            )
            logger.info("bucket %s/%s ready", namespace, bucket)

    async def start(self, spec: JobSpec) -> str:
        try:
            info = await self._call(
                self.api.run_job,
                image=spec.image,
                command=list(spec.command),
                env=dict(spec.env),
                secrets=dict(spec.secrets),
                flavor=spec.flavor,
                timeout=spec.timeout_s,
                name=spec.name,
                labels=dict(spec.labels),
                expose=[spec.port] if spec.port is not None else None,
                namespace=self.namespace,
            )
        except Exception as exc:
            raise LaunchError(f"could not start {spec.role} job {spec.name}: {exc}") from exc
        return str(info.id)

    async def status(self, job: Job) -> JobStatus:
        try:
            info = await self._call(self.api.inspect_job, job_id=job.id, namespace=self.namespace)
        except Exception as exc:
            raise LaunchError(
                f"could not inspect {job.spec.role} job {job.name} ({job.id}): {exc}"
            ) from exc
        stage = _STAGES.get(str(getattr(info.status.stage, "value", info.status.stage)), "running")
        url = None
        if job.spec.port is not None:
            exposed = info.status.expose_urls or []
            url = exposed[0] if exposed else None
            url = url or self.cfg.launch.jobs_url_template.format(job_id=job.id, port=job.spec.port)
        return JobStatus(
            stage=stage, url=url.rstrip("/") if url else None, message=info.status.message
        )

    async def log_tail(self, job: Job, lines: int) -> str:
        got = await self._call(
            lambda **kw: list(self.api.fetch_job_logs(**kw)),
            job_id=job.id,
            namespace=self.namespace,
            follow=False,
            tail=lines,
        )
        return "\n".join(got[-lines:])

    def metrics_path(self, job: Job) -> Path | None:
        """None: a trainer job's run directory is on its machine, gone when the job ends."""
        return None

    async def follow_logs(self, job: Job, on_line: Callable[[str], None]) -> None:
        """Stream the job's log until it ends (the stream blocks inside httpx)."""

        def stream(emit: Callable[[str], None]) -> None:
            for line in self.api.fetch_job_logs(
                job_id=job.id, namespace=self.namespace, follow=True
            ):
                emit(line)

        await follow_in_thread(job, stream, on_line)

    async def cancel(self, job: Job) -> None:
        await self._call(self.api.cancel_job, job_id=job.id, namespace=self.namespace)

    async def aclose(self) -> None:
        pass
