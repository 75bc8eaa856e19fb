"""Training state checkpoints (``save_state`` / ``load_state``) through the transport.

A client's state (its adapter weights, AdamW moments and step count) is saved as a checkpoint
of a :class:`~asyncgrpo.store.checkpoints.CheckpointStore` of its own under
``tinker-states/<model_id>``, its name in the checkpoint's meta; the SDK gets the path
``tinker://<model_id>/weights/<name>`` back. Loading looks the name up in the store, so a path
stays loadable after the service restarts on the same store.
"""

from __future__ import annotations

import re
from pathlib import Path

from asyncgrpo.errors import NotFound
from asyncgrpo.store.checkpoints import CheckpointStore
from asyncgrpo.tinker.engine import LoraSpec
from asyncgrpo.tinker.wire import WireError
from asyncgrpo.transport.base import Transport

__all__ = ["StateStore", "state_path"]

_PATH = re.compile(r"tinker://([A-Za-z0-9][A-Za-z0-9_.-]*)/weights/([^/]+)")


def state_path(model_id: str, name: str) -> str:
    return f"tinker://{model_id}/weights/{name}"


def parse_state_path(path: str) -> tuple[str, str]:
    """``(model_id, name)`` of a ``save_state`` path; WireError naming the form if not one."""
    found = _PATH.fullmatch(path)
    if found is None:
        raise WireError(f"{path!r} is not a save_state path: load one that save_state returned "
                        "(tinker://<model_id>/weights/<name>)")  # fmt: skip
    return found.group(1), found.group(2)


class StateStore:
    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    def _store(self, model_id: str) -> CheckpointStore:
        return CheckpointStore(self.transport, prefix=f"tinker-states/{model_id}")

    async def save(self, model_id: str, name: str, local_dir: Path, spec: LoraSpec) -> str:
        """Save ``local_dir`` as the client's state ``name`` (of a LoRA of ``spec``); its
        ``tinker://`` path."""
        if "/" in name or not name:
            raise WireError(f"save_state name {name!r}: give a name without '/'")
        store = self._store(model_id)
        step = (await store.latest_checkpoint() or 0) + 1
        lora = {"rank": spec.rank, "train_mlp": spec.train_mlp, "train_attn": spec.train_attn}
        await store.save(step, local_dir, meta={"name": name, "lora": lora})
        return state_path(model_id, name)

    async def fetch(self, path: str, dest: Path) -> tuple[Path, LoraSpec]:
        """Download the state ``path`` names (its newest save under that name) into ``dest``;
        the directory and the LoRA it was saved from."""
        model_id, name = parse_state_path(path)
        store = self._store(model_id)
        for step in reversed(await store.steps()):
            meta = await store.meta(step)
            if meta.get("name") == name:
                lora = meta["lora"]
                spec = LoraSpec(rank=int(lora["rank"]), seed=None,
                                train_mlp=bool(lora["train_mlp"]), train_attn=bool(lora["train_attn"]))  # fmt: skip
                return (await store.load(step, dest))[0], spec
        raise NotFound(f"no saved state at {path!r}: save it first with save_state")
