"""``python -m asyncgrpo.tinker`` / ``asyncgrpo tinker``: ready line, SDK client, clean stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest


def _start(args: list[str]) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TINKER_API_KEY", None)  # loopback: no key needed server-side
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("tinker service ready: "):
            return proc, line.split(": ", 1)[1].strip()
    proc.wait()
    raise AssertionError(f"the service exited ({proc.returncode}) without its ready line")


@pytest.mark.parametrize("command", [["-m", "asyncgrpo.tinker"], ["-m", "asyncgrpo", "tinker"]])
def test_the_command_serves_the_sdk_and_stops_on_sigterm(tiny_model: Path, command) -> None:
    import tinker

    proc, url = _start([*command, "--model", str(tiny_model), "--port", "0"])
    try:
        caps = tinker.RestClient(base_url=url).get_server_capabilities().result()
        assert caps.supported_models[0].model_name == str(tiny_model)
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    assert "tinker service stopped" in out


def test_a_bad_flag_is_one_line_and_status_2() -> None:
    r = subprocess.run([sys.executable, "-m", "asyncgrpo", "tinker", "--model", "m", "--host",
                        "0.0.0.0"], capture_output=True, text=True, env={**os.environ,
                        "TINKER_API_KEY": ""})  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "asyncgrpo tinker: error: tinker.host='0.0.0.0' is reachable from other machines: set "
        "TINKER_API_KEY (a key starting with 'tml-') or bind 127.0.0.1"
    ]
