"""Real vLLM replicas on CPU: exact LoRA logprobs, clear failures, no orphan processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import anyio
import psutil
import pytest

from asyncgrpo.errors import ConfigError, ReplicaHTTPError
from asyncgrpo.processes import WATCHDOG
from asyncgrpo.run.preflight import check_lora_capacity
from asyncgrpo.serve import Replica, ServeConfig, round_lora_rank
from asyncgrpo.testing import reference_logprobs
from asyncgrpo.vllm.client import VLLMClient

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


def _prompt_ids(model: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def test_flags() -> None:
    assert [round_lora_rank(r) for r in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]
    with pytest.raises(ConfigError):
        round_lora_rank(513)
    cfg = ServeConfig(model="m", lora_rank=3, max_staleness=4)
    argv = cfg.command(8000)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--max-lora-rank") + 1] == "8"
    assert argv[argv.index("--max-loras") + 1] == "6"
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"
    env = cfg.env()
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == env["VLLM_SERVER_DEV_MODE"] == "1"
    with pytest.raises(ConfigError, match="max_loras"):
        ServeConfig(model="m", max_staleness=4, max_loras=5)
    with pytest.raises(ConfigError, match="api_key"):
        ServeConfig(model="m", host="0.0.0.0")


def test_nice_is_0_to_19() -> None:
    with pytest.raises(ConfigError, match=r"serve\.nice=-1"):
        ServeConfig(model="m", nice=-1)


@pytest.mark.parametrize(
    ("environment", "threads"),
    [
        ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "1"}, "1"),
        ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "0-3,6"}, "5"),
        ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "auto"}, None),
        ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "3-1"}, None),
        ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}, None),
        (
            {
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_CPU_OMP_THREADS_BIND": "0",
                "OMP_NUM_THREADS": "2",
            },
            "2",
        ),
        ({"VLLM_CPU_OMP_THREADS_BIND": "1"}, None),
    ],
)
def test_an_engine_running_its_model_gets_the_threads_of_its_bound_cores(
    monkeypatch: pytest.MonkeyPatch, environment: dict[str, str], threads: str | None
) -> None:
    """vLLM binds OpenMP threads only in the worker process; with the engine core running the
    model, the replica's environment carries the thread count that binding would have set."""
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert ServeConfig(model="m").env().get("OMP_NUM_THREADS") == threads


def test_each_in_process_replica_gets_one_thread_on_its_own_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for name in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    cores = sorted(os.sched_getaffinity(0))
    envs = [ServeConfig(model="m").env(i) for i in range(2)]
    assert [e["VLLM_CPU_OMP_THREADS_BIND"] for e in envs] == [
        str(cores[i % len(cores)]) for i in range(2)
    ]
    assert [e["OMP_NUM_THREADS"] for e in envs] == ["1", "1"]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_lora_logprobs_equal_transformers_peft(
    vllm_replicas: list[Replica], tiny_model: Path, lora_adapter: Path, temperature: float
) -> None:
    name = f"lp-{uuid.uuid4().hex[:8]}"
    prompt = _prompt_ids(tiny_model, "what is two plus three?")
    for replica in vllm_replicas:
        async with VLLMClient(replica.url) as client:
            info = await client.server_info()
            assert check_lora_capacity(info, lora_rank=8, max_staleness=2) == 128  # CPU blocks
            await client.load_lora_adapter(name, str(lora_adapter))
            try:
                assert name in await client.models()
                body = await client.completions(
                    {
                        "model": name,
                        "prompt": prompt,
                        "max_tokens": 24,
                        "temperature": temperature,
                        "logprobs": 0,
                        "return_token_ids": True,
                    }
                )
            finally:
                await client.unload_lora_adapter(name)
        choice = body["choices"][0]
        tokens, served = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        assert len(tokens) == len(served) > 0
        trainer_side = await anyio.to_thread.run_sync(
            lambda t=tokens: reference_logprobs(
                tiny_model, lora_adapter, prompt, t, temperature=temperature
            )
        )
        diffs = [abs(a - b) for a, b in zip(trainer_side, served, strict=True)]
        assert max(diffs) < 1e-4, f"replica {replica.index}: max |diff| {max(diffs):.2e}"
        # The adapter matters: the base model's logprobs differ, so this check can fail.
        base = await anyio.to_thread.run_sync(
            lambda t=tokens: reference_logprobs(
                tiny_model, None, prompt, t, temperature=temperature
            )
        )
        assert max(abs(a - b) for a, b in zip(base, served, strict=True)) > 1e-2


async def test_missing_adapter_path_is_a_clear_error_and_replica_keeps_serving(
    vllm_replicas: list[Replica], tmp_path: Path
) -> None:
    replica = vllm_replicas[0]
    async with VLLMClient(replica.url) as client:
        with pytest.raises(ReplicaHTTPError) as info:
            await client.load_lora_adapter("ghost", str(tmp_path / "does-not-exist"))
        assert info.value.status == 404
        assert "No adapter found" in info.value.body
        assert "ghost" not in await client.models()
        base_model = (await client.models())[0]
        body = await client.completions({"model": base_model, "prompt": [5, 6], "max_tokens": 2})
        assert body["usage"]["completion_tokens"] == 2
        assert await client.health()


