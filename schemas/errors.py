"""One way to say what went wrong on one line (errors shown to users, dead letters, logs), and
blocking calls on threads whose every error reaches the awaiting coroutine (:func:`to_thread`)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

__all__ = ["one_line", "surfaced", "to_thread"]

P = ParamSpec("P")
T = TypeVar("T")


def one_line(err: BaseException | str, limit: int = 500, *, typed: bool = True) -> str:
    """``ExcType: first line of the message`` for an exception, the first non-empty line for text.

    Whitespace runs collapse to one space and the result is cut to ``limit`` characters (the
    last three then being ``...``). An exception whose message already starts with its class
    name (aiokafka's do) is not prefixed twice; one without a message is just its class name.
    ``typed=False`` leaves the class name out of an exception that has a message (for messages
    that already say what they are, e.g. ClickHouse's ``Code: 47. DB::Exception: ...``).
    """
    if isinstance(err, BaseException):
        name = type(err).__name__
        lines = [ln for ln in str(err).splitlines() if ln.strip()]
        first = " ".join(lines[0].split()) if lines else ""
        if first.startswith(name + ":"):
            first = first[len(name) + 1 :].strip()
        line = (f"{name}: {first}" if typed else first) if first else name
    else:
        lines = [ln for ln in str(err).splitlines() if ln.strip()]
        line = " ".join(lines[0].split()) if lines else "unknown error"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def surfaced(fn: Callable[P, T]) -> Callable[P, T]:
    """``fn`` with a ``StopIteration`` it raises turned into a ``RuntimeError``. asyncio cannot put
    a ``StopIteration`` into a future (a ``TypeError`` in the loop's callback instead), so awaiting
    a thread or executor call that raised one would never end: wrap what ``run_in_executor`` runs."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return fn(*args, **kwargs)
        except StopIteration as e:
            raise RuntimeError(f"{getattr(fn, '__qualname__', fn)} raised StopIteration") from e

    return call


async def to_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``asyncio.to_thread(fn, ...)`` whose await ends whatever ``fn`` raises (:func:`surfaced`)."""
    return await asyncio.to_thread(surfaced(fn), *args, **kwargs)
