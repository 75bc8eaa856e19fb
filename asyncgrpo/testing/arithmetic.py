"""A small arithmetic model trained from scratch on CPU: a task with headroom for RL tests.

What it is: a 4-layer Qwen2 causal LM (hidden 128, 2 heads of 64, ~1M parameters) with a
byte-level BPE tokenizer that writes every digit as its own token and Qwen's chat template,
trained here in minutes on synthetic chat arithmetic: a user turn such as ``What is 47 + 85?``
and an assistant turn that works it column by column, units first, and boxes the result:
``7+5+0=12 4+8+1=13 \\boxed{132}``. Problems come in graded levels (:data:`LEVELS`: sums of
two to four columns, products of a two- or three-digit number by one digit), so no single trick
solves the set, and a held-out problem is a new combination of column steps, not a memorised
answer. In the training corpus a step of the working is off by one now and then (``slip``), and
the working goes on from what was written, as a person's does: the model learns to slip at
about that rate, so sampled at temperature 1 it is right on fewer held-out problems than with
greedy decoding, and the more columns the fewer (the build prints both, per level, and keeps
them in ``build.json``). Reinforcement learning with an exact-answer reward has something to
sharpen (the slips it samples) and something to learn (the levels greedy decoding gets wrong).

Held-out problems are disjoint from everything the model or an RL run trains on by
construction: a problem (its operands, in either order, and its operation, whatever the
wording) is held out when a hash of it falls in one bucket of :data:`HELD_OUT_BUCKETS`, and
neither the training corpus nor ``train.jsonl`` ever draws one.

What it is not: a model anyone should use. It knows nothing but these problems in this one
format, and its weights exist to give tests, benchmarks and examples
(``examples/arithmetic.yaml``, ``bench/arithmetic.py``) a policy that is partly right, built
locally with no download.

The directory it writes is an ordinary checkpoint (``config.json``, ``model.safetensors``, the
tokenizer with its chat template) that transformers, PEFT and vLLM load as they load any, plus
``train.jsonl`` (RL prompts with their ``answer``), ``heldout.jsonl`` (the evaluation set, per
level) and ``build.json`` (the settings, the time taken and the held-out accuracies).

CLI: ``python -m asyncgrpo.testing.arithmetic DIR [--seed N] [--steps N] [--no-cache]``; built
once into the user's cache (``~/.cache/asyncgrpo/test-models``, or ``$ASYNCGRPO_TEST_CACHE``) and copied to ``DIR``."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import operator
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from asyncgrpo.testing.tiny import chat_tokenizer

#: Level name -> (operation, first operand range, second operand range), inclusive. Graded by
#: the number of columns worked and by the operation; sampled with :data:`LEVEL_WEIGHTS`.
LEVELS: dict[str, tuple[str, tuple[int, int], tuple[int, int]]] = {
    "add2": ("+", (10, 99), (0, 99)),
    "mul2": ("*", (10, 99), (2, 9)),
    "add3": ("+", (100, 999), (10, 999)),
    "mul3": ("*", (100, 999), (2, 9)),
    "add4": ("+", (1000, 9999), (100, 9999)),
}
LEVEL_WEIGHTS: dict[str, float] = {"add2": 1, "mul2": 1, "add3": 1, "mul3": 1, "add4": 1}
OPS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "*": operator.mul}
TEMPLATES = (
    "What is {a} {op} {b}?",
    "Compute {a} {op} {b}.",
    "{a} {op} {b} = ?",
    "Calculate {a} {op} {b}.",
)
#: One problem in HELD_OUT_BUCKETS is held out (by a hash of its operands and operation).
HELD_OUT_BUCKETS = 16


@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int
    level: str

    @property
    def answer(self) -> int:
        return OPS[self.op](self.a, self.b)

    @property
    def held_out(self) -> bool:
        """Whether this computation belongs to the held-out set, whatever its wording and the
        order of its operands (47 + 85 and 85 + 47 work the same columns)."""
        a, b = sorted((self.a, self.b))
        digest = hashlib.sha256(f"{a}{self.op}{b}".encode()).digest()
        return digest[0] % HELD_OUT_BUCKETS == 0

    def text(self, template: int = 0) -> str:
        return TEMPLATES[template % len(TEMPLATES)].format(a=self.a, op=self.op, b=self.b)

    def messages(self, template: int = 0) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.text(template)}]

    def columns(self) -> list[tuple[int, int]]:
        """The column operands, units first: (digit of a, digit of b) for a sum, (digit of a,
        b) for a product by one digit."""
        da = [int(c) for c in reversed(str(self.a))]
        if self.op == "*":
            return [(x, self.b) for x in da]
        db = [int(c) for c in reversed(str(self.b))]
        width = max(len(da), len(db))
        da, db = da + [0] * (width - len(da)), db + [0] * (width - len(db))
        return list(zip(da, db, strict=True))


def worked(p: Problem, rng: random.Random | None = None, slip: float = 0.0) -> str:
    """The assistant's answer: one step per column, units first, then the result boxed, e.g.
    ``7+5+0=12 4+8+1=13 \\boxed{132}`` for 47 + 85 (each step two digits: the carry and the
    column's digit; the next column adds the carry). With ``rng``, each step is written wrong
    with probability ``slip`` (off by one), and what follows is computed from
    what was written, as a person's working goes on from a slip: the boxed result is then
    consistently wrong."""
    steps, digits, carry = [], [], 0
    for x, y in p.columns():
        value = x * y + carry if p.op == "*" else x + y + carry
        pair = f"{value:02d}"
        if rng is not None and rng.random() < slip:  # off by one
            pair = f"{min(99, max(0, value + rng.choice((-1, 1)) if value else 1)):02d}"
        steps.append(f"{x}{p.op}{y}+{carry}={pair}")
        carry, digits = int(pair[0]), [pair[1], *digits]
    result = str(int(str(carry) + "".join(digits)))
    return " ".join(steps) + " " + boxed(result)


def boxed(value: int | str) -> str:
    """The final answer as the math reward reads it."""
    return f"\\boxed{{{value}}}"


def draw(rng: random.Random, level: str) -> Problem:
    op, (lo_a, hi_a), (lo_b, hi_b) = LEVELS[level]
    return Problem(rng.randint(lo_a, hi_a), op, rng.randint(lo_b, hi_b), level)


def draw_problems(rng: random.Random, n: int, *, held_out: bool) -> list[Problem]:
    """``n`` problems, levels by :data:`LEVEL_WEIGHTS`, each held out iff ``held_out``."""
    names = list(LEVELS)
    weights = [LEVEL_WEIGHTS[k] for k in names]
    out = []
    while len(out) < n:
        p = draw(rng, rng.choices(names, weights)[0])
        if p.held_out == held_out:
            out.append(p)
    return out


def heldout_rows(per_level: int, seed: int = 0) -> list[dict[str, Any]]:
    """The evaluation set: ``per_level`` distinct held-out problems of each level."""
    rng = random.Random(f"arithmetic:heldout:{seed}")
    rows = []
    for level in LEVELS:
        seen: set[Problem] = set()
        while len(seen) < per_level:
            p = draw(rng, level)
            if p.held_out and p not in seen:
                seen.add(p)
                rows.append(_row(p, rng.randrange(len(TEMPLATES))))
    return rows


def train_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """RL prompts: ``n`` problems that are never held out, levels mixed."""
    rng = random.Random(f"arithmetic:train:{seed}")
    return [_row(p, rng.randrange(len(TEMPLATES))) for p in draw_problems(rng, n, held_out=False)]


def _row(p: Problem, template: int) -> dict[str, Any]:
    return {"prompt": p.messages(template), "answer": str(p.answer), "level": p.level}


# ---- the model ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class BuildSettings:
    """Everything a build depends on besides the library versions (kept in build.json)."""

    seed: int = 0
    # steps x batch_size: chosen by measurement against 550 x 128 (docs/training.md)
    steps: int = 900
    batch_size: int = 64
    learning_rate: float = 3e-3
    warmup_steps: int = 100
    slip: float = 0.2
    """Probability that a step of a training answer's working is off by one."""
    hidden_size: int = 128
    num_layers: int = 4
    intermediate_size: int = 512
    vocab_size: int = 320
    heldout_per_level: int = 40
    t1_samples: int = 2
    """Draws per held-out problem for build.json's pass@1 at temperature 1."""
    train_prompts: int = 4000


#: The tests' build: every step of the full one (tokenizer, training, files, held-out
#: accuracies) in seconds; its model has learnt next to nothing.
REDUCED = BuildSettings(steps=4, batch_size=16, heldout_per_level=3, t1_samples=1, train_prompts=50)


def chat_prompt(question: str) -> str:
    """``question`` as the chat template renders a user turn before the assistant's (written out:
    the template engine would cost more than the training step; a test checks they agree)."""
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def final_answer(text: str) -> str | None:
    """What the last ``\\boxed{...}`` of ``text`` holds (the build's own check; RL runs score
    with the math reward)."""
    start = text.rfind("\\boxed{")
    end = text.find("}", start)
    return text[start + 7 : end] if start >= 0 and end >= 0 else None


def make_tokenizer(out: Path, seed: int, vocab_size: int) -> Any:
    """A byte-level BPE over the task's own text, every digit its own token (as Qwen's)."""
    rng = random.Random(f"arithmetic:tokenizer:{seed}")
    corpus = []
    for p in draw_problems(rng, 3000, held_out=False):
        corpus += [p.text(rng.randrange(len(TEMPLATES))), worked(p)]
    return chat_tokenizer(corpus, vocab_size, out, individual_digits=True)


def _batch(
    tokenizer: Any, problems: Sequence[Problem], answers: Sequence[str], templates: Sequence[int]
) -> tuple[Any, Any, Any]:
    """Right-padded ids, attention mask and labels (the assistant turn only)."""
    import torch

    prompts = [chat_prompt(p.text(t)) for p, t in zip(problems, templates, strict=True)]
    heads = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    tails = tokenizer([a + tokenizer.eos_token for a in answers], add_special_tokens=False)[
        "input_ids"
    ]
    width = max(len(h) + len(t) for h, t in zip(heads, tails, strict=True))
    pad = tokenizer.pad_token_id
    ids, labels, mask = [], [], []
    for h, t in zip(heads, tails, strict=True):
        n = width - len(h) - len(t)
        ids.append(h + t + [pad] * n)
        labels.append([-100] * len(h) + t + [-100] * n)
        mask.append([1] * (len(h) + len(t)) + [0] * n)
    return torch.tensor(ids), torch.tensor(mask), torch.tensor(labels)


def train_model(
    out: Path, settings: BuildSettings, log: Callable[[str], None] = print, eval_every: int = 0
) -> Any:
    """Write the tokenizer and a model trained on the (noisy) corpus to ``out``; returns the
    model, in eval mode. ``eval_every``: log greedy and temperature-1 accuracy on 20 held-out
    problems per level every so many steps (how many steps a build needs; the training itself
    is unchanged: it draws no random numbers from torch)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    s = settings
    tokenizer = make_tokenizer(out, s.seed, s.vocab_size)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.hidden_size // 64,
        num_key_value_heads=s.hidden_size // 64,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(s.seed)
    model = Qwen2ForCausalLM(config)
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=s.learning_rate, weight_decay=0.01, betas=(0.9, 0.98)
    )

    def lr_at(step: int) -> float:
        if step < s.warmup_steps:
            return (step + 1) / s.warmup_steps
        done = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * done))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    rng = random.Random(f"arithmetic:corpus:{s.seed}")
    t0 = time.monotonic()
    for step in range(s.steps):
        problems = draw_problems(rng, s.batch_size, held_out=False)
        answers = [worked(p, rng, s.slip) for p in problems]
        templates = [rng.randrange(len(TEMPLATES)) for _ in problems]
        ids, mask, labels = _batch(tokenizer, problems, answers, templates)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if (step + 1) % max(1, s.steps // 10) == 0 or step + 1 == s.steps:
            log(f"step {step + 1}/{s.steps}  loss {loss.item():.3f}  {time.monotonic() - t0:.0f} s")
        if eval_every and (step + 1) % eval_every == 0:
            model.eval()
            probe = heldout_rows(20)
            greedy = accuracy(model, tokenizer, probe, temperature=0)
            sampled = accuracy(model, tokenizer, probe, temperature=1.0)
            log(f"step {step + 1}: greedy {_levels(greedy)} | t1 {_levels(sampled)}")
            model.train()
    return model.eval()


def accuracy(
    model: Any,
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    *,
    temperature: float,
    samples: int = 1,
    seed: int = 0,
    max_new_tokens: int = 64,
) -> dict[str, float]:
    """Share of exactly right answers per level and overall (``all``): greedy when
    ``temperature`` is 0, else ``samples`` draws per row. The answer is read from ``\\boxed{}``
    as an integer (the build's check; RL runs score with the math reward)."""
    import torch

    torch.manual_seed(seed)
    prompts = [
        tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        for r in rows
    ]
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, add_special_tokens=False, return_tensors="pt", padding=True)
    right: dict[str, list[float]] = {}
    with torch.no_grad():
        for _ in range(samples):
            gen = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None,
                top_k=None,
                top_p=None,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            texts = tokenizer.batch_decode(
                gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True
            )
            for row, text in zip(rows, texts, strict=True):
                ok = final_answer(text) == row["answer"]
                right.setdefault(row["level"], []).append(float(ok))
                right.setdefault("all", []).append(float(ok))
    tokenizer.padding_side = "right"
    return {k: sum(v) / len(v) for k, v in right.items()}


def make_arithmetic_model(
    path: str | Path,
    settings: BuildSettings | None = None,
    *,
    log: Callable[[str], None] = print,
    measure: bool = True,
    eval_every: int = 0,
) -> Path:
    """Train the model and write it, its tokenizer, ``train.jsonl``, ``heldout.jsonl`` and
    ``build.json`` to ``path``. Deterministic for a settings' seed (on one machine kind and
    thread count). ``measure``: also compute the held-out accuracies (greedy; sampled at
    temperature 1, ``t1_samples`` draws per problem) for build.json."""
    import torch

    from asyncgrpo.trainer.model import no_progress_bars

    s = settings or BuildSettings()
    if s.hidden_size % 64:
        raise ValueError(
            "hidden_size must be a multiple of 64: vLLM's CPU attention needs head_dim 64"
        )
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    model = train_model(out, s, log, eval_every)
    train_s = time.monotonic() - t0
    with no_progress_bars():
        model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)  # vLLM would apply its defaults
    heldout = heldout_rows(s.heldout_per_level)
    _write_jsonl(out / "heldout.jsonl", heldout)
    _write_jsonl(out / "train.jsonl", train_rows(s.train_prompts))
    report: dict[str, Any] = {
        "settings": asdict(s),
        "train_s": round(train_s, 1),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    if measure:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(out)
        report["heldout_greedy"] = accuracy(model, tokenizer, heldout, temperature=0)
        report["heldout_t1"] = accuracy(
            model, tokenizer, heldout, temperature=1.0, samples=s.t1_samples
        )
        log(f"held-out accuracy, greedy: {_levels(report['heldout_greedy'])}")
        log(f"held-out pass@1 at temperature 1: {_levels(report['heldout_t1'])}")
    report["build_s"] = round(time.monotonic() - t0, 1)
    (out / "build.json").write_text(json.dumps(report, indent=1) + "\n")
    return out


def _levels(acc: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.0%}" for k, v in sorted(acc.items(), key=lambda kv: kv[0] != "all"))


def _write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def cached_arithmetic_model(
    cache_root: str | Path,
    settings: BuildSettings | None = None,
    *,
    log: Callable[[str], None] = print,
) -> Path:
    """:func:`make_arithmetic_model`, built once under ``cache_root`` per settings, this
    module's source and the torch, transformers and tokenizers versions."""
    from importlib.metadata import version

    from asyncgrpo.testing.model_cache import cache_key, cached_dir

    s = settings or BuildSettings()
    key = cache_key(
        (
            "arithmetic-model",
            json.dumps(asdict(s), sort_keys=True),
            hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
            version("torch"),
            version("transformers"),
            version("tokenizers"),
        )
    )
    return cached_dir(cache_root, key, lambda out: make_arithmetic_model(out, s, log=log))


def main(argv: Sequence[str] | None = None) -> None:
    from asyncgrpo.console import plain_help

    parser = argparse.ArgumentParser(
        prog="python -m asyncgrpo.testing.arithmetic", description=plain_help(__doc__)
    )
    parser.add_argument("out_dir", type=Path)
    defaults = BuildSettings()
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--steps",
        type=int,
        default=defaults.steps,
        help="training steps (fewer: a weaker model, sooner)",
    )
    parser.add_argument(
        "--reduced",
        action="store_true",
        help="the tests' build: seconds, and a model that has learnt nothing",
    )
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="build into OUT_DIR directly, not through the user's cache of test models",
    )
    args = parser.parse_args(argv)
    settings = REDUCED if args.reduced else BuildSettings(seed=args.seed, steps=args.steps)
    if args.no_cache:
        path = make_arithmetic_model(args.out_dir, settings)
    else:
        from asyncgrpo.testing.model_cache import DONE, default_cache_root

        built = cached_arithmetic_model(default_cache_root(), settings)
        if args.out_dir.exists():
            shutil.rmtree(args.out_dir)
        path = Path(shutil.copytree(built, args.out_dir, ignore=shutil.ignore_patterns(DONE)))
    build = json.loads((path / "build.json").read_text())
    print(
        json.dumps(
            {
                "model": str(path),
                "build_s": build["build_s"],
                "heldout_greedy": build.get("heldout_greedy", {}).get("all"),
                "heldout_t1": build.get("heldout_t1", {}).get("all"),
            }
        )
    )


if __name__ == "__main__":
    main()
