"""Every command the README and docs/ show runs as typed: its entry point, subcommand and flags
exist, and the files it names (examples, benchmarks, make targets) are there.

The docs are where a newcomer copies commands from; a flag renamed in code but not in a page
fails here instead of in their terminal. Commands are read from ``bash`` blocks (every line),
from other fenced blocks (lines starting ``$ ``) and from inline code spans that start like a
command (``asyncgrpo ...``, ``python -m ...``, ``make ...``).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: How an inline code span starts when it is a command to type.
COMMAND_STARTS = ("asyncgrpo ", "python -m ", "python bench/", "make ", "torchrun ", "OUT=")
SHELL_FENCES = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^```(\S*)\s*$")
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def _join_continued(lines: list[str]) -> list[str]:
    """Lines ending in a backslash joined to the next, as the shell reads them."""
    joined: list[str] = []
    pending = ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    if pending:
        joined.append(pending)
    return joined


def _normalised(command: str) -> str | None:
    """One command as its words joined by single spaces, its comment dropped; None if empty
    or not shell words (an output line)."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return None
    return " ".join(words) or None


def page_commands(text: str) -> list[str]:
    """The commands a markdown page shows, normalised (see the module docstring)."""
    commands: list[str] = []
    fence: str | None = None
    block: list[str] = []
    prose: list[str] = []
    for line in text.splitlines():
        opened = FENCE.match(line)
        if opened and fence is None:
            fence, block = opened.group(1), []
            continue
        if line.startswith("```") and fence is not None:
            if fence in SHELL_FENCES:
                commands += [c for c in map(_normalised, _join_continued(block)) if c]
            else:
                dollar = [ln[2:] for ln in block if ln.startswith("$ ")]
                commands += [c for c in map(_normalised, dollar) if c]
            fence = None
            continue
        (block if fence is not None else prose).append(line)
    for span in INLINE.findall("\n".join(prose)):
        if span.startswith(COMMAND_STARTS) and (command := _normalised(span)):
            commands.append(command)
    return commands


def entry_point(words: list[str]) -> tuple[list[str], list[str]] | None:
    """(the argv that asks the command's ``--help``, its arguments) for an asyncgrpo or bench
    command, or None for any other program (pip, hf, export, kill, ...)."""
    while words and ENV_ASSIGNMENT.match(words[0]):
        words = words[1:]
    if words[:1] == ["torchrun"] and "-m" in words:
        words = ["python", *words[words.index("-m") :]]
    if words[:1] == ["asyncgrpo"]:
        words = ["python", "-m", "asyncgrpo", *words[1:]]
    if words[:3] == ["python", "-m", "asyncgrpo"]:
        rest = words[3:]
        while rest and rest[0].startswith("-"):  # top-level flags: asyncgrpo --debug train
            rest = rest[1:]
        if not rest or rest[0] == "...":
            return ["-m", "asyncgrpo"], words[3:]
        return ["-m", "asyncgrpo", rest[0]], rest[1:]
    if words[:2] == ["python", "-m"] and words[2].startswith("asyncgrpo."):
        return ["-m", words[2]], words[3:]
    if words[:1] == ["python"] and len(words) > 1 and words[1].startswith("bench/"):
        return [words[1]], words[2:]
    return None


def flags(arguments: list[str]) -> list[str]:
    """The long and short options among a command's arguments, up to a bare ``--`` (what
    follows it goes to vLLM)."""
    found = []
    for word in arguments:
        if word == "--":
            break
        if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", word):
            found.append(word.split("=", 1)[0])
    return found


