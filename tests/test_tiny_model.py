"""The tiny local model: deterministic, vLLM-compatible shapes, a working chat template."""

import hashlib
from pathlib import Path

import pytest

from asyncgrpo.testing import make_tiny_model


def _digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_same_seed_same_files_other_seed_other_weights(tmp_path: Path) -> None:
    a = _digest(make_tiny_model(tmp_path / "a", seed=3))
    b = _digest(make_tiny_model(tmp_path / "b", seed=3))
    c = _digest(make_tiny_model(tmp_path / "c", seed=4))
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]


def test_shapes_and_chat_template(tiny_model: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model)
    assert config.hidden_size // config.num_attention_heads == 64  # 16 crashes vLLM CPU attention
    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "what is two plus three?"}], add_generation_prompt=True
    )
    if not isinstance(ids, list):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>user\nwhat is two plus three?<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")
    assert max(ids) < config.vocab_size


def test_head_dim_16_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="head_dim 64"):
        make_tiny_model(tmp_path / "m", hidden_size=64, num_heads=4)


def test_the_module_runs_as_a_script_without_warnings() -> None:
    """``python -m asyncgrpo.testing.tiny``: the package must not import the module before runpy
    runs it (a RuntimeWarning, "found in sys.modules"), and its help shows no reST markup."""
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-W", "error", "-m", "asyncgrpo.testing.tiny", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert "OUT_DIR" in p.stdout and "``" not in p.stdout
