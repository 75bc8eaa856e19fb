"""What the backends whose jobs run on other machines share (``hf-jobs``, ``skypilot``,
``ray``): the transport's credentials for each job, the keys made for the launch, the secrets of
each role, and the refusals before any job starts. A backend keeps only what is its own: where
a job runs, how it is started, watched and cancelled.
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets as secrets_lib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.errors import ConfigError
from asyncgrpo.launch.jobs import CONFIG_ENV, JobSpec, Role
from asyncgrpo.launch.plan import (
    PROXY_ADMIN_KEY_ENV,
    in_image,
    job_config,
    job_spec,
    proxy_args,
    replica_args,
    trainer_args,
    trainer_secrets,
    transport_secret,
)
from asyncgrpo.transport.credentials import JobCredentials
from asyncgrpo.transport.registry import is_local, job_credentials

__all__ = ["REPLICA_KEY_ENV", "TOKEN_ENV", "RemoteBackend", "first_line"]

#: The Hugging Face token, passed on to the jobs when set (model and dataset downloads).
TOKEN_ENV = "HF_TOKEN"
#: The variable each replica reads its vLLM API key from (a key made for the launch).
REPLICA_KEY_ENV = "ASYNCGRPO_REPLICA_API_KEY"


def first_line(exc: BaseException) -> str:
    """An SDK's error in one line (SkyPilot's and Ray's carry colour codes and several)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class RemoteBackend:
    """Base of the backends whose jobs share no disk and no environment with the launcher."""

    name: str
    writes_own_logs = False
    #: how the jobs receive their secrets, as the refusal of a missing one says it
    secrets_as = "as secrets"

    #: True where a directory transport can be shared (every node of a Ray cluster mounting it)
    shares_directories = False
    #: the SDK the backend drives (Ray's, SkyPilot's), imported on first use with one line
    #: saying how to install it when it is missing; ``sdk=`` at construction replaces it
    import_sdk: ClassVar[Callable[[], Any] | None] = None

    def __init__(
        self,
        cfg: TrainingConfig,
        launch_dir: Path,
        *,
        environ: Mapping[str, str] | None = None,
        hub_token: str | None = None,
        sdk: Any = None,
    ) -> None:
        """``hub_token``: the Hugging Face token the jobs get (default: ``HF_TOKEN`` of
        ``environ``, for model and dataset downloads); ``sdk``: a stand-in for the SDK."""
        self._sdk = sdk
        transport_url = self.transport_for(cfg, launch_dir)
        self.cfg = cfg
        self.launch_dir = launch_dir
        self.environ = dict(os.environ if environ is None else environ)
        self.transport_url = transport_url
        hub_token = hub_token or self.environ.get(TOKEN_ENV)
        creds = JobCredentials()
        if transport_url and not (is_local(transport_url) and self.shares_directories):
            creds = job_credentials(transport_url, self.environ)
        #: the transport's secrets and the token, for every job that opens the transport
        self.secrets = {**({TOKEN_ENV: hub_token} if hub_token else {}), **creds.secrets}
        self.env = dict(creds.plain)
        self.missing = list(creds.missing)
        self._hints = [creds.hint] if creds.hint else []
        #: the replicas' API key, made for the launch (each vLLM server listens on a port of
        #: its own machine)
        self.replica_key = secrets_lib.token_urlsafe(32)
        elastic = cfg.launch.replica_restarts > 0
        self._admin_key = secrets_lib.token_urlsafe(32) if elastic else None

    def transport_for(self, cfg: TrainingConfig, launch_dir: Path) -> str | None:
        """Where the jobs keep their state: ``transport_url`` (a directory only where every
        job's machine mounts it)."""
        return cfg.transport_url

    @property
    def sdk(self) -> Any:
        if self._sdk is None and self.import_sdk is not None:
            self._sdk = type(self).import_sdk()
        return self._sdk

    # -- what differs between backends (overridden) --------------------------------------------

    #: where a job's servers listen (a Ray actor: a placeholder its node fills in)
    listen_host = "0.0.0.0"
    #: the variable each replica reads its API key from (also a sweep's proxy's clients' key)
    key_env = REPLICA_KEY_ENV
    #: arguments added to each replica's command
    replica_extra: tuple[str, ...] = ()

    def _key(self) -> str | None:
        """The replicas' API key: the proxies send it; the launcher's health checks too."""
        return self.replica_key

    def _replica_port(self, index: int) -> int:
        return self.cfg.launch.port

    def _own_port(self) -> tuple[int | str, int | None]:
        """Where a proxy (a sweep's, or a trainer's the launcher reaches) listens: the port in
        its command, and the job's port (None: the backend reports its address itself)."""
        return self.cfg.launch.port, self.cfg.launch.port

    def _key_urls(self, urls: list[str]) -> list[str] | None:
        """Where replicas the launcher adds later will be: those get the replicas' key."""
        raise NotImplementedError

    def _proxy_admin_env(self) -> str | None:
        """The variable a sweep's proxy reads its admin key from; None: no admin routes."""
        return PROXY_ADMIN_KEY_ENV if self._admin_key else None

    def _trainer_admin_key(self, elastic: bool) -> str | None:
        """A trainer's proxy's admin key (replacements; a sweep's point books LoRA slots)."""
        return self._admin_key

    def _command(self, role: Role, args: list[str]) -> tuple[list[str], dict[str, str]]:
        """The job's command for ``python3 <args>`` and the environment it adds: by default in
        an image, after pip installing the role's requirement (:func:`~.plan.in_image`)."""
        lcfg = self.cfg.launch
        return in_image(args, lcfg.trainer_install if role == "trainer" else lcfg.replica_install)

    def _placement(self, role: Role) -> dict[str, Any]:
        """The spec's fields that say where a ``role`` job runs: its image and time limit."""
        lcfg = self.cfg.launch
        image = (lcfg.trainer_image or lcfg.image) if role == "trainer" else lcfg.image
        return {"image": image, "timeout_s": lcfg.timeout_s}

    # -- the specs (no request) --------------------------------------------------------------

    @property
    def admin_key(self) -> str | None:
        return self._admin_key

    @property
    def health_headers(self) -> dict[str, str]:
        key = self._key()
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _transport(self) -> str:
        return self.transport_url or "<transport_url>"

    def replica_spec(self, index: int) -> JobSpec:
        """Replica ``index``: its API key in :attr:`key_env`, the transport's secrets (a URL
        with credentials too)."""
        port, key = self._replica_port(index), self._key()
        args = replica_args(
            self.cfg,
            host=self.listen_host,
            port=port,
            transport_url=self._transport(),
            api_key_env=self.key_env,
        )
        command, env = self._command("replica", [*args, *self.replica_extra])
        own = {self.key_env: key} if key else {}
        secrets = {**self.secrets, **own, **transport_secret("replica", self._transport())}
        return job_spec(
            self.cfg,
            "replica",
            f"replica-{index}",
            command,
            env={**env, **self.env},
            secrets=secrets,
            port=port,
            **self._placement("replica"),
        )

    def proxy_spec(self, urls: list[str]) -> JobSpec:
        """A sweep's proxy: its clients' key is the replicas' (the points' trainers hold it);
        with replacements, the admin routes the launcher adds them through."""
        admin_env, key = self._proxy_admin_env(), self._key()
        port, job_port = self._own_port()
        args = proxy_args(
            urls,
            host=self.listen_host,
            port=port,
            key_env=self.key_env,
            admin_key_env=admin_env,
            key_urls=self._key_urls(urls) if admin_env else None,
        )
        secrets = {self.key_env: key} if key else {}
        if self._admin_key is not None:
            secrets[PROXY_ADMIN_KEY_ENV] = self._admin_key
        command, env = self._command("proxy", args)
        return job_spec(
            self.cfg,
            "proxy",
            "proxy",
            command,
            env=env,
            secrets=secrets,
            port=job_port,
            **self._placement("proxy"),
        )

    def trainer_spec(self, urls: list[str], cfg: TrainingConfig | None = None) -> JobSpec:
        """``cfg``'s trainer (a sweep's point sends to the sweep's proxy, which the launcher
        adds replacements to; else, with replacements, the launcher reaches its proxy): the
        config shipped without its secrets, which travel with the transport's, the token and
        its proxy's keys (:func:`~.plan.trainer_secrets`)."""
        elastic = self.cfg.launch.replica_restarts > 0 and cfg is None
        cfg = cfg or self.cfg
        shipped = dataclasses.replace(cfg, transport_url=cfg.transport_url or self.transport_url)
        port, job_port = self._own_port()
        args = trainer_args(
            urls,
            proxy_host=self.listen_host if elastic else None,
            proxy_port=port if elastic else None,
            key_urls=self._key_urls(urls) if elastic else None,
        )
        command, env = self._command("trainer", args)
        secrets = trainer_secrets(
            shipped,
            self.secrets,
            upstream_key=self._key(),
            admin_key=self._trainer_admin_key(elastic),
            listens=elastic,
        )
        return job_spec(
            cfg,
            "trainer",
            "trainer",
            command,
            env={**env, **self.env, CONFIG_ENV: job_config(shipped)},
            secrets=secrets,
            port=job_port if elastic else None,
            **self._placement("trainer"),
        )

    # -- refusals ----------------------------------------------------------------------------

    def _refuse_missing(self, *hints: str) -> None:
        """Refuse a launch whose jobs would miss a secret, naming each one."""
        if self.missing:
            notes = [*hints, *self._hints]
            raise ConfigError(
                f"set {', '.join(self.missing)} in the environment: the jobs get "
                f"{'it' if len(self.missing) == 1 else 'them'} {self.secrets_as}"
                + (f" ({'; '.join(notes)})" if notes else "")
            )

    def _refuse_unset_transport(self) -> None:
        if not self.transport_url:
            raise ConfigError(
                "transport_url is unset: jobs share no disk; set transport_url="
                "hf://buckets/<namespace>/<bucket>/<prefix> (created if missing), s3://..., "
                "gs://... or az://..."
            )

    def _refuse_local_files(self) -> None:
        """A model or dataset path on this host, which no job can read."""
        for what, value in (("model", self.cfg.model), ("dataset.path", self.cfg.dataset.path)):
            if value is not None and os.path.exists(value):
                raise ConfigError(
                    f"{what}={value!r} is a local path, which the jobs cannot read: upload it "
                    "to the Hub and give its id (or use dataset.prompts)"
                )
