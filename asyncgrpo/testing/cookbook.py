"""An offline workspace for tinker-cookbook's recipes against the Tinker-compatible service.

The recipes pick their chat renderer by a Hugging Face model name and load Hub datasets by name
(``openai/gsm8k``, ``HuggingFaceH4/no_robots``). Offline, ``transformers`` and ``datasets`` read
a local directory at the same relative path instead, so a directory holding
``Qwen/Qwen3-4B-Instruct-2507/`` (a model of that chat format: here the tiny model) and the two
datasets, with a recipe run from it (``model_name=Qwen/Qwen3-4B-Instruct-2507``, the service
started with ``--model-name`` the same), runs the recipe unchanged.

The model is the tiny model taught to answer as the math recipes grade (``\\boxed{d}``, a digit
0 to 3, whatever the question): a random model never writes ``\\boxed``, so every group of
samples would score 0 and ``rl_loop`` would skip every step; this one is right about a quarter
of the time, so groups have rewards to compare. The datasets' answers are digits 0 to 3.

CLI: ``python -m asyncgrpo.testing.cookbook OUT_DIR`` writes the workspace (the model built from
the tiny model, seed 0) and prints its paths.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from collections.abc import Sequence
from pathlib import Path

__all__ = ["MODEL_NAME", "cached_boxed_model", "make_boxed_model", "write_workspace"]

#: The Hub name the recipes are run with (a Qwen chat-format instruct model they know).
MODEL_NAME = "Qwen/Qwen3-4B-Instruct-2507"
NUMBERS = ("zero", "one", "two", "three")
WORDS = ("the cat", "a dog", "the bird", "one fish", "the sun", "a tree", "the house", "a stone")


def _question(rng: random.Random) -> tuple[str, int]:
    a = rng.randint(0, 3)
    b = rng.randint(0, 3 - a)
    return f"what is {NUMBERS[a]} plus {NUMBERS[b]}?", a + b


def _chatter(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def _conversations(rng: random.Random, count: int) -> list[list[dict[str, str]]]:
    """Prompts shaped like the math recipes' (an optional worked example first), each ending
    in a user question, for teaching the answer format."""
    out = []
    for _ in range(count):
        convo = []
        if rng.random() < 0.8:
            convo += [
                {"role": "user", "content": _chatter(rng, rng.randint(5, 30))},
                {
                    "role": "assistant",
                    "content": _chatter(rng, rng.randint(10, 60))
                    + f" \\boxed{{{rng.randint(0, 3)}}}",
                },
            ]
        question, _ = _question(rng)
        convo.append({"role": "user", "content": question + " " + _chatter(rng, rng.randint(0, 9))})
        out.append(convo)
    return out


def make_boxed_model(
    base_dir: str | Path, out_dir: str | Path, *, steps: int = 50, seed: int = 0
) -> Path:
    """Write to ``out_dir`` the model at ``base_dir`` fine-tuned to answer any chat prompt with
    ``\\boxed{d}`` (d uniform over 0 to 3) and end its turn; tokenizer and template kept."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncgrpo.trainer.model import no_progress_bars

    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    episodes = []
    for convo in _conversations(rng, 256):
        prompt = list(
            tokenizer.apply_chat_template(
                convo, add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        answer = tokenizer.encode(f"\\boxed{{{rng.randint(0, 3)}}}", add_special_tokens=False)
        episodes.append((prompt + answer + [end], len(prompt)))
    torch.manual_seed(seed)
    with no_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        batch = [episodes[(step * 8 + i) % len(episodes)] for i in range(8)]
        width = max(len(ids) for ids, _ in batch)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end
        ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in batch])
        labels = torch.tensor(
            [
                [t if n >= k else -100 for n, t in enumerate(i)] + [-100] * (width - len(i))
                for i, k in batch
            ]
        )
        mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in batch])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def cached_boxed_model(base_dir: str | Path, cache_root: str | Path, *, seed: int = 0) -> Path:
    """:func:`make_boxed_model` of ``base_dir``, built once under ``cache_root`` per base model
    files, seed, this module's source (the build reads no other of the package's code) and
    torch and transformers versions."""
    from importlib.metadata import version

    from asyncgrpo.testing.model_cache import cache_key, cached_dir, tree_digest

    parts = ["boxed-model", tree_digest(base_dir), str(seed), Path(__file__).read_text()]
    key = cache_key([*parts, version("torch"), version("transformers")])
    return cached_dir(cache_root, key, lambda out: make_boxed_model(base_dir, out, seed=seed))


def _write_dataset(root: Path, config: str, splits: dict[str, list[dict]]) -> None:
    """A local dataset directory ``datasets.load_dataset(root, config)`` reads (parquet files
    named by its README's configs)."""
    from datasets import Dataset

    lines = ["---", "configs:", f"- config_name: {config}", "  data_files:"]
    for split, rows in splits.items():
        path = f"{config}/{split}-00000-of-00001.parquet"
        (root / config).mkdir(parents=True, exist_ok=True)
        Dataset.from_list(rows).to_parquet(str(root / path))
        lines += [f"  - split: {split}", f"    path: {path}"]
    (root / "README.md").write_text("\n".join([*lines, "---", ""]))


def write_workspace(root: str | Path, model_dir: str | Path, *, seed: int = 0) -> Path:
    """Write the workspace under ``root``: the model at ``root``/``MODEL_NAME`` (a copy of
    ``model_dir``), ``openai/gsm8k`` (config ``main``: 64 train and 8 test questions) and
    ``HuggingFaceH4/no_robots`` (64 train and 8 test chats)."""
    root = Path(root)
    rng = random.Random(seed)
    model = root / MODEL_NAME
    if not model.exists():
        shutil.copytree(model_dir, model)

    def gsm8k(count: int) -> list[dict]:
        rows = []
        for _ in range(count):
            question, answer = _question(rng)
            rows.append(
                {"question": question, "answer": f"it is {NUMBERS[answer]}.\n#### {answer}"}
            )
        return rows

    def chats(count: int) -> list[dict]:
        return [
            {
                "prompt": q,
                "prompt_id": str(i),
                "category": "Chat",
                "messages": [
                    {"role": "user", "content": q},
                    {"role": "assistant", "content": _chatter(rng, rng.randint(3, 12))},
                ],
            }
            for i, (q, _) in enumerate(_question(rng) for _ in range(count))
        ]

    _write_dataset(root / "openai" / "gsm8k", "main", {"train": gsm8k(64), "test": gsm8k(8)})
    _write_dataset(
        root / "HuggingFaceH4" / "no_robots", "default", {"train": chats(64), "test": chats(8)}
    )
    return root


def main(argv: Sequence[str] | None = None) -> None:
    from asyncgrpo.console import plain_help
    from asyncgrpo.testing import make_tiny_model

    parser = argparse.ArgumentParser(
        prog="python -m asyncgrpo.testing.cookbook", description=plain_help(__doc__)
    )
    parser.add_argument("out_dir", type=Path, help="the workspace to write (run recipes from it)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    tiny = make_tiny_model(args.out_dir / ".tiny", seed=args.seed)
    boxed = make_boxed_model(tiny, args.out_dir / ".boxed", seed=args.seed)
    root = write_workspace(args.out_dir, boxed, seed=args.seed)
    print(
        json.dumps(
            {"workspace": str(root), "model": str(root / MODEL_NAME), "model_name": MODEL_NAME}
        )
    )


if __name__ == "__main__":
    main()
