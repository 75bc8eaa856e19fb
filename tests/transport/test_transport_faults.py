"""Faults: transient and permanent errors, a publisher SIGKILLed mid-upload, racing
publishers, tampered files. Everything runs against the real local store, a real S3 protocol
server (moto) and a real Azure Blob emulator (Azurite), through a fault-injecting proxy where
errors are needed. GCS's share (reads only, see conftest.GCS_WRITES_SKIP) is in test_gcs.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from asyncgrpo.errors import AlreadyExists, IntegrityError, NotFound, TransportError
from asyncgrpo.store.adapters import AdapterStore

pytestmark = pytest.mark.anyio


def make_adapter(path: Path, *, seed: int = 0, n_files: int = 1, size: int = 4096) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(
        json.dumps(
            {
                "r": 1,
                "lora_alpha": 2,
                "target_modules": ["q_proj", "v_proj"],
                "base_model_name_or_path": "tiny/base",
                "peft_type": "LORA",
            }
        )
    )
    rnd = __import__("random").Random(seed)
    for i in range(n_files):
        name = "adapter_model.safetensors" if i == 0 else f"extra-{i:03d}.bin"
        (path / name).write_bytes(rnd.randbytes(size))
    return path


# ---- transient / permanent errors -------------------------------------------------------------
PROXIED = ["s3-proxy", "azure-proxy"]


@pytest.mark.parametrize("kind", PROXIED)
async def test_transient_503s_are_retried(kind: str, transport_factory, proxy_of) -> None:
    t = transport_factory(kind)
    fault_proxy = proxy_of(kind)
    fault_proxy.fail_next(3, 503)
    await t.put("retry/a", b"payload")
    assert fault_proxy.failed == 3 and fault_proxy.requests == 4
    fault_proxy.fail_next(2, 503)
    assert await t.get("retry/a") == b"payload"
    assert fault_proxy.failed == 5


@pytest.mark.parametrize("kind", PROXIED)
async def test_permanent_error_surfaces_without_retry(
    kind: str, transport_factory, proxy_of
) -> None:
    t = transport_factory(kind)
    fault_proxy = proxy_of(kind)
    fault_proxy.fail_next(100, 403)
    started = time.perf_counter()
    with pytest.raises(TransportError) as info:
        await t.put("perm/a", b"x")
    assert not isinstance(info.value, NotFound)
    assert fault_proxy.requests == 1, "a 403 must not be retried"
    assert time.perf_counter() - started < 5


@pytest.mark.parametrize("kind", PROXIED)
async def test_persistent_503_gives_up_after_max_retries(
    kind: str, transport_factory, proxy_of
) -> None:
    t = transport_factory(kind, max_retries=2)
    fault_proxy = proxy_of(kind)
    fault_proxy.fail_next(100, 503)
    with pytest.raises(TransportError):
        await t.get("whatever")
    assert fault_proxy.requests == 3  # first try + 2 retries


@pytest.mark.parametrize("kind", ["hf", "azure-proxy"])
async def test_adapter_publish_survives_transient_errors(
    kind: str, transport_factory, proxy_of, tmp_path: Path
) -> None:
    store = AdapterStore(transport_factory(kind))
    fault_proxy = proxy_of(kind)
    src = make_adapter(tmp_path / "a", n_files=3)
    fault_proxy.fail_next(4, 503)
    await store.publish("run", 1, src, step=4)
    assert fault_proxy.failed == 4
    path = await store.fetch("run", 1, tmp_path / "cache")
    assert (path / "adapter_model.safetensors").read_bytes() == (
        src / "adapter_model.safetensors"
    ).read_bytes()


# ---- publisher killed mid-upload ------------------------------------------------------------
PUBLISHER = r"""
import asyncio, json, sys
import anyio
from asyncgrpo.store.adapters import AdapterStore
from asyncgrpo.transport.azure import AzureBlobTransport
from asyncgrpo.transport.local import LocalTransport
from asyncgrpo.transport.s3 import S3Transport

