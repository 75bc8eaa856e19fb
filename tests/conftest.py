"""Shared fixtures: a tiny local model, a LoRA adapter for it, and real vLLM replicas.

The two replicas start once per test session (start-up is the expensive part on CPU) and are
shared by every test that asks for ``vllm_replicas``: such tests must not kill them, must unload
what they load, and should use unique adapter names. Tests that kill a replica start their own
with :func:`asyncgrpo.testing.tiny_serve_config` + :func:`asyncgrpo.serve.launch_replicas`.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncgrpo.serve import Replica, launch_replicas
from asyncgrpo.serve.replicas import JOURNAL_ENV
from asyncgrpo.testing import tiny_serve_config

#: ``import trl`` sets ``VLLM_LOGGING_LEVEL=ERROR`` in this process's environment, and test
#: modules that import trl are imported at collection, so every vLLM replica started afterwards
#: would log errors only (tests read its INFO lines). Restore the variable once collection ends.
_VLLM_LOGGING_LEVEL = os.environ.get("VLLM_LOGGING_LEVEL")

#: The tests' replicas run their model in the engine core's process (no worker process): each
#: starts 8-13 s sooner and, given one OpenMP thread per bound core
#: (``ServeConfig.env``), generates no slower (docs/testing.md, "Cheaper starts"). Tests about
#: a replica's processes remove it; ``VLLM_ENABLE_V1_MULTIPROCESSING=1 make test`` runs every
#: replica as vLLM starts it by default.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def pytest_collection_finish(session: pytest.Session) -> None:
    if _VLLM_LOGGING_LEVEL is None:
        os.environ.pop("VLLM_LOGGING_LEVEL", None)
    else:
        os.environ["VLLM_LOGGING_LEVEL"] = _VLLM_LOGGING_LEVEL


#: The transport tests (tests/transport/conftest.py installs the Azure emulator for them).
_TRANSPORT_TESTS = Path(__file__).resolve().parent / "transport"
_emulator_install: threading.Thread | None = None


def _install_emulators_early(config: pytest.Config) -> None:
    """On a fresh checkout, install Azurite (npm, 30-40 s, mostly waiting on the registry) in
    the background from the start of a session whose paths hold the transport tests: it
    overlaps collection (a minute on a fresh clone) and the other tests, where the ``azurite``
    fixture's own install held a pytest-xdist worker idle (pytest-xdist hands out the largest
    modules first, the transport conformance suite among them). The fixture waits on the same
    file lock, and installs again, saying why, if this failed. Nothing to do once installed."""
    global _emulator_install
    if not _TRANSPORT_TESTS.is_dir():  # a copy of this file elsewhere (test_suite_rules.py)
        return
    here = config.invocation_params.dir
    paths = [Path(here, arg.split("::")[0]).resolve() for arg in config.args]
    if not any(
        _TRANSPORT_TESTS.is_relative_to(p) or p.is_relative_to(_TRANSPORT_TESTS) for p in paths
    ):
        return
    from asyncgrpo.testing.emulators import azurite_binary

    def install() -> None:
        with contextlib.suppress(Exception):  # no npm, or npm failed: the fixture reports it
            azurite_binary()

    _emulator_install = threading.Thread(target=install, name="azurite-install", daemon=True)
    _emulator_install.start()


class ReplicaStarts:
    """Every vLLM replica the session starts, in its own process or a subprocess's, read from
    the replica journal (``launch_replicas`` appends to the file :data:`JOURNAL_ENV` names)
    after each test phase, so that each start is put down to the test (and phase: a fixture's
    start is a ``setup`` one) during which it happened. Under pytest-xdist each worker keeps a
    journal of its own and hands what it read to the controller, which reports them together."""

    def __init__(self, path: Path | None) -> None:
        self.journals = [str(path)] if path else []
        self.path = path
        self.offset = 0
        self.spawned: dict[str, tuple[str, str]] = {}  # "journal:pid" -> (test id, phase)
        self.healthy_s: dict[str, float] = {}

    def read(self, nodeid: str, phase: str) -> int:
        """Read the journal's new lines; the number of replicas spawned since the last read."""
        if self.path is None:
            return 0
        try:
            with self.path.open() as journal:
                journal.seek(self.offset)
                lines = journal.readlines()
        except FileNotFoundError:
            return 0
        spawned = 0
        for line in lines:
            if not line.endswith("\n"):  # still being written: read it next time
                break
            self.offset += len(line.encode())
            entry = json.loads(line)
            pid = f"{self.path}:{entry['pid']}"
            if entry["event"] == "spawn":
                self.spawned[pid] = (_without_group(nodeid), phase)
                spawned += 1
            elif entry["event"] == "healthy":
                self.healthy_s[pid] = entry["seconds"]
        return spawned

    def export(self) -> dict:
        return {"journals": self.journals, "spawned": self.spawned, "healthy_s": self.healthy_s}

    def merge(self, exported: dict) -> None:
        self.journals += exported["journals"]
        self.spawned.update({k: tuple(v) for k, v in exported["spawned"].items()})
        self.healthy_s.update(exported["healthy_s"])

    def report(self) -> list[str]:
        by_module: Counter[str] = Counter()
        in_setup: Counter[str] = Counter()
        by_test: Counter[str] = Counter()
        for nodeid, phase in self.spawned.values():
            module = nodeid.split("::")[0]
            by_module[module] += 1
            if phase == "setup":
                in_setup[module] += 1
            else:
                by_test[nodeid] += 1
        total_s = sum(self.healthy_s.values())
        lines = [
            f"vLLM replica starts: {len(self.spawned)} ({total_s:.0f} s from spawn to "
            f"healthy, summed; journal {', '.join(self.journals) or 'none'})"
        ]
        for module, count in sorted(by_module.items(), key=lambda kv: (-kv[1], kv[0])):
            fixtures = f", {in_setup[module]} by fixtures" if in_setup[module] else ""
            lines.append(f"  {count:3d}  {module}{fixtures}")
        for nodeid, count in sorted(by_test.items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"         {count:3d}  {nodeid}")
        return lines


