"""The run's configuration: one ``TrainingConfig`` made of one section per component.

Sections: ``dataset``, ``generation`` and ``rollout`` (``asyncgrpo.config.rollout``), ``proxy``
(``asyncgrpo.config.proxy``), ``serve`` (``asyncgrpo.config.serve``), ``launch``
(``asyncgrpo.config.launch``), ``lora`` and ``trainer`` (``asyncgrpo.config.trainer``), and
here ``logging``. Every field is
keyword-only and documented by the string below it (its ``--help``); every section validates
itself in ``__post_init__`` and raises ``ConfigError`` naming the field and the fix, and
``TrainingConfig`` adds the cross-section checks.

Loading: a YAML file, then ``section.field=value`` overrides from the
command line, each parsed and type-checked against the field's annotation; an unknown key is
fatal and the error lists the valid ones::

    cfg = TrainingConfig.from_yaml("run.yaml", overrides=["trainer.learning_rate=1e-4"])

Between the two, ``ASYNCGRPO_SECTION__FIELD`` environment variables (``ASYNCGRPO_PROXY__API_KEY``)
override the file. Relative paths are then made absolute from the directory the command runs
in (:mod:`asyncgrpo.config.paths`), so a launched job or a sweep point reads what the user meant. Secret fields come only from there: set in the file or as an override they
are refused. The loader (:mod:`asyncgrpo.config.sources`, :mod:`~asyncgrpo.config.coerce`) is
shared with the proxy's and the replicas' own command lines (:mod:`asyncgrpo.config.flags`);
``redacted(cfg)`` is what may be shown of a config (``repr`` shows the same).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncgrpo.config.coerce import check_fields, config_from_dict, to_dict
from asyncgrpo.config.evaluation import EvalConfig
from asyncgrpo.config.launch import LaunchConfig
from asyncgrpo.config.paths import resolve_paths
from asyncgrpo.config.proxy import ProxyConfig
from asyncgrpo.config.redaction import redacted_repr
from asyncgrpo.config.rollout import DatasetConfig, GenerationConfig, RolloutConfig
from asyncgrpo.config.serve import ServeConfig
from asyncgrpo.config.sources import (
    apply_overrides,
    env_overrides,
    parse_yaml,
    read_yaml,
    refuse_file_secrets,
)
from asyncgrpo.config.trainer import LoraConfig, TrainerConfig
from asyncgrpo.errors import ConfigError

logger = logging.getLogger(__name__)

#: Environment variables ``ASYNCGRPO_<SECTION>__<FIELD>`` override the YAML file.
ENV_PREFIX = "ASYNCGRPO_"
#: The repository's example configs, next to the package in a source checkout (the README's
#: install is an editable one), so ``examples/NAME.yaml`` names them from any directory.
EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
#: Matched whole and ASCII only: ``$`` would accept a trailing newline, ``\d`` other digits.
#: At most 119 characters: adapter names ``<run_name>-<8 hex run id>`` stop at 128.
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,118}")


def _check_behaviour_logprobs(generation: GenerationConfig) -> None:
    """Refuse sampling settings whose logprobs the trainer cannot reproduce.

    vLLM (``processed_logprobs``) returns each token's logprob under the distribution it sampled
    from: after penalties, temperature, min_p, top_k and top_p, renormalised over the tokens
    they kept. The trainer recomputes ``log_softmax(logits / temperature)`` only, so with any
    of the others every ratio and importance weight would be biased (upwards: the truncated
    distribution puts more mass on each kept token).
    """
    biased = {
        "top_p": generation.top_p < 1,
        "top_k": generation.top_k != -1,
        "min_p": generation.min_p > 0,
        "repetition_penalty": generation.repetition_penalty != 1,
    }
    for name, on in biased.items():
        if on:
            raise ConfigError(
                f"generation.{name}={getattr(generation, name)!r}: vLLM's logprobs are then of "
                "the truncated or penalised distribution, not of the policy the trainer "
                "recomputes (softmax after temperature only), so every importance ratio would be "
                "biased; sample with temperature only (top_p=1, top_k=-1, min_p=0, "
                "repetition_penalty=1)"
            )


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class LoggingConfig:
    """Where metrics go."""

    jsonl: bool = True
    """Write metrics.jsonl (one object per step) in the run dir."""
    trackio: bool = False
    """Also log to trackio (must be installed)."""
    trackio_project: str | None = None
    """trackio project; None: 'asyncgrpo'."""
    wandb: bool = False
    """Also log to Weights & Biases (``pip install wandb``); the key only from WANDB_API_KEY in
    the environment, or WANDB_MODE=offline to write the run locally."""
    wandb_project: str | None = None
    """W&B project; None: 'asyncgrpo'."""
    wandb_entity: str | None = None
    """W&B entity (user or team); None: the key's default entity."""
    wandb_tags: list[str] = field(default_factory=list)
    """Tags of the W&B run."""
    log_every: int = 1
    """Log metrics every this many steps."""
    level: str = "INFO"
    """Python logging level of the CLI."""

    def __post_init__(self) -> None:
        check_fields(self, "logging", ge={"log_every": 1})
        if self.level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ConfigError(
                f"logging.level={self.level!r}: use DEBUG, INFO, WARNING, ERROR or CRITICAL"
            )


