"""A mapping (parsed YAML, overrides applied) to a config dataclass, every value type-checked.

``config_from_dict(cls, data)`` recurses into nested dataclass sections and checks each value
against its annotation, converting only lossless cases (an int for a float); the dataclass's
``__post_init__`` then checks ranges and combinations, through :func:`check_fields` for the
common ones, so a field is validated the same way however it was set.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import typing
from typing import Any, Literal, TypeVar

from asyncgrpo.config.fields import (
    init_fields,
    is_derived,
    is_secret,
    is_union,
    type_hints,
    type_name,
    unknown_key,
)
from asyncgrpo.errors import ConfigError

T = TypeVar("T")


def to_dict(obj: Any, *, where: str = "") -> Any:
    """A dataclass as plain YAML-friendly data (tuples become lists) that ``config_from_dict``
    turns back into an equal config (a section's derived fields are left out)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            f.name: to_dict(getattr(obj, f.name), where=f"{where}{f.name}.")
            for f in dataclasses.fields(obj)
            if not is_derived(f, where)
        }
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


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
    fields = init_fields(cls)
    hints = type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            raise unknown_key(where, str(key), cls)
        if is_derived(fields[key], where):
            raise ConfigError(
                f"{where}{key} is set from {fields[key].metadata['derived']}: remove it and "
                f"set {fields[key].metadata['derived']} instead"
            )
        kwargs[key] = coerce_field(fields[key], value, hints[key], f"{where}{key}")
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


def coerce_field(f: dataclasses.Field, value: Any, tp: Any, where: str) -> Any:
    """``coerce``, but a secret's error does not quote the value (it may be the secret)."""
    try:
        return coerce(value, tp, where)
    except ConfigError:
        if not is_secret(f):
            raise
        raise ConfigError(
            f"{where}: expected {type_name(tp)}, got a {type(value).__name__} (not shown: it "
            "is a secret)"
        ) from None


_EXPECTED = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against annotation ``tp`` and convert lossless cases (int -> float)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if is_union(tp):
        return _coerce_union(value, tp, where)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}={value!r}: use one of {', '.join(map(repr, args))}")
        return value
    if dataclasses.is_dataclass(tp):
        return config_from_dict(tp, value, where=f"{where}.")
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}={value!r}: expected a list")
        item = args[0] if args else Any
        items = [coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{where}={value!r}: expected a mapping with string keys")
        item = args[1] if len(args) == 2 else Any
        return {k: coerce(v, item, f"{where}.{k}") for k, v in value.items()}
    if tp in _EXPECTED:
        ok = isinstance(value, tp) and (tp is bool or not isinstance(value, bool))
        if tp is float and isinstance(value, int) and not isinstance(value, bool):
            ok, value = True, _float(value, where)
        if not ok:
            raise ConfigError(f"{where}={value!r}: expected {_EXPECTED[tp]}")
        return _in_range(value, where) if tp in (int, float) else value
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{where}={value!r}: expected {type_name(tp)}")


#: Every integer setting fits in 64 bits: torch, vLLM, sockets and timers take no more (a
#: ``seed`` of 2**70 was a ``ValueError`` from torch at the trainer's start, not a line
#: naming the setting).
_INT64 = (-(2**63), 2**63 - 1)


def _float(value: int, where: str) -> float:
    try:
        return float(value)
    except OverflowError:
        raise ConfigError(f"{where}={str(value)[:40]}...: too large for a number") from None


def _in_range(value: float, where: str) -> float:
    """A number every consumer of a setting can take: an integer in 64 bits, a finite float
    (an infinite timeout or NaN weight is a mistake, not a setting: unset means no limit)."""
    if isinstance(value, int) and not _INT64[0] <= value <= _INT64[1]:
        shown = str(value) if len(str(value)) <= 40 else str(value)[:40] + "..."
        raise ConfigError(f"{where}={shown}: must fit in 64 bits ({_INT64[0]} to {_INT64[1]})")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}={value!r}: must be a finite number")
    return value


def _coerce_union(value: Any, tp: Any, where: str) -> Any:
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    arms = [a for a in args if a is not type(None)]
    if len(arms) == 1:  # Optional[X]: X's own message
        return coerce(value, arms[0], where)
    for arm in arms:
        try:
            return coerce(value, arm, where)
        except ConfigError:
            pass
    raise ConfigError(f"{where}={value!r}: expected {type_name(tp)}")


_OPS = {
    "ge": (">=", operator.ge),
    "gt": (">", operator.gt),
    "le": ("<=", operator.le),
    "lt": ("<", operator.lt),
}


def check_fields(obj: Any, section: str, **bounds: dict[str, float]) -> None:
    """Check ``obj``'s ``Literal`` fields against their choices, and numbers against ``bounds``.

    ``check_fields(self, "trainer", ge={"max_steps": 1}, gt={"learning_rate": 0})``; ``None``
    (an optional field left unset) passes, and the error then says None is allowed. Called
    from each config's ``__post_init__``, so direct construction is checked like loading.
    """
    hints = type_hints(type(obj))
    for f in dataclasses.fields(obj):
        choices = typing.get_args(hints[f.name])
        if typing.get_origin(hints[f.name]) is Literal and getattr(obj, f.name) not in choices:
            raise ConfigError(
                f"{section}.{f.name}={getattr(obj, f.name)!r}: use one of "
                + ", ".join(map(repr, choices))
            )
    for op, fields in bounds.items():
        sign, holds = _OPS[op]
        for name, bound in fields.items():
            value = getattr(obj, name)
            if value is not None and not holds(value, bound):
                unset = ", or None" if type(None) in typing.get_args(hints[name]) else ""
                raise ConfigError(f"{section}.{name}={value!r}: must be {sign} {bound:g}{unset}")