def _without_group(nodeid: str) -> str:
    """A test's id without the ``@group`` pytest-xdist's loadgroup appends to it."""
    return nodeid.rpartition("@")[0] if nodeid.rfind("@") > nodeid.rfind("]") else nodeid


_starts: ReplicaStarts | None = None


def _xdist_controller(config: pytest.Config) -> bool:
    return config.pluginmanager.hasplugin("dsession")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Journal every replica start of the session (the subprocesses' too: they inherit it)."""
    global _starts
    if not hasattr(session.config, "workerinput"):  # not a pytest-xdist worker
        _install_emulators_early(session.config)
    if _xdist_controller(session.config):  # the workers journal; they report at their end
        _starts = ReplicaStarts(None)
        return
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is None or os.environ.get(JOURNAL_ENV):
        return
    path = factory.getbasetemp() / "replica-starts.jsonl"
    os.environ[JOURNAL_ENV] = str(path)
    _starts = ReplicaStarts(path)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The shared pair's users get the ``vllm`` mark, which ``make test``'s two sessions select
    on (``-m 'not vllm'``, then ``-m vllm``, each on pytest-xdist workers). Under ``--dist
    loadgroup`` the pair's users are one group, run on one worker in the order collected: one
    shared pair of replicas for them all. Every other module is a group of its own, a vLLM
    module's replicas starting and serving beside the pair's users on the other worker: one
    worker is a queue of short tests on an idle pair, the other of replica starts and process
    runs, and together they keep both cores busy (docs/testing.md, "Two sessions")."""
    for item in items:  # the shared pair's users are vLLM tests too (``-m vllm`` selects them)
        if "vllm_replicas" in item.fixturenames and not item.get_closest_marker("vllm"):
            item.add_marker(pytest.mark.vllm)
    if not getattr(config.option, "loadgroup", False):  # set by pytest-xdist, in workers too
        return
    groups: dict[pytest.Item, str] = {}
    for item in items:
        module = item.nodeid.split("::")[0].removeprefix("tests/").removesuffix(".py")
        groups[item] = "vllm-pair" if "vllm_replicas" in item.fixturenames else module
        item.add_marker(pytest.mark.xdist_group(groups[item]))
    items[:] = scheduling_order(items, groups)


#: Groups handed out before all others, whatever their size (pytest-xdist hands out the groups
#: with the most tests first): the tool-calling model's build, one test's setup (50-80 s on a
#: fresh clone; the vLLM session needs the model). Handed out among the one-test groups at the
#: end, it kept one worker busy while the other had nothing left to run.
FIRST_GROUPS = ("test_tool_model",)


def scheduling_order(items: list[pytest.Item], groups: dict[pytest.Item, str]) -> list[pytest.Item]:
    """``items`` in the order pytest-xdist should hand out their groups: ``FIRST_GROUPS``, then
    the groups with the most tests, each group's tests as collected. (``pytest_configure``
    turns pytest-xdist's own reordering, by size alone, off.)"""
    size = Counter(groups.values())
    first_seen = {group: i for i, group in reversed(list(enumerate(groups.values())))}

    def key(group: str) -> tuple[int, int, int]:
        rank = FIRST_GROUPS.index(group) if group in FIRST_GROUPS else len(FIRST_GROUPS)
        return rank, -size[group], first_seen[group]

    return sorted(items, key=lambda item: key(groups[item]))


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("dist", None) == "loadgroup":  # the order is scheduling_order's
        config.option.loadscopereorder = False
    if workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
        # Each worker's torch takes its share of the cores, not all of them: two workers'
        # OpenMP threads on each core wait on each other (docs/testing.md, "Two sessions").
        import torch

        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(workers)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: object, ids: list[str]) -> None:
    """pytest-xdist's controller: stop before any test runs if the worker's tests came without
    their groups, which would split the shared pair's users across workers, each starting a
    pair of its own, and a module's tests, each building its module's fixtures."""
    config = getattr(node, "config", None)
    if config is None or config.getoption("dist", None) != "loadgroup":
        return
    if ids and not all("@" in nodeid for nodeid in ids):
        pytest.exit(
            "pytest-xdist did not group the tests (--dist loadgroup): this pytest is too new "
            "for it (pytest-xdist#1386); install the versions pyproject.toml's dev extra names",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """pytest-xdist's controller: a worker ended; add the replica starts it read."""
    exported = getattr(node, "workeroutput", {}).get("replica_starts")
    if _starts is not None and exported:
        _starts.merge(exported)


def _unmarked(item: pytest.Item, started: int) -> None:
    """Fail a test that started replicas without the ``vllm`` mark: ``make test`` runs the
    tests without it on several workers at once, where its replicas would start beside others'
    work (and ``-m "not vllm"`` promises a run without vLLM)."""
    if started and not item.get_closest_marker("vllm"):
        pytest.fail(
            f"{_without_group(item.nodeid)} started {started} vLLM replica(s) without the vllm "
            "mark: add @pytest.mark.vllm",
            pytrace=False,
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    try:
        return (yield)
    finally:
        if _starts is not None:
            _unmarked(item, _starts.read(item.nodeid, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    try:
        return (yield)
    finally:
        if _starts is not None:
            _unmarked(item, _starts.read(item.nodeid, "call"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    try:
        return (yield)
    finally:
        if _starts is not None:
            _unmarked(item, _starts.read(item.nodeid, "teardown"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _starts is not None:
        terminalreporter.section("vLLM replica starts")
        for line in _starts.report():
            terminalreporter.write_line(line)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from asyncgrpo.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def tool_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model fine-tuned to call the calculator's add tool (its own weights: the
    shared replicas cannot serve it). Built once into the user's cache of test models
    (``~/.cache/asyncgrpo/test-models``, or ``$ASYNCGRPO_TEST_CACHE``: ``make test``,
    ``make test-vf4`` and every checkout share it), and copied under the session's temporary
    directory: the replica serving it names the session there, so the orphan check at the
    session's end still finds it."""
    import shutil

    from asyncgrpo.testing.model_cache import DONE, default_cache_root
    from asyncgrpo.testing.tool_model import cached_tool_model

    out = tmp_path_factory.mktemp("tool") / "model"
    built = cached_tool_model(tiny_model, default_cache_root(), seed=0)
    return Path(shutil.copytree(built, out, ignore=shutil.ignore_patterns(DONE)))


@pytest.fixture(scope="session")
def lora_adapter(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from asyncgrpo.testing import make_lora_adapter

    return make_lora_adapter(tiny_model, tmp_path_factory.mktemp("lora") / "adapter", seed=1)


@pytest.fixture(scope="session")
def vllm_replicas(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Replica]]:
    """Two real vLLM replicas for the whole session, run on a background event loop.

    They may fetch adapters from any transport under the session's temporary directory (each
    test's run keeps its store under its own ``tmp_path``), into caches of their own.
    """
    from anyio.from_thread import start_blocking_portal

    log_dir = os.environ.get("ASYNCGRPO_TEST_LOG_DIR") or str(tmp_path_factory.mktemp("vllm-logs"))
    config = tiny_serve_config(
        tiny_model,
        replicas=2,
        log_dir=log_dir,
        transports=(str(tmp_path_factory.getbasetemp()),),
        adapter_cache_dir=str(tmp_path_factory.mktemp("replica-adapters")),
    )
    with (
        start_blocking_portal() as portal,
        portal.wrap_async_context_manager(launch_replicas(config)) as replicas,
    ):
        yield replicas


@pytest.fixture
def leftovers() -> Iterator[list]:
    """Processes (``psutil.Process``) a test starts: any still running at its end is killed with
    its descendants, so a failing test leaves nothing behind."""
    import contextlib

    import psutil

    procs: list[psutil.Process] = []
    yield procs
    for proc in list(procs):
        with contextlib.suppress(psutil.NoSuchProcess):
            procs += proc.children(recursive=True)
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()


def _vllm_processes_under(root: str) -> list[int]:
    import psutil

    # this process and those that started it (``flock /tmp/...vllm.lock pytest --basetemp``)
    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if proc.info["pid"] not in mine and "vllm" in cmdline and root in cmdline:
            found.append(proc.info["pid"])
    return found


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if any vLLM process serving a test model outlived the session."""
    import time

    if _emulator_install is not None:  # npm must not outlive the session (its own timeout)
        _emulator_install.join()

    if _starts is not None and hasattr(session.config, "workeroutput"):
        session.config.workeroutput["replica_starts"] = _starts.export()

    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is None:
        return
    root = str(factory.getbasetemp())
    deadline = time.monotonic() + 10
    while (orphans := _vllm_processes_under(root)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if orphans:
        import psutil

        def described(pid: int) -> str:
            with contextlib.suppress(psutil.Error):
                return f"{pid} ({' '.join(psutil.Process(pid).cmdline())[:300]})"
            return f"{pid} (gone)"

        print(
            "\nERROR: vLLM processes outlived the test session: "
            + "; ".join(map(described, orphans))
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
