"""A local Hugging Face Hub that speaks the Jobs REST API the way ``huggingface_hub`` calls it.

``FakeHub`` answers ``/api/whoami-v2``, ``POST /api/buckets/<ns>/<name>``, ``POST
/api/jobs/<ns>`` (``run_job``), ``GET /api/jobs/<ns>/<id>`` (``inspect_job``), ``GET
.../logs`` (``fetch_job_logs``: server-sent events, honouring ``tail``), ``POST .../cancel``;
and, standing in for the Jobs gateway, each job's exposed port at ``/exposed/<id>/...``, which
demands the bearer token like the real gateway (``/health`` answers as the job's script says;
``/proxy/upstreams``, the trainer's proxy's admin route, answers 200). Every request is recorded. Jobs follow a script
the test sets: ``hub.script(role) -> dict`` returns what a new job of that role does.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from aiohttp import web
from threaded_app import ThreadedApp

NAMESPACE = "testns"
TOKEN = "hf_fakeTOKEN1234567890secret"


def _now() -> str:
    """The Hub's timestamp format (what huggingface_hub parses)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


@dataclass
class FakeJob:
    id: str
    spec: dict[str, Any]
    created: float
    stage: str = "RUNNING"
    logs: list[str] = field(default_factory=list)
    healthy_after_s: float | None = 0.0  #: None: never healthy
    fail_after_s: float | None = None  #: reported as ERROR after this
    complete_after_s: float | None = None  #: reported as COMPLETED after this
    complete_when: Callable[[], bool] | None = None  #: reported as COMPLETED once this holds
    health_checks: int = 0

    @property
    def role(self) -> str:
        return (self.spec.get("labels") or {}).get("asyncgrpo-role", "")

    def tick(self) -> None:
        age = time.monotonic() - self.created
        if self.stage != "RUNNING":
            return
        if self.fail_after_s is not None and age >= self.fail_after_s:
            self.stage = "ERROR"
        elif self.complete_after_s is not None and age >= self.complete_after_s:
            self.stage = "COMPLETED"
        elif self.complete_when is not None and self.complete_when():
            self.stage = "COMPLETED"


class FakeHub(ThreadedApp):
    def __init__(self) -> None:
        super().__init__()
        self.requests: list[dict[str, Any]] = []
        self.jobs: dict[str, FakeJob] = {}
        self.buckets: list[str] = []
        self.report_expose_urls = True
        self.scripts: dict[str, Callable[[], dict[str, Any]]] = {}

    # -- test helpers --------------------------------------------------------------------------

    def created(self, role: str | None = None) -> list[FakeJob]:
        return [j for j in self.jobs.values() if role is None or j.role == role]

    def cancelled(self) -> set[str]:
        return {
            r["path"].split("/")[-2]
            for r in self.requests
            if r["method"] == "POST" and r["path"].endswith("/cancel")
        }

    def api_requests(self) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["path"].startswith("/api/")]

    def admin_calls(self, job: FakeJob) -> list[tuple[str, str, bool]]:
        """(method, url, authorized) of each call to ``job``'s ``/proxy/upstreams``."""
        path = f"/exposed/{job.id}/proxy/upstreams"
        return [
            (r["method"], r["body"]["url"], r["authorized"])
            for r in self.requests
            if r["path"] == path
        ]

    # -- server ------------------------------------------------------------------------------

    def _job_json(self, job: FakeJob) -> dict[str, Any]:
        job.tick()
        spec = job.spec
        status: dict[str, Any] = {"stage": job.stage, "message": None}
        if job.stage == "ERROR":
            status["message"] = "exit code 1"
        ports = (spec.get("expose") or {}).get("ports") or []
        if ports and self.report_expose_urls:
            status["exposeUrls"] = [f"{self.url}/exposed/{job.id}"]
        return {
            "id": job.id,
            "createdAt": _now(),
            "dockerImage": spec.get("dockerImage"),
            "command": spec.get("command"),
            "arguments": [],
            "environment": spec.get("environment"),
            # the real Hub never returns secret values
            "secrets": dict.fromkeys(spec.get("secrets") or {}, "<hidden>"),
            "flavor": spec.get("flavor"),
            "labels": spec.get("labels"),
            "status": status,
            "owner": {"id": "0", "name": NAMESPACE, "type": "user"},
            "expose": spec.get("expose"),
        }

    async def make_app(self) -> web.Application:
        def authorized(request: web.Request) -> bool:
            return request.headers.get("Authorization") == f"Bearer {TOKEN}"

        @web.middleware
        async def record(request: web.Request, handler):
            body = await request.read()
            self.requests.append(
                {
                    "method": request.method,
                    "path": request.path,
                    "query": dict(request.query),
                    "body": json.loads(body) if body else None,
                    "authorized": authorized(request),
                }
            )
            if not authorized(request):
                return web.json_response({"error": "Invalid credentials"}, status=401)
            return await handler(request)

        async def whoami(request: web.Request) -> web.Response:
            return web.json_response({"type": "user", "name": NAMESPACE})

        async def create_bucket(request: web.Request) -> web.Response:
            ns, name = request.match_info["ns"], request.match_info["name"]
            self.buckets.append(f"{ns}/{name}")
            return web.json_response({"url": f"{self.url}/buckets/{ns}/{name}"})

        async def run_job(request: web.Request) -> web.Response:
            spec = await request.json()
            job = FakeJob(secrets.token_hex(12), spec, time.monotonic())
            script = self.scripts.get(job.role)
            for key, value in (script() if script else {}).items():
                setattr(job, key, value)
            self.jobs[job.id] = job
            return web.json_response(self._job_json(job))

        def find(request: web.Request) -> FakeJob:
            job = self.jobs.get(request.match_info["id"])
            if job is None:
                raise web.HTTPNotFound(text='{"error": "no such job"}')
            return job

        async def inspect(request: web.Request) -> web.Response:
            return web.json_response(self._job_json(find(request)))

        async def cancel(request: web.Request) -> web.Response:
            job = find(request)
            job.tick()
            if job.stage == "RUNNING":
                job.stage = "CANCELED"
            return web.json_response({})

        async def logs(request: web.Request) -> web.StreamResponse:
            job = find(request)
            lines = list(job.logs)
            if "tail" in request.query:
                lines = lines[-int(request.query["tail"]) :]
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            now = _now()
            for line in lines:
                event = json.dumps({"timestamp": now, "data": line})
                await resp.write(f"data: {event}\n\n".encode())
            await resp.write_eof()
            return resp

        async def exposed(request: web.Request) -> web.Response:
            job = find(request)
            job.health_checks += 1
            job.tick()
            age = time.monotonic() - job.created
            ok = job.healthy_after_s is not None and age >= job.healthy_after_s
            if job.stage != "RUNNING" or not ok:
                return web.Response(status=503, text="starting")
            return web.Response(text="")

        async def upstreams(request: web.Request) -> web.Response:
            find(request)
            return web.json_response({})

        app = web.Application(middlewares=[record])
        app.router.add_get("/api/whoami-v2", whoami)
        app.router.add_post("/api/buckets/{ns}/{name}", create_bucket)
        app.router.add_post("/api/jobs/{ns}", run_job)
        app.router.add_get("/api/jobs/{ns}/{id}", inspect)
        app.router.add_post("/api/jobs/{ns}/{id}/cancel", cancel)
        app.router.add_get("/api/jobs/{ns}/{id}/logs", logs)
        app.router.add_get("/exposed/{id}/health", exposed)
        for method in ("POST", "DELETE"):
            app.router.add_route(method, "/exposed/{id}/proxy/upstreams", upstreams)
        return app
