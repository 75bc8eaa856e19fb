"""Where a ``model`` comes from: a path on this host, or a Hugging Face id it can fetch.

Every command that starts replicas or loads the model checks it first (:func:`check_model`):
vLLM takes a missing directory for a Hub id and, on a host without Hub access, fails half a
minute later with a DNS error that does not mention the directory.
"""

from __future__ import annotations

import functools
import os
import shlex
from pathlib import Path

from asyncgrpo.errors import ConfigError


def local_path(name: str, cwd: Path | None = None) -> Path | None:
    """What ``name`` (a ``model`` or ``dataset.path``) names on this host, absolute from
    ``cwd`` (default: the current directory); None when nothing there has that name, so it is
    a Hugging Face id (or a ``datasets`` name), or a mistake :func:`check_model` explains."""
    path = Path(name).expanduser()
    path = path if cwd is None else cwd / path
    return Path(os.path.abspath(path)) if path.exists() else None


def check_model(model: str) -> None:
    """Refuse ``model`` unless it is a path on this host, a Hugging Face id in the local cache,
    or one the Hub answers for from here; the error says what to do (:func:`missing_model_fix`).

    Blocks for up to 10 s on the Hub lookup: call it from a worker thread in async code.
    """
    if local_path(model) is not None:
        return
    why = _hub_problem(model)
    if why is not None:
        raise ConfigError(
            f"model={model!r}: no such directory here, and {why}: {missing_model_fix(model)}"
        )


def missing_model_fix(model: str) -> str:
    """What to do about a missing ``model``. Building a test model there is offered only for a
    path named like one (the README's ``runs/tiny-model``, the arithmetic recipe's
    ``runs/arithmetic-model``): for any other path it would put a toy model where the user
    expects theirs."""
    fix = "set model to an existing model directory or a Hugging Face id"
    name = Path(model).name.lower()
    for kind, module in (("tiny", "tiny"), ("arithmetic", "arithmetic")):
        if kind in name:
            build = f"python -m asyncgrpo.testing.{module} {shlex.quote(model)}"
            return f"build the {kind} test model there with `{build}`, or {fix}"
    return fix


@functools.cache
def _hub_problem(model: str) -> str | None:
    """Why ``model`` cannot be fetched from the Hugging Face Hub here, or None if it can (or
    ``huggingface_hub``, which vLLM and transformers download with, is not installed)."""
    try:
        from huggingface_hub import HfApi, constants, try_to_load_from_cache
        from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError
        from huggingface_hub.utils import validate_repo_id
    except ImportError:
        return None
    if model.startswith((".", "/", "~")):
        return "it is a path, not a Hugging Face id"
    try:
        validate_repo_id(model)
    except HFValidationError:
        return "it is not a valid Hugging Face id either"
    if isinstance(try_to_load_from_cache(model, "config.json"), str):
        return None
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set and the Hugging Face cache does not hold it"
    try:
        HfApi().model_info(model, timeout=10)
    except RepositoryNotFoundError:
        return "the Hugging Face Hub has no such model (or it is private: set HF_TOKEN)"
    except Exception as exc:  # DNS, refused, timeout, proxy: the Hub is out of reach
        reason = " ".join(str(exc).split()) or type(exc).__name__
        return f"the Hugging Face Hub cannot be reached from this host ({reason})"
    return None
