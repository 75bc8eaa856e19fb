"""A directory cache for test models that take minutes to build.

The tool-calling model is the tiny model fine-tuned for a few hundred CPU steps (a minute and a
half of a core); ``make test``, ``make test-vf4`` and ``make test-cookbook`` are separate pytest
sessions, and a fresh clone or a second worktree would build the same bytes again. A build is
keyed by everything it reads (its own source, the base model's files, the seed, torch's and
transformers' versions), so one cache serves every checkout of a user, as uv's and pip's do
for packages: an edit to what a build reads gives it a new key. Each entry is written beside
the cache's entries and renamed into place once complete, so a reader never sees half a model
and concurrent sessions each end with a whole one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

#: Written last into a finished build's directory.
DONE = ".asyncgrpo-cache-complete"
#: Names the cache directory instead of the user's (an empty one gives a cold build).
CACHE_ENV = "ASYNCGRPO_TEST_CACHE"


def user_cache_dir(name: str) -> Path:
    """``asyncgrpo/<name>`` under the user's cache directory (``$XDG_CACHE_HOME``, else
    ``~/.cache``): what any checkout may reuse."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "asyncgrpo" / name


def default_cache_root() -> Path:
    """Where test models are cached: ``$ASYNCGRPO_TEST_CACHE``, else the user's
    ``asyncgrpo/test-models`` cache."""
    if env := os.environ.get(CACHE_ENV):
        return Path(env)
    return user_cache_dir("test-models")


def tree_digest(path: str | Path, pattern: str = "*") -> str:
    """SHA-256 over the relative names and bytes of every file under ``path`` matching
    ``pattern``."""
    root = Path(path)
    h = hashlib.sha256()
    for file in sorted(p for p in root.rglob(pattern) if p.is_file()):
        h.update(file.relative_to(root).as_posix().encode() + b"\0")
        h.update(file.read_bytes())
    return h.hexdigest()


def cache_key(parts: Iterable[str]) -> str:
    """A short digest of ``parts``, in order."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:24]


def cached_dir(cache_root: str | Path, key: str, build: Callable[[Path], Path]) -> Path:
    """The directory ``build(out_dir)`` writes for ``key``: built once, then reused."""
    root = Path(cache_root)
    final = root / key
    if (final / DONE).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{key}-"))
    try:
        built = build(staging / "out")
        (built / DONE).touch()
        try:
            os.rename(built, final)
        except OSError:  # another session finished first (or a stale, incomplete entry)
            if not (final / DONE).is_file():
                shutil.rmtree(final, ignore_errors=True)
                os.rename(built, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
