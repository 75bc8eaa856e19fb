"""Evaluation in a run, on real vLLM replicas: the base model before the first step and the
final version after the last, on prompts the trainer never sees."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import yaml

from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.errors import ConfigError
from asyncgrpo.evaluation.records import EVAL_FILE, read_evals
from asyncgrpo.evaluation.runner import eval_prompts
from asyncgrpo.rollout.dataset import load_tokenizer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"


def _config(tmp_path: Path, model: Path, urls: Sequence[str], *overrides: str) -> TrainingConfig:
    data = yaml.safe_load(EXAMPLE.read_text())
    data.update(model=str(model), output_dir=str(tmp_path), run_name="ev")
    data["trainer"]["max_staleness"] = 2  # the session's replicas hold 4 adapters
    data["serve"] = {"replicas": 0}
    data["proxy"]["upstreams"] = list(urls) or ["http://127.0.0.1:9"]
    data.pop("eval", None)
    return TrainingConfig.from_dict(data, overrides)


def test_held_out_prompts_must_not_be_training_prompts(tmp_path, tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    cfg = _config(tmp_path, tiny_model, [], 'eval.prompts=["name a fruit", "name a color"]')
    with pytest.raises(ConfigError, match="1 of 2 held-out prompts are also in the training"):
        eval_prompts(cfg, tokenizer)
    cfg = _config(
        tmp_path,
        tiny_model,
        [],
        'eval.prompts=["name a fruit", "name a color"]',
        "eval.check_disjoint=false",
    )
    assert [p.prompt for p in eval_prompts(cfg, tokenizer)] == ["name a fruit", "name a color"]
    cfg = _config(tmp_path, tiny_model, [], "eval.holdout=0.25", "eval.max_prompts=1")
    assert len(eval_prompts(cfg, tokenizer)) == 1


def test_a_version_not_published_is_refused_naming_every_published_one():
    from asyncgrpo.run.evaluation import pick_versions

    published = [*range(94), 95, 96, *range(98, 104)]
    with pytest.raises(ConfigError) as refused:
        pick_versions(published, version=999, base=False, every=False)
    assert str(refused.value) == (
        "version 999 is not published (published versions: 0-93, 95, 96, 98-103)"
    )


@pytest.mark.anyio
async def test_evaluating_a_run_that_never_started_says_so_and_makes_no_directory(
    tmp_path, tiny_model
):
    from asyncgrpo.run.evaluation import evaluate_published

    cfg = _config(tmp_path / "out", tiny_model, [], 'eval.prompts=["what flies on a string"]')
    with pytest.raises(ConfigError, match=r"no run has started in .*: train first"):
        await evaluate_published(cfg)
    assert not (tmp_path / "out").exists()


@pytest.mark.vllm
@pytest.mark.anyio
async def test_a_run_evaluates_base_and_final_on_prompts_it_never_trains_on(
    vllm_replicas, tiny_model, tmp_path
):
    from asyncgrpo.run.training import run_training

    cfg = _config(
        tmp_path,
        tiny_model,
        [r.url for r in vllm_replicas],
        "trainer.max_steps=3",
        "eval.holdout=0.25",
        "eval.num_generations=2",
    )
    held = [p.prompt for p in eval_prompts(cfg, load_tokenizer(tiny_model))]
    assert len(held) == 2
    trained: set[str] = set()
    tokenizer = load_tokenizer(tiny_model)
    held_ids = {tuple(p.prompt_ids) for p in eval_prompts(cfg, tokenizer)}

    def on_step(step, samples, version):
        trained.update(tuple(s.prompt_ids) for s in samples)

    result = await run_training(cfg, on_step=on_step)
    assert trained and trained.isdisjoint(held_ids)
    evals = read_evals(result.run_dir)
    assert [e["eval/version"] for e in evals] == [0, result.final_version]
    assert [e["step"] for e in evals] == [0, 3]
    for e in evals:
        assert e["eval/prompts"] == 2 and e["eval/completions"] == 4
        assert 0.0 <= e["eval/reward"] <= 1.0 and 0.0 <= e["eval/pass@1"] <= e["eval/pass@2"]
        assert e["eval/seconds"] > 0 and e["eval/completion_tokens"] > 0
        assert "eval/rewards/digit_fraction" in e
    rows = [json.loads(line) for line in (result.run_dir / EVAL_FILE).read_text().splitlines()]
    assert len(rows) == 2 * 2 * 2
    assert {r["prompt"] for r in rows} == set(held)
    assert {r["version"] for r in rows} == {0, result.final_version}
    # the summary `asyncgrpo train` prints ends with the held-out result
    from asyncgrpo.run.progress import run_summary

    summary = run_summary(result, 1.0)
    assert any(
        line.startswith("held-out reward: ")
        and "(version 0) -> " in line
        and f"(version {result.final_version}) over 2 prompts" in line
        for line in summary
    ), summary
    # `asyncgrpo eval` shows what it does while it does it
    from asyncgrpo.run.evaluation import evaluate_published

    heard: list[str] = []

    class Phases:
        def phase(self, text: str) -> None:
            heard.append(text)

        def step(self, step: int, metrics: dict) -> None:
            pass

    final = result.final_version
    (again,) = await evaluate_published(cfg, version=final, progress=Phases())
    assert again["eval/version"] == final
    assert f"evaluating version {final} ({result.adapter_prefix}-v{final})" in heard, heard
    assert heard[-1] == f"version {final}: 2/2 prompts graded", heard


@pytest.mark.vllm
@pytest.mark.anyio
async def test_evaluations_during_training_run_on_pinned_versions_beside_the_trainer(
    vllm_replicas, tiny_model, tmp_path, monkeypatch
):
    """``eval.every=2``: intermediate versions are evaluated, keyed by version, while the
    trainer keeps stepping. The evaluation of version 2 is held in its reward function (a gate
    file) until the trainer is at version 5: it stepped on meanwhile, version 4 fell due and
    was skipped, and version 2 stayed loaded past the window (max_staleness 1); once the
    evaluation ends, version 2 is unloaded while the run goes on."""
    import aiohttp
    import anyio

    from asyncgrpo.run.training import run_training
    from asyncgrpo.testing.rewards import GATE_ENV

    gate = tmp_path / "gate"
    gate.touch()  # open for the base model's evaluation
    monkeypatch.setenv(GATE_ENV, str(gate))
    cfg = _config(
        tmp_path,
        tiny_model,
        [r.url for r in vllm_replicas],
        "trainer.max_steps=10",
        "trainer.max_staleness=1",
        "trainer.samples_per_step=8",
        "generation.num_generations=4",
        "generation.max_completion_length=8",
        "trainer.save_steps=0",
        "eval.holdout=0.25",
        "eval.num_generations=2",
        "eval.every=2",
        'eval.reward_funcs=["asyncgrpo.testing.rewards:gated_digit_fraction"]',
    )
    seen: dict[int, set[int]] = {}  # version trained on -> versions loaded on a replica

    async def loaded() -> set[int]:
        async with aiohttp.ClientSession() as s, s.get(vllm_replicas[0].url + "/v1/models") as r:
            names = [m["id"] for m in (await r.json())["data"]]
        return {int(n.rsplit("-v", 1)[1]) for n in names if n.startswith(f"{cfg.run_name}-")}

    async def on_step(step, samples, version):
        if step == 1:
            gate.unlink()  # the base model is evaluated: hold the next evaluation
        seen[version] = await loaded()
        if version == 5:
            gate.touch()
        if version == 8:  # the held evaluation ended meanwhile: its version goes
            for _ in range(300):
                if 2 not in (now := await loaded()):
                    break
                await anyio.sleep(0.1)
            seen[version] = now

    async def open_gate_at_last() -> None:  # a run that failed early must not hang on it
        await anyio.sleep(120)
        gate.touch()

    async with anyio.create_task_group() as tg:
        tg.start_soon(open_gate_at_last)
        result = await run_training(cfg, on_step=on_step)
        tg.cancel_scope.cancel()
    evals = read_evals(result.run_dir)
    versions = [int(e["eval/version"]) for e in evals]
    assert versions[:2] == [0, 2] and versions[-1] == result.final_version == 10
    assert 4 not in versions and all(v % 2 == 0 for v in versions)
    for e in evals:  # keyed by the version, with the step that published it
        assert e["step"] == e["eval/version"] and e["eval/prompts"] == 2
        assert "eval/rewards/gated_digit_fraction" in e
    rows = [json.loads(line) for line in (result.run_dir / EVAL_FILE).read_text().splitlines()]
    assert {r["version"] for r in rows} == set(versions)
    # The trainer went from version 2 to 5 while version 2's evaluation was held, and version 2
    # stayed loaded, past the window {v - 1, v}; then it was unloaded with steps to come.
    assert all(2 in seen[v] for v in (2, 3, 4, 5)), seen
    assert 2 not in seen[8] and seen[8] >= {7, 8}, seen
    for v, held in seen.items():  # never more than the window and one pinned version
        assert len(held - {v, v - 1}) <= 1, seen
