"""How the recorder meets its store being down: which insert errors are an outage
(:func:`is_transient`), the deduplication token that makes a retried batch idempotent
(:func:`batch_token`), the backoff, and the state it publishes for ``rollstream status``
(:class:`StoreOutage` in ``<run_dir>/recorder_store.json``; :func:`describe_outage`).
:mod:`services.recorder` retries with these; docs/reliability.md, "The store down", tells more.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

import msgspec

from store.rows import COLUMNS

OUTAGE_FILE = "recorder_store.json"
"""The recorder's view of its store, in the run's folder (:class:`StoreOutage`)."""


class StoreOutage(msgspec.Struct, kw_only=True):
    """The store's state as the recorder sees it (``recorder_store.json``)."""

    down_since: float | None = None
    """Unix seconds of the first failed insert of the current outage; None = the store is up."""
    attempts: int = 0
    """Failed insert attempts in the current outage."""
    behind: int = 0
    """Messages of the failing poll waiting to be stored."""
    last_error: str = ""
    """The last insert error, one line."""
    last_outage_s: float = 0.0
    """How long the last ended outage lasted, seconds (0 = none yet)."""
    outages: int = 0
    """Outages ended so far."""


TRANSIENT_CODES = frozenset({
    3, 32,  # UNEXPECTED_END_OF_FILE, ATTEMPT_TO_READ_AFTER_EOF (a connection cut mid-answer)
    74, 75, 76, 77,  # CANNOT_READ_FROM/WRITE_TO_FILE_DESCRIPTOR, CANNOT_OPEN_FILE, CANNOT_CLOSE_FILE
    159, 209, 210, 279,  # TIMEOUT_EXCEEDED, SOCKET_TIMEOUT, NETWORK_ERROR, ALL_CONNECTION_TRIES_FAILED
    173, 241, 243,  # CANNOT_ALLOCATE_MEMORY, MEMORY_LIMIT_EXCEEDED, NOT_ENOUGH_SPACE
    202, 236, 242, 252,  # TOO_MANY_SIMULTANEOUS_QUERIES, ABORTED, TABLE_IS_READ_ONLY, TOO_MANY_PARTS
    319, 425, 1000,  # UNKNOWN_STATUS_OF_INSERT, SYSTEM_ERROR, POCO_EXCEPTION
})
"""ClickHouse error codes of a store that may work again (I/O, network, time, memory, load)."""
STD_EXCEPTION = 1001
"""ClickHouse's code for a C++ exception: transient when it is a filesystem error (chDB's I/O)."""


class StoreDown(Exception):
    """The store failed with a transient error while the recorder was stopping: not retried."""


def is_transient(e: BaseException) -> bool:
    """Whether an insert that raised ``e`` may succeed when retried (the store down): an ``OSError``
    (refused, reset, timed out), clickhouse-connect's ``OperationalError`` without a ClickHouse
    code (its connection failures), a ClickHouse error of :data:`TRANSIENT_CODES`, or chDB's
    filesystem errors. A bad column, a wrong type or a missing table is not: a retry cannot fix it."""
    code = getattr(e, "code", None)
    if not isinstance(code, int):
        m = re.search(r"\bCode:\s*(\d+)", str(e))
        code = int(m[1]) if m else None
    if code is not None:
        return code in TRANSIENT_CODES or (code == STD_EXCEPTION and "filesystem error" in str(e))
    if isinstance(e, OSError):
        return True
    from clickhouse_connect.driver.exceptions import OperationalError

    return isinstance(e, OperationalError)


def batch_token(tables: dict[str, list[list[Any]]]) -> str:
    """The deduplication token of one batch, the same at every attempt: a digest of its events'
    ``(topic, partition, offset, record_index)``, or of all its rows when it has no events."""
    h = hashlib.blake2b(digest_size=16)
    events = tables.get("events")
    if events:
        first, last = COLUMNS["events"].index("offset"), COLUMNS["events"].index("record_index")
        for row in events:
            h.update(f"{row[0]}\0{row[1]}\0{row[first]}\0{row[last]}\n".encode())
    else:
        h.update(repr(sorted(tables.items())).encode())
    return h.hexdigest()


def backoff_s(attempt: int, first_s: float, max_s: float) -> float:
    """The wait after failed attempt number ``attempt`` (1-based): first_s, 2x, 4x ... capped at max_s."""
    return min(max_s, first_s * 2.0 ** min(max(attempt - 1, 0), 30))


def write_outage(path: str, outage: StoreOutage) -> None:
    """Write ``outage`` to ``path`` as JSON, atomically (a reader never sees half a file)."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as fh:
        fh.write(msgspec.json.encode(outage))
    os.replace(tmp, path)


def describe_outage(o: StoreOutage, now: float) -> str:
    """One line for ``rollstream status``: the store's state as the recorder last published it."""
    if o.down_since is not None:
        return (f"store: unreachable for {now - o.down_since:.0f} s (recorder retrying, {o.attempts} attempts; "
                f"{o.behind} events behind): {o.last_error}")
    if o.outages:
        return f"store: up (caught up after {o.outages} outage(s), the last {o.last_outage_s:.0f} s)"
    return "store: up"
