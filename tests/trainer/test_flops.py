"""FLOP counting against a hand count and against the parameters transformers allocates."""

from __future__ import annotations

import pytest

from asyncgrpo.trainer.flops import ModelShape, step_flops


def test_step_flops_hand_count():
    shape = ModelShape(layer_params=1000, num_layers=2, attn_width=8, lm_head_params=50)
    # dense 6*1000*(3+5) + attention 6*2*8*(9+25) + head 6*50*4
    assert step_flops(shape, [3, 5], 4) == 48_000 + 3_264 + 1_200
    # packing does not change the count: attention is per sample
    assert step_flops(shape, [3, 5], 4) < step_flops(shape, [8], 4)


def test_shape_matches_the_model_parameters():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        tie_word_embeddings=True,
    )
    model = transformers.Qwen2ForCausalLM(cfg)
    layer_matmuls = sum(
        p.numel() for n, p in model.named_parameters() if "layers." in n and p.dim() == 2
    )
    shape = ModelShape.from_config(cfg)
    assert shape.layer_params == layer_matmuls
    assert shape.lm_head_params == model.lm_head.weight.numel()
    assert shape.attn_width == 128
