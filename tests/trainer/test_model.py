"""The default attention implementation: per-sample cost on every device."""

from __future__ import annotations

import importlib.util

import torch

from asyncgrpo.trainer.attention import VARLEN_SDPA
from asyncgrpo.trainer.model import default_attn_implementation


def test_default_attention_per_device_and_dtype(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    real = importlib.util.find_spec
    # No CUDA machine here: pretend flash-attn is installed to check the choice.
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "flash_attn" else real(name),
    )
    assert default_attn_implementation(cuda, torch.bfloat16) == "flash_attention_2"
    assert default_attn_implementation(cuda, torch.float32) == VARLEN_SDPA  # flash needs half
    assert default_attn_implementation(cpu, torch.bfloat16) == VARLEN_SDPA
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert default_attn_implementation(cuda, torch.bfloat16) == VARLEN_SDPA
