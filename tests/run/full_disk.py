"""A real full disk for tests: a 1 MiB tmpfs in a private mount namespace (root only; the mount
goes with the namespace, whatever the test does)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def on_full_disk(disk: Path, script: str, then: str = "") -> subprocess.CompletedProcess[str]:
    """Run ``python -c script disk`` with a 1 MiB tmpfs mounted on ``disk`` (made here), then the
    shell command ``then`` (e.g. copying what it wrote out) before the namespace goes."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("a tmpfs in a private mount namespace needs root")
    disk.mkdir()
    command = f"mount -t tmpfs -o size=1m full {disk} && {sys.executable} -c '{script}' {disk}"
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", command + then],
        capture_output=True,
        text=True,
        timeout=120,
    )
