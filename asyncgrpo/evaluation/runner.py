"""One evaluation: the held-out prompts, k completions each under one served name, scored.

Generation goes through the same environment and policy client as training rollouts (so a
multi-turn environment is evaluated the way it is trained), with the ``eval`` section's own
sampling (k, temperature, max tokens) and at most ``eval.max_inflight`` completions in flight,
its bound on the fleet's time while training goes on.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from asyncgrpo.config.rollout import DatasetConfig, GenerationConfig, RolloutConfig
from asyncgrpo.errors import ConfigError, EpisodeError
from asyncgrpo.evaluation.scores import Graded, summarize
from asyncgrpo.proxy.http.headers import RUN_HEADER
from asyncgrpo.rollout.dataset import Prompt, PromptDataset, read_rows, split_rows
from asyncgrpo.rollout.environment import group_rewards, load_environment
from asyncgrpo.rollout.policy import PolicyClient
from asyncgrpo.rollout.rewards import RewardScorer
from asyncgrpo.vllm.client import VLLMClient

if TYPE_CHECKING:
    from asyncgrpo.config.evaluation import EvalConfig
    from asyncgrpo.config.training import TrainingConfig

__all__ = ["EvalReport", "eval_prompts", "eval_rows", "eval_run", "evaluate"]


def eval_run(prefix: str) -> str:
    """The proxy run an evaluation of run ``prefix`` counts for (``X-Asyncgrpo-Run``): one of
    its own, with ``eval.share_weight``, though it generates under the run's adapter names."""
    return f"{prefix}-eval"


logger = logging.getLogger(__name__)


@dataclass
class EvalReport:
    """What one evaluation measured: ``eval/*`` metrics and one row per completion."""

    version: int
    model: str
    metrics: dict[str, float]
    rows: list[dict[str, Any]]


