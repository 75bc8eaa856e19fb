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

from asyncgrpo.config.sources import env_name
from asyncgrpo.config.training import ENV_PREFIX, TrainingConfig
from asyncgrpo.errors import ConfigError, LaunchError
from asyncgrpo.launch.jobs import CONFIG_ENV, Job, JobSpec, JobStatus, Stage
from asyncgrpo.launch.log_follower import follow_in_thread
from asyncgrpo.launch.plan import (
    ADMIN_KEY_ENV,
    in_image,
    job_config,
    job_secrets,
    key_origins,
    labels,
    proxy_args,
    replica_args,
    trainer_args,
    transport_credentials,
    transport_secret,
)

logger = logging.getLogger(__name__)

TOKEN_ENV = "HF_TOKEN"
_STAGES: dict[str, Stage] = {
    "SCHEDULING": "starting",
    "RUNNING": "running",
    "COMPLETED": "completed",
    "ERROR": "failed",
    "DELETED": "failed",
    "CANCELED": "canceled",
}


def _local_path(value: str) -> bool:
    return os.path.exists(value)


class HfJobsBackend:
    """Replicas and trainer as Hugging Face Jobs; the transport an HF bucket or S3."""

    name = "hf-jobs"
    writes_own_logs = False

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

        self.cfg = cfg
        self.launch_dir = launch_dir
        self.environ = dict(os.environ if environ is None else environ)
        self.token = token or self.environ.get(TOKEN_ENV) or get_token()
        self.api = api if api is not None else HfApi(token=self.token)
        self.namespace = cfg.launch.namespace
        self.transport_url = cfg.transport_url
        secrets: dict[str, str] = {}
        self.env: dict[str, str] = {}
        self.missing: list[str] = []
        if self.transport_url:
            secrets, self.env, self.missing = transport_credentials(
                self.transport_url, self.environ
            )
        if self.token:
            secrets = {TOKEN_ENV: self.token, **secrets}
        else:
            self.missing.insert(0, TOKEN_ENV)
        self.secrets = secrets

    # -- specs (no request) ------------------------------------------------------------------

    @property
    def health_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    @property
    def admin_key(self) -> str | None:
        return self.token if self.cfg.launch.replica_restarts else None

    def _transport(self) -> str:
        return self.transport_url or "<transport_url>"

    def replica_spec(self, index: int) -> JobSpec:
        lcfg = self.cfg.launch
        args = replica_args(
            self.cfg,
            host="0.0.0.0",
            port=lcfg.port,
            transport_url=self._transport(),
            api_key_env=TOKEN_ENV,
        )
        command, env = in_image(args, lcfg.replica_install)
        return JobSpec(
            role="replica",
            name=f"{self.cfg.run_name}-replica-{index}",
            command=tuple(command),
            env={**env, **self.env},
            secrets={**self.secrets, **transport_secret("replica", self._transport())},
            image=lcfg.image,
            flavor=lcfg.replica_flavor,
            timeout_s=lcfg.timeout_s,
            port=lcfg.port,
            labels=labels(self.cfg, "replica"),
        )

    def proxy_spec(self, urls: list[str]) -> JobSpec:
        """A sweep's proxy: behind the Jobs gateway too, so its clients' key is the token."""
        lcfg = self.cfg.launch
        elastic = lcfg.replica_restarts > 0
        args = proxy_args(
            urls,
            host="0.0.0.0",
            port=lcfg.port,
            key_env=TOKEN_ENV,
            admin_key_env=TOKEN_ENV if elastic else None,
            key_urls=key_origins(urls) if elastic and self.token else None,
        )
        command, env = in_image(args, lcfg.replica_install)
        return JobSpec(
            role="proxy",
            name=f"{self.cfg.run_name}-proxy",
            command=tuple(command),
            env=env,
            secrets={TOKEN_ENV: self.token} if self.token else {},
            image=lcfg.image,
            flavor=lcfg.proxy_flavor,
            timeout_s=lcfg.timeout_s,
            port=lcfg.port,
            labels=labels(self.cfg, "proxy"),
        )

    def trainer_spec(self, urls: list[str], cfg: TrainingConfig | None = None) -> JobSpec:
        lcfg = self.cfg.launch
        # a sweep's point sends to the sweep's proxy, which the launcher adds replacements to
        elastic = lcfg.replica_restarts > 0 and cfg is None
        cfg = cfg or self.cfg
        args = trainer_args(
            urls,
            proxy_host="0.0.0.0" if elastic else None,
            proxy_port=lcfg.port if elastic else None,
            # replacements, added at run time, pass the gateway only with the token
            key_urls=key_origins(urls) if elastic and self.token else None,
        )
        command, env = in_image(args, lcfg.trainer_install)
        secrets = {**job_secrets(cfg), **self.secrets}
        if self.token:  # the Jobs gateway in front of every replica demands the token
            secrets[env_name(ENV_PREFIX, "proxy.upstream_api_key")] = self.token
            if elastic:  # behind the gateway too: see the module docstring
                secrets[env_name(ENV_PREFIX, "proxy.api_key")] = self.token
                secrets[ADMIN_KEY_ENV] = self.token
        return JobSpec(
            role="trainer",
            name=f"{cfg.run_name}-trainer",
            command=tuple(command),
            env={**env, **self.env, CONFIG_ENV: job_config(cfg)},
            secrets=secrets,
            image=lcfg.trainer_image or lcfg.image,
            flavor=lcfg.trainer_flavor,
            timeout_s=lcfg.timeout_s,
            port=lcfg.port if elastic else None,
            labels=labels(cfg, "trainer"),
        )

    def check(self) -> None:
        self.check_offline()

    def check_offline(self) -> None:
        """Refuse, before any request, what no job could use (``--dry-run`` too)."""
        if not self.transport_url:
            raise ConfigError(
                "transport_url is unset: jobs share no disk; set transport_url="
                "hf://buckets/<namespace>/<bucket>/<prefix> (created if missing) or s3://..."
            )
        if self.missing:
            raise ConfigError(
                f"set {', '.join(self.missing)} in the environment: the jobs get "
                f"{'it' if len(self.missing) == 1 else 'them'} as secrets "
                f"({TOKEN_ENV}: a Hugging Face token with write access, or `hf auth login`; "
                "HF_S3_*: the S3 key pair generated for that token)"
            )
        if _local_path(self.cfg.model):
            raise ConfigError(
                f"model={self.cfg.model!r} is a local path, which the jobs cannot read: "
                "upload it to the Hub and give its id"
            )
        path = self.cfg.dataset.path
        if path is not None and _local_path(path):
            raise ConfigError(
                f"dataset.path={path!r} is a local file, which the jobs cannot read: use "
                "dataset.prompts or a Hub dataset name"
            )

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
