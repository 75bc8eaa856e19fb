"""Every subcommand's ``--help`` says what it does and shows examples, and every example runs as
typed; the README's commands run as typed after the line that says how the commands are found.

The examples run in a scratch directory holding a copy of the checkout's ``examples/``, the
tiny model at ``runs/tiny-model`` (as the README builds it) and a published run at
``runs/tiny-cpu`` (for ``export`` and ``plot``). An example that would start vLLM replicas runs
with ``--dry-run`` appended: the same command, through every check it makes before its first
replica; the ones that start nothing (``--dry-run`` already, ``export``, ``plot``) run whole.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

ROOT = Path(__file__).resolve().parent.parent
#: How an example line starts in a help text (``asyncgrpo.cli.help.EXAMPLE``).
EXAMPLE = "  $ "
#: Subcommands with examples (``tinker`` has its own parser: ``python -m asyncgrpo.tinker``).
COMMANDS = ("demo", "train", "rollout", "launch", "eval", "export", "plot", "check-serving")
#: Subcommands whose examples start replicas unless told --dry-run.
STARTS_REPLICAS = {"demo", "train", "rollout", "launch", "eval", "check-serving"}


def _help(*command: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "asyncgrpo", *command, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, lora_adapter: Path) -> Path:
    """A directory as a newcomer's checkout looks after ``make demo`` and one short run."""
    from asyncgrpo.run.metrics import MetricsWriter
    from asyncgrpo.store.adapters import AdapterStore
    from asyncgrpo.store.run_documents import RunStore
    from asyncgrpo.transport import open_transport

    root = tmp_path_factory.mktemp("checkout")
    shutil.copytree(ROOT / "examples", root / "examples")
    (root / "runs").mkdir()
    (root / "runs" / "tiny-model").symlink_to(tiny_model)
    (root / ".venv").symlink_to(Path(sys.prefix))
    run_dir = root / "runs" / "tiny-cpu"

    async def publish() -> None:
        async with open_transport(str(run_dir / "store")) as transport:
            run_id = await RunStore(transport).run_id("tiny-cpu")
            for v in (0, 1):
                await AdapterStore(transport).publish(f"tiny-cpu-{run_id}", v, lora_adapter, step=v)
            await RunStore(transport).write_policy(f"tiny-cpu-{run_id}-v1", 1)

    anyio.run(publish)
    with MetricsWriter(run_dir) as writer:
        for step in (1, 2):
            writer.log({"reward": step / 4, "ratio": 1.0, "perf/step_s": 0.5}, step=step)
    return root


Ran = dict[str, tuple[str, list[tuple[list[str], subprocess.CompletedProcess]]]]


@pytest.fixture(scope="module")
def ran(scratch: Path) -> Ran:
    """Every subcommand's help text, and each of its examples run in ``scratch`` (four at a
    time: each is a Python start and its imports)."""
    from concurrent.futures import ThreadPoolExecutor

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}

    def run(words: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(
            words, cwd=scratch, env=env, capture_output=True, text=True, timeout=300
        )

    with ThreadPoolExecutor(max_workers=4) as pool:
        texts = dict(zip(COMMANDS, pool.map(lambda c: _help(c), COMMANDS), strict=True))
        planned: list[tuple[str, list[str]]] = []
        for command, text in texts.items():
            for example in (
                ln[len(EXAMPLE) :] for ln in text.splitlines() if ln.startswith(EXAMPLE)
            ):
                words = shlex.split(example)
                if command in STARTS_REPLICAS and "--dry-run" not in words:
                    words.append("--dry-run")
                planned.append((command, words))
        done = list(pool.map(lambda plan: run(plan[1]), planned))
    out: Ran = {command: (text, []) for command, text in texts.items()}
    for (command, words), proc in zip(planned, done, strict=True):
        out[command][1].append((words, proc))
    return out


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_says_what_it_does_and_its_examples_run_as_typed(
    command: str, ran: Ran
) -> None:
    text, examples = ran[command]
    description = text.split("\n\n", 1)[1].split("\npositional arguments:")[0]
    assert len(description.split()) >= 12, f"asyncgrpo {command} --help has no description"
    assert examples, f"asyncgrpo {command} --help shows no example"
    for words, done in examples:
        assert words[:2] == ["asyncgrpo", command], words
        assert done.returncode == 0, f"`{' '.join(words)}`: {done.stderr[-2000:]}"
        assert "Traceback" not in done.stderr


def test_the_option_help_of_check_serving_says_what_output_dir_holds() -> None:
    text = _help("check-serving")
    assert re.search(r"--output-dir OUTPUT_DIR\s+where the model, the adapter", text), text


def test_the_top_level_help_names_every_backend_of_launch() -> None:
    text = _help()
    for line in (
        text[text.index("- asyncgrpo launch ") :].split("\n- asyncgrpo eval")[0],
        text[text.index("    launch ") :].split("\n    eval")[0],
    ):
        assert all(name in line for name in ("Hugging Face Jobs", "Ray", "SkyPilot", "local")), line


def test_the_readme_lists_every_command_and_every_docs_page() -> None:
    readme = (ROOT / "README.md").read_text()
    listed = readme[readme.index("`asyncgrpo --help` lists the commands") :].split(")")[0]
    for command in (*COMMANDS, "tinker"):
        assert f"`{command}`" in listed, command
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"](docs/{page.name})" in readme, f"the README's docs table lacks {page.name}"


def _readme_block(readme: str, after: str) -> list[str]:
    """The first ``bash`` block after the text ``after``: its commands, comments dropped."""
    block = readme[readme.index(after) :].split("```bash\n", 1)[1].split("\n```", 1)[0]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def test_the_readme_commands_run_as_typed_after_the_line_that_says_how_they_are_found(
    tmp_path: Path,
) -> None:
    """A fresh shell after ``make demo``: nothing on PATH but the system's. The README's
    shell block for training runs as typed (the real ``train`` with ``--dry-run`` appended: it
    starts replicas)."""
    readme = (ROOT / "README.md").read_text()
    assert "`make demo` installs the commands into `.venv`: activate it first" in readme
    commands = _readme_block(readme, "`make demo` installs the commands into `.venv`")
    assert commands[0] == ". .venv/bin/activate", commands
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    script = "\n".join(
        [
            "set -e",
            *(
                f"{c} --dry-run" if c.startswith("asyncgrpo train") and "--dry-run" not in c else c
                for c in commands
            ),
        ]
    )
    bare = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    bare["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    done = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=bare, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.count("recipe OK") == 2
    assert (tmp_path / "runs" / "tiny-model" / "config.json").is_file()
    # without the line, as the newcomer typed them: neither is found
    unfound = subprocess.run(
        ["bash", "-c", "asyncgrpo --help"], cwd=tmp_path, env=bare, capture_output=True, text=True
    )
    assert unfound.returncode == 127
