"""The tool-calling test model (``asyncgrpo.testing.tool_model``) calls the calculator's tool every
time at the temperature the tests sample it at.

This builds the session's ``tool_model`` (cached per checkout under ``make test``) in the
session of tests that start no vLLM replica, which runs on several workers: the vLLM tests that
serve it then find it built.
"""

from __future__ import annotations

from pathlib import Path


def _wrong_mass(model_dir: Path, temperature: float) -> list[float]:
    """Per calculator episode, the chance that sampling at ``temperature`` leaves the episode's
    model tokens somewhere (1 - the product of their probabilities, teacher-forced)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncgrpo.testing.envs import calculator_tasks
    from asyncgrpo.testing.tool_model import _episode_ids

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for row in calculator_tasks(64):
        ids, mask = _episode_ids(tokenizer, row)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        targets = torch.tensor(ids[1:])
        picked = logp.gather(1, targets[:, None])[:, 0][torch.tensor(mask[1:])]
        out.append(float(-torch.expm1(picked.sum())))
    return out


def test_the_tool_model_writes_each_episodes_tool_call_and_answer(
    tool_model: Path, tiny_model: Path
) -> None:
    wrong = _wrong_mass(tool_model, temperature=0.5)
    # run/test_training_v1.py samples 32 episodes at 0.5 and needs a tool call in every one: at
    # most 32 x 1e-4 (0.3 %) that any misses. Built here: 1.9e-5 (docs/benchmarks.md); another
    # CPU's float results may move it, a build of half the steps does not pass (8.2e-2).
    assert max(wrong) <= 1e-4, sorted(wrong)[-5:]
    assert max(_wrong_mass(tool_model, temperature=1.0)) < 0.1  # docs/benchmarks.md: 6.8e-2
    base = _wrong_mass(tiny_model, temperature=0.5)  # the random model it was tuned from
    assert min(base) > 0.99, sorted(base)[:5]
