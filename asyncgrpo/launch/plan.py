"""What each role of a launched run runs: pure functions from the config to job specs.

Roles: N replicas (``python -m asyncgrpo.serve``, one vLLM server each, fetching adapter
versions from the transport themselves) and one trainer (``python -m asyncgrpo.run.job``:
the proxy in front of the replicas' URLs, the rollout client and the trainer). The transport is
the only state they share. Secret values travel in :attr:`JobSpec.secrets` only, which nothing
prints; commands and plain environment variables hold none. A job reads its secrets from the
environment like every other command: the variables :func:`job_secrets` names are the ones
:mod:`asyncgrpo.config.sources` reads (``ASYNCGRPO_PROXY__UPSTREAM_API_KEY``).
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from asyncgrpo.config.fields import secret_keys
from asyncgrpo.config.redaction import has_credentials
from asyncgrpo.config.sources import env_name
from asyncgrpo.config.training import ENV_PREFIX, TrainingConfig, to_dict
from asyncgrpo.errors import ConfigError
from asyncgrpo.launch.jobs import JobSpec, Role
from asyncgrpo.run.metrics import METRICS_FILE

__all__ = [
    "JobSpec",
    "in_image",
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


#: Where a launched trainer job keeps its run directory, from its own working directory.
JOB_OUTPUT_DIR = "runs"


def trainer_metrics_path(workdir: Path, job_name: str) -> Path:
    """The ``metrics.jsonl`` of trainer job ``job_name`` working in ``workdir``: under the
    ``output_dir`` it is shipped with (:data:`JOB_OUTPUT_DIR`), in its run's directory."""
    return workdir / JOB_OUTPUT_DIR / job_name.removesuffix("-trainer") / METRICS_FILE


def job_config(cfg: TrainingConfig) -> str:
    """The config as YAML for ``$ASYNCGRPO_CONFIG``, with every secret field emptied and a
    transport URL with credentials left out (both travel as :func:`job_secrets`). The job's
    run directory is ``runs/`` in its own working directory: ``output_dir``, absolute on the
    launching host since loading, names nothing on the job's."""
    data: dict[str, Any] = to_dict(cfg)
    data["output_dir"] = JOB_OUTPUT_DIR
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


#: The pip requirement a job installs before it starts (``launch.replica_install``, ...).
INSTALL_ENV = "ASYNCGRPO_INSTALL"


def in_image(args: list[str], install: str | None) -> tuple[list[str], dict[str, str]]:
    """A job's command for ``python3 <args>`` in an image, after ``pip install
    $ASYNCGRPO_INSTALL`` if set. ``"$@"`` keeps ``args`` as they are: nothing is re-parsed by
    the shell."""
    if install is None:
        return ["python3", *args], {}
    script = f'python3 -m pip install --quiet "${INSTALL_ENV}" && exec python3 "$@"'
    return ["sh", "-c", script, "sh", *args], {INSTALL_ENV: install}


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
        "-m",
        "asyncgrpo.serve",
        "--model",
        cfg.model,
        "--replicas",
        "1",
        "--host",
        host,
        "--port",
        str(port),
        *(() if has_credentials(transport_url) else ("--transport", transport_url)),
        "--lora-rank",
        str(cfg.lora.r),
        "--max-staleness",
        str(cfg.trainer.max_staleness),
        "--dtype",
        cfg.serve.dtype,
    ]
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


def trainer_args(
    urls: list[str],
    *,
    proxy_host: str | None = None,
    proxy_port: int | str | None = None,
    key_urls: list[str] | None = None,
) -> list[str]:
    """``python -m asyncgrpo.run.job`` arguments: the replicas' URLs, no local replica;
    where its proxy listens when the launcher must reach it (to add replacement replicas), and
    which replicas added later get its upstream token. A host or port may be a placeholder the
    job's machine fills in (``--backend ray``: its node's address, a port free there)."""
    if not urls:
        raise ConfigError("the trainer needs at least one replica URL")
    args = [
        "-m",
        "asyncgrpo.run.job",
        "serve.replicas=0",
        "proxy.upstreams=" + ",".join(urls),
    ]
    if proxy_host is not None:
        args.append(f"proxy.host={proxy_host}")
    if proxy_port is not None:
        args.append(f"proxy.port={proxy_port}")
    if key_urls:
        args.append("proxy.upstream_key_urls=" + ",".join(key_urls))
    return args


