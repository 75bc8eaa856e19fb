"""``python -m asyncgrpo.tinker`` / ``asyncgrpo tinker``: ready line, SDK client, clean stop."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest


def _start(args: list[str]) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TINKER_API_KEY", None)  # loopback: no key needed server-side
    proc = subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
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
    r = subprocess.run(
        [sys.executable, "-m", "asyncgrpo", "tinker", "--model", "m", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        env={**os.environ, "TINKER_API_KEY": ""},
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "asyncgrpo tinker: error: tinker.host='0.0.0.0' is reachable from other machines: set "
        "TINKER_API_KEY (a key starting with 'tml-') or bind 127.0.0.1"
    ]


@dataclass
class _Running:
    """A service process started by the test and its URL."""

    proc: subprocess.Popen[str]
    url: str
    output: str = ""


@contextlib.contextmanager
def _running(args: list[str], leftovers: list) -> Iterator[_Running]:
    """The service run as users run it (its own process), SIGTERMed at the end of the block."""
    import psutil

    proc, url = _start(args)
    leftovers.append(psutil.Process(proc.pid))
    running = _Running(proc, url)
    try:
        yield running
    finally:
        proc.send_signal(signal.SIGTERM)
        running.output = proc.communicate(timeout=120)[0]


def _stopped_cleanly(running: _Running) -> None:
    assert running.proc.returncode == 0, running.output[-3000:]
    assert "tinker service stopped" in running.output


def _greedy(
    sampler, prompt: list[int], scored: list[int]
) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Greedy tokens and their logprobs after ``prompt``, and the logprobs ``compute_logprobs``
    gives the fixed sequence ``scored`` (position 0 has none)."""
    from tinker import types

    params = types.SamplingParams(max_tokens=6, temperature=0.0, seed=0)
    seq = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0]
    fixed = sampler.compute_logprobs(types.ModelInput.from_ints(scored)).result()
    assert fixed[0] is None
    return list(seq.tokens), np.asarray(seq.logprobs), np.asarray(fixed[1:])


def _train_and_save(service, model: Path) -> tuple[str, list[int], list[int]]:
    """A client of ``service`` trained two steps and its ``save_weights_for_sampler`` path
    (the client stays live); the fixed prompt and the fixed sequence to score."""
    from tinker import types

    training = service.create_lora_training_client(base_model=str(model), rank=8).result()
    ids = training.get_tokenizer().encode("12 + 7 = 19")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]}
    )
    for _ in range(2):
        training.forward_backward([datum], "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = training.save_weights_for_sampler("before-restart").result().path
    return path, ids[:-2], ids


@pytest.mark.vllm
def test_a_sampler_path_samples_the_same_after_the_service_restarts(
    tiny_model: Path, tmp_path: Path, leftovers: list, vllm_replicas: list
) -> None:
    """A ``save_weights_for_sampler`` path sampled before a SIGTERM, on a service in front of
    one of the session's replicas (``--upstream``), samples the same greedy tokens and logprobs
    on a fresh service process on the same ``--transport`` in front of the other replica, which
    never held that version: it came back from the transport, since no service process that
    held it is left, nor a copy outside the transport (the service's cache). A path never saved
    is the SDK's ``NotFoundError`` naming it. ``--replicas 1`` (the service starts a replica
    itself and stops it with itself, leaving no process): ``make test-cookbook``'s service,
    tests/tinker/test_cookbook.py."""
    import tinker

    common = ["-m", "asyncgrpo.tinker", "--model", str(tiny_model), "--port", "0",
              "--max-lora-rank", "8", "--work-dir", str(tmp_path / "work"),
              "--transport", str(tmp_path / "store")]  # fmt: skip
    with _running([*common, "--upstream", vllm_replicas[1].url], leftovers) as first:
        service = tinker.ServiceClient(base_url=first.url)
        path, prompt, scored = _train_and_save(service, tiny_model)  # sampled while live
        before = _greedy(service.create_sampling_client(model_path=path).result(), prompt, scored)
        base = _greedy(
            service.create_sampling_client(base_model=str(tiny_model)).result(), prompt, scored
        )
        service.close("success").result()
    _stopped_cleanly(first)
    assert np.abs(before[2] - base[2]).max() > 1e-3  # the adapter, not the base model, serves
    copies = [
        f
        for d in ("cache", "replica-adapters")
        for f in (tmp_path / "work" / d).rglob("*")
        if f.is_file()
    ]
    assert not copies, f"copies outside the transport outlived the stop: {copies}"
    with _running([*common, "--upstream", vllm_replicas[0].url], leftovers) as second:
        service = tinker.ServiceClient(base_url=second.url)
        after = _greedy(service.create_sampling_client(model_path=path).result(), prompt, scored)
        run_id = path.split("/")[2]
        for unknown in ("tinker://nope/sampler_weights/x", f"tinker://{run_id}/sampler_weights/x"):
            with pytest.raises(
                tinker.NotFoundError, match=re.escape(f"no checkpoint at '{unknown}'")
            ):
                service.create_sampling_client(model_path=unknown).result()
        service.close("success").result()
    _stopped_cleanly(second)
    assert after[0] == before[0], (before[0], after[0])
    assert np.abs(after[1] - before[1]).max() <= 1e-4, (before[1], after[1])
    assert np.abs(after[2] - before[2]).max() <= 1e-4, (before[2], after[2])


def test_replicas_beside_a_proxy_url_is_one_line_and_status_2() -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncgrpo.tinker",
            "--model",
            "m",
            "--replicas",
            "1",
            "--proxy-url",
            "http://127.0.0.1:9",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "python -m asyncgrpo.tinker: error: tinker.proxy_url and tinker.replicas/upstreams both "
        "given: sample through the proxy at --proxy-url, or let the service start its own "
        "(--replicas N, --upstream URL), not both"
    ]
