"""A tiny Qwen2 causal LM with a locally trained BPE tokenizer, for CPU tests and demos.

Why these shapes: vLLM's CPU attention supports head_dim 64 but crashes on 16, so the model has
hidden 128 with 2 heads (head_dim 64) and one KV head; two layers keep a vLLM replica at ~30 s
start-up. The tokenizer is a byte-level BPE trained on a generated corpus, so no download is
needed, and the chat template follows Qwen's ``<|im_start|>role ... <|im_end|>`` form.

CLI: ``python -m asyncgrpo.testing.tiny OUT_DIR [--seed N] [--lora-out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncgrpo.serve import ServeConfig

WORDS = (
    "the a an one two three four five six seven eight nine ten zero cat dog bird fish red blue "
    "green yellow big small fast slow up down left right yes no maybe add plus minus times equals "
    "what is of and or not to in on at for with from by answer question number word sum count "
    "sky sea sun moon star tree road house river stone light dark hot cold new old good bad"
).split()
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _corpus(seed: int, lines: int = 2000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
        if rng.random() < 0.3:
            words.append(f"{rng.randint(0, 99)} + {rng.randint(0, 99)} = {rng.randint(0, 198)}")
        out.append(" ".join(words) + rng.choice([".", "?", "!"]))
    return out


def chat_tokenizer(
    corpus: Sequence[str], vocab_size: int, out: Path, *, individual_digits: bool = False
) -> Any:
    """A byte-level BPE trained on ``corpus`` with the chat special tokens and template (a
    ChatML subset, as Qwen's), saved to ``out``: every test model's tokenizer.
    ``individual_digits`` splits numbers into one token per digit, as Qwen's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token=None))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if individual_digits
        else byte_level
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer=trainer)
    bpe.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return tokenizer


def make_tiny_model(
    path: str | Path,
    seed: int = 0,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int = 256,
    vocab_size: int = 384,
    max_position_embeddings: int = 2048,
    initializer_range: float = 0.1,
) -> Path:
    """Write a random-weight Qwen2 model, its tokenizer and chat template to ``path``.

    ``initializer_range`` is 0.1, not transformers' 0.02: with tied embeddings that small the
    logits of a 128-wide model stay within about +-1 whatever LoRA does to the hidden state (the
    final norm caps it), so no policy could learn; at 0.1 the random policy is still high-entropy
    but a rank-1 LoRA can move probability mass by orders of magnitude.

    Deterministic for a seed: the same seed gives byte-identical weights and tokenizer. Pass a
    larger ``hidden_size``/``num_layers`` for a generation-bound benchmark model; keep
    ``hidden_size / num_heads == 64``.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncgrpo.trainer.model import no_progress_bars

    if hidden_size // num_heads != 64:
        raise ValueError(
            "hidden_size / num_heads must be 64: vLLM's CPU attention needs head_dim 64"
        )
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = chat_tokenizer(_corpus(seed), vocab_size, out)

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=1,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        initializer_range=initializer_range,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    with no_progress_bars():
        model.save_pretrained(out, safe_serialization=True)
    generation_config = out / "generation_config.json"
    if generation_config.exists():
        generation_config.unlink()  # vLLM would apply its defaults over our sampling params
    return out


def make_lora_adapter(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    r: int = 8,
    alpha: int = 16,
    seed: int = 0,
    scale: float = 0.1,
    target_modules: Sequence[str] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ),
) -> Path:
    """Write a peft LoRA adapter for ``model_dir`` whose B matrices are non-zero.

    A freshly initialised LoRA has B = 0 and changes nothing; tests that must detect a wrong or
    stale adapter need one that moves the logprobs, hence the random B.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from asyncgrpo.trainer.model import no_progress_bars

    torch.manual_seed(seed)
    with no_progress_bars():
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(
        base,
        LoraConfig(r=r, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=0.0),
    )
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, scale)
    out = Path(out_dir)
    peft_model.save_pretrained(out, safe_serialization=True)
    return out


class ReferencePolicy:
    """transformers (+ peft) in float32, unpacked, one sequence at a time: the plain reference
    that served logprobs and the trainer's packed path are checked against."""

    def __init__(self, model_dir: str | Path, adapter_dir: str | Path | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from asyncgrpo.trainer.model import no_progress_bars

        with no_progress_bars():
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if adapter_dir is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapter_dir)
        self.model = model.eval()

    def logprobs(
        self, prompt_ids: Sequence[int], completion_ids: Sequence[int], *, temperature: float = 1.0
    ) -> list[float]:
        import torch

        ids = torch.tensor([[*prompt_ids, *completion_ids]])
        with torch.no_grad():
            logits = self.model(input_ids=ids).logits[0].float() / temperature
        logp = torch.log_softmax(logits, dim=-1)
        start = len(prompt_ids)
        return [float(logp[start + i - 1, tok]) for i, tok in enumerate(completion_ids)]


def reference_logprobs(
    model_dir: str | Path,
    adapter_dir: str | Path | None,
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    *,
    temperature: float = 1.0,
) -> list[float]:
    """Per-token logprobs of ``completion_ids`` under :class:`ReferencePolicy`."""
    policy = ReferencePolicy(model_dir, adapter_dir)
    return policy.logprobs(prompt_ids, completion_ids, temperature=temperature)


def tiny_serve_config(model: str | Path, **overrides: Any) -> ServeConfig:
    """How tests and the demo start replicas of the tiny model.

    float32 for exact logprobs; a 1 GiB KV cache and 1024-token context keep a replica near
    2 GB; ``max_staleness=2`` gives ``--max-loras 4``; ``nice=10`` as on any host shared with a
    CPU trainer.
    """
    from asyncgrpo.serve import ServeConfig

    defaults: dict[str, Any] = {
        "dtype": "float32",
        "max_model_len": 1024,
        "kv_cache_gib": 1,
        "lora_rank": 8,
        "max_staleness": 2,
        "startup_timeout_s": 600,
        "nice": 10,
    }
    return ServeConfig(model=str(model), **{**defaults, **overrides})


def main(argv: Sequence[str] | None = None) -> None:
    from asyncgrpo.console import plain_help

    parser = argparse.ArgumentParser(
        prog="python -m asyncgrpo.testing.tiny", description=plain_help(__doc__)
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora-out", type=Path, help="also write a LoRA adapter (non-zero B) here")
    args = parser.parse_args(argv)
    path = make_tiny_model(args.out_dir, seed=args.seed)
    print(json.dumps({"model": str(path)}))
    if args.lora_out:
        print(json.dumps({"adapter": str(make_lora_adapter(path, args.lora_out, seed=args.seed))}))


if __name__ == "__main__":
    main()
