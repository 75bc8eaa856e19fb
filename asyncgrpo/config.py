"""The run's configuration: one ``TrainingConfig`` made of one section per component.

Sections: ``dataset``, ``generation`` and ``rollout`` (``asyncgrpo.rollout.config``), ``proxy``
(``asyncgrpo.proxy.config``), and here ``lora``, ``trainer``, ``serve`` and ``logging``. Every
field is keyword-only with ``metadata["help"]``; every section validates itself in
``__post_init__`` and raises ``ConfigError`` naming the field and the fix, and
``TrainingConfig`` adds the cross-section checks.

Loading, like nanoGPT's configurator: a YAML file, then ``section.field=value`` overrides from the
command line, each parsed and type-checked against the field's annotation; an unknown key is
fatal and the error lists the valid ones::

    cfg = TrainingConfig.from_yaml("run.yaml", overrides=["trainer.learning_rate=1e-4"])

The loader (``config_from_dict``, ``apply_overrides``) works for any of these dataclasses, so a
component's own CLI (the proxy, a replica) can reuse it.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from asyncgrpo.errors import ConfigError
from asyncgrpo.proxy.config import ProxyConfig
from asyncgrpo.rollout.config import DatasetConfig, GenerationConfig, RolloutConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")

LrSchedule = Literal["constant", "linear", "cosine"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class LoraConfig:
    """The LoRA adapter that is trained and shipped to the replicas (peft ``LoraConfig``)."""

    r: int = field(
        default=1,
        metadata={"help": "Rank. Rank 1 matches full fine-tuning for policy-gradient RL."},
    )
    alpha: float = field(
        default=2.0, metadata={"help": "lora_alpha; the update is scaled by alpha/r."}
    )
    target_modules: str | list[str] = field(
        default="all-linear",
        metadata={"help": "'all-linear' or a list of module names, e.g. [q_proj, v_proj]."},
    )
    dropout: float = field(
        default=0.0,
        metadata={
            "help": "LoRA dropout in [0, 1). Keep 0: with dropout the trainer's logprobs differ "
            "from vLLM's and `ratio` drifts from 1."
        },
    )

    def __post_init__(self) -> None:
        if not 1 <= self.r <= 512:
            raise ConfigError(f"lora.r={self.r}: use 1..512 (vLLM's largest --max-lora-rank)")
        if not self.alpha > 0:
            raise ConfigError(f"lora.alpha={self.alpha}: must be > 0; e.g. 2 * r")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"lora.dropout={self.dropout}: must be in [0, 1); use 0.0")
        if isinstance(self.target_modules, list) and not self.target_modules:
            raise ConfigError("lora.target_modules is empty: use 'all-linear' or list module names")


@dataclass(kw_only=True)
class TrainerConfig:
    """Optimisation: loss, batching, schedule, and the cadence of syncs and checkpoints."""

    learning_rate: float = field(default=4e-5, metadata={"help": "AdamW peak learning rate."})
    lr_schedule: LrSchedule = field(
        default="constant",
        metadata={
            "help": "'constant', 'linear' or 'cosine' decay to 0 at max_steps, after warmup."
        },
    )
    warmup_steps: int = field(
        default=0, metadata={"help": "Optimizer steps of linear warm-up from 0 to learning_rate."}
    )
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    max_grad_norm: float | None = field(
        default=1.0, metadata={"help": "Clip the gradient norm to this; None disables clipping."}
    )
    epsilon: float = field(
        default=0.2, metadata={"help": "Lower clip range: the ratio is clipped at 1 - epsilon."}
    )
    epsilon_high: float | None = field(
        default=None,
        metadata={
            "help": "Upper clip range (1 + epsilon_high); None: same as epsilon. DAPO: 0.28."
        },
    )
    tis_cap: float | None = field(
        default=None,
        metadata={
            "help": "Truncated importance sampling: with a negative advantage the ratio is "
            "truncated at this value (dual clip), so stale samples cannot blow up the loss. "
            "Must exceed 1 + epsilon_high; None disables. E.g. 3.0."
        },
    )
    samples_per_step: int = field(
        default=64, metadata={"help": "Completions consumed by one optimizer step."}
    )
    token_budget: int | None = field(
        default=4096,
        metadata={
            "help": "Tokens per packed row (one row per micro-batch). None: no budget; the "
            "step's samples are split into gradient_accumulation_steps rows instead. Without "
            "flash-attention (CPU) a row's attention costs its length squared: keep it ~1024."
        },
    )
    gradient_accumulation_steps: int = field(
        default=1,
        metadata={
            "help": "Only when token_budget is None: number of micro-batches (packed rows) per "
            "optimizer step. samples_per_step of them gives one sequence per micro-batch."
        },
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata={"help": "Recompute activations in backward: less memory, one more forward."},
    )
    dtype: Dtype = field(
        default="auto",
        metadata={"help": "Base model dtype. 'auto': bfloat16 on CUDA with bf16, else float32."},
    )
    attn_implementation: str | None = field(
        default=None,
        metadata={
            "help": "transformers attn_implementation ('sdpa', 'eager', ...); None: "
            "flash_attention_2 on CUDA when flash-attn is installed, else "
            "asyncgrpo_varlen_sdpa (a packed row costs the sum of its samples' squares)."
        },
    )
    peak_flops: float | None = field(
        default=None,
        metadata={
            "help": "Peak FLOP/s of one accelerator at the training dtype (e.g. 9.89e14: H100/H200 "
            "bf16 dense), for perf/mfu; None: no MFU metric."
        },
    )
    max_steps: int = field(default=100, metadata={"help": "Optimizer steps to train."})
    max_staleness: int = field(
        default=4,
        metadata={"help": "Drop samples generated more than this many adapter versions ago."},
    )
    weight_sync_steps: int = field(
        default=4, metadata={"help": "Publish a new adapter version every this many steps."}
    )
    save_steps: int = field(
        default=50, metadata={"help": "Checkpoint every this many steps; 0 disables."}
    )

    def __post_init__(self) -> None:
        if not self.learning_rate > 0:
            raise ConfigError(f"trainer.learning_rate={self.learning_rate}: must be > 0; e.g. 4e-5")
        if self.lr_schedule not in ("constant", "linear", "cosine"):
            raise ConfigError(
                f"trainer.lr_schedule={self.lr_schedule!r}: use 'constant', 'linear' or 'cosine'"
            )
        if self.warmup_steps < 0:
            raise ConfigError(f"trainer.warmup_steps={self.warmup_steps}: set it to 0 or more")
        if self.weight_decay < 0:
            raise ConfigError(f"trainer.weight_decay={self.weight_decay}: must be >= 0")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError(
                f"trainer.max_grad_norm={self.max_grad_norm}: must be > 0, or None to disable"
            )
        if not self.epsilon > 0:
            raise ConfigError(f"trainer.epsilon={self.epsilon}: must be > 0; e.g. 0.2")
        if self.epsilon_high is not None and not self.epsilon_high > 0:
            raise ConfigError(
                f"trainer.epsilon_high={self.epsilon_high}: must be > 0, or None for epsilon"
            )
        if self.tis_cap is not None and not self.tis_cap > 1 + self.clip_high:
            raise ConfigError(
                f"trainer.tis_cap={self.tis_cap}: must exceed 1 + epsilon_high = "
                f"{1 + self.clip_high:g} (below it the cap would cut the clipped region); "
                "e.g. 3.0, or None to disable"
            )
        if self.samples_per_step < 1:
            raise ConfigError(f"trainer.samples_per_step={self.samples_per_step}: set it to 1+")
        if self.token_budget is not None and self.token_budget < 1:
            raise ConfigError(
                f"trainer.token_budget={self.token_budget}: set it to 1 or more (e.g. the "
                "replicas' max_model_len), or None to split by gradient_accumulation_steps"
            )
        if self.gradient_accumulation_steps < 1:
            raise ConfigError(
                f"trainer.gradient_accumulation_steps={self.gradient_accumulation_steps}: "
                "set it to 1 or more"
            )
        if self.peak_flops is not None and not self.peak_flops > 0:
            raise ConfigError(
                f"trainer.peak_flops={self.peak_flops}: give the accelerator's peak FLOP/s "
                "(e.g. 9.89e14), or leave it unset"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(
                f"trainer.dtype={self.dtype!r}: use 'auto', 'float32', 'bfloat16' or 'float16'"
            )
        if self.max_steps < 1:
            raise ConfigError(f"trainer.max_steps={self.max_steps}: set it to 1 or more")
        if self.max_staleness < 0:
            raise ConfigError(
                f"trainer.max_staleness={self.max_staleness}: set it to 0 (on-policy) or more"
            )
        if self.weight_sync_steps < 1:
            raise ConfigError(
                f"trainer.weight_sync_steps={self.weight_sync_steps}: set it to 1 or more"
            )
        if self.save_steps < 0:
            raise ConfigError(f"trainer.save_steps={self.save_steps}: set it to 0 (off) or more")

    @property
    def clip_high(self) -> float:
        """The upper clip range actually used: ``epsilon_high``, or ``epsilon`` when unset."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass(kw_only=True)
