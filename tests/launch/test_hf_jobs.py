"""``launch(cfg, backend="hf-jobs")`` against a local Hub speaking the Jobs REST API."""

from __future__ import annotations

import json
import re
from pathlib import Path

import anyio
import pytest
from fake_jobs_hub import NAMESPACE, TOKEN, FakeHub
from huggingface_hub import HfApi

from asyncgrpo.config.proxy import token_allowed
from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.errors import ConfigError, LaunchError
from asyncgrpo.launch import launch
from asyncgrpo.launch.launcher import launch_dir as launch_dir_of
from asyncgrpo.run.job import load_config
from asyncgrpo.run.progress import progress_line

S3_KEY, S3_SECRET = "HFAKfakeaccesskey", "fakeS3secretvalue987"
ENVIRON = {
    "HF_TOKEN": TOKEN,
    "HF_S3_ACCESS_KEY_ID": S3_KEY,
    "HF_S3_SECRET_ACCESS_KEY": S3_SECRET,
}
SECRET_VALUES = (TOKEN, S3_KEY, S3_SECRET)


def make_config(tmp_path: Path, *overrides: str) -> TrainingConfig:
    data = {
        "model": "Qwen/Qwen2.5-0.5B-Instruct",
        "run_name": "fake-run",
        "output_dir": str(tmp_path / "runs"),
        "transport_url": "hf://buckets/testns/asyncgrpo-runs/fake-run",
        "dataset": {"prompts": ["count to five", "name a color"]},
        "trainer": {"max_steps": 3, "max_staleness": 1},
        "launch": {"replicas": 2, "poll_s": 0.05, "health_timeout_s": 20},
    }
    return TrainingConfig.from_dict(data, list(overrides))


def run_launch(cfg: TrainingConfig, hub: FakeHub, body) -> object:
    api = HfApi(endpoint=hub.url, token=TOKEN)

    async def main():
        handle = await launch(cfg, "hf-jobs", api=api, environ=ENVIRON)
        async with handle:
            return await body(handle)

    return anyio.run(main)


def assert_no_secret_in(text: str) -> None:
    for value in SECRET_VALUES:
        assert value not in text


def test_launch_creates_replicas_then_trainer_and_follows_it_to_completion(
    tmp_path: Path, hub: FakeHub
) -> None:
    records = [{"reward": 0.1 * s, "ratio": 1.0, "perf/weight_sync_s": 0.5} for s in (1, 2, 3)]
    hub.scripts["replica"] = lambda: {"healthy_after_s": 0.2}
    hub.scripts["trainer"] = lambda: {
        "logs": ["installing", *(progress_line(s, 3, m) for s, m in enumerate(records, 1))],
        "complete_after_s": 0.5,
    }
    cfg = make_config(tmp_path)
    seen: list[dict] = []

    async def body(handle):
        assert len(handle.urls) == 2
        return await handle.wait()

    progress = run_launch(cfg, hub, body)
    seen = progress  # type: ignore[assignment]

    # the bucket, then two replicas, then the trainer: in that order
    posts = [r for r in hub.api_requests() if r["method"] == "POST" and "/cancel" not in r["path"]]
    assert [r["path"] for r in posts] == [
        "/api/buckets/testns/asyncgrpo-runs",
        f"/api/jobs/{NAMESPACE}",
        f"/api/jobs/{NAMESPACE}",
        f"/api/jobs/{NAMESPACE}",
    ]
    replicas, trainer = hub.created("replica"), hub.created("trainer")
    assert len(replicas) == 2 and len(trainer) == 1
    for job in replicas:
        spec = job.spec
        assert spec["dockerImage"] == cfg.launch.image
        assert spec["flavor"] == "a10g-large"
        assert spec["expose"]["ports"] == [8000]
        assert spec["timeoutSeconds"] == 8 * 3600
        cmd = spec["command"]
        assert cmd[cmd.index("-m") + 1] == "asyncgrpo.serve"
        assert cmd[cmd.index("--transport") + 1] == cfg.transport_url
        assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
        assert cmd[cmd.index("--api-key-env") + 1] == "HF_TOKEN"
        assert spec["secrets"] == ENVIRON  # every secret as a secret
        assert job.health_checks >= 1
    spec = trainer[0].spec
    assert spec["flavor"] == "a100-large"
    urls = [f"{hub.url}/exposed/{j.id}" for j in replicas]
    assert "proxy.upstreams=" + ",".join(urls) in spec["command"]
    assert "serve.replicas=0" in spec["command"]
    # its proxy behind the gateway (where the launcher adds replacement replicas), on all
    # interfaces of the job, so with a key: the token the gateway demands anyway
    assert spec["expose"]["ports"] == [8000]
    assert {"proxy.host=0.0.0.0", "proxy.port=8000"} <= set(spec["command"])
    # a replacement replica (added at run time) gets the token the gateway demands
    assert f"proxy.upstream_key_urls={hub.url}" in spec["command"]
    # the proxy's tokens, read like every command's secrets
    token = {
        f"ASYNCGRPO_PROXY__{name}": ENVIRON["HF_TOKEN"]
        for name in ("UPSTREAM_API_KEY", "API_KEY", "ADMIN_API_KEY")
    }
    assert spec["secrets"] == {**ENVIRON, **token}
    shipped = spec["environment"]["ASYNCGRPO_CONFIG"]
    assert "Qwen/Qwen2.5-0.5B-Instruct" in shipped
    # no secret in any command line, plain environment variable or log
    for job in hub.created():
        assert_no_secret_in(json.dumps(job.spec["command"]))
        assert_no_secret_in(json.dumps(job.spec["environment"]))
    # the trainer's progress, parsed from its log, and every job's log kept in the run dir
    assert [r["step"] for r in seen] == [1, 2, 3]
    assert seen[-1]["reward"] == pytest.approx(0.3) and seen[-1]["sync_s"] == 0.5
    launch_dir = launch_dir_of(cfg)
    trainer_log = (launch_dir / "fake-run-trainer.log").read_text()
    assert "installing" in trainer_log
    for path in launch_dir.iterdir():
        assert_no_secret_in(path.read_text())
    manifest = json.loads((launch_dir / "jobs.json").read_text())
    assert {j["id"] for j in manifest["jobs"]} == set(hub.jobs)
    # the run is over: the replicas were cancelled, the completed trainer was not
    assert hub.cancelled() == {j.id for j in replicas}


