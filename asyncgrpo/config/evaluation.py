"""The ``eval`` section: which held-out prompts, scored how, sampled how."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncgrpo.config.coerce import check_fields
from asyncgrpo.errors import ConfigError

#: In-training evaluations in flight at once (each pins its version): one.
MAX_PINNED = 1


@dataclass(kw_only=True)
class EvalConfig:
    """Held-out evaluation: the base model (version 0) before the first step, every ``every``
    published versions while training goes on, and the final version after the last step, on
    the fleet, written to ``eval.jsonl`` / ``eval_metrics.jsonl``.

    Prompts come from exactly one of ``path``, ``prompts`` and ``holdout`` (rows of the training
    set kept out of training). Rows are read like the training set's (``dataset`` section).
    """

    path: str | None = None
    """A local .jsonl/.json file, or a `datasets` name or directory."""
    prompts: list[Any] | None = None
    """Inline rows: strings, message lists, or dicts with a prompt column."""
    holdout: float | None = None
    """Share of the training set's rows (chosen by dataset.seed) evaluated and never trained
    on, in (0, 0.5]."""
    subset: str | None = None
    """`datasets` configuration name."""
    split: str = "test"
    """`datasets` split to read."""
    prompt_column: str = "prompt"
    """Column holding the prompt."""
    max_prompts: int | None = None
    """Evaluate at most this many prompts (the first ones); None: all."""
    reward_funcs: list[str] | None = None
    """Import paths of the reward functions; None: rollout.reward_funcs."""
    num_generations: int = 4
    """k: completions per prompt (pass@k is computed for k)."""
    temperature: float = 1.0
    """Sampling temperature; 0: greedy."""
    max_tokens: int | None = None
    """Maximum new tokens per completion; None: generation.max_completion_length."""
    pass_threshold: float = 1.0
    """A completion passes (pass@k) when its reward is at least this."""
    max_inflight: int = 16
    """Most completions of the evaluation in flight at once: its bound on the fleet's time."""
    check_disjoint: bool = True
    """Refuse held-out prompts that also appear in the training set."""
    every: int = 0
    """Also evaluate every N-th published version while training goes on, on that version
    (kept loaded until its evaluation ends); one at a time: a version falling due while one
    runs is skipped. 0: only the base model and the final version."""
    share_weight: float = 0.25
    """The evaluation's weight as a proxy run of its own (``<run>-eval``) beside training's
    rollout.share_weight, when the two saturate the replicas (0.001 to 1000)."""

    def __post_init__(self) -> None:
        given = [n for n in ("path", "prompts", "holdout") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ConfigError(
                "eval: set exactly one of eval.path (a file or `datasets` name), eval.prompts "
                f"(an inline list) and eval.holdout (a share of the training set); got {given}"
            )
        if self.prompts is not None and not self.prompts:
            raise ConfigError("eval.prompts is empty: give at least one prompt")
        if self.holdout is not None and not 0 < self.holdout <= 0.5:
            raise ConfigError(f"eval.holdout={self.holdout}: must be in (0, 0.5]")
        check_fields(
            self,
            "eval",
            ge={
                "num_generations": 1,
                "temperature": 0,
                "max_tokens": 1,
                "max_prompts": 1,
                "max_inflight": 1,
                "every": 0,
                "share_weight": 0.001,
            },
            le={"share_weight": 1000},
        )
        if self.max_inflight < self.num_generations:
            raise ConfigError(
                f"eval.max_inflight={self.max_inflight} < eval.num_generations="
                f"{self.num_generations}: a prompt's k completions are sent together"
            )

    @property
    def pinned_versions(self) -> int:
        """Versions an evaluation keeps loaded past the training window at most: the one an
        in-training evaluation runs on."""
        return MAX_PINNED if self.every else 0
