"""One owner per run directory (:mod:`asyncgrpo.run.lock`): the second is refused, naming the
first; the lock goes with its process however it ends; a directory that cannot be made is one
line naming the setting."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncgrpo.errors import ConfigError
from asyncgrpo.run.lock import LOCK_FILE, run_dir_lock

HOLD = """
import sys, time
from pathlib import Path
from asyncgrpo.run.lock import run_dir_lock
with run_dir_lock(Path(sys.argv[1]), "asyncgrpo train"):
    print("held", flush=True)
    time.sleep(600)
"""


def test_the_second_owner_is_refused_naming_the_first_until_it_is_killed(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "r"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(ConfigError) as refused, run_dir_lock(run_dir, "asyncgrpo train"):
            pass
        assert (
            f"run directory {run_dir} is in use by asyncgrpo train (PID {holder.pid} on host "
            f"{socket.gethostname()}, since "
        ) in str(refused.value)
        holder.send_signal(signal.SIGKILL)  # however it ends, its lock goes with it
        holder.wait()
    finally:
        holder.kill()
        holder.wait()
    with run_dir_lock(run_dir, "asyncgrpo train") as path:
        assert f'"pid": {os.getpid()}' in path.read_text()
    assert not (run_dir / LOCK_FILE).exists()


def test_one_process_cannot_own_a_directory_twice(tmp_path: Path) -> None:
    with run_dir_lock(tmp_path, "asyncgrpo train"):
        started = time.monotonic()
        with pytest.raises(ConfigError, match="is in use by asyncgrpo train"):
            with run_dir_lock(tmp_path, "asyncgrpo launch"):
                pass
        assert time.monotonic() - started < 1  # refused, not waited for


def test_a_directory_that_cannot_be_made_names_the_setting(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    for path in (Path("/proc/runs/r"), tmp_path / "file" / "r"):
        with pytest.raises(ConfigError, match=r"output_dir=X: cannot create or write"):
            with run_dir_lock(path, "asyncgrpo train", setting="output_dir=X"):
                pass
