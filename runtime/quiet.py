"""Keep aiokafka's connection-error logs off the terminal while rollstream reports them itself.

aiokafka logs every refused connection at ERROR (``Unable connect to "host:port": ...``). Where
rollstream retries such failures and then reports them in one line of its own (a bounded client
start, the readiness probe), those records are noise. Inside :func:`quiet_aiokafka` the records
aiokafka emits are downgraded to DEBUG, so they show only where DEBUG logging is on (``--debug``).

The scope is the calling task (a context variable), not the process: other tasks and threads
logging at the same time are untouched. Tasks started inside the scope (aiokafka's metadata
synchronizer) see it end with it. The filter is installed on aiokafka's loggers on the first use;
importing this module changes nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from collections.abc import Iterator

__all__ = ["quiet_aiokafka"]

_LOGGERS = ("aiokafka", "aiokafka.conn")
"""aiokafka's loggers that report connection and bootstrap failures."""


class _Scope:
    """One :func:`quiet_aiokafka` block; ``active`` turns off when the block ends."""

    __slots__ = ("active",)

    def __init__(self) -> None:
        self.active = True


_SCOPE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("rollstream_quiet_aiokafka", default=None)
_installed = False
_install_lock = threading.Lock()


class _DowngradeFilter(logging.Filter):
    """Inside a quiet scope: a record above DEBUG becomes DEBUG, kept only if its logger logs DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        scope = _SCOPE.get()
        if scope is None or not scope.active or record.levelno <= logging.DEBUG:
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def _install() -> None:
    global _installed
    with _install_lock:
        if not _installed:
            for name in _LOGGERS:
                logging.getLogger(name).addFilter(_DowngradeFilter())
            _installed = True


@contextlib.contextmanager
def quiet_aiokafka() -> Iterator[None]:
    """Within the block, aiokafka's log records from this task are DEBUG records (see the module doc)."""
    _install()
    scope = _Scope()
    token = _SCOPE.set(scope)
    try:
        yield
    finally:
        scope.active = False
        _SCOPE.reset(token)