def key_origins(urls: list[str]) -> list[str]:
    """``proxy.upstream_key_urls`` entries under which replacement replicas of the same kind as
    ``urls`` get the proxy's upstream token: each URL's origin, its first host label a wildcard
    when the host is a name of three labels or more (a Jobs URL ``https://<job id>--8000.hf.jobs``
    gives ``https://*.hf.jobs``; an address stays as it is)."""
    out: list[str] = []
    for url in urls:
        u = urlsplit(url)
        host = u.hostname or ""
        if u.scheme not in ("http", "https") or not host:
            continue  # a placeholder (a dry run's)
        try:
            ipaddress.ip_address(host)
        except ValueError:
            labels = host.split(".")
            if len(labels) >= 3:
                host = "*." + ".".join(labels[1:])
        host = f"[{host}]" if ":" in host else host
        origin = f"{u.scheme}://{host}" + (f":{u.port}" if u.port else "")
        if origin not in out:
            out.append(origin)
    return out


#: The variable the trainer job's config loader reads the proxy's admin key from.
ADMIN_KEY_ENV = env_name(ENV_PREFIX, "proxy.admin_api_key")
#: The variable a sweep's proxy job (``python -m asyncgrpo.proxy``) reads its admin key from.
PROXY_ADMIN_KEY_ENV = "ASYNCGRPO_PROXY_ADMIN_API_KEY"


def proxy_args(
    urls: list[str],
    *,
    host: str,
    port: int | str,
    key_env: str | None = None,
    admin_key_env: str | None = None,
    key_urls: list[str] | None = None,
) -> list[str]:
    """``python -m asyncgrpo.proxy`` arguments of a sweep's proxy in front of the replicas
    ``urls``; ``key_env``: the variable holding both its clients' key and the replicas' (a
    Hugging Face token through the Jobs gateway); ``admin_key_env``: the variable holding the
    key of its admin routes, through which the launcher adds replacement replicas; ``key_urls``:
    the origins of replicas added later that get the replicas' key."""
    if not urls:
        raise ConfigError("the proxy needs at least one replica URL")
    args = ["-m", "asyncgrpo.proxy", "--host", host, "--port", str(port)]
    for url in urls:
        args += ["--upstream", url]
    if key_env is not None:
        args += ["--api-key-env", key_env, "--upstream-api-key-env", key_env]
    if admin_key_env is not None:
        args += ["--admin-api-key-env", admin_key_env]
    for url in key_urls or ():
        args += ["--upstream-key-url", url]
    return args


def labels(cfg: TrainingConfig, role: Role) -> dict[str, str]:
    return {"asyncgrpo-run": cfg.run_name, "asyncgrpo-role": role}


def job_spec(
    cfg: TrainingConfig,
    role: Role,
    suffix: str,
    command: list[str] | tuple[str, ...],
    **fields: Any,
) -> JobSpec:
    """The spec of ``cfg``'s job ``<run_name>-<suffix>``, labelled with its run and role."""
    return JobSpec(
        role=role,
        name=f"{cfg.run_name}-{suffix}",
        command=tuple(command),
        labels=labels(cfg, role),
        **fields,
    )


#: The variables the trainer job's config loader reads its proxy's keys from.
UPSTREAM_KEY_ENV = env_name(ENV_PREFIX, "proxy.upstream_api_key")
CLIENT_KEY_ENV = env_name(ENV_PREFIX, "proxy.api_key")


def trainer_secrets(
    cfg: TrainingConfig,
    shared: dict[str, str],
    *,
    upstream_key: str | None,
    admin_key: str | None,
    listens: bool,
) -> dict[str, str]:
    """A trainer job's secrets: every secret of ``cfg`` and ``shared`` (the transport's, the
    token); ``upstream_key``, what its proxy sends the replicas; ``admin_key``, its proxy's admin
    key (the launcher adds replacements with it; a sweep's point books LoRA slots with it), also
    its clients' key when its proxy ``listens`` beyond the job."""
    secrets = {**job_secrets(cfg), **shared}
    if upstream_key:
        secrets[UPSTREAM_KEY_ENV] = upstream_key
    if admin_key is not None:
        secrets[ADMIN_KEY_ENV] = admin_key
        if listens:
            secrets[CLIENT_KEY_ENV] = admin_key
    return secrets
