"""The policy: a transformers causal LM with a peft LoRA adapter, and its per-token logprobs.

Packed rows: ``position_ids`` restart at 0 for every sample and the row's sample lengths go to
the attention kernel as ``cu_seq_lens_q/k`` (transformers' varlen kwargs), so no sample sees
another. The default attention is chosen so a packed row costs the sum of its samples' squares,
not the row's square: flash-attention's varlen kernels on CUDA when ``flash_attn`` is installed,
else ``trainer.attention.VARLEN_SDPA`` (samples batched for sdpa's fused causal kernel). Chosen
by measurement on CPU (``python bench/trainer.py --vs-trl``): transformers' own sdpa/eager paths
turn the restarts into one dense block-diagonal mask (a row costs its length squared, and sdpa
with a mask leaves its fused kernel), and flex_attention has no backward on CPU in torch 2.13.
``tests/trainer/test_packing.py`` checks for every implementation that packed and unpacked
logprobs agree within 1e-5, and that the test notices a row whose samples see each other.

``use_cache=False`` on every forward: with a KV cache transformers ignores packing.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from asyncgrpo.errors import ConfigError
from asyncgrpo.trainer.attention import VARLEN_SDPA, varlen_kwargs
from asyncgrpo.trainer.attention import register as register_varlen_sdpa
from asyncgrpo.trainer.packing import PackedRow

if TYPE_CHECKING:
    from asyncgrpo.config.trainer import LoraConfig

logger = logging.getLogger(__name__)


@contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' own bars (loading weights, writing shards) off: between asyncgrpo's phase
    and step lines they are noise, and a log file gets their every redraw."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def default_attn_implementation(device: torch.device, dtype: torch.dtype) -> str:
    """flash-attention's varlen kernels on CUDA in half precision when installed, else
    ``VARLEN_SDPA``. Both cost a packed row the sum of its samples' squares."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        import importlib.util

        if importlib.util.find_spec("flash_attn") is not None:
            return "flash_attention_2"
    return VARLEN_SDPA


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on a CUDA device that has it, else float32 (exact on CPU)."""
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            name
        ]
    except KeyError:
        raise ConfigError(
            f"trainer.dtype={name!r}: use auto, float32, bfloat16 or float16"
        ) from None


def _check_packing_support() -> None:
    try:
        from transformers import masking_utils
    except ImportError:
        masking_utils = None
    if masking_utils is None or not hasattr(masking_utils, "find_packed_sequence_indices"):
        raise ConfigError(
            "this transformers version cannot derive a packed-sequence attention mask from "
            "position_ids; upgrade transformers (5.x is tested)"
        )


def load_policy(
    model_path: str | Path,
    lora: LoraConfig,
    *,
    dtype: str = "auto",
    device: torch.device | str | None = None,
    gradient_checkpointing: bool = False,
    attn_implementation: str | None = None,
) -> Any:
    """Load the base model, wrap it with a fresh LoRA adapter, and put it in train mode.

    Only the adapter is trainable. peft keeps adapter weights in float32 even on a bfloat16
    base (``autocast_adapter_dtype``), so AdamW state stays in full precision.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    _check_packing_support()
    device = torch.device(device) if device is not None else default_device()
    torch_dtype = resolve_dtype(dtype, device)
    attn = attn_implementation or default_attn_implementation(device, torch_dtype)
    if attn == VARLEN_SDPA:
        register_varlen_sdpa()
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "attn_implementation": attn}
    with no_progress_bars():
        base = AutoModelForCausalLM.from_pretrained(str(model_path), **kwargs)
    base.to(device)
    if gradient_checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.config.use_cache = False
    peft_config = PeftLoraConfig(
        task_type="CAUSAL_LM",
        r=lora.r,
        lora_alpha=lora.alpha,
        target_modules=lora.target_modules,
        lora_dropout=lora.dropout,
    )
    model = get_peft_model(base, peft_config)
    model.train()
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    logger.info(
        "loaded %s (%s on %s, %s attention) with LoRA r=%d: %d trainable parameters",
        model_path,
        torch_dtype,
        device,
        attn,
        lora.r,
        n_train,
    )
    return model


#: Where a transformers config states its context, under each architecture's name (vLLM reads
#: the same keys for its default ``--max-model-len``).
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                 "model_max_length", "max_target_positions", "max_sequence_length",
                 "max_seq_length", "seq_len")  # fmt: skip


