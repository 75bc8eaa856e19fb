"""Settings of the rollout side: which prompts, how completions are sampled, how rollouts run.

Three keyword-only dataclasses: ``DatasetConfig`` (where prompts come from, epochs, shuffling),
``GenerationConfig`` (what vLLM is asked for) and ``RolloutConfig`` (concurrency, queueing,
scoring, retries). ``asyncgrpo.config.training`` nests them
in the run's ``TrainingConfig``; every field's ``help`` doubles as CLI help.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from asyncgrpo.config.coerce import check_fields
from asyncgrpo.errors import ConfigError

RequestMode = Literal["n", "per_sample"]

_IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


@dataclass(kw_only=True)
class DatasetConfig:
    """Where prompts come from and in which order.

    Rows are TRL-style: a ``prompt`` column holding a string (plain text, tokenized as is) or a
    list of chat messages (rendered with the tokenizer's chat template and
    ``add_generation_prompt=True``). Other columns reach the reward functions as kwargs.
    """

    path: str | None = None
    """A local .jsonl/.json file, or a `datasets` name or directory (loaded with
    datasets.load_dataset). Exactly one of path and prompts."""
    prompts: list[Any] | None = None
    """Inline rows: strings, message lists, or dicts with a prompt column."""
    subset: str | None = None
    """`datasets` configuration name (load_dataset's `name`)."""
    split: str = "train"
    """`datasets` split to read."""
    prompt_column: str = "prompt"
    """Column holding the prompt."""
    epochs: int | None = 1
    """Passes over the prompts; None: repeat forever."""
    shuffle: bool = True
    """Shuffle each epoch with a permutation seeded by seed."""
    seed: int = 0
    """Shuffle seed; epoch e uses a permutation derived from it."""
    max_prompt_tokens: int | None = None
    """Skip (and count) prompts longer than this many tokens; None: keep all."""

    def __post_init__(self) -> None:
        if (self.path is None) == (self.prompts is None):
            raise ConfigError(
                "dataset: set exactly one of dataset.path (JSONL file or `datasets` name) and "
                "dataset.prompts (an inline list)"
            )
        if self.prompts is not None and not self.prompts:
            raise ConfigError("dataset.prompts is empty: give at least one prompt")
        check_fields(self, "dataset", ge={"epochs": 1, "max_prompt_tokens": 1})


@dataclass(kw_only=True)
class GenerationConfig:
    """Sampling parameters sent to ``/v1/completions`` for every rollout.

    ``temperature`` also reaches the trainer (through each ``Sample``): vLLM's
    ``processed_logprobs`` are taken after temperature, so the trainer divides its logits by it.
    """

    num_generations: int = 8
    """G: completions per prompt; advantages are normalised within a group."""
    max_completion_length: int = 256
    """Maximum new tokens per completion (vLLM `max_tokens`)."""
    temperature: float = 1.0
    """Sampling temperature (> 0). The trainer scales its logits by it too."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = -1
    """Top-k sampling; -1 disables it."""
    min_p: float = 0.0
    """Min-p sampling, in [0, 1]; 0 disables."""
    repetition_penalty: float = 1.0
    """vLLM repetition penalty (> 0); 1.0 disables it."""
    stop: list[str] = field(default_factory=list)
    """Stop strings; generation ends before them (vLLM `stop`)."""
    seed: int | None = None
    """Base sampling seed. None: vLLM samples freely. Set: completion i of the prompt at dataset
    position p uses seed + p * G + i (in both request modes). Caution: vLLM 0.32 on CPU kills
    its engine when a seeded request's prefill is chunked ('CPU Generator does not use offset');
    keep None with CPU replicas."""
    request_mode: RequestMode = "n"
    """'n': one request with n=G per prompt (vLLM prefills once; single-turn tasks).
    'per_sample': G requests with n=1 (turns that diverge)."""

    def __post_init__(self) -> None:
        if self.num_generations < 2:
            raise ConfigError(
                f"generation.num_generations={self.num_generations}: GRPO needs at least 2 "
                "completions per prompt to compute group advantages; set it to 2 or more"
            )
        if not self.temperature > 0:
            raise ConfigError(
                f"generation.temperature={self.temperature}: must be > 0 (greedy decoding "
                "gives identical completions and zero advantages); use e.g. 1.0"
            )
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigError(
                f"generation.top_k={self.top_k}: use -1 to disable or a positive integer"
            )
        check_fields(
            self,
            "generation",
            ge={"max_completion_length": 1, "min_p": 0},
            gt={"top_p": 0, "repetition_penalty": 0},
            le={"top_p": 1, "min_p": 1},
        )
        if isinstance(self.stop, str):
            self.stop = [self.stop]


@dataclass(kw_only=True)
class RolloutConfig:
    """Scheduling of rollouts: concurrency caps, the sample queue, scoring and retries.

    ``max_inflight`` counts completions, not HTTP requests: a request with ``n=G`` holds G.
    """

    retired_keys: ClassVar[dict[str, str]] = {
        "max_inflight_per_replica": "the proxy balances load over the replicas now; delete it "
        "(rollout.max_inflight caps completions in flight)",
    }
    """Keys earlier releases accepted, with what replaces them (named in the error)."""

    max_inflight: int = 64
    """Global cap on completions admitted at once (a group of G holds G until it is handed to
    scoring). Too low and extra replicas sit idle; >= num_generations."""
    queue_maxsize: int = 256
    """Capacity of the scored-sample queue, in samples. A full queue blocks scoring
    (rollout/backpressure_s), which then blocks generation."""
    environment: str | dict[str, Any] | None = None
    """The environment that turns a prompt into episodes: an import path 'pkg.module:Class' (a
    subclass of asyncgrpo.rollout.environment.Environment, e.g. a MultiTurnEnv with tools), or
    {verifiers: NAME, args: {...}} for an installed verifiers environment (asyncgrpo[envs]),
    with python: PATH to run a verifiers 0.4 one in its own process from the venv of that
    Python. None: single-turn completions."""
    environment_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's constructor, e.g. {max_turns: 3}."""
    reward_funcs: list[str] = field(default_factory=list)
    """Reward functions as import paths 'pkg.module:fn', called as fn(prompts, completions,
    **kwargs) -> list[float | None] once per group. Optional when the environment scores its
    own episodes."""
    reward_weights: list[float] | None = None
    """Weights of reward_funcs in the combined reward; None: all 1.0."""
    reward_max_threads: int = 4
    """Worker threads shared by synchronous reward functions."""
    score_concurrency: int = 4
    """Groups scored at once; generation waits when all are busy."""
    request_timeout_s: float = 600.0
    """Deadline of one completion request, seconds (then it is retried)."""
    retries: int = 5
    """Retries of a request after a transport error (connection refused/reset, HTTP 5xx or 429,
    timeout). Other HTTP 4xx answers are errors, not retried."""
    retry_backoff_s: float = 0.5
    """First retry delay, seconds; doubles on each retry (capped at 30 s)."""
    share_weight: float = 1.0
    """This run's weight when several runs share the replicas through one proxy and saturate
    them: each gets a share of generation proportional to its weight (0.001 to 1000)."""

    def __post_init__(self) -> None:
        check_fields(
            self,
            "rollout",
            gt={"request_timeout_s": 0},
            le={"share_weight": 1000},
            ge={
                "retries": 0,
                "retry_backoff_s": 0,
                "share_weight": 0.001,
                **dict.fromkeys(
                    ("max_inflight", "queue_maxsize", "reward_max_threads", "score_concurrency"), 1
                ),
            },
        )
        if isinstance(self.reward_funcs, str):
            self.reward_funcs = [self.reward_funcs]
        if isinstance(self.environment, dict):
            env = self.environment
            if (
                not isinstance(env.get("verifiers"), str)
                or not isinstance(env.get("args", {}), dict)
                or not isinstance(env.get("python", ""), str)
                or set(env) - {"verifiers", "args", "python"}
            ):
                raise ConfigError(
                    f"rollout.environment={env!r}: a verifiers environment is written "
                    "{verifiers: NAME, args: {...}, python: PATH} (args and python optional)"
                )
        elif self.environment is not None and not _IMPORT_PATH.fullmatch(self.environment):
            raise ConfigError(
                f"rollout.environment={self.environment!r}: write it as an import path "
                "'package.module:Class'"
            )
        for path in self.reward_funcs:
            if not isinstance(path, str) or not _IMPORT_PATH.fullmatch(path):
                raise ConfigError(
                    f"rollout.reward_funcs entry {path!r}: write it as an import path "
                    "'package.module:function'"
                )
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ConfigError(
                f"rollout.reward_weights has {len(self.reward_weights)} entries for "
                f"{len(self.reward_funcs)} reward_funcs: give one weight per function, or None"
            )

    def check_against(self, generation: GenerationConfig) -> None:
        """Cross-field check: one group must fit under the in-flight cap, or nothing runs."""
        if self.max_inflight < generation.num_generations:
            raise ConfigError(
                f"rollout.max_inflight={self.max_inflight} < generation.num_generations="
                f"{generation.num_generations}: a group of G completions is admitted whole; "
                "raise max_inflight to at least num_generations"
            )
