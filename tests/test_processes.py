"""Children started through :mod:`asyncgrpo.processes` never outlive the process that started
them: real processes, killed or exiting at the worst moments."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import psutil
import pytest

from asyncgrpo.processes import alive, log_tail, parent_death_argv, start_group, stop_group

#: For a child interpreter that imports this copy of asyncgrpo.
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
#: Prints its pid once it runs, then sleeps.
READY_SLEEP = [
    sys.executable,
    "-c",
    "import os, time; print(os.getpid(), flush=True); time.sleep(60)",
]


def _gone_within(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive([pid]):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_parent_that_exits_right_after_starting_a_child_leaves_nothing_running() -> None:
    """The parent exits while the child is still starting (before the child can set its
    parent-death signal, most runs): the child notices it has a new parent and does not run."""
    parent = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, subprocess, sys\n"
            "from asyncgrpo.processes import parent_death_argv\n"
            f"child = subprocess.Popen(parent_death_argv({SLEEP!r}), start_new_session=True,\n"
            "                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
            "print(child.pid, flush=True)\n"
            "os._exit(0)\n",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env=ENV,
    )
    child = int(parent.stdout)
    try:
        assert _gone_within(child, 5), "the child outlived its parent"
    finally:
        if alive([child]):
            os.kill(child, signal.SIGKILL)


def test_the_signal_comes_when_the_thread_that_started_the_child_ends() -> None:
    """Why children must be started from a thread that lives as long as they should (the event
    loop's): here a worker thread starts one and ends, and the child gets SIGTERM while this
    process lives on."""
    started: list[subprocess.Popen[str]] = []

    def start() -> None:
        proc = subprocess.Popen(parent_death_argv(READY_SLEEP), stdout=subprocess.PIPE, text=True)
        started.append(proc)
        proc.stdout.readline()  # the program runs: the signal is set

    worker = threading.Thread(target=start)
    worker.start()
    worker.join()
    try:
        assert started[0].wait(timeout=10) == -signal.SIGTERM
    finally:
        started[0].kill()


@pytest.mark.anyio
async def test_start_group_starts_children_from_the_event_loops_thread() -> None:
    """The thread whose end would signal the child is the one running the event loop (not a
    worker thread of ``to_thread``, which ends after 10 s idle)."""
    process = await start_group(SLEEP, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        loop_thread = Path(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/children")
        assert str(process.pid) in loop_thread.read_text().split()
        assert os.getpgid(process.pid) == process.pid  # a session, so a group, of its own
    finally:
        await stop_group(process, 5, "the sleeper")
    assert process.returncode == -signal.SIGTERM


#: Its pid, directory, arguments, environment and signal masks, with shell builtins only (a
#: shell waiting for a command has its signals blocked).
SHOW = (
    'echo $$; pwd; echo "$X" "$@"; '
    "while read -r k v; do case $k in SigIgn:|SigBlk:) echo $k $v;; esac; done </proc/$$/status"
)


def test_the_program_runs_as_if_started_directly(tmp_path: Path) -> None:
    """Same pid (the program replaces the shim), arguments, directory, environment, and the
    signals ``subprocess`` gives a program (the interpreter's ignored SIGPIPE is not passed on)."""
    argv = ["sh", "-c", SHOW, "sh", "a", "b c"]
    env = {"PATH": os.environ["PATH"], "X": "x"}
    direct = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True)
    shimmed = subprocess.Popen(
        parent_death_argv(argv, env), cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True
    )
    out, _ = shimmed.communicate(timeout=30)
    assert shimmed.returncode == 0
    pid, *rest = out.splitlines()
    assert int(pid) == shimmed.pid
    assert rest == direct.stdout.splitlines()[1:] and rest[:2] == [str(tmp_path), "x a b c"]


#: Ignores SIGTERM (as vLLM's API server does while its engine starts) and prints its pid.
STUBBORN = [
    sys.executable,
    "-c",
    "import os, signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print(os.getpid(), flush=True)\n"
    "time.sleep(120)\n",
]


def test_a_child_that_ignores_sigterm_is_killed_a_grace_after_its_parent_dies() -> None:
    """The parent is SIGKILLed and cannot escalate: the keeper does, ``grace_s`` after the
    child's SIGTERM (without it the child would run on for its full two minutes)."""
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            "from asyncgrpo.processes import parent_death_argv\n"
            f"subprocess.Popen(parent_death_argv({STUBBORN!r}, grace_s=1.0), start_new_session=True)\n"
            "time.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        time.sleep(0.3)  # the child's handler is set
        parent.kill()
        parent.wait(timeout=10)
        assert alive([child]), "the child must survive its SIGTERM: it ignores it"
        assert _gone_within(child, 10), "the child outlived its parent"
    finally:
        if alive([child]):
            os.kill(child, signal.SIGKILL)


@pytest.mark.anyio
async def test_the_watchdog_is_out_of_the_groups_way_and_ends_with_the_program() -> None:
    """The watchdog is the program's child in a group of its own: the group's SIGTERM stops the
    program alone, the program's status is its own, and the watchdog is gone with it."""
    process = await start_group(SLEEP, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not (watchdogs := psutil.Process(process.pid).children()):
        assert time.monotonic() < deadline, "no watchdog"
        await anyio.sleep(0.05)
    (watchdog,) = watchdogs
    assert watchdog.name() == "asyncgrpo-watch"
    assert os.getpgid(watchdog.pid) == watchdog.pid != process.pid
    assert os.getsid(watchdog.pid) == process.pid
    await stop_group(process, 5, "the sleeper")
    assert process.returncode == -signal.SIGTERM
    assert _gone_within(watchdog.pid, 5)


def test_the_program_is_looked_up_on_the_childs_path_and_a_missing_one_is_refused(
    tmp_path: Path,
) -> None:
    (tmp_path / "asyncgrpo-test-hello").write_text("#!/bin/sh\necho hello\n")
    (tmp_path / "asyncgrpo-test-hello").chmod(0o755)
    env = {"PATH": str(tmp_path)}
    out = subprocess.run(
        parent_death_argv(["asyncgrpo-test-hello"], env), env=env, capture_output=True
    )
    assert out.stdout == b"hello\n"
    with pytest.raises(FileNotFoundError, match="asyncgrpo-test-hello"):
        parent_death_argv(["asyncgrpo-test-hello"])  # not on this process's PATH


def test_a_program_that_ends_before_its_watchdog_starts_does_not_keep_it_waiting() -> None:
    """The watchdog is scheduled late (a loaded host): the program, ``true``, has already ended.
    The watchdog must see that and exit, not take the reaper for the program: it would wait on
    the parent holding the program's stderr (``capture_output`` hangs), then SIGKILL the
    reaper's process group (pid 1's, in a container)."""
    import asyncgrpo.parent_death

    late_watchdog = (
        "import importlib.util, sys, time\n"
        f"spec = importlib.util.spec_from_file_location('pd', {asyncgrpo.parent_death.__file__!r})\n"
        "pd = importlib.util.module_from_spec(spec); spec.loader.exec_module(pd)\n"
        "watch = pd._watch\n"
        "pd._watch = lambda *args: (time.sleep(1.0), watch(*args))\n"
        "pd.main([sys.argv[1], '30', '/bin/true', 'true'])\n"
    )
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", late_watchdog, str(os.getpid())], capture_output=True, timeout=20
    )
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - started < 10, "the watchdog outlived the program"


def test_elsewhere_than_linux_the_command_is_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    assert parent_death_argv(["true", "x"]) == ["true", "x"]


def test_log_tail_is_the_last_lines_and_empty_for_a_log_that_never_came(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_text("one\ntwo\nthree\n")
    assert log_tail(log, 2) == "two\nthree"
    assert log_tail(tmp_path / "missing.log", 2) == ""


def test_free_ports_lie_below_the_ephemeral_range_bindable_and_never_twice() -> None:
    """A port from the ephemeral range could be handed to another socket (an outgoing
    connection, vLLM's own) before the child binds it: the chaos run's proxy once failed so."""
    import socket

    from asyncgrpo.processes import RAY_WORKER_PORTS, _ephemeral_low, free_port

    ports = [free_port() for _ in range(40)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < _ephemeral_low() for p in ports), ports
    # `ray start --port` refuses one in its workers' range (the Ray target's cluster once did)
    assert not [p for p in ports if p in RAY_WORKER_PORTS], ports
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # still free for the child
