"""``--backend ray`` without a cluster: each actor's options from the config, the resource check
against ``ray.cluster_resources()``, the address probe, the dry run, and the one-line refusals a
Python without Ray gives. The live launch on a two-node cluster is ``test_ray.py`` (``make
test-ray``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.errors import ConfigError
from asyncgrpo.launch.ray_actor import NODE_IP, PORT, node_argv
from asyncgrpo.launch.ray_jobs import (
    RayBackend,
    actor_options,
    gcs_endpoint,
    ray_address,
    role_requests,
    unmet_resources,
)
from asyncgrpo.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
AWS_KEY, AWS_SECRET = "AKIAFAKEKEY0123", "fake-aws-secret-value-42"
LAUNCH = {
    "replicas": 2,
    "port": 18000,
    "replica_num_gpus": 1,
    "replica_num_cpus": 4,
    "replica_resources": {"inference": 1},
    "replica_accelerator_type": "A10G",
    "trainer_num_gpus": 0,
    "trainer_resources": {"trainer": 1},
}


def config(tmp_path: Path, **launch: object) -> TrainingConfig:
    data = {
        "model": "Qwen/Qwen2.5-0.5B-Instruct",
        "run_name": "ray-run",
        "output_dir": str(tmp_path / "runs"),
        "transport_url": "s3://asyncgrpo-runs/ray-run",
        "dataset": {"prompts": ["p"]},
        "launch": {**LAUNCH, **launch},
    }
    return TrainingConfig.from_dict(data)


def backend(tmp_path: Path, **launch: object) -> RayBackend:
    environ = {"AWS_ACCESS_KEY_ID": AWS_KEY, "AWS_SECRET_ACCESS_KEY": AWS_SECRET}
    cfg = config(tmp_path, **launch)
    return RayBackend(cfg, cfg.run_dir / "launch", environ=environ, sdk=object())


def test_each_actor_gets_its_roles_resources_no_ray_restarts_and_no_secret_in_its_runtime_env(
    tmp_path: Path,
) -> None:
    be = backend(tmp_path)
    lcfg = be.cfg.launch
    replica = actor_options(be.replica_spec(1), lcfg)
    assert replica["num_gpus"] == 1 and replica["num_cpus"] == 4
    assert replica["resources"] == {"inference": 1} and replica["accelerator_type"] == "A10G"
    assert replica["max_restarts"] == 0 and replica["max_task_retries"] == 0
    assert (replica["name"], replica["namespace"]) == ("ray-run-replica-1", "asyncgrpo")
    # Ray logs a runtime_env's env_vars: secrets go to RoleActor.start, the env only turns off
    # Ray's SIGKILL of the role's process (its own shutdown stops what it started)
    assert replica["runtime_env"] == {
        "env_vars": {"RAY_kill_child_processes_on_worker_exit": "false"}
    }
    secrets = be.replica_spec(1).secrets
    assert secrets["AWS_SECRET_ACCESS_KEY"] == AWS_SECRET and secrets["ASYNCGRPO_REPLICA_API_KEY"]
    trainer = actor_options(be.trainer_spec(["http://10.0.0.1:18000"]), lcfg)
    assert trainer["num_gpus"] == 0 and trainer["resources"] == {"trainer": 1}
    assert "accelerator_type" not in trainer
    assert (
        be.trainer_spec(["http://10.0.0.1:18000"]).secrets["ASYNCGRPO_PROXY__UPSTREAM_API_KEY"]
        == be.replica_key
    )
    # no secret in any command; the replica's port is planned, its address the node's
    for spec in (be.replica_spec(1), be.trainer_spec(["http://10.0.0.1:18000"])):
        text = " ".join(spec.command)
        for value in (AWS_SECRET, be.replica_key, str(be.admin_key)):
            assert value not in text and value not in be.dry_run_text(spec)
    assert "--host <node-ip> --port 18001" in " ".join(be.replica_spec(1).command)


def test_the_trainers_proxy_listens_on_its_node_and_gives_every_planned_replica_the_key(
    tmp_path: Path,
) -> None:
    be = backend(tmp_path, replica_restarts=2)
    args = be.trainer_spec(["http://10.0.0.1:18000", "http://10.0.0.1:18001"]).command
    assert f"proxy.host={NODE_IP}" in args and f"proxy.port={PORT}" in args
    keyed = next(a for a in args if a.startswith("proxy.upstream_key_urls="))
    assert keyed.split("=", 1)[1].split(",") == [f"http://*:{p}" for p in range(18000, 18004)]
    # without replacements nothing reaches the trainer's proxy: it stays on loopback
    quiet = backend(tmp_path, replica_restarts=0).trainer_spec(["http://10.0.0.1:18000"])
    assert not any(a.startswith("proxy.host=") for a in quiet.command)


def test_a_node_fills_in_its_address_port_and_python() -> None:
    argv = ["python", "-m", "asyncgrpo.run.job", f"proxy.host={NODE_IP}", f"proxy.port={PORT}"]
    assert node_argv(argv, node_ip="10.1.2.3", port=41234, python="/opt/py") == [
        "/opt/py",
        "-m",
        "asyncgrpo.run.job",
        "proxy.host=10.1.2.3",
        "proxy.port=41234",
    ]


def test_resources_the_cluster_lacks_are_named_with_who_asks_and_the_field() -> None:
    cfg = TrainingConfig.from_dict(
        {"model": "m/m", "dataset": {"prompts": ["p"]}, "launch": {**LAUNCH, "replicas": 3}}
    )
    requests = role_requests(cfg.launch)
    cluster = {"CPU": 64.0, "GPU": 2.0, "inference": 8.0, "trainer": 1.0}
    unmet = unmet_resources(requests, cluster)
    assert unmet[1] == "A10G (launch.replica_accelerator_type): the cluster has no node with it"
    assert unmet[0] == ("GPU: 3 asked (3 replicas x 1; launch.replica_num_gpus), the cluster has 2")
    assert len(unmet) == 2
    cluster |= {"GPU": 3.0, "accelerator_type:A10G": 3.0}
    assert unmet_resources(requests, cluster) == []
    assert unmet_resources(requests, {**cluster, "trainer": 0.5})[0].startswith(
        "trainer: 1 asked (1 trainer x 1; launch.trainer_resources)"
    )


def test_the_address_comes_from_the_config_then_ray_address_then_auto(tmp_path: Path) -> None:
    lcfg = config(tmp_path).launch
    assert ray_address(lcfg, {}) == "auto"
    assert ray_address(lcfg, {"RAY_ADDRESS": "10.0.0.5:6379"}) == "10.0.0.5:6379"
    lcfg = config(tmp_path, ray_address="ray://head:10001").launch
    assert ray_address(lcfg, {"RAY_ADDRESS": "10.0.0.5:6379"}) == "ray://head:10001"
    assert gcs_endpoint("auto") is None
    assert gcs_endpoint("ray://head") == ("head", 10001)
    assert gcs_endpoint("10.0.0.5:6380") == ("10.0.0.5", 6380)


def cli(tmp_path: Path, *args: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": str(model),
                "run_name": "ray-run",
                "output_dir": str(tmp_path / "runs"),
                "dataset": {"prompts": ["p"]},
            }
        )
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(
        [python, "-m", "asyncgrpo", "launch", str(path), "--backend", "ray", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )


def one_line_refusal(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_the_dry_run_shows_each_actor_and_its_resources_without_ray(tmp_path: Path) -> None:
    done = cli(
        tmp_path, "--dry-run", "launch.replica_resources={inference: 1}", "--replica-num-gpus", "0"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("replica actor ray-run-replica-") == 2
    assert "resources={'inference': 1.0}" in done.stdout and "num_gpus=0.0" in done.stdout
    assert "trainer actor ray-run-trainer" in done.stdout


def test_no_cluster_at_the_address_is_one_line_and_status_2(tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="runs under make test-ray")
    done = cli(tmp_path, "--ray-address", f"127.0.0.1:{free_port()}")
    one_line_refusal(done, "no Ray cluster at 127.0.0.1:", "launch.ray_address")


def test_ray_not_installed_is_one_line_naming_the_extra(tmp_path: Path) -> None:
    # the main virtualenv has no Ray; ``make test-ray`` runs this from .venv-ray layered on it
    shared = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "python"
    python = str(shared) if shared.exists() else sys.executable
    if subprocess.run([python, "-c", "import ray"], capture_output=True).returncode == 0:
        pytest.skip("no Python without Ray here")
    one_line_refusal(cli(tmp_path, python=python), "asyncgrpo[ray]")


def test_a_negative_or_zero_amount_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"launch\.replica_resources: inference=0"):
        config(tmp_path, replica_resources={"inference": 0})
    with pytest.raises(ConfigError, match=r"launch\.trainer_num_gpus=-1"):
        config(tmp_path, trainer_num_gpus=-1)