def test_a_replica_job_reported_failed_is_replaced_and_added_to_the_trainers_proxy(
    tmp_path: Path, hub: FakeHub
) -> None:
    """One replica job fails mid-run: a new job is started; once healthy, the dead URL leaves
    the trainer's proxy and the new one joins it (the admin route, through the gateway with the
    token); the trainer, which completes only once a replica was added, completes."""
    count = iter(range(10))
    hub.scripts["replica"] = lambda: {"fail_after_s": 0.5} if next(count) == 1 else {}

    def added() -> bool:
        (trainer,) = hub.created("trainer")
        return any(m == "POST" for m, _, _ in hub.admin_calls(trainer))

    hub.scripts["trainer"] = lambda: {"complete_when": added}
    cfg = make_config(tmp_path, "launch.replica_restart_backoff_s=0")

    async def body(handle):
        await handle.wait()
        return handle.urls

    urls = run_launch(cfg, hub, body)
    replicas, (trainer,) = hub.created("replica"), hub.created("trainer")
    assert len(replicas) == 3 and replicas[1].stage == "ERROR"
    url = [f"{hub.url}/exposed/{j.id}" for j in replicas]
    assert hub.admin_calls(trainer) == [("DELETE", url[1], True), ("POST", url[2], True)]
    assert urls == [url[0], url[2]]
    # the spec of the replacement is a replica's, under the next name
    assert replicas[2].spec["command"] == replicas[0].spec["command"]
    # the trainer job's proxy, as the job loads its config: reachable by the launcher with the
    # token, and sending the token on to the replacement (the gateway demands it)
    command = trainer.spec["command"]
    args = command[command.index("asyncgrpo.run.job") + 1 :]
    loaded = load_config(args, {**trainer.spec["environment"], **trainer.spec["secrets"]})
    assert loaded.proxy.admin_api_key == loaded.proxy.api_key == TOKEN
    assert (loaded.proxy.host, loaded.proxy.port) == ("0.0.0.0", 8000)
    assert token_allowed(url[2], loaded.proxy) and loaded.proxy.upstream_api_key == TOKEN
    manifest = json.loads((launch_dir_of(cfg) / "jobs.json").read_text())
    names = {j["id"]: j["name"] for j in manifest["jobs"]}
    assert names[replicas[2].id] == "fake-run-replica-2"
    assert hub.cancelled() == {replicas[0].id, replicas[2].id}  # the failed one had ended


def test_a_spent_restart_budget_fails_the_launch_naming_the_job(
    tmp_path: Path, hub: FakeHub
) -> None:
    count = iter(range(10))
    hub.scripts["replica"] = lambda: {"fail_after_s": 0.5} if next(count) >= 1 else {}
    hub.scripts["trainer"] = lambda: {"logs": ["training"]}  # never completes by itself
    cfg = make_config(tmp_path, "launch.replica_restarts=1", "launch.replica_restart_backoff_s=0")
    with pytest.raises(
        LaunchError,
        match=r"replica job fake-run-replica-2 \(\w+\) failed during "
        r"the run \(exit code 1\); launch.replica_restarts=1 replacements used",
    ):
        run_launch(cfg, hub, lambda handle: handle.wait())
    assert len(hub.created("replica")) == 3  # two at start, one replacement
    assert hub.cancelled() == {hub.created("replica")[0].id, hub.created("trainer")[0].id}


