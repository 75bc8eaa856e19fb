"""The stores written once against Transport, run over S3 (moto), the HF gateway path and Azure
Blob (Azurite)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from asyncgrpo.sample import Sample
from asyncgrpo.store.adapters import AdapterStore
from asyncgrpo.store.channel import RolloutChannel
from asyncgrpo.store.checkpoints import CheckpointStore

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("kind", ["s3", "hf", "azure"])
async def test_adapter_and_checkpoint_roundtrip(kind: str, transport_factory, tmp_path: Path):
    t = transport_factory(kind)
    src = tmp_path / "src"
    src.mkdir()
    (src / "adapter_config.json").write_text('{"r": 1, "lora_alpha": 2}')
    (src / "adapter_model.safetensors").write_bytes(b"\x01" * 9000)
    adapters = AdapterStore(t, keep_last=2)
    for v in (1, 2, 3):
        await adapters.publish("run", v, src, step=v * 4)
    assert await adapters.versions("run") == [2, 3]
    path = await adapters.fetch("run", 3, tmp_path / "cache")
    assert (path / "adapter_model.safetensors").read_bytes() == b"\x01" * 9000

    ckpt = CheckpointStore(t)
    await ckpt.save(12, src, {"adapter_version": 3})
    loaded, meta = await ckpt.load("latest", tmp_path / "restore")
    assert meta == {"adapter_version": 3, "step": 12}
    assert (loaded / "adapter_config.json").read_text() == '{"r": 1, "lora_alpha": 2}'


@pytest.mark.parametrize("kind", ["s3", "hf", "azure"])
async def test_channel_two_producers(kind: str, transport_factory) -> None:
    t = transport_factory(kind)

    def sample(tag: str) -> Sample:
        return Sample(
            prompt_ids=[1, 2],
            completion_ids=[3],
            logprobs=[-0.5],
            reward=1.0,
            advantage=0.5,
            version=1,
            group_id=tag,
        )

    async def produce(p: int) -> None:
        ch = RolloutChannel(t)
        for i in range(6):
            await ch.append([sample(f"p{p}-{i}")])

    async with anyio.create_task_group() as tg:
        for p in range(2):
            tg.start_soon(produce, p)
    consumer = RolloutChannel(t, poll_interval_s=0.02)
    got = [await consumer.receive(timeout_s=5) for _ in range(12)]
    assert [b.seq for b in got] == list(range(12))
    assert len({b.samples[0].group_id for b in got}) == 12
    await consumer.commit()
    resumed = RolloutChannel(t, poll_interval_s=0.02)
    with pytest.raises(TimeoutError):
        await resumed.receive(timeout_s=0.3)  # everything was committed: nothing redelivered
