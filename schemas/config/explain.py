"""One line for a msgspec validation error of a config, in the project's style:

* a declared bound: ``train.batch_size=0 must be >= 1`` (the key, the value given, what is allowed);
* a wrong type or value: ``train.steps: Expected `int`, got `str` (got 'ten'; allowed type: int)``;
* an unknown key: ``unknown key 'train.learning_rate' (keys: strategy, ranks, ...)``.

Keys are written as ``--set`` takes them (``data.domains.0.ratio``). msgspec says ``[...]`` for a
dict entry; the entry meant is the first whose value does not convert (``judge.models.q.path``).
A message without a path (a rule's, raised in ``__post_init__``) is passed through as it is.
"""

from __future__ import annotations

import math
import re
import types
import typing
from typing import Any, Literal

import msgspec

from schemas.config.base import bounds, split_annotated, type_name
from schemas.config.redact import redact_text

_AT = re.compile(r" - at (?P<in_key>`key` in )?`\$(?P<path>[^`]*)`$")
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<f>[^`]+)`")
_BOUND = re.compile(r"Expected `[^`]+` (?:[<>]=?|of length|matching)")


def _split_path(path: str) -> list[str]:
    # msgspec paths look like ".train.lr", ".data.domains[0].name" or ".judge.models[...].path"
    return [p for p in re.split(r"[.\[\]]", path.replace("[...]", "[*]")) if p]


def _container(tp: Any) -> Any:
    """``tp`` without its bounds and, when optional, without ``None``."""
    tp, _ = split_annotated(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        members = [split_annotated(a)[0] for a in typing.get_args(tp) if a is not type(None)]
        tp = next((m for m in members if typing.get_origin(m) in (list, dict) or _is_struct(m)), members[0])
    return tp


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _failing_key(raw: Any, value_type: Any) -> Any:
    """The first key of the mapping ``raw`` whose value does not convert to ``value_type``."""
    for key, value in raw.items() if isinstance(raw, dict) else ():
        try:
            msgspec.convert(value, value_type, strict=False)
        except msgspec.ValidationError:
            return key
    return "*"


def _locate(raw: Any, tp: Any, parts: list[str]) -> tuple[list[str], Any, Any]:
    """The key names, the given value and the declared type at a msgspec error path."""
    names: list[str] = []
    for i, part in enumerate(parts):
        tp = _container(tp)
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if _is_struct(tp):
            tp = typing.get_type_hints(tp, include_extras=True).get(part)
            raw = raw.get(part) if isinstance(raw, dict) else None
        elif origin is list and part.isdigit():
            tp = args[0] if args else Any
            raw = raw[int(part)] if isinstance(raw, list) and int(part) < len(raw) else None
        elif origin is dict:
            tp = args[1] if args else Any
            key = _failing_key(raw, tp) if part == "*" else part
            raw, part = (raw.get(key) if isinstance(raw, dict) else None), str(key)
        else:
            return names + parts[i:], None, None
        names.append(part)
    return names, raw, tp


def _expected(tp: Any) -> str:
    """What a field of type ``tp`` takes: its keys, its allowed values or its type."""
    tp, _ = split_annotated(tp)
    if _is_struct(tp):
        return "keys: " + ", ".join(tp.__struct_fields__)
    if typing.get_origin(tp) is Literal:
        return "one of: " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        parts = [repr(a) for m in typing.get_args(tp) if typing.get_origin(m) is Literal for a in typing.get_args(m)]
        parts += ["true, false" if m is bool else type_name(m)
                  for m in typing.get_args(tp) if typing.get_origin(m) is not Literal]
        return "one of: " + ", ".join(parts)
    if tp is not None:
        return "type: " + getattr(tp, "__name__", str(tp))
    return ""


def _shown(value: Any, tp: Any) -> str:
    """``value`` as the error line shows it: a number as converted (``1e-05``, ``nan``), text quoted."""
    scalar = _container(tp)
    if isinstance(value, str) and scalar in (int, float):
        try:
            value = msgspec.convert(value, scalar, strict=False)
        except msgspec.ValidationError:
            pass
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return redact_text(repr(value))


def explain_error(err: msgspec.ValidationError, raw: Any, root: type) -> str:
    """One line for ``err``, raised converting ``raw`` into ``root``."""
    msg = str(err)
    at = _AT.search(msg)
    if not at and not _UNKNOWN.match(msg):
        return msg
    problem = msg[: at.start()] if at else msg
    names, value, tp = _locate(raw, root, _split_path(at["path"]) if at else [])
    key = ".".join(names)
    unknown = _UNKNOWN.match(problem)
    if unknown:
        return f"unknown key '{'.'.join([*names, unknown['f']])}' ({_expected(_container(tp))})"
    if at and at["in_key"]:
        return f"{key}: a key: {problem} (got {_shown(value, None)})"
    bound = bounds(tp) if _BOUND.match(problem) else ""
    if bound:
        finite = "a finite number " if isinstance(value, float) and not math.isfinite(value) else ""
        return f"{key}={_shown(value, tp)} must be {finite}{bound}"
    if not names:
        return problem
    details = [f"got {_shown(value, tp)}"] if value is not None else []
    details += [f"allowed {_expected(tp)}"] if _expected(tp) else []
    return f"{key}: {problem}" + (f" ({'; '.join(details)})" if details else "")