class ServingConfig:
    """Where the vLLM replicas come from: started locally, given as URLs, or both.

    The remaining replica settings (LoRA rank and slots) are derived from ``lora.r`` and
    ``trainer.max_staleness``, so they cannot disagree with the trainer.
    """

    replicas: int = field(
        default=1, metadata={"help": "Local vLLM replicas to start (0: use only urls)."}
    )
    urls: list[str] = field(
        default_factory=list,
        metadata={"help": "Base URLs of already running vLLM replicas, e.g. http://10.0.0.2:8000."},
    )
    max_model_len: int | None = field(
        default=None, metadata={"help": "--max-model-len of local replicas; None: the model's."}
    )
    dtype: str = field(
        default="auto",
        metadata={"help": "--dtype of local replicas; use float32 on CPU for exact logprobs."},
    )
    kv_cache_gib: float | None = field(
        default=None,
        metadata={"help": "CPU KV cache per local replica, GiB (VLLM_CPU_KVCACHE_SPACE)."},
    )
    nice: int = field(
        default=0,
        metadata={
            "help": "Nice value (0-19) of local replicas. On a CPU host shared with the trainer "
            "use ~10: vLLM's workers busy-poll for 1 s after each batch, right when the trainer "
            "computes."
        },
    )

    def __post_init__(self) -> None:
        if not 0 <= self.nice <= 19:
            raise ConfigError(f"serve.nice={self.nice}: use 0..19 (higher: lower priority)")
        if self.replicas < 0:
            raise ConfigError(f"serve.replicas={self.replicas}: set it to 0 or more")
        for url in self.urls:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ConfigError(
                    f"serve.urls: {url!r} is not an http(s) URL; write http://HOST:PORT"
                )
        if self.replicas == 0 and not self.urls:
            raise ConfigError(
                "serve: no replicas: set serve.replicas to start local ones, or list serve.urls"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"serve.max_model_len={self.max_model_len}: set it to 1 or more")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise ConfigError(f"serve.kv_cache_gib={self.kv_cache_gib}: must be > 0 GiB")


