"""Configuration, the bottom layer: the loader and ``TrainingConfig``.

Every component's section is a keyword-only dataclass beside its component
(``asyncgrpo.<component>.config``) that imports nothing above this layer; the loader raises
:class:`~asyncgrpo.errors.ConfigError` and never exits the process (the CLI turns errors into
exit statuses). Names are imported lazily, so loading a config loads no component.
"""

from __future__ import annotations

from asyncgrpo.lazy import lazy_exports

_EXPORTS = {
    "LoggingConfig": "asyncgrpo.config.training",
    "LoraConfig": "asyncgrpo.trainer.config",
    "TrainerConfig": "asyncgrpo.trainer.config",
    "TrainingConfig": "asyncgrpo.config.training",
    "example_path": "asyncgrpo.config.training",
    "run_transport_url": "asyncgrpo.config.training",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