def context_length(config: Any, max_model_len: int | None = None) -> int | None:
    """The longest sample a model's replicas can have served, generously: its largest stated
    context times its RoPE scaling factor (vLLM's default ``--max-model-len`` is at most that),
    or ``max_model_len`` (the replicas' setting) if larger; None when nothing states one."""
    stated = [v for k in _CONTEXT_KEYS if isinstance(v := getattr(config, k, None), int)]
    factors = [1.0]
    for name in ("rope_scaling", "rope_parameters"):
        rope = getattr(config, name, None)
        if isinstance(rope, dict):  # one dict, or one per layer type
            for part in (rope, *(v for v in rope.values() if isinstance(v, dict))):
                if isinstance(factor := part.get("factor"), int | float):
                    factors.append(float(factor))
    length = int(max(stated) * max(factors)) if stated else None
    if max_model_len is not None:
        length = max(length or 0, max_model_len)
    return length


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def autocast(model: torch.nn.Module, device: torch.device) -> Any:
    """Autocast to the base model's dtype when it is bfloat16/float16, else a no-op.

    The adapter's weights (and so AdamW's state) stay float32; autocast runs its matmuls in the
    base's half precision instead of upcasting every LoRA input to float32.
    """
    dtype = getattr(model, "dtype", torch.float32)
    half = dtype in (torch.bfloat16, torch.float16)
    return torch.autocast(device.type, dtype=dtype if half else torch.bfloat16, enabled=half)


def _row_scaled_logits(model: torch.nn.Module, row: PackedRow) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits / temperature`` (float32) at the positions that predict a row's completion
    tokens, and those tokens."""
    device = model_device(model)
    targets_at = torch.nonzero(row.completion_mask, as_tuple=True)[0]
    if int(targets_at.min()) == 0:
        raise ValueError("a completion token at position 0 of a row has no preceding token")
    predict_from = (targets_at - 1).to(device)
    with autocast(model, device):
        out = model(
            input_ids=row.input_ids.to(device).unsqueeze(0),
            position_ids=row.position_ids.to(device).unsqueeze(0),
            use_cache=False,
            logits_to_keep=predict_from,
            **varlen_kwargs(row.seq_lens, device),
        )
    temps = row.temperatures.to(device)[targets_at.to(device)].unsqueeze(-1)
    return out.logits[0].float() / temps, row.input_ids.to(device)[targets_at.to(device)]


def row_logprobs(
    model: torch.nn.Module, row: PackedRow, *, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (with grad) and entropies (without) of a row's completion tokens, in row order.

    Token ``t``'s logprob is ``log_softmax(logits[t - 1] / temperature)[input_ids[t]]``, the same
    quantity vLLM returns with ``processed_logprobs``. The LM head runs only on the positions
    that predict completion tokens (``logits_to_keep``), so prompt tokens cost no vocab-sized
    logits.
    """
    if not bool(row.completion_mask.any()):
        empty = torch.zeros(0, device=model_device(model))
        return empty, (empty if with_entropy else None)
    scaled, targets = _row_scaled_logits(model, row)
    # gather - logsumexp rather than log_softmax: autograd then keeps no second [tokens, vocab]
    # tensor alive (log_softmax saves its output for backward).
    lse = torch.logsumexp(scaled, dim=-1)
    logp = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        entropy = _entropy(scaled.detach(), lse.detach())
    return logp, entropy


@torch.no_grad()
def row_vocab_logprobs(model: torch.nn.Module, row: PackedRow) -> torch.Tensor:
    """The whole next-token distribution (log, ``[tokens, vocab]``, no grad) at each position
    that predicts one of a row's completion tokens: the trust region's vocabulary KL."""
    if not bool(row.completion_mask.any()):
        return torch.zeros(0, 0, device=model_device(model))
    scaled, _ = _row_scaled_logits(model, row)
    return torch.log_softmax(scaled, dim=-1)


@torch.no_grad()
def _entropy(scaled: torch.Tensor, lse: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """Per-token entropy ``lse - sum(p * x)``, in chunks so no full softmax is materialised."""
    parts = []
    for start in range(0, scaled.shape[0], chunk):
        x = scaled[start : start + chunk]
        p = torch.softmax(x, dim=-1)
        parts.append(lse[start : start + chunk] - (p * x).sum(-1))
    return torch.cat(parts)


def save_adapter(model: Any, path: str | Path) -> Path:
    """Write the adapter as ``adapter_model.safetensors`` + ``adapter_config.json`` in ``path``.

    safetensors reports a failed write (a full disk) as a ``SafetensorError`` naming the OS
    error: it is raised as that ``OSError``, which the trainer puts off to the next step."""
    from safetensors import SafetensorError

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    try:
        model.save_pretrained(str(path), safe_serialization=True)
    except SafetensorError as exc:
        if (code := re.search(r"\(os error (\d+)\)", str(exc))) is None:
            raise
        raise OSError(int(code[1]), f"writing the adapter to {path}: {exc}") from exc
    return path


def load_adapter_weights(model: Any, path: str | Path) -> None:
    """Copy the adapter saved in ``path`` (by :func:`save_adapter`) into ``model``'s adapter,
    in place: the parameters stay the optimizer's. Refuses files that do not cover exactly
    this adapter's weights (another LoRA config)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(str(Path(path) / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, state)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"the adapter in {path} does not match this model's LoRA config (missing "
            f"{missing[:3]}, unexpected {list(result.unexpected_keys)[:3]})"
        )
