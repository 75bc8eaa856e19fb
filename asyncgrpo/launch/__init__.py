"""``asyncgrpo launch``: start a run's roles on separate machines, watch them, tear them down.

``await launch(cfg, backend="hf-jobs")`` (Hugging Face Jobs), ``backend="ray"`` (Ray actors on a
Ray cluster), ``backend="skypilot"`` (SkyPilot managed jobs) or ``backend="local"`` (separate process groups on this host) returns a :class:`~asyncgrpo.launch.launcher.LaunchHandle`. Names
are imported lazily: the ``launch`` config section is part of every config, and loading a
config must not import the launcher.
"""

from __future__ import annotations

from asyncgrpo.lazy import lazy_exports

_EXPORTS = {
    "JobSpec": "asyncgrpo.launch.jobs",
    "LaunchConfig": "asyncgrpo.config.launch",
    "LaunchHandle": "asyncgrpo.launch.launcher",
    "launch": "asyncgrpo.launch.launcher",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
