"""The trainer's state: everything needed to continue a run bit for bit, and its file.

A checkpoint directory holds ``trainer_state.pt`` (the adapter, AdamW's state, the schedule, the
step count, the spike clip's statistics and every RNG) and ``adapter/``, the same adapter in
peft's format for humans and serving. The state file is written to a temporary name and renamed,
so a crash mid-write leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch

from asyncgrpo.trainer.spike_clip import SpikeClip

__all__ = [
    "ADAPTER_DIR",
    "STATE_FILE",
    "load_state_dict",
    "read_state",
    "save_torch",
    "state_dict",
    "write_state",
]

STATE_FILE = "trainer_state.pt"
ADAPTER_DIR = "adapter"
_STATE_FORMAT = 1


def state_dict(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    step: int,
    spike_clip: SpikeClip | None = None,
) -> dict[str, Any]:
    """The adapter of ``model``, the optimizer, the schedule, ``step`` and the RNGs."""
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    extra = {} if spike_clip is None else {"spike_clip": spike_clip.state_dict()}
    return {
        "format": _STATE_FORMAT,
        **extra,
        "step": step,
        "adapter": {
            name: p.detach().cpu().clone()
            for name, p in model.named_parameters()
            if p.requires_grad
        },
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": rng,
    }


def load_state_dict(
    state: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    spike_clip: SpikeClip | None = None,
) -> int:
    """Restore :func:`state_dict`'s ``state`` into the others; returns its step count."""
    if state.get("format") != _STATE_FORMAT:
        raise ValueError(f"unsupported trainer state format {state.get('format')!r}")
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    adapter = state["adapter"]
    if set(adapter) != set(params):
        missing = sorted(set(params) - set(adapter))[:3]
        extra = sorted(set(adapter) - set(params))[:3]
        raise ValueError(
            "checkpoint adapter does not match this model's LoRA config "
            f"(missing {missing}, unexpected {extra}); resume with the same lora settings"
        )
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(adapter[name].to(p.device, p.dtype))
    optimizer.load_state_dict(state["optimizer"])  # AdamW moves its state to the params' device
    scheduler.load_state_dict(state["scheduler"])
    if spike_clip is not None and "spike_clip" in state:
        spike_clip.load_state_dict(state["spike_clip"])
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return int(state["step"])


def write_state(directory: Path, state: dict[str, Any]) -> None:
    """Write ``state`` as ``directory/trainer_state.pt`` (atomically: temporary name, rename)."""
    tmp = directory / f".{STATE_FILE}.tmp"
    save_torch(state, tmp)
    os.replace(tmp, directory / STATE_FILE)


def save_torch(obj: Any, path: Path) -> None:
    """``torch.save`` through a Python file, so that a full disk raises ``OSError`` (ENOSPC),
    which the trainer puts off to the next step. Given a path, torch's own writer reports it as
    a ``RuntimeError`` ("unexpected pos 64 vs 0") that nothing can tell from a bug; given a
    file, the write's ``OSError`` is raised, unless closing the archive after it raises that
    ``RuntimeError`` over it: the ``OSError`` is what happened."""
    with open(path, "wb") as f:
        try:
            torch.save(obj, f)
        except RuntimeError as exc:
            if isinstance(exc.__context__, OSError):
                raise exc.__context__ from None
            raise


def read_state(directory: Path) -> dict[str, Any]:
    """The state :func:`write_state` wrote into ``directory``, on the CPU."""
    return torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True)
