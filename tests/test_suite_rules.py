"""The suite's own rules, as ``tests/conftest.py`` enforces them: a test that starts a vLLM replica
carries the ``vllm`` mark (``make test`` runs the unmarked tests on several workers at once, and
``-m "not vllm"`` promises no replica), and the shared pair's users are marked for it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from asyncgrpo.serve.replicas import JOURNAL_ENV

CONFTEST = Path(__file__).resolve().parent / "conftest.py"

# Each test appends to the replica journal what launch_replicas appends when it spawns one.
TESTS = textwrap.dedent(f"""
    import json, os
    import pytest

    def spawn(pid):
        with open(os.environ["{JOURNAL_ENV}"], "a") as journal:
            journal.write(json.dumps({{"event": "spawn", "pid": pid}}) + "\\n")

    def test_unmarked_start():
        spawn(101)

    @pytest.mark.vllm
    def test_marked_start():
        spawn(102)

    def test_no_start():
        pass

    def test_pair_user(vllm_replicas):
        pass
""")


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    vllm: starts vLLM\n")
    (tmp_path / "test_starts.py").write_text(TESTS)
    env = {k: v for k, v in os.environ.items() if k != JOURNAL_ENV}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # where the Azure emulator would go
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rf", *args]
    return subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )


def test_a_test_that_starts_a_replica_without_the_mark_fails_naming_it(tmp_path: Path) -> None:
    out = _pytest(tmp_path, "-m", "not vllm")
    assert "1 failed, 1 passed, 2 deselected" in out.stdout, out.stdout[-3000:]
    assert (
        "test_starts.py::test_unmarked_start started 1 vLLM replica(s) without the vllm mark"
        in out.stdout
    ), out.stdout[-3000:]
    # a copy of the conftest beside no transport tests installs no Azure emulator (npm, 30 s)
    assert not (tmp_path / "cache" / "asyncgrpo" / "emulators").exists()


def test_the_shared_pairs_users_are_vllm_tests(tmp_path: Path) -> None:
    out = _pytest(tmp_path, "--collect-only", "-m", "vllm")
    assert "2/4 tests collected (2 deselected)" in out.stdout, out.stdout[-3000:]
    assert "test_pair_user" in out.stdout and "test_marked_start" in out.stdout


def test_the_tool_model_build_is_handed_out_first_then_the_largest_groups(tmp_path: Path) -> None:
    """pytest-xdist alone hands out the groups with the most tests first, so the one-test group
    that builds the tool-calling model (a minute on a fresh clone) would come last; with one
    worker the order it runs the tests in is the order the groups are handed out."""
    record = tmp_path / "order.txt"
    modules = {"test_small.py": 1, "test_tool_model.py": 1, "test_mid.py": 2, "test_big.py": 3}
    for name, count in modules.items():
        tag = name.removeprefix("test_").removesuffix(".py")
        body = "".join(
            f"def test_{i}():\n    open({str(record)!r}, 'a').write({tag!r} + '\\n')\n\n"
            for i in range(count)
        )
        (tmp_path / name).write_text(body)
    out = _pytest(tmp_path, "-n", "1", "--dist", "loadgroup", *modules)
    assert "7 passed" in out.stdout, out.stdout[-3000:]
    order = record.read_text().split()
    assert order == ["tool_model", "big", "big", "big", "mid", "mid", "small"], order
