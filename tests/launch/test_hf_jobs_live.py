"""Live check against real Hugging Face Jobs (costs a few cents of ``cpu-basic``).

Runs only with ``HF_TOKEN`` (a token that may run jobs) and the opt-in
``ASYNCGRPO_TEST_HF_JOBS=1``. It runs ``asyncgrpo launch --dry-run``, then a one-replica launch
on ``cpu-basic`` whose "replica" is a tiny HTTP server in ``python:3.12-slim`` (vLLM needs a
GPU): the job starts, its exposed port answers ``/health`` through the Jobs gateway with the
token, the gateway forwards the ``Authorization`` header (the replicas' vLLM API key relies on
it), and cancelling the launch cancels every job.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import yaml

from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.launch import launch
from asyncgrpo.launch.hf_jobs import HfJobsBackend
from asyncgrpo.launch.jobs import JobSpec

_missing = [n for n in ("HF_TOKEN", "ASYNCGRPO_TEST_HF_JOBS") if not os.environ.get(n)]
pytestmark = [
    pytest.mark.live,
    pytest.mark.skipif(
        bool(_missing), reason=f"live Hugging Face Jobs test needs {', '.join(_missing)} set"
    ),
]

#: /health: 200; /auth: 200 only if the gateway forwarded an Authorization header.
SERVER = """
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.path == "/health" or (self.path == "/auth" and "Authorization" in self.headers)
        self.send_response(200 if ok else 401)
        self.end_headers()
http.server.ThreadingHTTPServer(("0.0.0.0", 8000), H).serve_forever()
"""


class SmokeBackend(HfJobsBackend):
    """Hugging Face Jobs with a stand-in server for vLLM and an idle trainer; no transport."""

    def replica_spec(self, index: int) -> JobSpec:
        return JobSpec(
            role="replica",
            name=f"asyncgrpo-smoke-replica-{index}",
            command=("python", "-c", SERVER),
            image="python:3.12-slim",
            flavor="cpu-basic",
            timeout_s=900,
            port=8000,
            labels={"asyncgrpo-role": "replica"},
        )

    def trainer_spec(self, urls: list[str], cfg: TrainingConfig | None = None) -> JobSpec:
        return JobSpec(
            role="trainer",
            name="asyncgrpo-smoke-trainer",
            command=("python", "-c", "import time; time.sleep(900)"),
            image="python:3.12-slim",
            flavor="cpu-basic",
            timeout_s=900,
            labels={"asyncgrpo-role": "trainer"},
        )

    def check(self) -> None:
        pass

    async def prepare(self) -> None:
        self.transport_url = None
        await super().prepare()


def config(tmp_path: Path) -> TrainingConfig:
    return TrainingConfig.from_dict(
        {
            "model": "Qwen/Qwen2.5-0.5B-Instruct",
            "run_name": "asyncgrpo-smoke",
            "output_dir": str(tmp_path),
            "transport_url": "hf://buckets/someone/asyncgrpo-smoke/run",
            "dataset": {"prompts": ["hi"]},
            "launch": {
                "replicas": 1,
                "replica_flavor": "cpu-basic",
                "poll_s": 3,
                "health_timeout_s": 600,
            },
        }
    )


def test_dry_run_then_a_cpu_basic_smoke_job_is_started_checked_and_cancelled(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config(tmp_path).to_dict()))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncgrpo.cli.main",
            "launch",
            str(path),
            "--backend",
            "hf-jobs",
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert os.environ["HF_TOKEN"] not in out.stdout + out.stderr

    async def main() -> None:
        import aiohttp

        cfg = config(tmp_path)
        backend = SmokeBackend(cfg, cfg.run_dir / "launch")
        handle = await launch(cfg, backend)
        try:
            (url,) = handle.urls
            async with aiohttp.ClientSession(headers=backend.health_headers) as session:
                async with session.get(f"{url}/auth") as resp:
                    assert resp.status == 200, "the Jobs gateway did not forward Authorization"
        finally:
            await handle.cancel()
        for job in handle.jobs:
            info = backend.api.inspect_job(job_id=job.id, namespace=backend.namespace)
            assert info.status.stage in ("CANCELED", "CANCELLED", "DELETED"), info.status

    anyio.run(main)
