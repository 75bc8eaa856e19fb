"""Limits of the store layer: how much one bundle download may take.

A section of the configuration layer (it imports nothing above it), so a replica's settings can
carry the limits without importing the store.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncgrpo.errors import ConfigError


@dataclass(frozen=True, slots=True)
class FetchLimits:
    """How much one bundle download may take; checked before any file is fetched."""

    max_manifest_bytes: int = 1 << 20
    """Largest manifest read (a manifest of 1,000 files is ~150 KB)."""
    max_files: int = 1024
    """Most files one bundle may list."""
    max_total_bytes: int | None = 16 << 30
    """Largest sum of the listed file sizes; None: no cap (each file is still read no further
    than its declared size)."""

    def __post_init__(self) -> None:
        for name in ("max_manifest_bytes", "max_files", "max_total_bytes"):
            value = getattr(self, name)
            if value is None and name == "max_total_bytes":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"FetchLimits.{name}={value!r}: must be an integer >= 1")
