"""Attention for packed rows whose cost is the sum of its samples' squares, not the row's square.

transformers' sdpa/eager paths turn a packed row into one dense block-diagonal mask, so a row
of ``T`` tokens costs ``T^2`` however many samples it holds. ``varlen_sdpa_attention`` (the
``attn_implementation`` named ``VARLEN_SDPA``) instead gathers the row's ``n`` samples into a
right-padded ``[n, heads, L_max, head_dim]`` batch and runs ``scaled_dot_product_attention``
with ``is_causal=True`` and no mask: a query never sees a later key, so right padding is
invisible to real tokens, and without a mask sdpa takes its fused (flash) CPU/GPU kernel, which
also skips the upper triangle. Cost: ``n * L_max^2 / 2``, the sum of the samples' squares when
they are of equal length (GRPO rows: groups of completions of one prompt), at most ``n`` times
the longest sample's square otherwise, never the row's. Outputs of padding positions are dropped
when scattering back, so they get no gradient.

Sample boundaries travel as ``cu_seq_lens_q`` (transformers' ``FlashAttentionKwargs``, which
flash-attention's varlen kernels read directly), computed once per forward by ``varlen_kwargs``;
without them they are read from the ``position_ids`` restarts. A padded batch with an
``attention_mask`` is not supported (transformers builds no mask for this implementation).

Why not the alternatives on CPU (measured with ``python bench/trainer.py --vs-trl``, which
runs this next to transformers' dense-mask sdpa): the dense mask costs the row's square and
keeps sdpa off its fused kernel; flex_attention with a document mask has no backward on CPU in
torch 2.13 ("FlexAttention does not support backward on CPU"); one sdpa call per sample costs
``layers x samples`` kernel launches, where this costs ``layers``.
"""

from __future__ import annotations

from typing import Any

import torch

VARLEN_SDPA = "asyncgrpo_varlen_sdpa"


def varlen_kwargs(seq_lens: list[int], device: torch.device) -> dict[str, Any]:
    """The forward kwargs that describe a packed row's sample boundaries."""
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(seq_lens, dtype=torch.int32), 0)
    cu = cu.to(device)
    longest = max(seq_lens)
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
    }


def _cu_from_positions(pos: torch.Tensor) -> torch.Tensor | None:
    """Sample boundaries from positions that restart at 0; None when the row is one sequence."""
    starts = torch.nonzero(pos == 0).flatten()
    if starts.numel() < 2 or int(starts[0]) != 0:
        return None
    end = torch.tensor([pos.numel()], device=pos.device)
    return torch.cat([starts, end]).to(torch.int32)


def _pad_index(cu: torch.Tensor, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``index[i, j]``: row position of sample ``i``'s token ``j`` (clamped), and its validity."""
    starts = cu[:-1].long().unsqueeze(1)
    lens = (cu[1:] - cu[:-1]).long().unsqueeze(1)
    offs = torch.arange(longest, device=cu.device).unsqueeze(0)
    valid = offs < lens
    index = torch.where(valid, starts + offs, starts)  # padding repeats the sample's first token
    return index, valid


def varlen_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: ``query`` ``[1, H, T, D]`` -> output ``[1, T, H, D]``."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None and query.shape[0] == 1 and kwargs.get("position_ids") is not None:
        cu = _cu_from_positions(kwargs["position_ids"][0])
    if cu is None or query.shape[0] != 1:
        # Not a packed row (e.g. generation or a padded batch): plain causal sdpa.
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    longest = (
        int((cu[1:] - cu[:-1]).max())
        if kwargs.get("max_length_q") is None
        else int(kwargs["max_length_q"])
    )
    index, valid = _pad_index(cu.to(query.device), longest)
    n = index.shape[0]
    flat = index.reshape(-1)

    def batch(x: torch.Tensor) -> torch.Tensor:  # [1, H, T, D] -> [n, H, L, D]
        h, d = x.shape[1], x.shape[3]
        return x[0].index_select(1, flat).view(h, n, longest, d).transpose(0, 1)

    q, k, v = batch(query), batch(key), batch(value)
    out = torch.nn.functional.scaled_dot_product_attention(
        q,
        k,
        v,
        dropout_p=dropout,
        is_causal=True,
        scale=scaling,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    # [n, H, L, D] -> [n, L, H, D] -> the valid tokens, in row order -> [1, T, H, D]
    out = out.transpose(1, 2)[valid]
    return out.unsqueeze(0), None


def register() -> None:
    """Make ``VARLEN_SDPA`` a valid ``attn_implementation`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
