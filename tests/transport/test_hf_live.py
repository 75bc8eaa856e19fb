"""Live check against a real Hugging Face Storage Bucket through its S3 gateway.

Runs only with credentials: ``ASYNCGRPO_TEST_HF_BUCKET`` (``namespace/bucket`` or
``hf://buckets/namespace/bucket``) and the S3 key pair Hugging Face derives from a write token
(``HF_S3_ACCESS_KEY_ID``, ``HF_S3_SECRET_ACCESS_KEY``); ``HF_TOKEN`` alone is not enough, since
the transport talks to the S3 gateway (see ``asyncgrpo/transport/hf.py`` for why). Everything is written under a fresh
prefix and deleted at the end. This is the only test that shows the gateway honours
``If-None-Match: *`` (create-only writes); the offline suite proves it for S3 via moto.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from asyncgrpo.errors import AlreadyExists, NotFound
from asyncgrpo.store.adapters import AdapterStore
from asyncgrpo.transport import open_transport

_NEEDED = ("ASYNCGRPO_TEST_HF_BUCKET", "HF_S3_ACCESS_KEY_ID", "HF_S3_SECRET_ACCESS_KEY")
_missing = [name for name in _NEEDED if not os.environ.get(name)]

pytestmark = [
    pytest.mark.live,
    pytest.mark.anyio,
    pytest.mark.skipif(
        bool(_missing),
        reason=f"live Hugging Face bucket test needs {', '.join(_missing)} set (not verified live)",
    ),
]


def _bucket_url() -> str:
    spec = os.environ["ASYNCGRPO_TEST_HF_BUCKET"].strip().rstrip("/")
    base = spec if spec.startswith("hf://") else f"hf://buckets/{spec}"
    return f"{base}/asyncgrpo-live-{uuid.uuid4().hex[:8]}"


async def test_live_bucket_roundtrip_and_conditional_create(tmp_path: Path) -> None:
    async with open_transport(_bucket_url()) as t:
        try:
            await t.put("probe/a.txt", b"hello")
            assert await t.get("probe/a.txt") == b"hello"
            assert [i.key async for i in t.list("probe")] == ["probe/a.txt"]
            await t.put("probe/once", b"first", mode="create")
            with pytest.raises(AlreadyExists):
                await t.put("probe/once", b"second", mode="create")
            assert await t.get("probe/once") == b"first"

            src = tmp_path / "adapter"
            src.mkdir()
            (src / "adapter_config.json").write_text('{"r": 1, "lora_alpha": 2}')
            (src / "adapter_model.safetensors").write_bytes(os.urandom(300_000))
            store = AdapterStore(t)
            await store.publish("live", 1, src, step=1)
            assert await store.latest("live") == 1
            path = await store.fetch("live", 1, tmp_path / "cache")
            assert (path / "adapter_model.safetensors").read_bytes() == (
                src / "adapter_model.safetensors"
            ).read_bytes()
            with pytest.raises(NotFound):
                await store.fetch("live", 2, tmp_path / "cache")
        finally:
            async for info in t.list(""):
                await t.delete(info.key)
