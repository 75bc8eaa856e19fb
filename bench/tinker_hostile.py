"""Hostile clients of the Tinker service, side by side: this checkout's service and each
``--baseline`` checkout's, each a fresh ``python -m asyncgrpo.tinker`` process on the tiny
model, under a 1,024-descriptor limit (soft and hard).

Per service:

- ``idle``: 1,040 idle connections held: how many the service closed within 3 s, ``healthz``
  latency meanwhile (5 s: no answer), and ``Too many open files`` lines in its log;
- ``slow head``: a request head sent one byte every 0.5 s: how long the service holds it
  (stopped at 30 s);
- ``control body``: a ``create_session`` body of ``{}`` tags (``--control-mb``, 3 MB by default;
  the finding's 15 MB took 16.6 s and 6.2 GB, too much for a shared machine): time to the
  answer, its status, the service's peak memory growth, the longest ``healthz`` meanwhile;
- ``empty datums``: a ``forward_backward`` of datums with no tokens for a live client
  (``--fwdbwd-mb``, 2 MB by default): the same figures.

Run: ``python bench/tinker_hostile.py [--baseline ../main] [--model DIR]`` (about a minute per
service; add ``--baseline`` checkouts to compare).
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this file's directory comes first on sys.path and bench/tinker.py would
# shadow the SDK.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import argparse
import json
import os
import re
import resource
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

FILES = 1024
HEALTH_TIMEOUT_S = 5.0


def _limit_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FILES, FILES))


def _vm(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _healthz(port: int) -> float:
    """Seconds to a ``healthz`` answer; HEALTH_TIMEOUT_S when none came."""
    started = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=HEALTH_TIMEOUT_S) as s:
            s.sendall(
                b"GET /api/v1/healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
            )
            got = b""
            while chunk := s.recv(65536):
                got += chunk
        if not got.startswith(b"HTTP/1.1 200"):
            return HEALTH_TIMEOUT_S
    except OSError:
        return HEALTH_TIMEOUT_S
    return time.monotonic() - started


def _send(port: int, raw: bytes, timeout: float = 300.0) -> bytes:
    """``raw`` on a new connection, reading the answer meanwhile."""
    got: list[bytes] = []
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:

        def read() -> None:
            try:
                while chunk := s.recv(65536):
                    got.append(chunk)
            except OSError:
                pass

        reader = threading.Thread(target=read)
        reader.start()
        try:
            s.sendall(raw)
        except OSError:
            pass
        reader.join(timeout)
    return b"".join(got)


def _post(path: str, body: bytes, content_type: str) -> bytes:
    return (
        b"POST /api/v1/%s HTTP/1.1\r\nHost: localhost\r\nContent-Type: %s\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n"
        % (path.encode(), content_type.encode(), len(body))
    ) + body


def _costly(pid: int, port: int, send: Callable[[], bytes]) -> dict[str, str]:
    """Time, status, peak memory growth and worst ``healthz`` while ``send()`` runs."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    before = _vm(pid, "VmRSS")
    took: list[float] = []
    started = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(send)
        while not sent.done():
            took.append(_healthz(port))
            time.sleep(0.05)
        answer = sent.result()
    elapsed = time.monotonic() - started
    status = answer[9:12].decode() or "closed"
    return {
        "s": f"{elapsed:.2f}",
        "status": status,
        "grew MB": f"{(_vm(pid, 'VmHWM') - before) / 1e6:.0f}",
        "healthz max ms": f"{max(took, default=0) * 1000:.0f}",
    }


def _idle(port: int, log: Path) -> dict[str, str]:
    lines_before = log.read_text(errors="replace").count("Too many open files")
    conns = []
    for _ in range(1040):
        try:
            conns.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        except OSError:
            break
    health = _healthz(port)
    time.sleep(3.0)
    closed = 0
    for s in conns:
        s.settimeout(0.01)
        try:
            closed += s.recv(1024) == b""
        except TimeoutError:
            pass
        except OSError:
            closed += 1
    for s in conns:
        s.close()
    time.sleep(1.0)
    lines = log.read_text(errors="replace").count("Too many open files") - lines_before
    return {
        "opened": str(len(conns)),
        "closed by it": str(closed),
        "healthz ms": "no answer" if health >= HEALTH_TIMEOUT_S else f"{health * 1000:.0f}",
        "EMFILE log lines": str(lines),
    }


