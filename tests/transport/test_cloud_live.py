"""Live checks against a real Google Cloud Storage bucket and a real Azure Blob container.

Each runs only when its URL variable is set, with credentials the usual way for its cloud:

* ``ASYNCGRPO_TEST_GCS_URL=gs://bucket[/prefix]``; ``GOOGLE_APPLICATION_CREDENTIALS``,
  ``gcloud auth application-default login`` or the metadata server on Google Cloud.
* ``ASYNCGRPO_TEST_AZURE_URL=az://container[/prefix]`` (or the ``https://<account>.blob...``
  form, SAS query allowed); ``AZURE_STORAGE_CONNECTION_STRING``, or
  ``AZURE_STORAGE_ACCOUNT_NAME`` with ``AZURE_STORAGE_ACCOUNT_KEY`` / ``AZURE_STORAGE_SAS_TOKEN``.

Everything is written under a fresh prefix and deleted at the end. For GCS this is the only
test of the write path, including the ``x-goog-if-generation-match: 0`` create-only write (the
offline emulator cannot take XML writes); for Azure, Azurite covers the same paths offline.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import anyio
import pytest

from asyncgrpo.errors import AlreadyExists
from asyncgrpo.store.adapters import AdapterStore
from asyncgrpo.transport import open_transport

CLOUDS = {
    "gcs": ("ASYNCGRPO_TEST_GCS_URL", "Google credentials (GOOGLE_APPLICATION_CREDENTIALS or ADC)"),
    "azure": (
        "ASYNCGRPO_TEST_AZURE_URL",
        "Azure credentials (AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME with "
        "a key or SAS token)",
    ),
}

pytestmark = [pytest.mark.live, pytest.mark.anyio]


def _live_url(cloud: str) -> str:
    variable, credentials = CLOUDS[cloud]
    if not os.environ.get(variable):
        pytest.skip(f"live {cloud} test needs {variable} and {credentials}; not verified live")
    base, _, query = os.environ[variable].partition("?")
    fresh = f"{base.rstrip('/')}/asyncgrpo-live-{uuid.uuid4().hex[:8]}"
    return fresh + (f"?{query}" if query else "")


@pytest.mark.parametrize("cloud", sorted(CLOUDS))
async def test_live_roundtrip_racing_creates_and_adapter(cloud: str, tmp_path: Path) -> None:
    async with open_transport(_live_url(cloud)) as t:
        try:
            await t.put("probe/a.txt", b"hello")
            assert await t.get("probe/a.txt") == b"hello"
            assert [i.key async for i in t.list("probe")] == ["probe/a.txt"]
            wins: list[int] = []

            async def create(i: int) -> None:
                try:
                    await t.put("probe/once", str(i).encode(), mode="create")
                    wins.append(i)
                except AlreadyExists:
                    pass

            async with anyio.create_task_group() as tg:
                for i in range(6):
                    tg.start_soon(create, i)
            assert len(wins) == 1 and await t.get("probe/once") == str(wins[0]).encode()

            src = tmp_path / "adapter"
            src.mkdir()
            (src / "adapter_config.json").write_text('{"r": 1, "lora_alpha": 2}')
            (src / "adapter_model.safetensors").write_bytes(os.urandom(12_000_000))  # multipart
            store = AdapterStore(t)
            await store.publish("live", 1, src, step=1)
            path = await store.fetch("live", 1, tmp_path / "cache")
            assert (path / "adapter_model.safetensors").read_bytes() == (
                src / "adapter_model.safetensors"
            ).read_bytes()
        finally:
            async for info in t.list(""):
                await t.delete(info.key)
