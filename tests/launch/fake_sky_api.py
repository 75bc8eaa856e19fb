"""A SkyPilot API server on loopback: the managed-jobs routes the launcher's calls reach.

It speaks SkyPilot's wire protocol with SkyPilot's own types: a POST answers with a request id
(``X-Skypilot-Request-ID``), ``GET /api/get`` answers with the request encoded by
``sky.server.requests.requests.Request`` (the return value through SkyPilot's own encoder for
that request name: ``ManagedJobRecord`` rows for ``jobs.queue_v2``), ``/api/health`` with the
version headers the client checks. The jobs' states are the test's to set (``jobs``).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import sky
from sky.client import sdk
from sky.jobs.state import ManagedJobStatus
from sky.schemas.api import responses
from sky.server import constants as server_constants
from sky.server.requests import payloads
from sky.server.requests import requests as requests_lib


@dataclass
class FakeJob:
    job_id: int
    name: str
    status: str = "RUNNING"
    ip: str | None = None  #: its node's external address
    recovery_count: int = 0
    log: list[str] = field(default_factory=list)


class FakeSkyApi:
    """The API server; :attr:`jobs` by id, :attr:`calls` the routes called, in order."""

    def __init__(self, *, enabled_clouds: tuple[str, ...] = ("aws",)) -> None:
        self.jobs: dict[int, FakeJob] = {}
        self.calls: list[str] = []
        self.launched: list[dict[str, Any]] = []  #: each jobs.launch body
        self.enabled = list(enabled_clouds)
        self.ips: dict[str, str] = {}  #: job name -> the address its node gets
        self._ids = itertools.count(1)
        self._results: dict[str, tuple[str, Any]] = {}
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> None:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # -- the routes --------------------------------------------------------------------------

    def _request(self, name: str, value: Any) -> str:
        request_id = uuid.uuid4().hex
        with self._lock:
            self._results[request_id] = (name, value)
        return request_id

    def _encoded(self, request_id: str) -> dict[str, Any]:
        name, value = self._results[request_id]
        request = requests_lib.Request(
            request_id=request_id,
            name=server_constants.REQUEST_NAME_PREFIX + name,
            entrypoint=sdk.status,
            request_body=payloads.RequestBody(),
            status=requests_lib.RequestStatus.SUCCEEDED,
            created_at=time.time(),
            user_id="fake-user",
        )
        request.set_return_value(value)
        return json.loads(request.encode().model_dump_json())

    def _record(self, job: FakeJob) -> responses.ManagedJobRecord:
        ips = [(job.ip, job.ip)] if job.ip and job.status == "RUNNING" else None
        return responses.ManagedJobRecord(
            job_id=job.job_id,
            job_name=job.name,
            task_id=0,
            task_name=job.name,
            status=ManagedJobStatus(job.status),
            recovery_count=job.recovery_count,
            internal_external_ips=ips,
        )

    def _launch(self, body: dict[str, Any]) -> str:
        self.launched.append(body)
        job = FakeJob(next(self._ids), str(body["name"]))
        job.ip = self.ips.get(job.name)
        self.jobs[job.job_id] = job
        return self._request("jobs.launch", ([job.job_id], None))

    def _queue(self, body: dict[str, Any]) -> str:
        wanted = body.get("job_ids") or list(self.jobs)
        records = [self._record(self.jobs[i]) for i in wanted if i in self.jobs]
        return self._request("jobs.queue_v2", (records, len(records), {}, len(self.jobs)))

    def _cancel(self, body: dict[str, Any]) -> str:
        for i in body.get("job_ids") or []:
            if i in self.jobs and self.jobs[i].status not in ("SUCCEEDED", "FAILED"):
                self.jobs[i].status = "CANCELLED"
        return self._request("jobs.cancel", None)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(
                self,
                code: int,
                body: bytes,
                request_id: str | None = None,
                content_type: str = "application/json",
            ) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header(
                    server_constants.API_VERSION_HEADER, str(server_constants.API_VERSION)
                )
                self.send_header(server_constants.VERSION_HEADER, sky.__version__)
                if request_id is not None:
                    self.send_header("X-Skypilot-Request-ID", request_id)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                api.calls.append(f"GET {url.path}")
                if url.path == "/api/health":
                    health = {
                        "status": "healthy",
                        "api_version": server_constants.API_VERSION,
                        "version": sky.__version__,
                        "commit": "fake",
                        "user": None,
                    }
                    self._send(200, json.dumps(health).encode())
                elif url.path == "/enabled_clouds":
                    self._send(200, b"{}", api._request("enabled_clouds", api.enabled))
                elif url.path == "/api/get":
                    request_id = parse_qs(url.query)["request_id"][0]
                    self._send(200, json.dumps(api._encoded(request_id)).encode())
                else:
                    self._send(404, b"{}")

            def do_POST(self) -> None:
                path = urlsplit(self.path).path
                api.calls.append(f"POST {path}")
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                if path == "/jobs/launch":
                    self._send(200, b"{}", api._launch(body))
                elif path == "/validate":  # SkyPilot's schema check ran on the client
                    self._send(200, b"{}")
                elif path == "/jobs/queue/v2":
                    self._send(200, b"{}", api._queue(body))
                elif path == "/jobs/cancel":
                    self._send(200, b"{}", api._cancel(body))
                elif path == "/jobs/logs":
                    job = api.jobs.get(int(body.get("job_id") or 0))
                    text = "".join(f"{line}\n" for line in (job.log if job else []))
                    self._send(200, text.encode(), api._request("jobs.logs", 0), "text/plain")
                else:
                    self._send(404, b"{}")

        return Handler