@dataclass(kw_only=True)
class LoggingConfig:
    """Where metrics go."""

    jsonl: bool = field(
        default=True, metadata={"help": "Write metrics.jsonl (one object per step) in the run dir."}
    )
    trackio: bool = field(
        default=False, metadata={"help": "Also log to trackio (must be installed)."}
    )
    trackio_project: str | None = field(
        default=None, metadata={"help": "trackio project; None: 'asyncgrpo'."}
    )
    log_every: int = field(default=1, metadata={"help": "Log metrics every this many steps."})
    level: str = field(default="INFO", metadata={"help": "Python logging level of the CLI."})

    def __post_init__(self) -> None:
        if self.log_every < 1:
            raise ConfigError(f"logging.log_every={self.log_every}: set it to 1 or more")
        if self.level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ConfigError(
                f"logging.level={self.level!r}: use DEBUG, INFO, WARNING, ERROR or CRITICAL"
            )


@dataclass(kw_only=True)
class TrainingConfig:
    """Everything one async GRPO run needs; the same file drives every process of a split run."""

    model: str = field(metadata={"help": "Base model: a local directory or a Hugging Face id."})
    dataset: DatasetConfig = field(
        metadata={"help": "Prompts: file, inline list or datasets name."}
    )
    run_name: str = field(
        default="asyncgrpo",
        metadata={
            "help": "Names the run directory and the adapter versions (<run_name>-<run id>-vN); "
            "letters, digits, '.', '_', '-'."
        },
    )
    output_dir: str = field(
        default="runs", metadata={"help": "Parent of the run directory (<output_dir>/<run_name>)."}
    )
    seed: int = field(default=0, metadata={"help": "Seeds torch, Python and the LoRA init."})
    transport_url: str | None = field(
        default=None,
        metadata={
            "help": "Storage for adapters, checkpoints and the rollout channel (file://, s3://, "
            "hf://). None: a local directory inside the run directory."
        },
    )
    lora: LoraConfig = field(default_factory=LoraConfig, metadata={"help": "LoRA adapter."})
    trainer: TrainerConfig = field(
        default_factory=TrainerConfig, metadata={"help": "Optimisation and cadence."}
    )
    generation: GenerationConfig = field(
        default_factory=GenerationConfig, metadata={"help": "Sampling parameters."}
    )
    rollout: RolloutConfig = field(
        default_factory=RolloutConfig, metadata={"help": "Rollout scheduling and scoring."}
    )
    proxy: ProxyConfig = field(default_factory=ProxyConfig, metadata={"help": "The proxy."})
    serve: ServingConfig = field(
        default_factory=ServingConfig, metadata={"help": "Where the replicas come from."}
    )
    logging: LoggingConfig = field(default_factory=LoggingConfig, metadata={"help": "Metrics."})

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model is empty: give a model directory or a Hugging Face id")
        if not _RUN_NAME.match(self.run_name):
            raise ConfigError(
                f"run_name={self.run_name!r}: use letters, digits, '.', '_' and '-' (it becomes "
                "part of adapter names and storage keys)"
            )
        self.rollout.check_against(self.generation)
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
    def from_dict(
        cls, data: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()
    ) -> TrainingConfig:
        """Build from a plain dict (e.g. parsed YAML), after applying ``overrides``."""
        return config_from_dict(cls, apply_overrides(cls, data, overrides))

    @classmethod
    def from_yaml(
        cls, path: str | Path, overrides: list[str] | tuple[str, ...] = ()
    ) -> TrainingConfig:
        """Read a YAML file, apply ``section.field=value`` overrides, validate."""
        try:
            text = Path(path).read_text()
        except FileNotFoundError as exc:
            raise ConfigError(f"config file {path} does not exist") from exc
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path}: the top level must be a mapping of sections")
        return cls.from_dict(data, overrides)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists, not tuples) that ``from_dict`` turns back into an equal config."""
        return to_dict(self)


# ---------------------------------------------------------------------------------------------
# Generic loader: dict -> dataclass, with type checks and helpful errors
# ---------------------------------------------------------------------------------------------


def to_dict(obj: Any) -> Any:
    """A dataclass as plain YAML-friendly data (tuples become lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _unknown_key(where: str, key: str, cls: type) -> ConfigError:
    valid = ", ".join(sorted(_fields(cls)))
    return ConfigError(f"unknown key {where + key!r}; valid keys are: {valid}")


def config_from_dict(cls: type[T], data: Any, *, where: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, checking keys and value types recursively.

    ``where`` prefixes field names in error messages (``"trainer."``). Unknown keys and values
    of the wrong type raise ``ConfigError``; each dataclass's own ``__post_init__`` then
    validates ranges and combinations.
    """
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(
            f"{where.rstrip('.') or cls.__name__}: expected a mapping of fields, got "
            f"{type(data).__name__}"
        )
    fields = _fields(cls)
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown_key(where, str(key), cls)
        kwargs[key] = _coerce(value, hints[key], f"{where}{key}")
    missing = [
        name
        for name, f in fields.items()
        if name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"missing required key(s): {', '.join(where + m for m in missing)}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where.rstrip('.') or cls.__name__}: {exc}") from exc


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against annotation ``tp`` and convert lossless cases (int -> float)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arm in args:
            if arm is type(None):
                continue
            try:
                return _coerce(value, arm, where)
            except ConfigError as exc:
                errors.append(exc)
        raise ConfigError(f"{where}={value!r}: expected {_type_name(tp)}")
    if origin is Literal:
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{where}={value!r}: use one of {choices}")
        return value
    if dataclasses.is_dataclass(tp):
        return config_from_dict(tp, value, where=f"{where}.")
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}={value!r}: expected a list")
        if origin is tuple:
            item = args[0] if args else Any
            return tuple(_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value))
        item = args[0] if args else Any
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}={value!r}: expected a mapping")
        vt = args[1] if len(args) == 2 else Any
        return {k: _coerce(v, vt, f"{where}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}={value!r}: expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}={value!r}: expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}={value!r}: expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}={value!r}: expected a string")
        return value
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{where}={value!r}: expected {_type_name(tp)}")


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
_NONE = {"none", "null", "~"}


def parse_cli_value(text: str, tp: Any, where: str) -> Any:
    """Parse a command-line string for a field annotated ``tp`` (then ``_coerce`` checks it)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if text.strip().lower() in _NONE and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        if len(arms) == 1:
            return parse_cli_value(text, arms[0], where)
        # Several arms (e.g. str | list[str]): let YAML decide the shape, then type-check.
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError:
            return text
    if tp is bool:
        low = text.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ConfigError(f"{where}={text!r}: expected true or false")
    if tp is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{where}={text!r}: expected an integer") from None
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{where}={text!r}: expected a number") from None
    if tp is str:
        return text
    if origin is Literal:
        for a in args:
            if str(a) == text:
                return a
        return text
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}={text!r}: not valid YAML ({exc})") from exc
    if origin in (list, tuple) and isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    return value


def apply_overrides(
    cls: type, data: dict[str, Any], overrides: list[str] | tuple[str, ...]
) -> dict[str, Any]:
    """Apply ``a.b.c=value`` strings to a copy of ``data``; values are typed by ``cls``'s fields."""
    import copy

    data = copy.deepcopy(data)
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip().removeprefix("--")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: write it as section.field=value")
        parts = key.split(".")
        target_cls: Any = cls
        node = data
        for depth, part in enumerate(parts):
            if not dataclasses.is_dataclass(target_cls):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[:depth])} has no fields")
            fields = _fields(target_cls)
            if part not in fields:
                raise _unknown_key("".join(p + "." for p in parts[:depth]), part, target_cls)
            tp = _hints(target_cls)[part]
            if depth == len(parts) - 1:
                node[part] = parse_cli_value(text, tp, key)
            else:
                child = node.get(part)
                if child is None:
                    child = node[part] = {}
                elif not isinstance(child, dict):
                    raise ConfigError(
                        f"override {item!r}: {'.'.join(parts[: depth + 1])} is not a section"
                    )
                node = child
                target_cls = tp
    return data