def _slow_head(port: int) -> str:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"GET /api/v1/healthz HTTP/1.1\r\nHost: localhost\r\n")
    started = time.monotonic()
    try:
        while time.monotonic() - started < 30:
            s.sendall(b"X")
            s.settimeout(0.5)
            try:
                if s.recv(1024) == b"":
                    break
            except TimeoutError:
                pass
    except OSError:
        pass
    finally:
        s.close()
    held = time.monotonic() - started
    return f"{held:.1f}" if held < 30 else ">= 30"


def _client(port: int) -> str:
    """A training client's model id (a session, then create_model, then its future)."""

    def call(path: str, body: dict) -> dict:
        answer = _send(port, _post(path, json.dumps(body).encode(), "application/json"))
        return json.loads(answer.partition(b"\r\n\r\n")[2])

    sid = call("create_session", {"tags": [], "user_metadata": {}, "sdk_version": "bench"})[
        "session_id"
    ]
    made = call(
        "create_model",
        {
            "session_id": sid,
            "model_seq_id": 0,
            "base_model": MODEL[0],
            "lora_config": {"rank": 1},
            "type": "create_model",
        },
    )
    call("retrieve_future", {"request_id": made["request_id"]})
    return made["model_id"]


MODEL: list[str] = [""]


def _empty_datums(model_id: str, mb: float) -> bytes:
    from tinker.proto import tinker_public_pb2 as pb

    msg = pb.ForwardBackwardRequest(model_id=model_id, loss_fn="cross_entropy")
    datum = pb.Datum()
    datum.model_input.add().encoded_text.tokens = b""
    for name, dtype in (("target_tokens", pb.DTYPE_INT64), ("weights", pb.DTYPE_FLOAT32)):
        datum.loss_fn_inputs[name].dtype = dtype
    one = len(datum.SerializeToString()) + 3
    for _ in range(int(mb * 1e6 / one)):
        msg.data.add().CopyFrom(datum)
    return msg.SerializeToString()


def run(name: str, checkout: str, model: str, args: argparse.Namespace) -> dict[str, str]:
    work = Path(tempfile.mkdtemp(prefix=f"tinker-hostile-{name}-"))
    log = work / "service.log"
    env = {**os.environ, "PYTHONPATH": os.path.abspath(checkout), "TINKER_TELEMETRY": "0"}
    argv = [
        sys.executable,
        "-m",
        "asyncgrpo.tinker",
        "--model",
        model,
        "--port",
        "0",
        "--work-dir",
        str(work),
        "--max-lora-rank",
        "8",
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(
            argv,
            env=env,
            cwd=checkout,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=_limit_files,
        )
    try:
        deadline = time.monotonic() + 180
        while not (m := re.search(r"ready: http://[^:]+:(\d+)", log.read_text())):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{name}: the service did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.5)
        port = int(m[1])
        row = {"service": name}
        row.update({f"idle {k}": v for k, v in _idle(port, log).items()})
        row["slow head held s"] = _slow_head(port)
        tags = (
            b'{"tags": ['
            + b"{}," * int(args.control_mb * 1e6 / 3)
            + b'{}], "user_metadata": {}, "sdk_version": "x"}'
        )
        row.update(
            {
                f"control {k}": v
                for k, v in _costly(
                    proc.pid,
                    port,
                    lambda: _send(port, _post("create_session", tags, "application/json")),
                ).items()
            }
        )
        body = _empty_datums(_client(port), args.fwdbwd_mb)
        row.update(
            {
                f"datums {k}": v
                for k, v in _costly(
                    proc.pid,
                    port,
                    lambda: _send(port, _post("forward_backward", body, "application/x-protobuf")),
                ).items()
            }
        )
        return row
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", action="append", default=[], help="another checkout")
    parser.add_argument("--model", help="the tiny model's directory (default: built here)")
    parser.add_argument("--control-mb", type=float, default=3.0)
    parser.add_argument("--fwdbwd-mb", type=float, default=2.0)
    args = parser.parse_args()
    model = args.model
    if model is None:
        from asyncgrpo.testing import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "model", seed=0))
    MODEL[0] = model
    here = str(Path(__file__).resolve().parents[1])
    rows = [run(os.path.basename(os.path.abspath(b)), b, model, args) for b in args.baseline]
    rows.append(run("this checkout", here, model, args))
    keys = list(rows[-1])
    width = max(len(k) for k in keys)
    for key in keys:
        print(f"{key:<{width}}  " + "  ".join(f"{r.get(key, '-'):>14}" for r in rows))


if __name__ == "__main__":
    main()
