"""What the loader reads from a config's fields: their docstrings become the flags' help."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from asyncgrpo.config.fields import field_docs
from asyncgrpo.config.flags import add_fields


@dataclass(kw_only=True)
class _Documented:
    plain: int = 1
    """One line."""
    wrapped: str = "x"
    """Two
    lines."""
    bare: float = 0.5


def test_field_docs_reads_the_string_below_each_field() -> None:
    docs = field_docs(_Documented)
    assert docs["plain"] == "One line."
    assert docs["wrapped"] == "Two lines."
    assert "bare" not in docs
    assert "One line." in _help_of(_Documented, "--plain")


def _help_of(cls: type, flag: str) -> str:
    parser = argparse.ArgumentParser()
    add_fields(parser, cls, env_prefix="X_")
    return next(a.help for a in parser._actions if flag in a.option_strings)