@dataclass(kw_only=True)
class TrainingConfig:
    """Everything one async GRPO run needs; the same file drives every process of a split run."""

    model: str
    """Base model: a local directory or a Hugging Face id."""
    dataset: DatasetConfig
    """Prompts: file, inline list or datasets name."""
    run_name: str = "asyncgrpo"
    """Names the run directory and the adapter versions (<run_name>-<run id>-vN); up to 119
    letters, digits, '.', '_', '-'."""
    output_dir: str = "runs"
    """Parent of the run directory (<output_dir>/<run_name>)."""
    seed: int = 0
    """Seeds torch, Python and the LoRA init."""
    transport_url: str | None = None
    """Storage for adapters, checkpoints and the rollout channel (file://, s3://, hf://). None:
    a local directory inside the run directory."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapter."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Optimisation and cadence."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """Sampling parameters."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout scheduling and scoring."""
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    """The proxy."""
    serve: ServeConfig = field(default_factory=ServeConfig)
    """Local vLLM replicas to start."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """`asyncgrpo launch`: jobs, images, hardware (asyncgrpo.config.launch)."""
    eval: EvalConfig | None = None
    """Held-out evaluation of the base model and the final adapter (asyncgrpo.config.evaluation);
    None: none."""

    __repr__ = redacted_repr  # the generated repr would print credentials in transport_url

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model is empty: give a model directory or a Hugging Face id")
        if not isinstance(self.run_name, str) or not _RUN_NAME.fullmatch(self.run_name):
            raise ConfigError(
                f"run_name={self.run_name!r}: use at most 119 letters, digits, '.', '_' and '-' "
                "(it becomes part of adapter names and storage keys)"
            )
        self.rollout.check_against(self.generation)
        _check_behaviour_logprobs(self.generation)
        # The replicas serve the trained model and adapter: one source for each shared value.
        self.serve = dataclasses.replace(
            self.serve,
            model=self.model,
            lora_rank=self.lora.r,
            max_staleness=self.trainer.max_staleness,
            pinned_versions=self.eval.pinned_versions if self.eval is not None else 0,
        )
        if self.serve.replicas == 0 and not self.proxy.upstreams:
            raise ConfigError(
                "serve.replicas=0 and proxy.upstreams is empty: start local replicas "
                "(serve.replicas=1) or list running ones in proxy.upstreams"
            )
        budget = self.trainer.token_budget
        if budget is not None and self.serve.max_model_len is not None:
            if budget < self.serve.max_model_len:
                logger.warning(
                    "trainer.token_budget=%d < serve.max_model_len=%d: a sample longer than the "
                    "budget gets a row of its own; raise token_budget to bound memory",
                    budget,
                    self.serve.max_model_len,
                )

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run_name

    # -- loading ---------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict[str, Any], overrides: Sequence[str] = ()) -> TrainingConfig:
        """Build from a plain dict (e.g. parsed YAML), after applying ``overrides`` (from a
        command line: a secret field there is refused); its paths are made absolute from the
        current directory (:func:`~asyncgrpo.config.paths.resolve_paths`), once, here."""
        data = apply_overrides(cls, data, overrides, env_prefix=ENV_PREFIX)
        return config_from_dict(cls, resolve_paths(cls, data))

    @classmethod
    def from_yaml(
        cls,
        path: str | Path,
        overrides: Sequence[str] = (),
        environ: Mapping[str, str] | None = None,
    ) -> TrainingConfig:
        """Read a YAML file, then ``ASYNCGRPO_SECTION__FIELD`` variables (``environ``, default
        ``os.environ``), then ``section.field=value`` overrides; validate."""
        data = read_yaml(example_path(path))
        refuse_file_secrets(cls, data, f"config file {path}", env_prefix=ENV_PREFIX)
        return cls.from_dict(env_overrides(cls, data, ENV_PREFIX, environ), overrides)

    @classmethod
    def from_yaml_text(
        cls,
        text: str,
        source: str,
        overrides: Sequence[str] = (),
        environ: Mapping[str, str] | None = None,
    ) -> TrainingConfig:
        """:meth:`from_yaml` for YAML text (a launched job's config arrives in its
        environment); ``source`` names the text in errors."""
        data = parse_yaml(text, source)
        refuse_file_secrets(cls, data, source, env_prefix=ENV_PREFIX)
        return cls.from_dict(env_overrides(cls, data, ENV_PREFIX, environ), overrides)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists, not tuples) that ``from_dict`` turns back into an equal config."""
        return to_dict(self)


def run_transport_url(cfg: TrainingConfig) -> str:
    """``transport_url``, or the directory ``store`` inside the run directory."""
    return cfg.transport_url or str((cfg.run_dir / "store").resolve())


def example_path(path: str | Path) -> Path:
    """``path``; or, for an ``examples/NAME.yaml`` that does not exist here, the checkout's own
    example of that name (so the README's commands run from any directory)."""
    path = Path(path)
    if not path.exists() and path.parts[:1] == ("examples",) and len(path.parts) == 2:
        bundled = EXAMPLES_DIR / path.name
        if bundled.is_file():
            return bundled
    return path
