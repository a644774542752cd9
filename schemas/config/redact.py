"""Secrets in configs and messages: ``kafka.sasl_password`` and any URL password (a store DSN)
are shown as ``***`` wherever a config is written, published or printed."""

from __future__ import annotations

import re
import typing
from typing import Any

import msgspec

REDACTED = "***"
"""What a secret is shown as in ``runs/<id>/config.yaml``, ``RunStarted.config_json``, summaries and
messages. As a config value it means "given elsewhere" (the environment or a file)."""

SECRET_KEYS = frozenset({"sasl_password", "password"})
"""Config keys whose values are secrets."""

_URL_PASSWORD = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s:/@]*:)(?P<pw>[^\s/]*)@")
_ASSIGNED_PASSWORD = re.compile(r"(?P<head>\b(?:sasl_)?password\s*[=:]\s*)(?P<pw>[^\s,;]+)", re.IGNORECASE)


def redact_url(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@host`` in it shown as ``***``
    (a store DSN, a bootstrap address written as a URL)."""
    return _URL_PASSWORD.sub(lambda m: f"{m['head']}{REDACTED if m['pw'] else ''}@", text)


def redact_text(text: str) -> str:
    """``text`` (a command line, a message) with URL passwords and ``password=...`` /
    ``sasl_password=...`` assignments shown as ``***``."""
    return _ASSIGNED_PASSWORD.sub(lambda m: f"{m['head']}{REDACTED}", redact_url(text))


def _redact_builtins(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: (REDACTED if k in SECRET_KEYS and obj[k] else _redact_builtins(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_redact_builtins(v) for v in obj]
    return redact_url(obj) if isinstance(obj, str) else obj


def redacted_dict(cfg: msgspec.Struct | dict[str, Any]) -> dict[str, Any]:
    """``cfg`` (a config Struct or its builtins) as plain builtins with every secret shown as
    ``***``: ``kafka.sasl_password`` and the password of ``store.dsn`` (of any URL). What is
    written to ``runs/<id>/config.yaml`` and ``summary.json`` and published as
    ``RunStarted.config_json``; services that read it get the secrets from the environment or a
    file again (``$ROLLSTREAM_SASL_PASSWORD`` / ``kafka.sasl_password_file``,
    ``$ROLLSTREAM_STORE_PASSWORD`` / ``$ROLLSTREAM_STORE_PASSWORD_FILE``)."""
    raw = cfg if isinstance(cfg, dict) else msgspec.to_builtins(cfg)
    return typing.cast(dict[str, Any], _redact_builtins(raw))


def to_dict(cfg: msgspec.Struct, *, reveal_secrets: bool = False) -> dict[str, Any]:
    """The config as plain builtins (for JSON / YAML output), secrets shown as ``***``
    (:func:`redacted_dict`) unless ``reveal_secrets``."""
    raw = typing.cast(dict[str, Any], msgspec.to_builtins(cfg))
    return raw if reveal_secrets else typing.cast(dict[str, Any], _redact_builtins(raw))