def test_job_url_from_the_template_when_the_api_reports_none(tmp_path: Path, hub: FakeHub) -> None:
    hub.report_expose_urls = False
    hub.scripts["trainer"] = lambda: {"complete_after_s": 0.1}
    cfg = make_config(
        tmp_path, "launch.replicas=1", f"launch.jobs_url_template={hub.url}/exposed/{{job_id}}"
    )

    async def body(handle):
        assert handle.urls == [f"{hub.url}/exposed/{handle.replicas[0].id}"]
        await handle.wait()

    run_launch(cfg, hub, body)
    assert hub.created("replica")[0].health_checks >= 1


def test_a_replica_that_fails_to_start_surfaces_its_log_and_cancels_the_rest(
    tmp_path: Path, hub: FakeHub
) -> None:
    count = iter(range(10))

    def replica() -> dict:
        if next(count) == 1:
            return {
                "healthy_after_s": None,
                "fail_after_s": 0.3,
                "logs": ["loading weights", "torch.OutOfMemoryError: CUDA out of memory"],
            }
        return {"healthy_after_s": 0.0}

    hub.scripts["replica"] = replica
    cfg = make_config(tmp_path)
    with pytest.raises(LaunchError, match="CUDA out of memory") as info:
        run_launch(cfg, hub, lambda handle: handle.wait())
    assert "fake-run-replica-1" in str(info.value) and "failed" in str(info.value)
    replicas = hub.created("replica")
    assert len(replicas) == 2 and not hub.created("trainer")  # the trainer never started
    assert hub.cancelled() == {replicas[0].id}  # the healthy one; the failed one had ended
    log = (launch_dir_of(cfg) / "fake-run-replica-1.log").read_text()
    assert "CUDA out of memory" in log


def test_a_trainer_that_dies_cancels_the_replicas(tmp_path: Path, hub: FakeHub) -> None:
    hub.scripts["trainer"] = lambda: {"fail_after_s": 0.3, "logs": ["Traceback", "boom"]}
    cfg = make_config(tmp_path)
    with pytest.raises(LaunchError, match="boom"):
        run_launch(cfg, hub, lambda handle: handle.wait())
    assert hub.cancelled() == {j.id for j in hub.created("replica")}


def test_a_cancelled_launch_cancels_every_job(tmp_path: Path, hub: FakeHub) -> None:
    cfg = make_config(tmp_path)

    async def body(handle):
        with anyio.move_on_after(0.5):
            await handle.wait()  # the trainer never completes

    run_launch(cfg, hub, body)
    assert len(hub.jobs) == 3
    assert hub.cancelled() == set(hub.jobs)


def test_health_timeout_cancels_what_started(tmp_path: Path, hub: FakeHub) -> None:
    hub.scripts["replica"] = lambda: {"healthy_after_s": None, "logs": ["pulling image"]}
    cfg = make_config(tmp_path, "launch.health_timeout_s=0.3")
    with pytest.raises(LaunchError, match="not healthy after"):
        run_launch(cfg, hub, lambda handle: handle.wait())
    assert hub.cancelled() == set(hub.jobs) and len(hub.jobs) == 2


def test_missing_credentials_or_local_files_are_refused_before_any_request(
    tmp_path: Path, hub: FakeHub
) -> None:
    api = HfApi(endpoint=hub.url, token=TOKEN)
    cases = [
        (make_config(tmp_path), {"HF_TOKEN": TOKEN}, "HF_S3_ACCESS_KEY_ID"),
        (make_config(tmp_path, "transport_url=null"), ENVIRON, "transport_url is unset"),
        (make_config(tmp_path, f"model={tmp_path}"), ENVIRON, "local path"),
        (make_config(tmp_path, "transport_url=/tmp/x"), ENVIRON, "share no disk"),
    ]
    for cfg, environ, message in cases:
        with pytest.raises(ConfigError, match=message):
            anyio.run(lambda c=cfg, e=environ: launch(c, "hf-jobs", api=api, environ=e, token=None))
    assert hub.requests == []


