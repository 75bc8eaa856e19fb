"""docs/security.md's limits table says what the code does: each row's default is read from the
place it names (a module constant, or a config dataclass field's default), and the surfaces a
party outside the owner's process reaches each list the limits they have.

A surface added later (a service of its own) adds rows to the same table; this test reads them
without change, and :data:`REQUIRED` says which of its settings must be listed."""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path
from typing import Any

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"
HEADER = "| surface | limit | default | setting | in code |"
UNITS = {"": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "s": 1, "ms": 1e-3}

#: Settings each surface's rows must name (its config fields that bound what a client costs).
REQUIRED = {
    "proxy": {
        "proxy.max_body_bytes",
        "proxy.max_buffered_bytes",
        "proxy.offload_body_bytes",
        "proxy.max_connections",
        "proxy.head_timeout_s",
        "proxy.client_idle_timeout_s",
        "proxy.max_queued_per_run",
        "proxy.queue_timeout_s",
        "proxy.max_runs",
    },
    "tinker service": {
        "tinker.max_connections",
        "tinker.head_timeout_s",
        "tinker.client_idle_timeout_s",
        "tinker.max_body_bytes",
        "tinker.max_datums",
        "tinker.max_queued_per_client",
        "tinker.max_context_length",
        "tinker.max_training_clients",
        "tinker.session_timeout_s",
    },
    "replicas": {
        "serve.adapter_max_manifest_bytes",
        "serve.adapter_max_files",
        "serve.adapter_max_total_bytes",
    },
}


def _rows() -> list[dict[str, str]]:
    lines = DOC.read_text().splitlines()
    start = lines.index(HEADER)
    keys = [k.strip() for k in HEADER.strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(keys, (c.strip() for c in line.strip("|").split("|")), strict=True)))
    return rows


def _value(text: str) -> float:
    """``64 KiB``, ``2 GiB``, ``600 s``, ``5 ms``, ``4096`` as a number (bytes, seconds)."""
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?) ?(KiB|MiB|GiB|s|ms|)", text)
    assert match, f"default {text!r}: write a number and one of {sorted(UNITS)}"
    return float(match[1]) * UNITS[match[2]]


def _in_code(path: str) -> Any:
    """The value at a dotted path: a module's attribute, or a dataclass field's default."""
    parts = path.strip("`").split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            if dataclasses.is_dataclass(obj) and name in {f.name for f in dataclasses.fields(obj)}:
                (f,) = [f for f in dataclasses.fields(obj) if f.name == name]
                obj = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            else:
                obj = getattr(obj, name)
        return obj
    raise AssertionError(f"{path}: no such module")


ROWS = _rows()


@pytest.mark.parametrize("row", ROWS, ids=[f"{r['surface']}: {r['limit']}" for r in ROWS])
def test_each_default_in_the_table_is_the_codes(row: dict[str, str]) -> None:
    assert _in_code(row["in code"]) == pytest.approx(_value(row["default"])), row


def test_every_surface_lists_its_limits() -> None:
    named = {r["setting"].strip("`") for r in ROWS}
    for surface, settings in REQUIRED.items():
        assert any(r["surface"] == surface for r in ROWS), surface
        assert settings <= named, f"{surface}: not in the table: {sorted(settings - named)}"
    assert len(ROWS) >= 20
