"""What every config section shares: the strict base Struct, :class:`ConfigError`, and the named
bounds (msgspec ``Meta`` constraints) that fields declare, with :func:`allowed` saying in words
what a bound allows (for error lines and ``docs/config.md``)."""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta


class ConfigError(ValueError):
    """A config problem, with a one-line message that names the key."""


class Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of config sections: strict (unknown keys are errors)."""


PositiveInt = Annotated[int, Meta(ge=1)]
"""A count that needs at least one (workers, steps, tokens)."""
NonNegativeInt = Annotated[int, Meta(ge=0)]
"""A count where 0 means none, off or auto (the field says which)."""
PositiveFloat = Annotated[float, Meta(gt=0)]
"""A duration, rate or scale that must be above 0."""
NonNegativeFloat = Annotated[float, Meta(ge=0)]
"""A duration, ratio or coefficient where 0 means none or off."""
UnitInterval = Annotated[float, Meta(ge=0, le=1)]
"""A probability, discount or threshold in ``[0, 1]``."""
PositiveFraction = Annotated[float, Meta(gt=0, le=1)]
"""A fraction in ``(0, 1]``."""
FractionBelowOne = Annotated[float, Meta(ge=0, lt=1)]
"""A fraction in ``[0, 1)``."""
AboveOne = Annotated[float, Meta(gt=1)]
"""A factor above 1."""
NonEmptyStr = Annotated[str, Meta(min_length=1)]
"""A name or path that must be given."""
Device = Annotated[str, Meta(pattern=r"^(auto|cpu|cuda|cuda:\d+)$", description="'auto', 'cpu', 'cuda' or 'cuda:N'")]
"""A torch device; whether this machine has it is checked before a run starts."""


def split_annotated(tp: Any) -> tuple[Any, list[Meta]]:
    """``(type, [Meta, ...])`` of an ``Annotated`` type (``(tp, [])`` for any other type)."""
    if typing.get_origin(tp) is Annotated:
        base, *extras = typing.get_args(tp)
        return base, [m for m in extras if isinstance(m, Meta)]
    return tp, []


def _num(x: float) -> str:
    return f"{x:g}"


def allowed(metas: list[Meta]) -> str:
    """What ``Meta`` constraints allow, in words: ``>= 1``, ``in (0, 1]``, ``non-empty`` or the
    constraint's ``description`` (empty when there is none)."""
    words: list[str] = []
    for m in metas:
        if m.description:
            return m.description
        low = f"[{_num(m.ge)}" if m.ge is not None else f"({_num(m.gt)}" if m.gt is not None else ""
        high = f"{_num(m.le)}]" if m.le is not None else f"{_num(m.lt)})" if m.lt is not None else ""
        if low and high:
            words.append(f"in {low}, {high}")
        elif low:
            words.append((">= " if low[0] == "[" else "> ") + low[1:])
        elif high:
            words.append(("<= " if high[-1] == "]" else "< ") + high[:-1])
        if m.min_length == 1 and m.max_length is None:
            words.append("non-empty")
        elif m.min_length is not None or m.max_length is not None:
            words.append(f"of length {m.min_length or 0} to {m.max_length if m.max_length is not None else 'any'}")
        if m.pattern is not None:
            words.append(f"matching {m.pattern!r}")
    return ", ".join(words)


def bounds(tp: Any) -> str:
    """What the declared bounds of a field type allow, in words (``""`` when it declares none); an
    optional bounded field adds ``or null``."""
    _, metas = split_annotated(tp)
    if metas:
        return allowed(metas)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        inner = [bounds(a) for a in args if a is not type(None)]
        if any(inner):
            return " or ".join(w for w in inner if w) + (" or null" if type(None) in args else "")
    return ""


def type_name(tp: Any) -> str:
    """A field type as a reader writes it, bounds left out: ``int``, ``'a' | 'b'``, ``list[str]``,
    ``float | None``."""
    tp, _ = split_annotated(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))
