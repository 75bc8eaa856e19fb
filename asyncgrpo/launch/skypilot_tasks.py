"""A job spec as a SkyPilot task: pure functions from :class:`JobSpec` to the task's YAML config.

Each job is one SkyPilot managed job: ``resources`` (``infra``, accelerators, ``use_spot``, the
docker image, the exposed port, ``job_recovery``), ``envs`` (plain values), ``secrets`` (names
only, each ``null``: the values go to SkyPilot at launch, never into the YAML written or
printed) and ``run`` (the job's command, bounded by ``launch.timeout``: a managed job outlives
the launcher that started it, so the bound is what stops the bill if the launcher dies).
"""

from __future__ import annotations

import re
import shlex
from typing import Any

import yaml

from asyncgrpo.config.launch import LaunchConfig
from asyncgrpo.launch.jobs import JobSpec

__all__ = ["any_host_origin", "label_value", "task_config", "task_yaml"]


def any_host_origin(port: int) -> str:
    """The ``proxy.upstream_key_urls`` entry under which a replica at any address on ``port``
    gets the replicas' key: SkyPilot relaunches a preempted replica on a new machine, whose
    address nobody knows in advance."""
    return f"http://*:{port}"


def label_value(value: str) -> str:
    """``value`` as every cloud and Kubernetes takes a label value: lowercase letters, digits,
    ``-`` and ``_``, at most 63 characters, starting and ending alphanumeric."""
    cleaned = re.sub(r"[^a-z0-9_-]+", "-", value.lower()).strip("-_")
    return cleaned[:63].rstrip("-_") or "x"


def _resources(spec: JobSpec, lcfg: LaunchConfig) -> dict[str, Any]:
    accelerators = {
        "replica": lcfg.replica_accelerators,
        "trainer": lcfg.trainer_accelerators,
        "proxy": None,
    }[spec.role]
    use_spot = {"replica": lcfg.use_spot, "trainer": lcfg.trainer_use_spot, "proxy": False}
    res: dict[str, Any] = {}
    if lcfg.infra:
        res["infra"] = lcfg.infra
    if accelerators:
        res["accelerators"] = accelerators
    else:
        res["cpus"] = "2+"
    res["use_spot"] = use_spot[spec.role]
    if spec.image:
        res["image_id"] = f"docker:{spec.image}"
    if spec.port is not None:
        res["ports"] = [spec.port]
    res["job_recovery"] = {
        "strategy": lcfg.recovery,
        "max_restarts_on_errors": lcfg.max_restarts_on_errors,
    }
    res["labels"] = {k: label_value(v) for k, v in spec.labels.items()}
    return res


def task_config(spec: JobSpec, lcfg: LaunchConfig) -> dict[str, Any]:
    """The SkyPilot task of ``spec``, as ``sky.Task.from_yaml_config`` takes it; secret values
    are not in it (give them as ``secrets_overrides``)."""
    command = shlex.join(spec.command)
    if spec.timeout_s is not None:
        command = f"exec timeout --signal=TERM {spec.timeout_s} {command}"
    config: dict[str, Any] = {
        "name": spec.name,
        "resources": _resources(spec, lcfg),
        "envs": dict(spec.env),
    }
    if spec.secrets:
        config["secrets"] = dict.fromkeys(sorted(spec.secrets))
    config["run"] = command
    return config


def task_yaml(spec: JobSpec, lcfg: LaunchConfig) -> str:
    """:func:`task_config` as YAML: what ``--dry-run`` prints and writes."""
    return yaml.safe_dump(task_config(spec, lcfg), sort_keys=False, width=1 << 16)
