"""What each role of a launched run runs: pure functions from the config to job specs.

Roles: N replicas (``python -m asyncgrpo.serve``, one vLLM server each, fetching adapter
versions from the transport themselves) and one trainer (``python -m asyncgrpo.launch.trainer``:
the proxy in front of the replicas' URLs, the rollout client and the trainer). The transport is
the only state they share. Secret values travel in :attr:`JobSpec.secrets` only, which nothing
prints; commands and plain environment variables hold none. A job reads its secrets from the
environment like every other command: the variables :func:`job_secrets` names are the ones
:mod:`asyncgrpo.settings` reads (``ASYNCGRPO_PROXY__UPSTREAM_API_KEY``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from asyncgrpo.config import ENV_PREFIX, TrainingConfig, to_dict
from asyncgrpo.errors import ConfigError
from asyncgrpo.launch.jobs import JobSpec, Role
from asyncgrpo.redaction import has_credentials
from asyncgrpo.settings import env_name, secret_keys

__all__ = [
    "JobSpec",
    "job_config",
    "job_secrets",
    "labels",
    "proxy_args",
    "replica_args",
    "trainer_args",
    "transport_secret",
]

#: A transport URL with credentials in it (a SAS token) reaches each role as this secret,
#: never in a command line or the shipped config.
TRANSPORT_SECRET_ENV = {
    "replica": "ASYNCGRPO_SERVE_TRANSPORTS",
    "trainer": "ASYNCGRPO_TRANSPORT_URL",
}


def transport_secret(role: Role, url: str) -> dict[str, str]:
    """The secret a ``role`` job needs for transport ``url``: none unless it has credentials."""
    return {TRANSPORT_SECRET_ENV[role]: url} if has_credentials(url) else {}


def _secret_values(cfg: TrainingConfig) -> dict[str, Any]:
    """Dotted key -> value of every secret field of ``cfg`` (``proxy.api_key``)."""
    values = {}
    for key in secret_keys(TrainingConfig):
        node: Any = cfg
        for part in key.split("."):
            node = getattr(node, part)
        values[key] = node
    return values


def job_config(cfg: TrainingConfig) -> str:
    """The config as YAML for ``$ASYNCGRPO_CONFIG``, with every secret field emptied and a
    transport URL with credentials left out (both travel as :func:`job_secrets`)."""
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


def job_secrets(cfg: TrainingConfig) -> dict[str, str]:
    """Every secret set in ``cfg``, under the environment variable the job's config loader
    reads it from (``proxy.api_key`` -> ``ASYNCGRPO_PROXY__API_KEY``)."""
    secrets = {env_name(ENV_PREFIX, k): v for k, v in _secret_values(cfg).items() if v}
    return {**secrets, **transport_secret("trainer", cfg.transport_url or "")}


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
    if cfg.serve.max_loras is not None:  # a sweep's fleet: every run's window at once
        args += ["--max-loras", str(cfg.serve.max_loras)]
    if cfg.serve.kv_cache_gib is not None:
        args += ["--kv-cache-gib", str(int(cfg.serve.kv_cache_gib))]
    if cfg.serve.nice:
        args += ["--nice", str(cfg.serve.nice)]
    if api_key_env is not None:
        args += ["--api-key-env", api_key_env]
    return args


def trainer_args(urls: list[str]) -> list[str]:
    """``python -m asyncgrpo.launch.trainer`` arguments: the replicas' URLs, no local replica."""
    if not urls:
        raise ConfigError("the trainer needs at least one replica URL")
    return [
        "-m",
        "asyncgrpo.launch.trainer",
        "serve.replicas=0",
        "proxy.upstreams=" + ",".join(urls),
    ]


def proxy_args(urls: list[str], *, host: str, port: int, key_env: str | None = None) -> list[str]:
    """``python -m asyncgrpo.proxy`` arguments of a sweep's proxy in front of the replicas
    ``urls``; ``key_env``: the variable holding both its clients' key and the replicas' (a
    Hugging Face token through the Jobs gateway)."""
    if not urls:
        raise ConfigError("the proxy needs at least one replica URL")
    args = ["-m", "asyncgrpo.proxy", "--host", host, "--port", str(port)]
    for url in urls:
        args += ["--upstream", url]
    if key_env is not None:
        args += ["--api-key-env", key_env, "--upstream-api-key-env", key_env]
    return args


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
