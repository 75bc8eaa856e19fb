"""The proxy's config validation and its command line: refuses unsafe binds, stops cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from asyncgrpo.errors import ConfigError
from asyncgrpo.proxy import ProxyConfig
from asyncgrpo.serve.replicas import free_port


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"host": "0.0.0.0"}, "api_key"),
        ({"upstreams": ("localhost:8000",)}, "http"),
        ({"upstreams": ("http://a:1", "http://a:1/")}, "twice"),
        ({"lora_roots": ("relative",)}, "absolute"),
        ({"imbalance": -1}, "imbalance"),
        ({"request_timeout_s": 0}, "request_timeout_s"),
        ({"routing": "random"}, "routing"),
        ({"upstreams": ("http://user:pw@a:1",)}, "no credentials"),
        ({"upstreams": ("http://a:99999",)}, "http"),
        ({"upstream_key_urls": ("https://*.hf.space/path",)}, "has a path"),
        ({"upstream_api_key": "tok\r\nX-Injected: 1"}, "control character"),
        ({"max_connections": 0}, "max_connections"),
        ({"head_timeout_s": 0}, "head_timeout_s"),
    ],
)
def test_config_errors_name_the_fix(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ProxyConfig(**kwargs)


def test_config_hides_secrets_and_allows_public_bind_with_key() -> None:
    cfg = ProxyConfig(
        host="0.0.0.0", api_key="s3cret", upstream_api_key="hf_tok", admin_api_key="adm1n"
    )
    assert not [secret for secret in ("s3cret", "hf_tok", "adm1n") if secret in repr(cfg)]


def _cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "asyncgrpo.proxy", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def test_cli_refuses_public_bind_without_key() -> None:
    env = {"ASYNCGRPO_PROXY_API_KEY": ""}
    p = _cli("--upstream", "http://127.0.0.1:9", "--host", "0.0.0.0", env=env)
    _, err = p.communicate(timeout=60)
    assert p.returncode != 0 and "api_key" in err


def test_cli_serves_and_stops_cleanly_on_sigterm() -> None:
    port = free_port()
    key = "cli-test-key-123"
    p = _cli(
        "--upstream",
        "http://127.0.0.1:9",
        "--host",
        "0.0.0.0",
        "--port",
        str(port),
        env={"ASYNCGRPO_PROXY_API_KEY": key},
    )
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert f":{port}" in line, line
        import urllib.error
        import urllib.request

        req = urllib.request.Request(f"http://127.0.0.1:{port}/proxy/stats")
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(req, timeout=10)
        assert exc.value.code == 401
        req.add_header("Authorization", f"Bearer {key}")
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
        assert p.returncode == 0, err
        assert "stopped" in out
        assert key not in out + err
        assert time.monotonic() - t0 < 10
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
