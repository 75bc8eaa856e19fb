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


def test_replicas_started_by_the_service_sample_and_stop_with_it(
    tiny_model: Path, tmp_path: Path, leftovers: list
) -> None:
    """``--replicas 1`` with the serve flags: the service starts a vLLM replica itself (the run's
    fleet starter), samples the saved weights on it through the SDK, and leaves no process."""
    import psutil
    import tinker
    from tinker import types

    proc, url = _start(["-m", "asyncgrpo.tinker", "--model", str(tiny_model), "--port", "0",
                        "--replicas", "1", "--dtype", "float32", "--kv-cache-gib", "1",
                        "--max-model-len", "512", "--max-lora-rank", "8",
                        "--work-dir", str(tmp_path / "work")])  # fmt: skip
    leftovers.append(psutil.Process(proc.pid))
    try:
        vllm = [p for p in psutil.Process(proc.pid).children(recursive=True)
                if "vllm" in " ".join(p.cmdline())]  # fmt: skip
        assert vllm, "no vLLM replica under the service"
        service = tinker.ServiceClient(base_url=url)
        training = service.create_lora_training_client(base_model=str(tiny_model), rank=8).result()
        ids = training.get_tokenizer().encode("12 + 7 = 19")
        sampler = training.save_weights_and_get_sampling_client().result()
        out = sampler.sample(types.ModelInput.from_ints(ids), 2,
                             types.SamplingParams(max_tokens=4, temperature=1.0)).result()  # fmt: skip
        assert len(out.sequences) == 2 and all(s.logprobs for s in out.sequences)
        service.close("success").result()
    finally:
        proc.send_signal(signal.SIGTERM)
        out_text = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out_text[-3000:]
    _, alive = psutil.wait_procs(vllm, timeout=30)
    assert not alive, f"replicas outlived the service: {[p.pid for p in alive]}"
    assert (tmp_path / "work" / "replica-logs").is_dir()


def test_replicas_beside_a_proxy_url_is_one_line_and_status_2() -> None:
    r = subprocess.run([sys.executable, "-m", "asyncgrpo.tinker", "--model", "m", "--replicas",
                        "1", "--proxy-url", "http://127.0.0.1:9"], capture_output=True,
                       text=True)  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "python -m asyncgrpo.tinker: error: tinker.proxy_url and tinker.replicas/upstreams both "
        "given: sample through the proxy at --proxy-url, or let the service start its own "
        "(--replicas N, --upstream URL), not both"
    ]
