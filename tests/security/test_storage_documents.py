"""JSON documents read from storage (``policy.json``, ``run.json``, manifests, cursors) are read
bounded and depth-guarded: a malformed one is one ``IntegrityError`` naming it, never a
``KeyError``, ``RecursionError`` or ``MemoryError``; a rollout process waits past it."""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import pytest

from asyncgrpo.cli.export import export
from asyncgrpo.console import error_lines
from asyncgrpo.errors import IntegrityError
from asyncgrpo.store.run_documents import POLICY_KEY, RUN_KEY, RunStore
from asyncgrpo.transport.local import LocalTransport

pytestmark = pytest.mark.anyio

#: What a storage writer can leave as ``policy.json``, and what reading it raised before.
BAD_POLICIES = {
    "an empty object (KeyError)": b"{}",
    "nested 100,000 deep (RecursionError)": b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "a version of 1e400 (OverflowError)": b'{"adapter": "r-v1", "version": 1e400}',
    "a version as text": b'{"adapter": "r-v1", "version": "1"}',
    "a version of true": b'{"adapter": "r-v1", "version": true}',
    "a negative version": b'{"adapter": "r-v1", "version": -1}',
    "a list": b'[{"adapter": "r-v1", "version": 1}]',
    "not UTF-8 (UnicodeDecodeError)": b'{"adapter": "\xff", "version": 1}',
    "over the size bound (read whole before)": b'{"adapter": "r-v1", "version": 1, "pad": "'
    + b"x" * 64 * 1024  # the bound: MAX_DOCUMENT_BYTES
    + b'"}',
}


@pytest.mark.parametrize("what", list(BAD_POLICIES))
async def test_a_malformed_policy_is_one_integrity_error_naming_it(
    tmp_path: Path, what: str
) -> None:
    transport = LocalTransport(tmp_path)
    await transport.put(POLICY_KEY, BAD_POLICIES[what])
    with pytest.raises(IntegrityError, match=r"policy\.json") as info:
        await RunStore(transport).read_policy()
    assert len(str(info.value).splitlines()) == 1 and len(str(info.value)) < 500


async def test_export_of_a_run_with_a_malformed_policy_says_so_in_one_line(
    tmp_path: Path,
) -> None:
    """``asyncgrpo export RUN DIR`` read the adapter name from ``policy.json``: an empty one
    was a ``KeyError`` (an "unexpected" error)."""
    store = tmp_path / "run" / "store"
    store.mkdir(parents=True)
    (store / RUN_KEY).write_text('{"run_name": "r", "run_id": "ab"}')
    (store / POLICY_KEY).write_text("{}")
    with pytest.raises(IntegrityError) as info:
        await export(str(tmp_path / "run"), str(tmp_path / "out"), version=None, name=None)
    (line,) = error_lines("asyncgrpo", info.value)
    assert "policy.json" in line and "unexpected" not in line


@pytest.mark.parametrize(
    "raw", [b"{}", b'{"run_name": "r", "run_id": 7}', b"[" * 100_000, b'{"run_name": ["r"]}']
)
async def test_a_malformed_run_json_is_an_integrity_error(tmp_path: Path, raw: bytes) -> None:
    transport = LocalTransport(tmp_path)
    await transport.put(RUN_KEY, raw)
    with pytest.raises(IntegrityError, match=r"run\.json"):
        await RunStore(transport).run_id("r")


async def test_a_rollout_process_waits_past_a_malformed_policy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The trainer rewrites ``policy.json`` at every sync: a rollout process logs the fault
    once and takes the next valid one, instead of stopping."""
    transport = LocalTransport(tmp_path)
    await transport.put(POLICY_KEY, b"[" * 100_000)
    store = RunStore(transport)
    caplog.set_level(logging.WARNING, "asyncgrpo.store.run_documents")
    async with anyio.create_task_group() as tg:

        async def trainer_writes_later() -> None:
            await anyio.sleep(0.1)
            await store.write_policy("r-ab-v3", 3)

        tg.start_soon(trainer_writes_later)
        with anyio.fail_after(10):
            assert await store.wait_for_policy(0.01) == ("r-ab-v3", 3)
    warnings = [r for r in caplog.records if "policy.json" in r.getMessage()]
    assert len(warnings) == 1
