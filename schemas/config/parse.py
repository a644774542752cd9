"""Parsing a run config: YAML text (:func:`parse_config`) or a raw mapping (:func:`parse_raw`),
plus ``--set section.key=value`` overrides applied to the raw mapping first (so they are checked
exactly like the file). Every problem is a :class:`ConfigError` with one line starting ``config:``
(or naming the ``--set`` or the file). No I/O: callers read the file and pass its text."""

from __future__ import annotations

import typing
from typing import Any

import msgspec
import yaml

from schemas.config.base import ConfigError
from schemas.config.explain import explain_error
from schemas.config.infra import KafkaSettings
from schemas.config.redact import REDACTED
from schemas.config.run import RunConfig


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply ``a.b.c=value`` (value parsed as YAML) to the raw mapping in place."""
    key, sep, text = assignment.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. train.lr=1e-5")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {key}: value {text!r} is not valid YAML ({e.__class__.__name__})") from None
    node: Any = raw
    parts = key.split(".")
    for i, part in enumerate(parts):
        if part.isdigit() and not (isinstance(node, list) and int(part) < len(node)):
            if i == 0:
                raise ConfigError(f"--set {key}: '{part}' is not a config key")
            where = ".".join(parts[:i])
            raise ConfigError(f"--set {key}: the config has no item {part} in {where or 'the top level'} "
                              f"(set the whole list instead: --set '{where}=[...]')")
        if i == len(parts) - 1:
            break
        if isinstance(node, list):
            node = node[int(part)]
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: '{parts[i - 1]}' is not a section")
        node = node.setdefault(part, {})
    last = parts[-1]
    if isinstance(node, list) and last.isdigit() and int(last) < len(node):
        node[int(last)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ConfigError(f"--set {key}: '{parts[-2] if len(parts) > 1 else key}' is not a section")


REMOVED: dict[tuple[str, str], str] = {
    ("algorithm", "target_kl"): "was a KL summed per sequence; the adaptive KL controller "
    "now targets the mean KL per token: set algorithm.target_kl_per_token (about target_kl / mean response length)",
}
"""Keys that were removed because their meaning changed: ``(section, key) -> what changed``. A
recorded ``null`` is dropped (it meant "off" and still does); any other value is refused."""


def _drop_removed(raw: dict[str, Any]) -> None:
    """Refuse a removed key with a value, in one line saying what changed; drop a ``null`` one."""
    for (section, key), why in REMOVED.items():
        node = raw.get(section)
        if isinstance(node, dict) and key in node:
            if node[key] is not None:
                raise ConfigError(f"config: {section}.{key}={node[key]!r} is no longer a key: it {why}")
            del node[key]


def parse_raw(raw: Any, overrides: list[str] | tuple[str, ...] = (), root: type = RunConfig) -> Any:
    """Validate a raw mapping (plus overrides) into ``root`` or raise :class:`ConfigError`: removed
    keys (:data:`REMOVED`), the declared bounds, then (for a :class:`RunConfig`) the rules."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config: the top level must be a mapping of sections, got {type(raw).__name__}")
    for assignment in overrides:
        apply_override(raw, assignment)
    if root is RunConfig:
        _drop_removed(raw)
    try:
        parsed: Any = msgspec.convert(raw, root, strict=False)
    except msgspec.ValidationError as e:  # a bound or type, or a rule (raised in RunConfig.__post_init__)
        raise ConfigError(f"config: {explain_error(e, raw, root)}") from None
    kafka = getattr(parsed, "kafka", None)
    if isinstance(kafka, KafkaSettings) and kafka.sasl_password not in ("", REDACTED):
        raise ConfigError(
            "config: kafka.sasl_password: a password in the config would be copied into runs/<id>/config.yaml "
            "and the run's record; set $ROLLSTREAM_SASL_PASSWORD or kafka.sasl_password_file instead"
        )
    return parsed


def parse_config(text: str, overrides: list[str] | tuple[str, ...] = (), source: str = "<config>") -> RunConfig:
    """Parse YAML text into a :class:`RunConfig` or raise :class:`ConfigError`."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{source}{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    return typing.cast(RunConfig, parse_raw(raw, overrides))
