"""Prompt dataset: sources, epochs, seeded shuffling, resume positions, chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncgrpo.config.rollout import DatasetConfig
from asyncgrpo.errors import ConfigError
from asyncgrpo.rollout.dataset import PromptDataset, encode_prompt, load_tokenizer


class CharTokenizer:
    """A stand-in with the two methods the dataset calls, for order-only tests."""

    chat_template = "x"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(ch) for ch in text]

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def texts(ds: PromptDataset, position: int = 0) -> list[str]:
    return [p.prompt for p in ds.iter_from(position)]


def test_epochs_cover_every_row_once_per_epoch() -> None:
    rows = [f"p{i}" for i in range(7)]
    ds = PromptDataset(rows, tokenizer=CharTokenizer(), epochs=3, shuffle=True, seed=1)
    out = texts(ds)
    assert len(out) == 21 and ds.total == 21
    for e in range(3):
        assert sorted(out[7 * e : 7 * e + 7]) == sorted(rows)
    assert out[:7] != out[7:14], "each epoch should have its own permutation"


def test_shuffle_is_deterministic_for_a_seed() -> None:
    rows = [f"p{i}" for i in range(20)]
    a = texts(PromptDataset(rows, tokenizer=CharTokenizer(), seed=3))
    b = texts(PromptDataset(rows, tokenizer=CharTokenizer(), seed=3))
    c = texts(PromptDataset(rows, tokenizer=CharTokenizer(), seed=4))
    assert a == b and a != c
    assert texts(PromptDataset(rows, tokenizer=CharTokenizer(), shuffle=False)) == rows


def test_resume_from_position_continues_the_same_order() -> None:
    rows = [f"p{i}" for i in range(5)]
    full = PromptDataset(rows, tokenizer=CharTokenizer(), epochs=2, seed=9)
    resumed = PromptDataset(rows, tokenizer=CharTokenizer(), epochs=2, seed=9)
    assert texts(resumed, 7) == texts(full)[7:]
    assert [p.index for p in resumed.iter_from(7)] == [7, 8, 9]
    assert [p.epoch for p in resumed.iter_from(3)] == [0, 0, 1, 1, 1, 1, 1]


def test_forever_and_rows_with_extra_columns() -> None:
    rows = [{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": 2}]
    ds = PromptDataset(rows, tokenizer=CharTokenizer(), epochs=None, shuffle=False)
    it = ds.iter_from(0)
    got = [next(it) for _ in range(5)]
    assert [p.prompt for p in got] == ["a", "b", "a", "b", "a"]
    assert got[1].extra == {"answer": 2} and got[1].prompt_ids == [ord("b")]


def test_jsonl_file_and_max_prompt_tokens(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"q": "x" * n}) for n in (1, 5, 2)) + "\n")
    cfg = DatasetConfig(path=str(path), prompt_column="q", shuffle=False, max_prompt_tokens=3)
    ds = PromptDataset.from_config(cfg, tokenizer=CharTokenizer())
    assert texts(ds) == ["x", "xx"] and ds.skipped_too_long == 1
    with pytest.raises(ConfigError, match="prompt_column"):
        PromptDataset.from_config(DatasetConfig(path=str(path)), tokenizer=CharTokenizer())


def test_datasets_name_via_load_dataset(tmp_path: Path) -> None:
    # A directory of JSONL is loaded through `datasets.load_dataset`, like a hub name.
    folder = tmp_path / "hubish"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"prompt": "hello"}\n{"prompt": "world"}\n')
    cfg = DatasetConfig(path=str(folder), shuffle=False)
    assert texts(PromptDataset.from_config(cfg, tokenizer=CharTokenizer())) == ["hello", "world"]


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match="exactly one"):
        DatasetConfig()
    with pytest.raises(ConfigError, match="epochs"):
        DatasetConfig(prompts=["a"], epochs=0)


def test_chat_template_of_the_real_tokenizer(tiny_model: Path) -> None:
    tok = load_tokenizer(tiny_model)
    messages = [{"role": "user", "content": "what is two plus two?"}]
    ids = encode_prompt(tok, messages)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    ds = PromptDataset([messages, "plain text"], tokenizer=tok, shuffle=False)
    chat, plain = list(ds.iter_from(0))
    assert chat.is_chat and chat.prompt_ids == ids
    assert not plain.is_chat and tok.decode(plain.prompt_ids) == "plain text"