def test_a_sweep_shares_one_proxy_job_and_a_failed_point_lets_the_others_finish(
    tmp_path: Path, hub: FakeHub
) -> None:
    """Two points: one proxy job in front of the replicas, one trainer job per point sending to
    it. Replica 1 fails: its replacement joins the sweep's proxy (not a trainer's). Point 0's
    trainer fails: point 1 still runs to its end, then the launch fails naming point 0."""
    count = iter(range(10))
    hub.scripts["replica"] = lambda: {"fail_after_s": 0.3} if next(count) == 1 else {}

    def added() -> bool:
        (proxy,) = hub.created("proxy")
        return any(m == "POST" for m, _, _ in hub.admin_calls(proxy))

    points = iter(range(10))
    hub.scripts["trainer"] = lambda: (
        {"logs": ["Traceback", "RuntimeError: out of memory"], "fail_after_s": 0.2}
        if next(points) == 0
        else {
            "logs": [progress_line(s, 3, {"reward": s / 10}) for s in (1, 2, 3)],
            "complete_when": added,
        }
    )
    cfg = make_config(
        tmp_path,
        "launch.sweep=['trainer.learning_rate=1e-5,1e-4']",
        "launch.replica_restart_backoff_s=0",
    )

    async def body(handle):
        with pytest.raises(LaunchError) as info:
            await handle.wait()
        return str(info.value), handle.progress

    error, progress = run_launch(cfg, hub, body)
    assert re.match(r"trainer job fake-run-0-trainer \(\w+\) failed during the run", error)
    assert "fake-run-1" not in error
    replicas, (proxy,), trainers = (hub.created(r) for r in ("replica", "proxy", "trainer"))
    assert len(replicas) == 3 and len(trainers) == 2
    url = [f"{hub.url}/exposed/{j.id}" for j in replicas]
    proxy_url = f"{hub.url}/exposed/{proxy.id}"
    # the proxy: in front of the first replicas, behind the gateway with the token as every key,
    # and giving the token on to replacements where the first replicas live
    command = proxy.spec["command"]
    assert command[command.index("-m") + 1] == "asyncgrpo.proxy"
    assert [command[i + 1] for i, a in enumerate(command) if a == "--upstream"] == url[:2]
    for flag in ("--api-key-env", "--upstream-api-key-env", "--admin-api-key-env"):
        assert command[command.index(flag) + 1] == "HF_TOKEN"
    assert command[command.index("--upstream-key-url") + 1] == hub.url
    assert proxy.spec["secrets"] == {"HF_TOKEN": TOKEN}
    assert hub.admin_calls(proxy) == [("DELETE", url[1], True), ("POST", url[2], True)]
    # the replicas hold both points' windows: 2 x (max_staleness 1 + 2) LoRA slots
    command = replicas[0].spec["command"]
    assert command[command.index("--max-loras") + 1] == "6"
    for i, trainer in enumerate(trainers):
        command = trainer.spec["command"]
        assert f"proxy.upstreams={proxy_url}" in command and "proxy.port=8000" not in command
        args = command[command.index("asyncgrpo.run.job") + 1 :]
        loaded = load_config(args, {**trainer.spec["environment"], **trainer.spec["secrets"]})
        assert loaded.run_name == f"fake-run-{i}"
        assert loaded.trainer.learning_rate == (1e-5, 1e-4)[i]
        assert loaded.transport_url == f"{cfg.transport_url}/fake-run-{i}"
        assert loaded.proxy.upstream_api_key == TOKEN and loaded.proxy.admin_api_key is None
    # point 1's progress lines, named; the jobs still running cancelled at the end
    assert [(r["run"], r["step"]) for r in progress] == [("fake-run-1", s) for s in (1, 2, 3)]
    assert hub.cancelled() == {replicas[0].id, replicas[2].id, proxy.id}


def test_a_job_that_printed_nothing_fails_saying_its_log_is_empty_and_where(
    tmp_path: Path, hub: FakeHub
) -> None:
    hub.scripts["trainer"] = lambda: {"fail_after_s": 0.2}
    cfg = make_config(tmp_path)
    with pytest.raises(LaunchError) as info:
        run_launch(cfg, hub, lambda handle: handle.wait())
    log = launch_dir_of(cfg) / "fake-run-trainer.log"
    assert str(info.value).endswith(
        f"failed during the run (exit code 1); its log is empty (log file {log})"
    )


def test_a_sweep_whose_points_all_fail_shows_each_points_last_lines(
    tmp_path: Path, hub: FakeHub
) -> None:
    points = iter(range(10))
    hub.scripts["trainer"] = lambda: {
        "logs": ["Traceback", f"python -m asyncgrpo.run.job: error: point {next(points)} broke"],
        "fail_after_s": 0.2,
    }
    cfg = make_config(tmp_path, "launch.sweep=['trainer.learning_rate=1e-5,1e-4']")
    with pytest.raises(LaunchError) as info:
        run_launch(cfg, hub, lambda handle: handle.wait())
    text = str(info.value)
    assert text.startswith("2 of 2 sweep points failed:\n")
    for i in (0, 1):
        log = launch_dir_of(cfg) / f"fake-run-{i}-trainer.log"
        assert re.search(
            rf"trainer job fake-run-{i}-trainer \(\w+\) failed during the run \(exit code 1\): "
            rf"point {i} broke; "
            rf"log {re.escape(str(log))}, last lines:\nTraceback\n.*error: point {i} broke\n?",
            text,
        ), text
