"""Model FLOPs of a training step, for MFU (model FLOPs utilisation).

Convention (PaLM's, the one MFU figures are quoted in): a matmul weight of ``P`` parameters costs
``6 P`` FLOPs per token for forward plus backward, and causal attention over a sample of ``n``
tokens costs ``6 n^2 d`` per layer (``12 n^2 d`` halved by the causal mask; ``d`` the query width).
With a frozen base and a LoRA adapter the hardware skips the base's weight gradients (about
``4 P``), so MFU by this convention is the usual comparable figure, not a count of work done.
Only the work the trainer asks for is counted: a packed row's attention is per sample (the
varlen kernels' cost, not the row's square), and the LM head runs on completion positions only
(``logits_to_keep``). LoRA's own matmuls are negligible at small ranks and left out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the FLOP count needs of a decoder-only transformer."""

    layer_params: int  # matmul weights inside the decoder layers (all layers together)
    num_layers: int
    attn_width: int  # num_attention_heads * head_dim
    lm_head_params: int  # hidden_size * vocab_size

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a transformers config (Qwen2/Llama-style attribute names)."""
        hidden = config.hidden_size
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        attn = hidden * head_dim * (2 * heads + 2 * kv)  # q, o + k, v
        mlp = 3 * hidden * config.intermediate_size  # gate, up, down
        return cls(
            layer_params=config.num_hidden_layers * (attn + mlp),
            num_layers=config.num_hidden_layers,
            attn_width=heads * head_dim,
            lm_head_params=hidden * config.vocab_size,
        )


def step_flops(shape: ModelShape, seq_lens: Iterable[int], completion_tokens: int) -> float:
    """Forward + backward model FLOPs for samples of ``seq_lens`` tokens."""
    lens = list(seq_lens)
    tokens = sum(lens)
    dense = 6.0 * shape.layer_params * tokens
    attention = 6.0 * shape.num_layers * shape.attn_width * sum(n * n for n in lens)
    head = 6.0 * shape.lm_head_params * completion_tokens
    return dense + attention + head
