"""Configuration, the bottom layer: the loader, every component's settings section and
``TrainingConfig``.

Each section is a keyword-only dataclass in a module of this package named after its component
(:mod:`.rollout`, :mod:`.trainer`, :mod:`.proxy`, :mod:`.serve`, :mod:`.launch`,
:mod:`.evaluation`, :mod:`.store`, :mod:`.tinker`); the component packages re-export their own.
Nothing here imports anything above this layer; the loader raises
:class:`~asyncgrpo.errors.ConfigError` and never exits the process (the CLI turns errors into
exit statuses). Names are imported lazily, so loading a config loads no component.

The loader, one job per module: :mod:`.fields` (what a field's type, docstring and metadata
say), :mod:`.text` (typed text to a value), :mod:`.coerce` (a mapping to a checked dataclass),
:mod:`.sources` (YAML, ``key=value`` overrides, environment variables), :mod:`.flags` (the
command line), :mod:`.paths` (a run's paths, absolute once), :mod:`.redaction` (what may be
shown), :mod:`.model_source` (a model: a path here or a Hugging Face id).
"""

from __future__ import annotations

from asyncgrpo.lazy import lazy_exports

_EXPORTS = {
    "AuditConfig": "asyncgrpo.config.trainer",
    "DatasetConfig": "asyncgrpo.config.rollout",
    "EvalConfig": "asyncgrpo.config.evaluation",
    "FetchLimits": "asyncgrpo.config.store",
    "GenerationConfig": "asyncgrpo.config.rollout",
    "LaunchConfig": "asyncgrpo.config.launch",
    "LoggingConfig": "asyncgrpo.config.training",
    "LoraConfig": "asyncgrpo.config.trainer",
    "ProxyConfig": "asyncgrpo.config.proxy",
    "RolloutConfig": "asyncgrpo.config.rollout",
    "ServeConfig": "asyncgrpo.config.serve",
    "TinkerConfig": "asyncgrpo.config.tinker",
    "TrainerConfig": "asyncgrpo.config.trainer",
    "TrainingConfig": "asyncgrpo.config.training",
    "example_path": "asyncgrpo.config.training",
    "run_transport_url": "asyncgrpo.config.training",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
