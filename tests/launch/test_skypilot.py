"""``--backend skypilot``: the tasks SkyPilot's SDK loads, the one-line refusals, and a replica
SkyPilot recovers after a preemption rejoining a real proxy.

SkyPilot's API server is the boundary this machine cannot reach: :mod:`fake_sky_api` answers
its routes with SkyPilot's own request and response types, so every call goes through the
real SDK. No vLLM: the replicas are stand-in HTTP servers that demand the replicas' key.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import yaml

sky = pytest.importorskip(
    "sky", reason="SkyPilot's SDK is not here: these tests run under make test-skypilot"
)
import aiohttp  # noqa: E402
import gcs_keys  # noqa: E402
from aiohttp import web  # noqa: E402
from fake_sky_api import FakeSkyApi  # noqa: E402

from asyncgrpo.config.training import TrainingConfig  # noqa: E402
from asyncgrpo.errors import ConfigError  # noqa: E402
from asyncgrpo.launch import launch  # noqa: E402
from asyncgrpo.launch.skypilot import SkyPilotBackend  # noqa: E402
from asyncgrpo.proxy import ProxyConfig, serve_proxy  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
AWS_KEY, AWS_SECRET, HF = "AKIAFAKEKEY0123", "fake-aws-secret-value-42", "hf_fakeHubToken123"
ENVIRON = {"AWS_ACCESS_KEY_ID": AWS_KEY, "AWS_SECRET_ACCESS_KEY": AWS_SECRET, "HF_TOKEN": HF}
CONFIG = {
    "model": "Qwen/Qwen2.5-0.5B-Instruct",
    "run_name": "sky-run",
    "transport_url": "s3://asyncgrpo-runs/sky-run",
    "dataset": {"prompts": ["count to five", "name a color"]},
    "trainer": {"max_steps": 3, "max_staleness": 1},
    "launch": {
        "replicas": 2,
        "infra": "aws/us-east-1",
        "use_spot": True,
        "poll_s": 0.05,
        "health_timeout_s": 20,
        "replica_restart_backoff_s": 0,
    },
}


def cli(
    tmp_path: Path, *args: str, python: str = sys.executable, environ: dict | None = None
) -> subprocess.CompletedProcess:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**CONFIG, "output_dir": str(tmp_path / "runs")}))
    env = {**os.environ, **ENVIRON, **(environ or {}), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [python, "-m", "asyncgrpo", "launch", str(path), "--backend", "skypilot", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )


@pytest.mark.parametrize("sweep", [False, True], ids=["single", "sweep"])
def test_dry_run_writes_tasks_that_skypilot_loads(tmp_path: Path, sweep: bool) -> None:
    args = ["--dry-run", *(["--sweep", "trainer.learning_rate=1e-5,3e-5"] if sweep else [])]
    done = cli(tmp_path, *args)
    assert done.returncode == 0, done.stderr
    task_dir = tmp_path / "runs" / "sky-run-launch" / "skypilot"
    names = sorted(p.stem for p in task_dir.glob("*.yaml"))
    expected = ["sky-run-replica-0", "sky-run-replica-1"] + (
        ["sky-run-0-trainer", "sky-run-1-trainer", "sky-run-proxy"]
        if sweep
        else ["sky-run-trainer"]
    )
    assert names == sorted(expected)
    for path in task_dir.glob("*.yaml"):
        text = path.read_text()
        assert text in done.stdout  # printed as written
        for value in (AWS_KEY, AWS_SECRET, HF):
            assert value not in text and value not in done.stdout
        config = yaml.safe_load(text)
        task = sky.Task.from_yaml_config(dict(config))  # SkyPilot's own validation
        (res,) = task.resources
        assert str(res.cloud) == "AWS" and res.region == "us-east-1"
        assert res.ports == ["8000"] or (path.stem.endswith("trainer") and sweep)
        assert config["resources"]["job_recovery"]["strategy"] == "EAGER_NEXT_REGION"
        role = config["resources"]["labels"]["asyncgrpo-role"]
        assert res.use_spot is (role == "replica")
        assert all(v is None for v in config["secrets"].values())  # names only
        if role != "proxy":  # a sweep's proxy opens no transport
            assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(config["secrets"])
        if role == "replica":
            assert "ASYNCGRPO_REPLICA_API_KEY" in config["secrets"]
            assert "--api-key-env ASYNCGRPO_REPLICA_API_KEY" in config["run"]
            assert str(res.accelerators) == "{'A10G': 1}"


AZURE_KEY = "ZmFrZS1henVyZS1hY2NvdW50LWtleQ=="


@pytest.mark.parametrize("scheme", ["gs", "az"])
def test_dry_run_on_gcs_and_azure_carries_their_credentials_by_name(
    tmp_path: Path, scheme: str
) -> None:
    """Every object store the transports open works on SkyPilot: the jobs get the store's
    credential as a SkyPilot secret (a GCS key file's JSON; an Azure connection string)."""
    if scheme == "gs":
        key = gcs_keys.key_file(tmp_path / "sa.json")
        environ, secret = {"GOOGLE_APPLICATION_CREDENTIALS": str(key)}, "GOOGLE_SERVICE_ACCOUNT_KEY"
        hidden = gcs_keys.private_key().splitlines()[1]
    else:
        conn = f"AccountName=acct;AccountKey={AZURE_KEY};EndpointSuffix=core.windows.net"
        environ, secret = (
            {"AZURE_STORAGE_CONNECTION_STRING": conn},
            "AZURE_STORAGE_CONNECTION_STRING",
        )
        hidden = AZURE_KEY
    done = cli(tmp_path, "--dry-run", f"transport_url={scheme}://runs/sky-run", environ=environ)
    assert done.returncode == 0, done.stderr
    assert hidden not in done.stdout + done.stderr
    for path in (tmp_path / "runs" / "sky-run-launch" / "skypilot").glob("*.yaml"):
        config = yaml.safe_load(path.read_text())
        sky.Task.from_yaml_config(dict(config))
        assert secret in config["secrets"] and config["secrets"][secret] is None


def one_line_refusal(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for word in words:
        assert word in lines[0]


def test_an_unknown_infra_is_one_line_and_status_2(tmp_path: Path) -> None:
    done = cli(tmp_path, "--dry-run", "--infra", "nosuchcloud/us-east-1")
    one_line_refusal(done, "SkyPilot refuses", "nosuchcloud")


def test_skypilot_not_installed_is_one_line_and_status_2(tmp_path: Path) -> None:
    shared = Path(__file__).parents[2] / ".venv" / "bin" / "python"  # the main venv: no SkyPilot
    python = str(shared) if shared.exists() else shutil.which("python3") or sys.executable
    probe = subprocess.run([python, "-c", "import sky"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip("no Python without SkyPilot here")
    one_line_refusal(cli(tmp_path, "--dry-run", python=python), "asyncgrpo[skypilot]")


@pytest.fixture
def sky_api(monkeypatch: pytest.MonkeyPatch):
    api = FakeSkyApi()
    api.start()
    monkeypatch.setenv("SKYPILOT_API_SERVER_ENDPOINT", api.url)
    sky.server.common.get_server_url.cache_clear()
    try:
        yield api
    finally:
        api.stop()
        sky.server.common.get_server_url.cache_clear()


def test_no_enabled_infra_is_one_line_and_status_2_before_any_job(
    tmp_path: Path, sky_api: FakeSkyApi
) -> None:
    sky_api.enabled = []
    done = cli(tmp_path)  # a real launch: the check asks SkyPilot first
    one_line_refusal(done, "SkyPilot has no enabled infra", "sky check")
    assert "POST /jobs/launch" not in sky_api.calls and "GET /enabled_clouds" in sky_api.calls


def make_config(tmp_path: Path, **launch: object) -> TrainingConfig:
    data = {**CONFIG, "output_dir": str(tmp_path / "runs")}
    data["launch"] = {**CONFIG["launch"], **launch}  # type: ignore[dict-item]
    return TrainingConfig.from_dict(data)


@pytest.mark.parametrize(
    ("enabled", "infra", "words"),
    [
        ((), "aws", ["no enabled infra", "sky check"]),
        (("kubernetes",), "aws/us-east-1", ["launch.infra", "aws is not enabled", "kubernetes"]),
    ],
    ids=["none-enabled", "infra-not-enabled"],
)
def test_infra_skypilot_has_not_enabled_is_refused_before_any_job(
    tmp_path: Path, sky_api: FakeSkyApi, enabled: tuple[str, ...], infra: str, words: list[str]
) -> None:
    sky_api.enabled = list(enabled)
    backend = SkyPilotBackend(make_config(tmp_path, infra=infra), tmp_path, environ=ENVIRON)
    with pytest.raises(ConfigError) as caught:
        backend.check()
    for word in words:
        assert word in str(caught.value)
    assert not sky_api.launched


def test_an_api_server_that_does_not_answer_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SKYPILOT_API_SERVER_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    sky.server.common.get_server_url.cache_clear()
    try:
        backend = SkyPilotBackend(make_config(tmp_path), tmp_path, environ=ENVIRON)
        with pytest.raises(ConfigError, match="SkyPilot could not list its enabled infra") as e:
            backend.check()
        assert "\n" not in str(e.value)
    finally:
        sky.server.common.get_server_url.cache_clear()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class StandIn:
    """A replica at its own loopback address: ``/health`` and ``/v1/models``, each only with
    the replicas' key (as vLLM with ``--api-key``); counts the requests that carried it."""

    def __init__(self, host: str, port: int, key: str) -> None:
        self.host, self.port, self.key = host, port, key
        self.authorized = 0
        self.runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @web.middleware
    async def auth(self, request: web.Request, handler):  # type: ignore[no-untyped-def]
        if request.headers.get("Authorization") != f"Bearer {self.key}":
            return web.Response(status=401)
        self.authorized += 1
        return await handler(request)

    async def start(self) -> None:
        app = web.Application(middlewares=[self.auth])
        app.router.add_get("/health", lambda r: web.Response(text=""))
        app.router.add_get("/v1/models", lambda r: web.json_response({"data": [{"id": "m"}]}))
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, self.host, self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


async def until(condition, what: str, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    """Poll ``condition`` (the state is in other processes' hands: nothing to wait on)."""
    deadline = anyio.current_time() + timeout_s
    while not await condition():
        assert anyio.current_time() < deadline, f"timed out waiting: {what}"
        await anyio.sleep(0.05)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_replica_skypilot_recovers_rejoins_the_proxy(
    tmp_path: Path, sky_api: FakeSkyApi, anyio_backend: str
) -> None:
    port = free_port()
    cfg = make_config(tmp_path, port=port)
    backend = SkyPilotBackend(cfg, cfg.run_dir / "launch", environ=ENVIRON)
    key, admin = backend.replica_key, backend.admin_key
    assert admin is not None
    first, second, moved = (StandIn(f"127.0.0.{i}", port, key) for i in (2, 3, 4))
    sky_api.ips = {
        "sky-run-replica-0": first.host,
        "sky-run-replica-1": second.host,
        "sky-run-trainer": "127.0.0.5",
    }
    for replica in (first, second):
        await replica.start()
    # the trainer job's proxy, as its spec configures it: the origins of recovered replicas
    spec = backend.trainer_spec([first.url, second.url])
    key_urls = next(a for a in spec.command if a.startswith("proxy.upstream_key_urls="))
    proxy_cfg = ProxyConfig(
        upstreams=(first.url, second.url),
        host="127.0.0.5",
        port=port,
        api_key=admin,
        admin_api_key=admin,
        upstream_api_key=key,
        block_size=16,
        health_interval_s=0.1,
        upstream_key_urls=tuple(key_urls.split("=", 1)[1].split(",")),
    )
    async with (
        serve_proxy(proxy_cfg) as proxy_url,
        serve_proxy(
            dataclasses.replace(proxy_cfg, host="127.0.0.6")  # the trainer, relaunched elsewhere
        ) as relaunched_url,
    ):
        handle = await launch(cfg, backend)
        async with handle, anyio.create_task_group() as tg:
            tg.start_soon(handle.wait)
            replica0 = handle.replicas[0]
            assert replica0.url == first.url
            job = sky_api.jobs[int(replica0.id)]
            # preempted: its machine gone; SkyPilot relaunches it elsewhere
            await first.stop()
            job.status, job.recovery_count = "RECOVERING", 1
            await until(lambda: _no(replica0), "the old address leaves")
            await moved.start()
            job.ip, job.status = moved.host, "RUNNING"

            async def rejoined() -> bool:
                health = await get(proxy_url, "/health", admin)
                return health["serving"] == 2 and not health["unhealthy"]

            await until(rejoined, "the recovered replica joins the proxy")
            assert replica0.url == moved.url and handle.restarts == 0  # no replacement job
            assert moved.authorized >= 2  # health from the launcher, requests from the proxy
            assert [j for j in sky_api.launched if "replica-2" in str(j)] == []
            # the secrets reach SkyPilot with the task it launches (its task secrets)
            assert key in sky_api.launched[0]["task"] and AWS_SECRET in sky_api.launched[0]["task"]
            # the trainer preempted too: back elsewhere with the replicas of its command
            trainer = sky_api.jobs[int(handle.trainer.id)]  # type: ignore[union-attr]
            trainer.status = "RECOVERING"
            await anyio.sleep(0.3)
            trainer.ip, trainer.status = "127.0.0.6", "RUNNING"

            async def resynced() -> bool:
                listed = await get(relaunched_url, "/proxy/upstreams", admin)
                return {u["url"] for u in listed["upstreams"]} == {second.url, moved.url}

            await until(resynced, "the relaunched trainer's proxy gets the replicas serving")
            trainer.status = "SUCCEEDED"
        await second.stop()
        await moved.stop()
    # SkyPilot was asked for every job's status, and to cancel what was left running
    assert "POST /jobs/queue/v2" in sky_api.calls and "POST /jobs/cancel" in sky_api.calls
    assert sky_api.jobs[int(replica0.id)].status == "CANCELLED"


async def get(base: str, path: str, key: str) -> dict:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{base}{path}", headers={"Authorization": f"Bearer {key}"}) as answer,
    ):
        return await answer.json()


async def _no(job) -> bool:  # type: ignore[no-untyped-def]
    return job.url is None