spec = json.loads(sys.argv[1])
if spec["kind"] == "local":
    transport = LocalTransport(spec["root"])
elif spec["kind"] == "azure":  # credentials from AZURE_STORAGE_CONNECTION_STRING, not argv
    transport = AzureBlobTransport(spec["bucket"], spec["prefix"])
else:
    transport = S3Transport(spec["bucket"], spec["prefix"], **spec["options"])

slow_put_file = transport.put_file
async def put_file(key, path, **kw):   # a slow link: gives the test time to kill us mid-upload
    await slow_put_file(key, path, **kw)
    print("uploaded", key, flush=True)
    await anyio.sleep(0.2)
transport.put_file = put_file

asyncio.run(AdapterStore(transport, concurrency=1).publish("run", 1, spec["src"], step=1))
print("PUBLISHED", flush=True)
"""


@pytest.mark.parametrize("kind", ["local", "s3", "azure"])
async def test_publisher_sigkilled_mid_upload_leaves_no_version(
    kind: str, transport_factory, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    transport = transport_factory(kind)
    src = make_adapter(tmp_path / "src", n_files=10, size=64 * 1024)
    env = dict(os.environ)
    if kind == "local":
        spec = {"kind": "local", "root": str(transport.root)}
    elif kind == "azure":
        spec = {"kind": "azure", "bucket": transport.container, "prefix": transport.prefix}
        env["AZURE_STORAGE_CONNECTION_STRING"] = request.getfixturevalue("azurite")
    else:
        moto_endpoint = request.getfixturevalue("moto_endpoint")
        credentials = {"access_key_id": "testing", "secret_access_key": "testing"}
        spec = {
            "kind": "s3",
            "bucket": transport.bucket,
            "prefix": transport.prefix,
            "options": {"endpoint": moto_endpoint, "region": "us-east-1", **credentials},
        }
    spec["src"] = str(src)
    from anyio.streams.buffered import BufferedByteReceiveStream

    async with await anyio.open_process(
        [sys.executable, "-c", PUBLISHER, json.dumps(spec)], stderr=subprocess.STDOUT, env=env
    ) as proc:
        assert proc.stdout is not None
        out = BufferedByteReceiveStream(proc.stdout)
        uploaded = 0
        with anyio.fail_after(60):
            while uploaded < 3:  # three of eleven files are in the store
                line = await out.receive_until(b"\n", 1 << 16)
                assert b"PUBLISHED" not in line
                uploaded += line.startswith(b"uploaded")
        proc.send_signal(signal.SIGKILL)
        assert await proc.wait() == -signal.SIGKILL
    leftovers = [i.key async for i in transport.list("adapters/run/v1")]
    assert 3 <= len(leftovers) < 11, leftovers  # really killed mid-upload
    store = AdapterStore(transport)
    assert await store.versions("run") == []
    assert await store.latest("run") is None
    with pytest.raises(NotFound, match="not published"):
        await store.fetch("run", 1, tmp_path / "cache")
    assert not (tmp_path / "cache" / "run-v1").exists()
    # The version number is still free; the winner also sweeps the dead attempt's files.
    await store.publish("run", 1, src, step=1)
    files = [i.key async for i in transport.list("adapters/run/v1")]
    assert len(files) == 12  # 11 files + manifest, leftovers gone
    path = await store.fetch("run", 1, tmp_path / "cache")
    assert len(list(path.iterdir())) == 12  # 11 files + local manifest copy


# ---- racing publishers -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["local", "s3", "hf", "azure"])
async def test_two_publishers_same_version_exactly_one_wins(
    kind: str, transport_factory, tmp_path: Path
) -> None:
    transport = transport_factory(kind)
    srcs = [make_adapter(tmp_path / f"src{i}", seed=i, n_files=4) for i in range(2)]
    results: dict[int, object] = {}

    async def publisher(i: int) -> None:
        store = AdapterStore(transport, concurrency=2)
        try:
            results[i] = await store.publish("run", 7, srcs[i], step=i)
        except AlreadyExists as exc:
            results[i] = exc

    async with anyio.create_task_group() as tg:
        for i in range(2):
            tg.start_soon(publisher, i)
    winners = [i for i, r in results.items() if not isinstance(r, AlreadyExists)]
    assert len(winners) == 1, results
    store = AdapterStore(transport)
    path = await store.fetch("run", 7, tmp_path / "cache")
    w = srcs[winners[0]]
    for f in w.iterdir():
        assert (path / f.name).read_bytes() == f.read_bytes()
    assert (await store.info("run", 7)).step == winners[0]
    # the loser cleaned up: only the winner's 5 files and the manifest remain
    left = [i.key async for i in transport.list("adapters/run/v7")]
    assert len(left) == 6, (left, winners, {k: str(v)[:300] for k, v in results.items()})


# ---- tampering ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["local", "s3", "azure"])
async def test_tampered_file_raises_and_is_not_used(
    kind: str, transport_factory, tmp_path: Path
) -> None:
    transport = transport_factory(kind)
    store = AdapterStore(transport)
    src = make_adapter(tmp_path / "src", n_files=2)
    await store.publish("run", 3, src)
    listed = [i.key async for i in transport.list("adapters/run/v3")]
    victim = next(k for k in listed if k.endswith(".safetensors"))
    good = await transport.get(victim)
    await transport.put(victim, bytes([good[0] ^ 0xFF]) + good[1:])  # same size, other bytes
    cache = tmp_path / "cache"
    with pytest.raises(IntegrityError, match="sha256"):
        await store.fetch("run", 3, cache)
    assert not (cache / "run-v3").exists()
    assert [p.name for p in cache.iterdir()] == []  # no half-verified temp dir either
    await transport.put(victim, good)  # repaired: now it fetches
    path = await store.fetch("run", 3, cache)
    assert (path / "adapter_model.safetensors").read_bytes() == good


# ---- a publish that fails half-way must not break its version for good -------------------------
async def test_a_create_that_landed_but_answered_already_exists_keeps_its_files(
    transport_factory, proxy_of, tmp_path: Path
) -> None:
    """The manifest's create reaches S3, its answer is lost (503), the retry is told 412: the
    version is ours, so publish must succeed, not delete the files its manifest lists."""
    transport = transport_factory("s3-proxy")
    fault_proxy = proxy_of("s3-proxy")
    store = AdapterStore(transport)
    src = make_adapter(tmp_path / "src", n_files=2)
    fault_proxy.lose_answer_to("PUT", "/adapters/run/v1/manifest.json")
    published = await store.publish("run", 1, src, step=3)
    manifest_puts = [m for m, p, _ in fault_proxy.seen if m == "PUT" and "manifest" in p]
    assert fault_proxy.failed == 1 and len(manifest_puts) == 2  # landed, lost, retried: 412
    assert published.step == 3 and await store.versions("run") == [1]
    path = await store.fetch("run", 1, tmp_path / "cache")
    for f in src.iterdir():
        assert (path / f.name).read_bytes() == f.read_bytes()


async def test_a_full_disk_without_hard_links_leaves_no_truncated_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a filesystem without hard links the manifest's create is written in place; ENOSPC
    half-way must remove it, or the truncated manifest lists as a published version."""
    import errno
    import shutil

    from asyncgrpo.transport.local import LocalTransport

    def no_link(src: str, dst: str, **kw: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")  # what such a filesystem answers

    real_copy = shutil.copyfileobj

    def disk_full(src, dst, length: int = 0) -> None:
        if not isinstance(dst.name, int):  # only the in-place create writes to a bare fd
            return real_copy(src, dst)
        dst.write(src.read(40))
        dst.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    transport = LocalTransport(tmp_path / "store")
    store = AdapterStore(transport)
    src = make_adapter(tmp_path / "src")
    monkeypatch.setattr(os, "link", no_link)
    monkeypatch.setattr(shutil, "copyfileobj", disk_full)
    with pytest.raises(OSError, match="No space left"):
        await store.publish("run", 1, src)
    monkeypatch.undo()
    assert await store.versions("run") == []
    assert not (tmp_path / "store" / "adapters" / "run" / "v1" / "manifest.json").exists()
    # the disk has room again: the same version publishes and fetches
    await store.publish("run", 1, src)
    path = await store.fetch("run", 1, tmp_path / "cache")
    assert (path / "adapter_model.safetensors").read_bytes() == (
        src / "adapter_model.safetensors"
    ).read_bytes()


# ---- the rollout channel exactly once across lost answers ----------------
def _batch_sample(tag: str):
    from asyncgrpo.sample import Sample

    return Sample(
        prompt_ids=[1, 2],
        completion_ids=[3],
        logprobs=[-0.5],
        reward=1.0,
        advantage=0.5,
        version=1,
        group_id=tag,
    )


async def test_a_batch_whose_create_answer_was_lost_is_delivered_once(
    transport_factory, proxy_of
) -> None:
    """The create lands on moto, its answer is lost (503), the retry is told 412: the batch is
    ours. Before, append wrote it again as batch 1 and the trainer trained on it twice."""
    from asyncgrpo.store.channel import RolloutChannel

    transport = transport_factory("s3-proxy")
    fault_proxy = proxy_of("s3-proxy")
    producer = RolloutChannel(transport)
    fault_proxy.lose_answer_to("PUT", "/rollouts/batches/000000000000.agrb")
    assert await producer.append([_batch_sample("once")]) == 0
    batch_puts = [p for m, p, _ in fault_proxy.seen if m == "PUT" and p.endswith("0.agrb")]
    assert fault_proxy.failed == 1 and len(batch_puts) == 2  # landed, lost, retried: 412
    assert await producer.append([_batch_sample("next")]) == 1
    consumer = RolloutChannel(transport, poll_interval_s=0.02)
    got = [await consumer.receive(timeout_s=5) for _ in range(2)]
    assert [(b.seq, b.samples[0].group_id) for b in got] == [(0, "once"), (1, "next")]
    with pytest.raises(TimeoutError):
        await consumer.receive(timeout_s=0.3)  # no second copy


async def test_a_conflict_that_wrote_nothing_leaves_no_gap(transport_factory, proxy_of) -> None:
    """A create answered 412 that wrote nothing: append writes the same number again. Before,
    it moved on to the next number, and the consumer waited at the empty one forever."""
    from asyncgrpo.store.channel import RolloutChannel

    transport = transport_factory("s3-proxy")
    fault_proxy = proxy_of("s3-proxy")
    producer = RolloutChannel(transport)
    assert await producer.append([_batch_sample("a")]) == 0
    fault_proxy.fail_next(1, status=412)  # the next request: batch 1's create, not forwarded
    assert await producer.append([_batch_sample("b")]) == 1
    assert fault_proxy.failed == 1
    consumer = RolloutChannel(transport, poll_interval_s=0.02)
    got = [await consumer.receive(timeout_s=5) for _ in range(2)]
    assert [b.samples[0].group_id for b in got] == ["a", "b"]


# ---- the fault proxy's windows, as the fault bench drives them ----------------------------------
async def test_error_hang_and_down_windows_are_ridden_out_by_retries(moto_endpoint: str) -> None:
    """``python -m asyncgrpo.testing.fault_proxy``'s modes, driven through its control port: a
    share of 500/503 answers, requests that hang past the client's time-out and a closed port
    each cost retries, and a transport tuned in its URL rides each window out."""
    import json
    import urllib.request

    from asyncgrpo.processes import free_port
    from asyncgrpo.testing.fault_proxy import serve_fault_proxy
    from asyncgrpo.transport import open_transport

    port, control = free_port(), free_port()

    def set_mode(mode: str, share: float = 0.0) -> dict:
        body = json.dumps({"mode": mode, "share": share}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{control}/fault", data=body, method="POST")
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())

    # obstore's jittered backoff may wait as little as its initial 0.05 s between tries (20
    # tries took 2.3 s once): 200 tries cannot end inside the 2.5 s window; retry_timeout_s bounds
    url = (
        f"s3://asyncgrpo-test/fp-{os.getpid()}?endpoint=http://127.0.0.1:{port}"
        "&timeout_s=1&connect_timeout_s=1&max_retries=200&backoff_max_s=0.5&retry_timeout_s=30"
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(serve_fault_proxy, moto_endpoint, port, control)
        await anyio.sleep(0.5)
        t = open_transport(
            url,
            access_key_id="testing",
            secret_access_key="testing",
            region="us-east-1",
            backoff_initial_s=0.05,
        )
        try:
            await t.put("a", b"1")
            for mode, share in (("errors", 1.0), ("hang", 0.0), ("down", 0.0)):
                await anyio.to_thread.run_sync(set_mode, mode, share)
                async with anyio.create_task_group() as window:
                    window.start_soon(t.put, f"during-{mode}", mode.encode())
                    await anyio.sleep(2.5)  # longer than the client's 1 s time-out
                    stats = await anyio.to_thread.run_sync(set_mode, "pass")
                assert await t.get(f"during-{mode}") == mode.encode()
                seen = {"errors": "failed", "hang": "hung", "down": "dropped"}[mode]
                assert stats["mode"] == mode and (stats[seen] > 0 or mode == "down"), stats
        finally:
            await t.aclose()
            tg.cancel_scope.cancel()


# ---- a rollout process through a storage outage ----------------------------------------------
async def test_a_rollout_process_rides_out_a_storage_outage(transport_factory, proxy_of) -> None:
    """Storage failing for a while (every request 503, the transport's retries spent) costs a
    rollout process a pause, not its life: its policy poll polls on and switches to the version
    written after the outage, and a batch whose append failed is shipped once, afterwards.
    (Before, the first failed poll or append ended the process, and every rollout in flight.)"""
    from types import SimpleNamespace

    from asyncgrpo.run import rollouts
    from asyncgrpo.store.channel import RolloutChannel
    from asyncgrpo.store.run_documents import RunStore
    from asyncgrpo.testing.samples import sample

    t = transport_factory("s3-proxy", max_retries=1)
    store, faults = RunStore(t), proxy_of("s3-proxy")
    await store.write_policy("run-v0", 0)
    switched: list[int] = []
    moved = anyio.Event()
    client = SimpleNamespace(policy=("run-v0", 0))
    client.set_policy = lambda name, version: (
        moved.set(),
        switched.append(version),
        setattr(client, "policy", (name, version)),
    )
    progress = SimpleNamespace(phase=lambda text: None)
    channel = RolloutChannel(t)
    async with anyio.create_task_group() as tg:
        tg.start_soon(rollouts._follow_policy, store, client, 0.05, tg.cancel_scope, progress)
        faults.fail_next(40, 503)  # a few seconds of every request failing
        seq = await rollouts._append(channel, [sample("g", sample_id="x-0-0")])
        assert faults.failed == 40
        await store.write_policy("run-v1", 1)
        with anyio.fail_after(10):
            await moved.wait()
        await t.put("done.json", b'{"step": 1, "version": 1}')
    assert switched == [1] and seq == 0
    batch = await RolloutChannel(t).receive(timeout_s=5)
    assert [s.sample_id for s in batch.samples] == ["x-0-0"]
    assert not await t.exists("rollouts/batches/000000000001.agrb")  # shipped once