def _key(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def _prompt_of(row: Any, column: str) -> Any:
    return row.get(column) if isinstance(row, dict) else row


def eval_rows(cfg: TrainingConfig) -> tuple[list[Any], str]:
    """The held-out rows and their prompt column (nothing tokenized: a dry run reads them);
    ``ConfigError`` when told to be disjoint from the training set and they are not."""
    e = _section(cfg)
    if e.holdout is not None:
        _, rows = split_rows(read_rows(cfg.dataset), e.holdout, seed=cfg.dataset.seed)
        return rows, cfg.dataset.prompt_column
    source = DatasetConfig(
        path=e.path,
        prompts=e.prompts,
        subset=e.subset,
        split=e.split,
        prompt_column=e.prompt_column,
        epochs=1,
        shuffle=False,
    )
    rows = read_rows(source)
    if e.check_disjoint:
        trained = {_key(_prompt_of(r, cfg.dataset.prompt_column)) for r in read_rows(cfg.dataset)}
        both = [p for r in rows if _key(p := _prompt_of(r, e.prompt_column)) in trained]
        if both:
            raise ConfigError(
                f"eval: {len(both)} of {len(rows)} held-out prompts are also in the training "
                f"set (first: {str(both[0])[:80]!r}); remove them, or set "
                "eval.check_disjoint=false"
            )
    return rows, e.prompt_column


def eval_prompts(cfg: TrainingConfig, tokenizer: Any) -> list[Prompt]:
    """The held-out prompts, tokenized, in their file's order (at most ``eval.max_prompts``)."""
    rows, column = eval_rows(cfg)
    dataset = PromptDataset(
        rows,
        tokenizer=tokenizer,
        prompt_column=column,
        epochs=1,
        shuffle=False,
        max_prompt_tokens=cfg.dataset.max_prompt_tokens,
    )
    prompts = list(dataset.iter_from(0))
    limit = _section(cfg).max_prompts
    return prompts[:limit] if limit is not None else prompts


def _section(cfg: TrainingConfig) -> EvalConfig:
    if cfg.eval is None:
        raise ConfigError("no eval section in the config: add one (docs/eval.md)")
    return cfg.eval


def _sampling(cfg: TrainingConfig) -> tuple[GenerationConfig, RolloutConfig]:
    """The training settings with the evaluation's sampling. The generation section is copied
    and changed in place: its checks are training's (GRPO needs G >= 2 and a temperature > 0),
    and an evaluation may ask for one greedy completion."""
    e = _section(cfg)
    gen = copy.copy(cfg.generation)
    gen.num_generations = e.num_generations
    gen.temperature = e.temperature
    gen.max_completion_length = e.max_tokens or cfg.generation.max_completion_length
    gen.seed = None
    rollout = dataclasses.replace(
        cfg.rollout,
        reward_funcs=list(
            e.reward_funcs if e.reward_funcs is not None else cfg.rollout.reward_funcs
        ),
        reward_weights=None if e.reward_funcs is not None else cfg.rollout.reward_weights,
        max_inflight=e.max_inflight,
    )
    return gen, rollout


class _Counter:
    """Counts the prompts graded (or given up on) and tells ``on_graded(done, total)``."""

    def __init__(self, total: int, on_graded: Callable[[int, int], None] | None) -> None:
        self.total, self.done, self.on_graded = total, 0, on_graded

    def __call__(self) -> None:
        self.done += 1
        if self.on_graded is not None:
            self.on_graded(self.done, self.total)


def _rows(
    version: int, prompt: Prompt, episodes: Sequence[Any], scores: Any
) -> list[dict[str, Any]]:
    """eval.jsonl's lines of one prompt's graded episodes."""
    return [
        {
            "version": version,
            "prompt_index": prompt.index,
            "prompt": prompt.prompt,
            "completion": ep.completion,
            "reward": scores.rewards[j],
            "rewards": {n: v[j] for n, v in scores.per_func.items()},
            "completion_tokens": len(ep.completion_ids),
            "finish_reason": ep.finish_reason,
        }
        for j, ep in enumerate(episodes)
    ]


async def evaluate(
    cfg: TrainingConfig,
    *,
    base_url: str,
    api_key: str | None,
    model: str,
    version: int,
    prompts: Sequence[Prompt],
    tokenizer: Any,
    run: str | None = None,
    on_graded: Callable[[int, int], None] | None = None,
) -> EvalReport:
    """Evaluate the served ``model`` (adapter ``version``) on ``prompts``; ``run``: the proxy
    run its requests count for (:func:`eval_run`), else the run ``model`` names.
    ``on_graded(done, total)`` hears of each prompt graded (or given up on)."""
    e = _section(cfg)
    gen, rollout = _sampling(cfg)
    environment = load_environment(
        rollout.environment, rollout.environment_args, tokenizer=tokenizer, generation=gen
    )
    scorer = None
    if rollout.reward_funcs or not environment.provides_reward:
        scorer = RewardScorer(
            rollout.reward_funcs,
            weights=rollout.reward_weights,
            max_threads=rollout.reward_max_threads,
        )
    graded: list[Graded] = []
    rows: list[dict[str, Any]] = []
    limiter = anyio.CapacityLimiter(max(1, e.max_inflight // e.num_generations))
    t0 = time.perf_counter()
    async with VLLMClient(
        base_url,
        api_key=api_key,
        headers=None if run is None else {RUN_HEADER: run},
        timeout_s=rollout.request_timeout_s,
    ) as client:
        policy = PolicyClient(
            client=client,
            generation=gen,
            rollout=rollout,
            policy=lambda: (model, version),
        )

        graded_one = _Counter(len(prompts), on_graded)

        async def one(prompt: Prompt) -> None:
            async with limiter:
                try:
                    episodes = await environment.group(prompt, policy, e.num_generations)
                except EpisodeError as exc:  # that prompt is not graded; the eval goes on
                    logger.warning("eval prompt %d: environment failed: %s", prompt.index, exc)
                    graded_one()
                    return
                scores = await group_rewards(scorer, prompt, episodes)
            graded_one()
            graded.append(
                Graded(
                    rewards=scores.rewards,
                    per_func=scores.per_func,
                    completion_tokens=[len(ep.completion_ids) for ep in episodes],
                )
            )
            rows.extend(_rows(version, prompt, episodes, scores))

        async with environment.running(), anyio.create_task_group() as tg:
            for prompt in prompts:
                tg.start_soon(one, prompt)
    metrics = summarize(graded, k=e.num_generations, threshold=e.pass_threshold)
    metrics["eval/version"] = float(version)
    metrics["eval/seconds"] = time.perf_counter() - t0
    rows.sort(key=lambda r: r["prompt_index"])
    return EvalReport(version=version, model=model, metrics=metrics, rows=rows)