@cache
def help_text(argv: tuple[str, ...]) -> str:
    proc = subprocess.run(
        [sys.executable, *argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"{' '.join(argv)} --help: {proc.stderr.strip()[-500:]}"
    return proc.stdout


def all_commands() -> list[tuple[str, str]]:
    return [
        (page.relative_to(ROOT).as_posix(), command)
        for page in PAGES
        for command in page_commands(page.read_text())
    ]


def test_page_commands_reads_blocks_spans_and_continuations() -> None:
    text = (
        "Run `asyncgrpo train CONFIG` or `--not-a-command`.\n"
        "```bash\n"
        "export KEY=...   # a comment\n"
        "python -m asyncgrpo.serve --model M \\\n"
        "    --replicas 1\n"
        "```\n"
        "```\n"
        "$ make demo\n"
        "step 1/40 reward 0.1\n"
        "```\n"
    )
    assert page_commands(text) == [
        "export KEY=...",
        "python -m asyncgrpo.serve --model M --replicas 1",
        "make demo",
        "asyncgrpo train CONFIG",
    ]


def test_entry_point_and_flags() -> None:
    words = "torchrun --nproc-per-node 2 -m asyncgrpo train x.yaml --dry-run".split()
    assert entry_point(words) == (["-m", "asyncgrpo", "train"], ["x.yaml", "--dry-run"])
    assert entry_point("VLLM_PLUGINS=a python -m asyncgrpo.serve --port 1".split()) == (
        ["-m", "asyncgrpo.serve"],
        ["--port", "1"],
    )
    assert entry_point("asyncgrpo --debug ...".split()) == (["-m", "asyncgrpo"], ["--debug", "..."])
    assert entry_point("pip install asyncgrpo".split()) is None
    assert flags(["--a=1", "-v", "x", "--", "--vllm-flag"]) == ["--a", "-v"]


def test_the_docs_show_commands() -> None:
    """The extraction finds the commands a newcomer needs (so the checks below check something)."""
    shown = {command for _, command in all_commands()}
    for expected in (
        "make demo",
        "make test",
        "asyncgrpo launch examples/tiny_cpu.yaml --backend local",
    ):
        assert expected in shown


def test_every_documented_command_exists_with_its_flags() -> None:
    unknown = []
    for page, command in all_commands():
        found = entry_point(command.split())
        if found is None:
            continue
        argv, arguments = found
        if argv[-1].endswith(".py") and not (ROOT / argv[-1]).is_file():
            unknown.append(f"{page}: `{command}`: no {argv[-1]}")
            continue
        named = flags(arguments)
        if not named and argv[:2] != ["-m", "asyncgrpo"]:
            continue  # nothing to check without running it
        text = help_text(tuple(argv))
        unknown += [
            f"{page}: `{command}`: {flag} is not in `{' '.join(argv)} --help`"
            for flag in named
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text)
        ]
    assert not unknown, "\n".join(unknown)


def test_every_documented_file_and_make_target_exists() -> None:
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    missing = []
    for page, command in all_commands():
        words = command.split()
        for word in words:
            if re.fullmatch(r"(examples|bench)/[\w.-]+\.\w+", word) and not (ROOT / word).is_file():
                missing.append(f"{page}: `{command}`: no {word}")
        if "make" in words:  # its first word that is not an option (-j4) nor a VAR=value
            after = words[words.index("make") + 1 :]
            target = [w for w in after if not w.startswith("-") and "=" not in w][:1]
            if target and target[0] not in targets:
                missing.append(f"{page}: `{command}`: no make target {target[0]}")
    assert not missing, "\n".join(missing)


LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor for a markdown heading: lower case, punctuation but ``-`` dropped,
    spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return {anchor(h) for h in re.findall(r"^#+ (.+)$", prose, re.M)}


def test_anchor_follows_github() -> None:
    assert (
        anchor("The guard: collapse metrics and the alarm")
        == "the-guard-collapse-metrics-and-the-alarm"
    )
    assert anchor("`asyncgrpo train`") == "asyncgrpo-train"
    assert anchors("# A\n```\n# not a heading\n```\n## Exit statuses\n") == {"a", "exit-statuses"}


def test_every_relative_link_resolves() -> None:
    """The README and docs link each other by file and heading; a page moved or a heading
    renamed breaks a link here first."""
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # https://, mailto:
            path, _, fragment = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: ({target}): no {path}")
            elif (
                fragment and linked.suffix == ".md" and fragment not in anchors(linked.read_text())
            ):
                broken.append(f"{page.relative_to(ROOT)}: ({target}): no heading #{fragment}")
    assert not broken, "\n".join(broken)
