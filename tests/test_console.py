"""How a command turns an error into lines and an exit status (pure parts; the commands
themselves are run in tests/test_exit_paths.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncgrpo.console import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, error_lines, exit_status
from asyncgrpo.errors import ConfigError, LaunchError, ReplicaStartError, SyncError, leaves

ROOT = Path(__file__).resolve().parents[1]


def test_leaves_flattens_nested_groups_in_order() -> None:
    a, b, c = ValueError("a"), KeyError("b"), OSError("c")
    group = BaseExceptionGroup("outer", [ExceptionGroup("inner", [a, b]), c])
    assert leaves(group) == [a, b, c]
    assert leaves(a) == [a]


def test_one_leaf_is_its_message_and_several_are_each_a_line() -> None:
    one = ExceptionGroup("task group", [ExceptionGroup("nested", [SyncError("not loaded")])])
    assert error_lines("asyncgrpo", one) == ["asyncgrpo: error: not loaded"]
    assert exit_status(one) == EXIT_FAILED
    several = ExceptionGroup("g", [ReplicaStartError("replica 0 died"), SyncError("no sync")])
    assert error_lines("p", several) == ["p: error: replica 0 died", "p: error: no sync"]


def test_cancellations_that_follow_an_error_are_left_out() -> None:
    group = BaseExceptionGroup("g", [asyncio.CancelledError(), ConfigError("model=x: no such")])
    assert error_lines("p", group) == ["p: error: model=x: no such"]
    assert exit_status(group) == EXIT_USAGE


def test_statuses() -> None:
    assert exit_status(ConfigError("bad")) == EXIT_USAGE
    assert exit_status(ExceptionGroup("g", [ConfigError("a"), LaunchError("b")])) == EXIT_FAILED
    assert exit_status(BaseExceptionGroup("g", [KeyboardInterrupt()])) == EXIT_INTERRUPTED
    assert error_lines("p", KeyboardInterrupt()) == []
    assert exit_status(BaseExceptionGroup("g", [SystemExit("MISMATCH")])) == EXIT_FAILED
    assert error_lines("p", SystemExit("MISMATCH")) == ["p: error: MISMATCH"]
    assert exit_status(SystemExit(3)) == 3


def test_a_setting_is_one_line_and_an_unexpected_error_names_its_type() -> None:
    assert error_lines("p", ConfigError("a\n  b")) == ["p: error: a b"]
    (line,) = error_lines("p", PermissionError(13, "Permission denied"))
    assert line.startswith("p: error: PermissionError: [Errno 13] Permission denied")
    assert "--debug" in line


def test_help_text_shows_what_a_user_types_not_rest_markup(capsys: pytest.CaptureFixture) -> None:
    from asyncgrpo.cli.main import main
    from asyncgrpo.console import plain_help

    assert plain_help(
        "``asyncgrpo plot RUN_DIR``: see :mod:`asyncgrpo.run.progress`, "
        ":func:`~asyncgrpo.run.training.run_training`"
    ) == ("asyncgrpo plot RUN_DIR: see asyncgrpo.run.progress, asyncgrpo.run.training.run_training")
    for argv in (["--help"], ["launch", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        out = capsys.readouterr().out
        assert "asyncgrpo" in out and "``" not in out and ":mod:" not in out


def test_a_second_sigterm_during_the_shutdown_does_not_cut_it_short(tmp_path: Path) -> None:
    """The shutdown (stopping a server's children) runs to its end through another SIGTERM:
    with the signal's default action back in place, the second one would kill the process
    mid-shutdown and leave its children running."""
    done = tmp_path / "shutdown-done"
    script = f"""
import os, signal, anyio
from asyncgrpo.console import run_async

async def serve():
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        await anyio.sleep_forever()
    finally:
        with anyio.CancelScope(shield=True):
            os.kill(os.getpid(), signal.SIGTERM)  # again, while stopping
            await anyio.sleep(0.5)
            open({str(done)!r}, "w").close()

try:
    run_async(serve)
except KeyboardInterrupt:
    print("interrupted")
"""
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "interrupted" and done.exists()
