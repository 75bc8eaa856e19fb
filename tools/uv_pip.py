"""``uv pip ARGS`` under this machine's pip configuration.

The Makefile installs packages with uv: a virtualenv of the main extras takes seconds where pip
takes minutes (docs/testing.md). uv reads neither pip's configuration files nor its ``PIP_*``
variables, which is where a machine keeps its index mirror, local wheel directories, version
constraints and CA bundle; this passes them on to uv and runs it. They go as uv's environment
variables, not its arguments, because an index URL may carry a credential. A ``UV_*`` variable
already set wins, and pip's rule of the best version across all indexes is kept (uv's own
default takes a package from the first index that has it).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

# pip's key -> uv's variable and how uv separates several values in it.
UV_VARIABLES = {
    "index-url": ("UV_INDEX_URL", " "),
    "extra-index-url": ("UV_EXTRA_INDEX_URL", " "),
    "find-links": ("UV_FIND_LINKS", ","),
    "constraint": ("UV_CONSTRAINT", " "),
    "cert": ("SSL_CERT_FILE", " "),
}
# Later sections override earlier ones, as in pip (environment variables last).
SECTIONS = ("global", "install", ":env:")


def pip_settings(listing: str) -> dict[str, list[str]]:
    """The settings uv needs from ``pip config list`` output (``section.key='value'`` lines)."""
    found: dict[str, tuple[int, list[str]]] = {}
    for line in listing.splitlines():
        name, sep, value = line.partition("=")
        section, _, key = name.rpartition(".")
        if not sep or key not in UV_VARIABLES or section not in SECTIONS:
            continue
        rank = SECTIONS.index(section)
        if key not in found or rank >= found[key][0]:
            found[key] = (rank, str(ast.literal_eval(value)).split())
    return {key: values for key, (_, values) in found.items()}


def uv_environment(settings: dict[str, list[str]], env: dict[str, str]) -> dict[str, str]:
    """``env`` with pip's settings added as uv's variables, where ``env`` lacks them."""
    out = dict(env)
    for key, values in settings.items():
        variable, separator = UV_VARIABLES[key]
        out.setdefault(variable, separator.join(values))
    out.setdefault("UV_INDEX_STRATEGY", "unsafe-best-match")
    return out


def main() -> None:
    from uv import find_uv_bin

    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    uv = find_uv_bin()
    os.execve(
        uv, [uv, "pip", *sys.argv[1:]], uv_environment(pip_settings(listing), dict(os.environ))
    )


if __name__ == "__main__":
    main()
