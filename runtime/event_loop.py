"""The event loop of a service process: uvloop's (libuv, written in C) where uvloop is installed,
else asyncio's own.

A service spends much of its CPU in the loop itself: scheduling callbacks and tasks, polling
sockets, writing to them. uvloop does that work in C. In ``bench/pipeline_ceiling.py`` it cut the
rollout's, reward router's and trainer's CPU per sample by 8-15% (bench/README.md, "uvloop in
the service processes"). The library itself is loop-agnostic: tests and library users run it on
whatever loop they like. Only the service entry point (``rollstream service``) calls :func:`run`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["loop_factory", "run"]

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's ``new_event_loop`` when uvloop can be imported, else ``None`` (asyncio's default)."""
    try:
        import uvloop
    except ImportError:  # a platform without uvloop (Windows) runs on asyncio's loop
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], *, factory: Callable[[], asyncio.AbstractEventLoop] | None = None) -> T:
    """``asyncio.run(main)`` on ``factory``'s loop (default: :func:`loop_factory`'s)."""
    with asyncio.Runner(loop_factory=factory or loop_factory()) as runner:
        return runner.run(main)
