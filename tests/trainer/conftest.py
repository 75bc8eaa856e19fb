"""Fixtures for trainer tests: a tiny random Qwen2 on disk and synthetic samples."""

from __future__ import annotations

import pytest
from trainer_helpers import VOCAB


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random tiny Qwen2 saved with ``save_pretrained`` (no tokenizer needed)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=256,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny_qwen2")
    model.save_pretrained(path)
    return path