def test_cli_starts_two_replicas_without_memory_flags_and_sigint_stops_every_process(
    tiny_model: Path, tmp_path: Path
) -> None:
    """docs/serving.md's command as typed: no KV size, so it is chosen from the memory available
    (vLLM's own default, 92 % of the NUMA node per replica, cannot start two)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING")
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asyncgrpo.serve",
            "--model",
            str(tiny_model),
            "--replicas",
            "2",
            "--log-dir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        # Blocks until both replicas are healthy (or the CLI dies).
        lines = [proc.stdout.readline(), proc.stdout.readline()]
        assert all("ready: http://127.0.0.1:" in line for line in lines), lines
        import urllib.request

        for line in lines:
            url = line.split("ready: ")[1].split()[0]
            assert urllib.request.urlopen(f"{url}/health", timeout=10).status == 200
        tree = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
        assert len(tree) >= 5  # CLI, and per replica an API server and an engine core
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert "giving each of 2 replica(s)" in proc.stderr.read()
        time.sleep(1)
        assert _alive(tree) == []
    finally:
        if proc.poll() is None:  # the test failed midway: take the whole tree down
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()


def test_cli_killed_outright_leaves_no_vllm_process(
    tiny_model: Path, tmp_path: Path, leftovers: list[psutil.Process]
) -> None:
    """SIGKILL (the OOM killer, ``kill -9``, a CI runner cancelling) gives the CLI no chance to
    stop its replicas, which run in sessions of their own: each replica's API server gets
    SIGTERM as the CLI dies, and stops its engine core and worker. Before that: ``--nice 10``
    reaches every process of the replica, and its scheduler autogroup where the kernel has
    them (else CPU is shared per session whatever the nice)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING")
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asyncgrpo.serve",
            "--model",
            str(tiny_model),
            "--log-dir",
            str(tmp_path),
            "--nice",
            "10",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    leftovers.append(psutil.Process(proc.pid))
    line = proc.stdout.readline()  # once the replica is healthy (or the CLI died)
    assert "ready: http://127.0.0.1:" in line, line
    tree = psutil.Process(proc.pid).children(recursive=True)
    leftovers += tree
    api_server = int(line.split("(pid ")[1].split(",")[0])
    root = psutil.Process(api_server)
    replica = [root, *(p for p in root.children(recursive=True) if p.name() != WATCHDOG)]
    assert len(replica) >= 3  # API server, engine core, worker (the idle watchdog is not niced)
    assert {p.nice() for p in replica} == {10}
    autogroup = Path(f"/proc/{root.pid}/autogroup")
    if autogroup.exists():
        assert autogroup.read_text().split()[-1] == "10"
    proc.kill()
    proc.wait()
    start = time.monotonic()
    _, alive = psutil.wait_procs(tree, timeout=30)
    assert alive == [], f"outlived the CLI: {alive}"
    print(f"the replica's processes exited {time.monotonic() - start:.1f} s after SIGKILL")


async def test_serve_register_adds_each_replica_caught_up_and_removes_it_on_stop(
    vllm_replicas: list[Replica],
    tiny_model: Path,
    lora_adapter: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``python -m asyncgrpo.serve --register PROXY`` (its coroutine, on one of the session's
    replicas instead of a new one): once healthy the replica is added to the running proxy,
    which loads the adapter its fleet serves onto it before admitting it; when the command
    stops, the replica leaves the proxy. (A replacement the launcher starts joins the same way:
    tests/launch/test_local.py's end-to-end run.)"""
    import contextlib

    import aiohttp

    from asyncgrpo.proxy import ProxyConfig, serve_proxy
    from asyncgrpo.serve import __main__ as serve_cli

    fleet, joiner = vllm_replicas
    key = "register-admin-key-0123456789"
    name = f"reg-{uuid.uuid4().hex[:8]}"

    @contextlib.asynccontextmanager
    async def the_joiner(config: ServeConfig):  # what launch_replicas would have started
        yield [joiner]

    monkeypatch.setattr(serve_cli, "launch_replicas", the_joiner)
    cfg = ProxyConfig(upstreams=(fleet.url,), port=0, admin_api_key=key)
    async with serve_proxy(cfg) as proxy, aiohttp.ClientSession() as http:

        async def upstreams() -> list[str]:
            async with http.get(proxy + "/proxy/upstreams") as r:
                return [u["url"] for u in (await r.json())["upstreams"]]

        body = {"lora_name": name, "lora_path": str(lora_adapter)}
        async with http.post(proxy + "/v1/load_lora_adapter", json=body) as r:
            assert r.status == 200, await r.text()
        try:
            async with anyio.create_task_group() as tg:
                registration = serve_cli.Registration(proxy, key)
                tg.start_soon(serve_cli._serve, ServeConfig(model=str(tiny_model)), registration)
                with anyio.fail_after(120):
                    while joiner.url not in await upstreams():  # noqa: ASYNC110 (the proxy's state)
                        await anyio.sleep(0.1)
                # admitted only once caught up: it serves the fleet's adapter already
                async with VLLMClient(joiner.url) as client:
                    assert name in await client.models()
                tg.cancel_scope.cancel()
            assert await upstreams() == [fleet.url]  # it left as the command stopped
            out = capsys.readouterr().out
            assert f"replica 1 ready: {joiner.url}" in out and f"joined the proxy at {proxy}" in out
        finally:
            for replica in vllm_replicas:  # the session's replicas: leave them as found
                async with VLLMClient(replica.url) as client:
                    if name in await client.models():
                        await client.unload_lora_adapter(name)
