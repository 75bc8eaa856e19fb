"""A subcommand's ``--help``: what it does, then examples that run as typed from a checkout.

Every subcommand is added with :func:`add_command`, so each help text has a description and an
``examples:`` section; ``tests/test_cli_help.py`` runs every example it shows (in a scratch
copy of the checkout's ``examples/``, after ``make demo``'s tiny model), so an example that
stops working fails there, not in a newcomer's terminal.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from asyncgrpo.console import plain_help

#: How an example line starts in a help text (what a test looks for).
EXAMPLE = "  $ "


def examples_text(examples: Sequence[tuple[str, str]]) -> str:
    """The ``examples:`` section: each command on its line, what it does below it."""
    lines = ["examples:"]
    for command, what in examples:
        lines += [f"{EXAMPLE}{command}", f"      {what}"]
    return "\n".join(lines)


def add_command(
    sub: Any,
    name: str,
    *,
    help: str,
    description: str,
    examples: Sequence[tuple[str, str]],
) -> argparse.ArgumentParser:
    """Add subcommand ``name`` to ``sub`` (the ``asyncgrpo`` command's subparsers): ``help`` in
    the command list, ``description`` and ``examples`` in its own ``--help``."""
    return sub.add_parser(  # type: ignore[no-any-return]
        name,
        help=help,
        description=plain_help(description),
        epilog=examples_text(examples),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def help_examples(text: str) -> list[str]:
    """The example commands of a help text (:func:`examples_text`)."""
    return [line[len(EXAMPLE) :] for line in text.splitlines() if line.startswith(EXAMPLE)]
