"""Live check against a real SkyPilot API server and infra (costs a few cents of a CPU machine).

Runs only with SkyPilot credentials (``sky check`` finds an enabled infra; the API server at
``SKYPILOT_API_SERVER_ENDPOINT`` or a local one) and the opt-in ``ASYNCGRPO_TEST_SKYPILOT=1``.
It checks that the enabled infra passes the backend's check, then starts one managed job on a
CPU machine, sees it run through the SDK's status calls, and cancels it.
"""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest

pytestmark = [
    pytest.mark.live,
    pytest.mark.skipif(
        not os.environ.get("ASYNCGRPO_TEST_SKYPILOT"),
        reason="live SkyPilot test needs ASYNCGRPO_TEST_SKYPILOT=1 and SkyPilot credentials",
    ),
]
sky = pytest.importorskip("sky")

from asyncgrpo.config.training import TrainingConfig  # noqa: E402
from asyncgrpo.launch.jobs import Job, JobSpec  # noqa: E402
from asyncgrpo.launch.skypilot import SkyPilotBackend  # noqa: E402


def test_a_managed_job_starts_runs_and_is_cancelled(tmp_path: Path) -> None:
    cfg = TrainingConfig.from_dict({
        "model": "Qwen/Qwen2.5-0.5B-Instruct", "run_name": "asyncgrpo-live",
        "output_dir": str(tmp_path), "transport_url": "s3://unused/prefix",
        "dataset": {"prompts": ["hi"]},
        "launch": {"replica_accelerators": None, "infra": os.environ.get("ASYNCGRPO_SKY_INFRA")},
    })  # fmt: skip
    environ = {"AWS_ACCESS_KEY_ID": "unused", "AWS_SECRET_ACCESS_KEY": "unused"}
    backend = SkyPilotBackend(cfg, tmp_path, environ=environ)
    backend.check()  # an enabled infra, through the real API server
    spec = JobSpec(
        role="replica",
        name="asyncgrpo-live-sleep",
        command=("sleep", "600"),
        timeout_s=900,
        port=8000,
    )

    async def main() -> None:
        job = Job(spec, await backend.start(spec), tmp_path / "job.log")
        try:
            for _ in range(120):  # up to 20 minutes to provision
                status = await backend.status(job)
                if status.stage != "starting":
                    break
                await anyio.sleep(10)
            assert status.stage == "running" and status.url is not None
        finally:
            await backend.cancel(job)

    anyio.run(main)
