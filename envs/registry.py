"""Registries of task sources, verifiers and multi-step environments, by name.

``register_*`` are decorators; lookups raise ``KeyError`` naming what is registered.
Built-ins (sources ``arith``, ``jsonl``, ``parquet``, ``dataset``, ...; verifiers ``exact``,
``math``, ``format``, ...) register themselves when ``envs`` is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from envs.base import Env, TaskSource, Verifier

SourceFactory = Callable[..., TaskSource]
EnvFactory = Callable[..., Env]

SOURCES: dict[str, SourceFactory] = {}
VERIFIERS: dict[str, Verifier] = {}
ENVS: dict[str, EnvFactory] = {}
VISUAL_SOURCES: set[str] = set()
"""Task sources whose problems carry images (:func:`is_visual`): they need a vision-language model."""

F = TypeVar("F")


def _register(table: dict[str, Any], kind: str, name: str) -> Callable[[F], F]:
    def deco(obj: F) -> F:
        if name in table and table[name] is not obj:
            raise ValueError(f"{kind} {name!r} is already registered")
        table[name] = obj
        return obj

    return deco


def register_source(name: str) -> Callable[[F], F]:
    """Register a task source factory ``factory(**kwargs) -> TaskSource``."""
    return _register(SOURCES, "task source", name)


def register_verifier(name: str) -> Callable[[F], F]:
    """Register a verifier ``fn(response, reference, **kwargs) -> VerifyResult``."""
    return _register(VERIFIERS, "verifier", name)


def register_env(name: str) -> Callable[[F], F]:
    """Register an environment factory ``factory(prompt=..., reference=..., **kwargs) -> Env``."""
    return _register(ENVS, "environment", name)


def _lookup(table: dict[str, Any], kind: str, name: str) -> Any:
    if name not in table:
        raise KeyError(f"unknown {kind} {name!r}; registered: {', '.join(sorted(table)) or 'none'}")
    return table[name]


def make_source(name: str, **kwargs: Any) -> TaskSource:
    """Build the registered task source ``name`` with ``kwargs``."""
    factory: SourceFactory = _lookup(SOURCES, "task source", name)
    return factory(**kwargs)


def get_verifier(name: str) -> Verifier:
    """The registered verifier ``name``."""
    verifier: Verifier = _lookup(VERIFIERS, "verifier", name)
    return verifier


def get_env_factory(name: str) -> EnvFactory:
    """The registered environment factory ``name``."""
    factory: EnvFactory = _lookup(ENVS, "environment", name)
    return factory


def is_episodic(source: str) -> bool:
    """Whether task source ``source`` is multi-turn: registered as an environment too, so its problems
    are episodes played by the rollout agent loop against environment workers (``frozenlake``,
    ``sokoban``, ``tool_use``, ``webshop``) rather than single responses scored by a verifier."""
    return source in ENVS and source in SOURCES


def is_visual(source: str) -> bool:
    """Whether task source ``source`` is visual: its problems carry images (``shapes``)."""
    return source in VISUAL_SOURCES


def episodic_domains(cfg: Any) -> list[str]:
    """Names of the run config's multi-turn domains (:func:`is_episodic` sources), in config order."""
    return [d.name for d in cfg.data.domains if is_episodic(d.source)]


def load_plugins(modules: list[str]) -> None:
    """Import ``modules`` (``data.plugins``) so their registrations take effect; the current directory
    is searched too. Raises ``ImportError`` naming the module and why."""
    import importlib
    import os
    import sys

    here = os.getcwd()
    if modules and here not in sys.path:
        sys.path.append(here)
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ImportError(f"cannot import plugin module {name!r}: {type(e).__name__}: {first}") from None
