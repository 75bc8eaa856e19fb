"""What each role of a launched run runs: pure functions from the config to job specs.

Roles: N replicas (``python -m asyncgrpo.serve``, one vLLM server each, fetching adapter
versions from the transport themselves) and one trainer (``python -m asyncgrpo.launch.trainer``:
the proxy in front of the replicas' URLs, the rollout client and the trainer). The transport is
the only state they share. Secret values travel in :attr:`JobSpec.secrets` only, which nothing
prints; commands and plain environment variables hold none.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from asyncgrpo.config import TrainingConfig, to_dict
from asyncgrpo.errors import ConfigError
from asyncgrpo.launch.trainer import CONFIG_ENV
from asyncgrpo.redaction import has_credentials, redact_text
from asyncgrpo.settings import secret_keys

Role = Literal["replica", "trainer"]

#: A transport URL with credentials in it (a SAS token) reaches each role as this secret,
#: never in a command line or the shipped config.
TRANSPORT_SECRET_ENV = {
    "replica": "ASYNCGRPO_SERVE_TRANSPORTS",
    "trainer": "ASYNCGRPO_TRANSPORT_URL",
}


def transport_secret(role: Role, url: str) -> dict[str, str]:
    """The secret a ``role`` job needs for transport ``url``: none unless it has credentials."""
    return {TRANSPORT_SECRET_ENV[role]: url} if has_credentials(url) else {}


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


def job_config(cfg: TrainingConfig) -> str:
    """The config as YAML for ``$ASYNCGRPO_CONFIG``, with every secret field emptied and a
    transport URL with credentials left out (it travels as :func:`transport_secret`)."""
    data: dict[str, Any] = to_dict(cfg)
    for key in secret_keys(TrainingConfig):
        *sections, name = key.split(".")
        node = data
        for section in sections:
            node = node[section]
        node[name] = None
    if cfg.transport_url and has_credentials(cfg.transport_url):
        data["transport_url"] = None
    return yaml.safe_dump(data, sort_keys=False)


def replica_args(
    cfg: TrainingConfig,
    *,
    host: str,
    port: int,
    transport_url: str,
    api_key_env: str | None = None,
) -> list[str]:
    """``python -m asyncgrpo.serve`` arguments of one replica: one vLLM server sized like the
    trainer's local replicas would be (LoRA rank, slots from max_staleness, dtype, length). A
    transport URL with credentials is not among them: see :func:`transport_secret`."""
    args = [
        "-m", "asyncgrpo.serve",
        "--model", cfg.model,
        "--replicas", "1",
        "--host", host,
        "--port", str(port),
        *(() if has_credentials(transport_url) else ("--transport", transport_url)),
        "--lora-rank", str(cfg.lora.r),
        "--max-staleness", str(cfg.trainer.max_staleness),
        "--dtype", cfg.serve.dtype,
    ]  # fmt: skip
    if cfg.serve.max_model_len is not None:
        args += ["--max-model-len", str(cfg.serve.max_model_len)]
    if cfg.serve.kv_cache_gib is not None:
        args += ["--kv-cache-gib", str(int(cfg.serve.kv_cache_gib))]
    if cfg.serve.nice:
        args += ["--nice", str(cfg.serve.nice)]
    if api_key_env is not None:
        args += ["--api-key-env", api_key_env]
    return args


def trainer_args(urls: list[str], *, upstream_key_env: str | None = None) -> list[str]:
    """``python -m asyncgrpo.launch.trainer`` arguments: the replicas' URLs, no local replica."""
    if not urls:
        raise ConfigError("the trainer needs at least one replica URL")
    args = ["-m", "asyncgrpo.launch.trainer"]
    if upstream_key_env is not None:
        args += ["--upstream-key-env", upstream_key_env]
    return [*args, "serve.replicas=0", "proxy.upstreams=" + ",".join(urls)]


def labels(cfg: TrainingConfig, role: Role) -> dict[str, str]:
    return {"asyncgrpo-run": cfg.run_name, "asyncgrpo-role": role}


def pick_secrets(
    names: tuple[str, ...],
    environ: Mapping[str, str],
    *,
    fallbacks: Mapping[str, str] | None = None,
) -> tuple[dict[str, str], list[str]]:
    """``names`` from ``environ`` (or each one's fallback variable); the missing names too."""
    fallbacks = fallbacks or {}
    found: dict[str, str] = {}
    missing: list[str] = []
    for name in names:
        value = environ.get(name) or environ.get(fallbacks.get(name, ""), "")
        if value:
            found[name] = value
        else:
            missing.append(name)
    return found, missing


def transport_credentials(
    url: str, environ: Mapping[str, str]
) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """(secrets, plain env, missing names) a job needs to open transport ``url``.

    A job shares no disk with the launcher, so only object stores qualify.
    """
    plain_names: tuple[str, ...]
    if url.startswith("hf://"):
        secrets, missing = pick_secrets(
            ("HF_S3_ACCESS_KEY_ID", "HF_S3_SECRET_ACCESS_KEY"),
            environ,
            fallbacks={
                "HF_S3_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID",
                "HF_S3_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY",
            },
        )
        plain_names = ("HF_S3_ENDPOINT",)
    elif url.startswith("s3://"):
        secrets, missing = pick_secrets(("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"), environ)
        if environ.get("AWS_SESSION_TOKEN"):
            secrets["AWS_SESSION_TOKEN"] = environ["AWS_SESSION_TOKEN"]
        plain_names = (
            "AWS_REGION",
            "AWS_DEFAULT_REGION",
            "AWS_ENDPOINT_URL",
            "AWS_ENDPOINT_URL_S3",
        )
    else:
        raise ConfigError(
            f"transport_url={url!r}: jobs on other machines share no disk; use "
            "hf://buckets/<namespace>/<bucket>/<prefix> or s3://bucket/prefix"
        )
    plain = {k: environ[k] for k in plain_names if environ.get(k)}
    return secrets, plain, missing
