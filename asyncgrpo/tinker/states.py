"""Training state checkpoints (``save_state`` / ``load_state``) through the transport, and the
checkpoint index every saved path is recorded in.

A client's state (its adapter weights, AdamW moments and step count) is saved as a checkpoint
of a :class:`~asyncgrpo.store.checkpoints.CheckpointStore` of its own under
``tinker-states/<run_id>``; the SDK gets the path ``tinker://<run_id>/weights/<name>`` back and
the :class:`~asyncgrpo.tinker.checkpoints.CheckpointIndex` maps it to that checkpoint. Loading
resolves the path through the index, so a path stays loadable after the service restarts on
the same store, and one deleted or past its TTL is refused.
"""

from __future__ import annotations

import time
from pathlib import Path

from asyncgrpo.store.adapters import AdapterStore
from asyncgrpo.store.checkpoints import CheckpointStore
from asyncgrpo.tinker.checkpoints import Checkpoint, CheckpointIndex, Deleter, parse_path
from asyncgrpo.tinker.engine import LoraSpec
from asyncgrpo.tinker.wire import WireError
from asyncgrpo.transport.base import Transport

__all__ = ["StateStore", "files_deleter", "parse_state_path", "state_path"]

STATES = "tinker-states"


def state_path(model_id: str, name: str) -> str:
    return f"tinker://{model_id}/weights/{name}"


def parse_state_path(path: str) -> tuple[str, str]:
    """``(run_id, name)`` of a ``save_state`` path; WireError naming the form if not one."""
    run_id, kind, name = parse_path(path)
    if kind != "training":
        raise WireError(
            f"{path!r} holds sampler weights (no optimizer state): load a path "
            "save_state returned (tinker://<model_id>/weights/<name>)"
        )
    return run_id, name


def _state_store(transport: Transport, run_id: str) -> CheckpointStore:
    """The run's own checkpoint store, ``tinker-states/<run_id>``."""
    return CheckpointStore(transport, prefix=f"{STATES}/{run_id}")


def files_deleter(transport: Transport, adapters: AdapterStore) -> Deleter:
    """What deletes a checkpoint's files: its state-store step, or its adapter version."""

    async def delete(run_id: str, checkpoint: Checkpoint) -> None:
        if checkpoint.kind == "training":
            await _state_store(transport, run_id).delete(checkpoint.where)
        else:
            await adapters.delete(run_id, checkpoint.where)

    return delete


class StateStore:
    def __init__(self, transport: Transport, index: CheckpointIndex, base_model: str) -> None:
        self.transport = transport
        self.index = index
        self.base_model = base_model

    def _store(self, model_id: str) -> CheckpointStore:
        return _state_store(self.transport, model_id)

    async def start_run(self, model_id: str, spec: LoraSpec) -> None:
        """Record the client's run in the index (listed from then on)."""
        await self.index.start_run(
            model_id,
            self.base_model,
            spec.rank,
            train_mlp=spec.train_mlp,
            train_attn=spec.train_attn,
        )

    async def save(
        self,
        model_id: str,
        name: str,
        local_dir: Path,
        spec: LoraSpec,
        *,
        ttl_seconds: int | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> str:
        """Save ``local_dir`` as the client's state ``name`` (of a LoRA of ``spec``) and index
        it (in place of an older save of that name); its ``tinker://`` path."""
        if "/" in name or not name:
            raise WireError(f"save_state name {name!r}: give a name without '/'")
        store = self._store(model_id)
        step = (await store.latest_checkpoint() or 0) + 1
        lora = {"rank": spec.rank, "train_mlp": spec.train_mlp, "train_attn": spec.train_attn}
        manifest = await store.save(step, local_dir, meta={"name": name, "lora": lora})
        size = sum(int(f["size"]) for f in manifest.get("files", []))
        await self.start_run(model_id, spec)
        run = await self.index.run(model_id)
        replaced = run.find("training", name)
        checkpoint = Checkpoint(
            kind="training",
            name=name,
            where=step,
            created=time.time(),
            size_bytes=size,
            user_metadata=user_metadata,
        )
        path = await self.index.add(model_id, checkpoint, ttl_seconds)
        if replaced is not None:  # the older save of that name is no longer reachable
            await self.index.delete_files(model_id, replaced)
        return path

    async def fetch(self, path: str, dest: Path) -> tuple[Path, LoraSpec]:
        """Download the state ``path`` names into ``dest``; the directory and the LoRA it was
        saved from. NotFound naming the fix for a path unknown, deleted or expired."""
        parse_state_path(path)
        run, checkpoint = await self.index.resolve(path)
        spec = LoraSpec(
            rank=run.rank, seed=None, train_mlp=run.train_mlp, train_attn=run.train_attn
        )
        return (await self._store(run.run_id).load(checkpoint.where, dest))[0], spec
