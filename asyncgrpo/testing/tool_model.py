"""A copy of the tiny model fine-tuned to call the calculator's ``add`` tool, for multi-turn tests.

The random tiny model never writes a tool call, so every episode of a tool environment would
end after one model turn. This copy is trained (full weights, CPU, a few hundred steps,
deterministic for a seed) on each calculator task played out as the environment plays it: the
prompt through the chat template with the tools, a first turn
``<tool_call>{"name":"calculator_tools_add","arguments":{"a":A,"b":B}}</tool_call>`` (the form
:func:`~asyncgrpo.rollout.verifiers_env.parse_tool_calls` reads) and the end-of-turn token, the
tool's result as :class:`~asyncgrpo.rollout.environment.ChatContinuation` renders it, then the
sum and the end-of-turn token. The loss is on the model's two turns only. (The tiny model's
chat template does not write the tools into the prompt: the call is learnt from the prompt.)

CLI: ``python -m asyncgrpo.testing.tool_model BASE_DIR OUT_DIR [--steps N] [--seed N]``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: The name verifiers 0.4 serves examples/envs/vf_v1_calculator's ``add`` under (a toolset's
#: tools are ``<toolset, snake case>_<tool>``: ``CalculatorTools.add``).
TOOL_NAME = "calculator_tools_add"
#: The calculator's tool as an OpenAI-style chat request offers it.
ADD_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def tool_call_text(a: int, b: int, name: str = TOOL_NAME) -> str:
    """The first model turn's text for ``a + b``."""
    return f'<tool_call>{{"name":"{name}","arguments":{{"a":{a},"b":{b}}}}}</tool_call>'


def _episode_ids(tokenizer: Any, row: dict[str, Any]) -> tuple[list[int], list[bool]]:
    """One calculator episode's ids and which of them are the model's (the loss mask)."""
    from asyncgrpo.rollout.environment import ChatContinuation

    end = tokenizer.eos_token
    prompt = tokenizer.apply_chat_template(
        row["prompt"], tools=[ADD_TOOL], add_generation_prompt=True, tokenize=False
    )
    result = [{"role": "tool", "content": str(row["a"] + row["b"]), "tool_call_id": "call_0"}]
    tool = ChatContinuation(tokenizer).text(result, ended_with=end)
    pieces = [
        (prompt, False),
        (tool_call_text(row["a"], row["b"]) + end, True),
        (tool, False),
        (str(row["a"] + row["b"]) + end, True),
    ]
    ids: list[int] = []
    mask: list[bool] = []
    for text, model in pieces:
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids += piece
        mask += [model] * len(piece)
    return ids, mask


def make_tool_model(
    base_dir: str | Path,
    out_dir: str | Path,
    rows: Sequence[dict[str, Any]] | None = None,
    *,
    steps: int = 200,
    learning_rate: float = 3e-3,
    seed: int = 0,
) -> Path:
    """Write to ``out_dir`` the model at ``base_dir`` fine-tuned on the calculator ``rows``
    (default: :func:`~asyncgrpo.testing.envs.calculator_tasks` (64), the rows of
    examples/calculator_tasks.jsonl); its tokenizer and chat template are the base model's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncgrpo.testing.envs import calculator_tasks
    from asyncgrpo.trainer.model import no_progress_bars

    rows = list(rows) if rows is not None else calculator_tasks(64)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    episodes = [_episode_ids(tokenizer, row) for row in rows]
    width = max(len(ids) for ids, _ in episodes)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in episodes])
    labels = torch.tensor(
        [
            [t if m else -100 for t, m in zip(i, k, strict=True)] + [-100] * (width - len(i))
            for i, k in episodes
        ]
    )
    attention = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in episodes])

    torch.manual_seed(seed)
    with no_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with no_progress_bars():
        model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    for name in ("generation_config.json",):  # vLLM would apply its defaults over ours
        (out / name).unlink(missing_ok=True)
    return out


def tool_model_key(base_dir: str | Path, seed: int = 0) -> str:
    """The cache key of :func:`make_tool_model`'s default build: what the build reads. That is
    this module's source, the base model's files, the seed, the training episodes' token ids
    and loss masks (whatever code renders them), and torch's and transformers' versions; an
    edit elsewhere in the package does not rebuild it."""
    from importlib.metadata import version

    from transformers import AutoTokenizer

    from asyncgrpo.testing.envs import calculator_tasks
    from asyncgrpo.testing.model_cache import cache_key, tree_digest

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    episodes = [_episode_ids(tokenizer, row) for row in calculator_tasks(64)]
    parts = ["tool-model", Path(__file__).read_text(), tree_digest(base_dir), str(seed)]
    return cache_key([*parts, json.dumps(episodes), version("torch"), version("transformers")])


def cached_tool_model(base_dir: str | Path, cache_root: str | Path, *, seed: int = 0) -> Path:
    """:func:`make_tool_model` of ``base_dir`` with its defaults, built once under
    ``cache_root`` per :func:`tool_model_key` (pytest sessions of one checkout share one
    build)."""
    from asyncgrpo.testing.model_cache import cached_dir

    key = tool_model_key(base_dir, seed)
    return cached_dir(cache_root, key, lambda out: make_tool_model(base_dir, out, seed=seed))


def main(argv: Sequence[str] | None = None) -> None:
    from asyncgrpo.console import plain_help

    parser = argparse.ArgumentParser(
        prog="python -m asyncgrpo.testing.tool_model", description=plain_help(__doc__)
    )
    parser.add_argument(
        "base_dir", type=Path, help="the tiny model (python -m asyncgrpo.testing.tiny)"
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = make_tool_model(args.base_dir, args.out_dir, steps=args.steps, seed=args.seed)
    print(json.dumps({"model": str(out)}))


if __name__ == "__main__":
    main()
