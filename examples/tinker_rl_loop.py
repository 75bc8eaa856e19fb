"""An RL loop in tinker-cookbook's ``rl_loop`` shape, on the demo's digits task, through the SDK.

Every step: save the weights and get a sampling client, sample a group of completions per
prompt, reward each by the share of its characters that are digits, centre the rewards in
each group, and take one step on the tokens sampled with ``rl_loop``'s default loss,
``stable_reinforce``: the sampling client records what it samples
(``record_stability_info=True``) and each datum names its sampled sequence (provenance), as
``rl_loop`` does (``--loss importance_sampling`` for the plain one). Run it against a service
with sampling (``docs/tinker.md``)::

    python examples/tinker_rl_loop.py --base-url http://127.0.0.1:8000 --model runs/tiny-model

It prints one line per step and, last, a JSON line with every step's mean reward.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import tinker
from tinker import types

PROMPTS = ["count to five", "name a color", "what is two plus two", "say something about the sea",
           "name an animal", "describe the sky", "pick a number", "say yes or no"]  # fmt: skip


def digit_reward(text: str) -> float:
    chars = [c for c in text if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


def with_sampled_provenance(datum: types.Datum, prompt_len: int, seq) -> types.Datum:
    """Name the sampled sequence behind every position: the input is the prompt and all but
    the last sampled token, the targets the same shifted by one."""
    sid, n = seq.sequence_id, len(seq.tokens)
    return datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sid, length=prompt_len),
                     types.SampledProvenanceSpan(sequence_id=sid, length=n - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sid, offset=1,
                                                   length=prompt_len - 1),
                        types.SampledProvenanceSpan(sequence_id=sid, length=n)],
    )  # fmt: skip


def group_data(
    prompt: list[int], sequences: list, rewards: list[float], provenance: bool = True
) -> list[types.Datum]:
    """The group's datums: rewards centred on their mean, the advantage on every sampled
    token, zero (and no loss) on the prompt's; each naming its sampled sequence."""
    mean = sum(rewards) / len(rewards)
    data = []
    for seq, reward in zip(sequences, rewards, strict=True):
        tokens = list(seq.tokens)
        if not tokens:
            continue
        full = prompt + tokens
        pad = [0.0] * (len(prompt) - 1)
        inputs = {"target_tokens": full[1:], "logprobs": pad + list(seq.logprobs),
                  "advantages": pad + [reward - mean] * len(tokens)}  # fmt: skip
        datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                            loss_fn_inputs=inputs)  # fmt: skip
        data.append(with_sampled_provenance(datum, len(prompt), seq) if provenance else datum)
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=os.environ.get("TINKER_BASE_URL"))
    parser.add_argument("--model", required=True, help="the service's base_model")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4, help="prompts per step")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=3e-2)
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loss", default="stable_reinforce",
                        choices=("stable_reinforce", "importance_sampling", "ppo", "cispo"))  # fmt: skip
    args = parser.parse_args()
    stable = args.loss == "stable_reinforce"

    service = tinker.ServiceClient(base_url=args.base_url)
    training = service.create_lora_training_client(
        base_model=args.model, rank=args.rank, seed=args.seed
    ).result()
    tokenizer = training.get_tokenizer()
    adam = types.AdamParams(learning_rate=args.learning_rate, beta1=0.0, beta2=0.95, eps=1e-8)
    means = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        sampler = training.save_weights_and_get_sampling_client(
            record_stability_info=stable
        ).result()
        texts = [PROMPTS[(step * args.groups + i) % len(PROMPTS)] for i in range(args.groups)]
        prompts = [tokenizer.encode(t) for t in texts]
        params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0,
                                      seed=args.seed * 100_000 + step)  # fmt: skip
        futures = [sampler.sample(types.ModelInput.from_ints(p), args.group_size, params)
                   for p in prompts]  # fmt: skip
        data, rewards = [], []
        for prompt, future in zip(prompts, futures, strict=True):
            sequences = future.result().sequences
            group = [digit_reward(tokenizer.decode(list(s.tokens))) for s in sequences]
            rewards += group
            if max(group) > min(group):  # a group with one reward teaches nothing
                data += group_data(prompt, sequences, group)
        if data:
            training.forward_backward(data, args.loss)
            training.optim_step(adam).result()
        means.append(sum(rewards) / len(rewards))
        print(f"step {step}: reward {means[-1]:.3f}  {time.perf_counter() - t0:.2f} s", flush=True)
    service.close("success").result()
    print(json.dumps({"rewards": means}), flush=True)


if __name__ == "__main__":
    main()
