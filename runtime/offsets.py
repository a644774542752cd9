"""Which offsets are safe to commit when records of one partition finish out of order.

:class:`OffsetTracker` keeps, per partition, the offsets admitted to handler calls and those
finished; the offset safe to commit is one past the longest finished prefix, so concurrent
handlers (``max_concurrency > 1``) never commit past unfinished work.

:func:`encode_ahead` / :func:`decode_ahead` write and read the *ahead list* that the
transactional loop commits with an offset (its commit metadata): the offsets at or after the
committed one whose outputs a committed transaction already holds. A record finished after a
slower one of its partition is committed with its outputs at once and listed there; whoever
reads the partition next from the committed offset skips the listed records instead of
handling them again. Kafka keeps a commit's metadata string with the offset (up to
``offset.metadata.max.bytes``, 4096 by default), and a transactional offset commit writes it
atomically with the transaction's messages.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from runtime.bus import TopicPartition

__all__ = ["AHEAD_MAX_CHARS", "AHEAD_TAG", "OffsetTracker", "decode_ahead", "encode_ahead"]

AHEAD_TAG = "rs-ahead1:"
"""The start of an ahead list in a commit's metadata (a different start: not an ahead list)."""
AHEAD_MAX_CHARS = 2048
"""The longest ahead list written, half of Kafka's default ``offset.metadata.max.bytes``."""


def encode_ahead(committed: int, offsets: Iterable[int]) -> str:
    """``offsets`` (each ``>= committed``) as commit metadata: :data:`AHEAD_TAG`, then comma-separated
    distances from ``committed``, a run of consecutive ones as ``first-last``
    (``committed`` 100, offsets 102, 103, 104, 107 -> ``rs-ahead1:2-4,7``). No offsets: ``""``."""
    deltas = sorted({o - committed for o in offsets})
    if not deltas:
        return ""
    if deltas[0] < 0:
        raise ValueError(f"ahead offset {deltas[0] + committed} is before the committed offset {committed}")
    runs: list[str] = []
    start = prev = deltas[0]
    for d in [*deltas[1:], -1]:
        if d == prev + 1:
            prev = d
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = d
    return AHEAD_TAG + ",".join(runs)


def decode_ahead(committed: int, metadata: str) -> set[int]:
    """The offsets an ahead list written by :func:`encode_ahead` names; ``set()`` for metadata
    that is not one (empty, or written by another tool). ``ValueError`` on a damaged list."""
    if not metadata.startswith(AHEAD_TAG):
        return set()
    body = metadata[len(AHEAD_TAG):]
    out: set[int] = set()
    try:
        for part in body.split(",") if body else []:
            first, _, last = part.partition("-")
            lo, hi = int(first), int(last or first)
            if lo < 0 or hi < lo:
                raise ValueError(part)
            out.update(range(committed + lo, committed + hi + 1))
    except ValueError:
        raise ValueError(f"damaged ahead list in the commit metadata: {metadata[:80]!r}") from None
    return out


class OffsetTracker:
    """Per partition: which admitted offsets are finished, and the next offset safe to commit
    (one past the longest finished prefix)."""

    def __init__(self) -> None:
        self._pending: dict[TopicPartition, deque[int]] = {}
        self._done: dict[TopicPartition, set[int]] = {}
        self._next: dict[TopicPartition, int] = {}
        self._committed: dict[TopicPartition, int] = {}

    def add(self, tp: TopicPartition, offset: int) -> None:
        self._pending.setdefault(tp, deque()).append(offset)

    def done(self, tp: TopicPartition, offset: int) -> None:
        q = self._pending.get(tp)
        if q is None:  # partition was revoked meanwhile
            return
        ds = self._done.setdefault(tp, set())
        ds.add(offset)
        while q and q[0] in ds:
            o = q.popleft()
            ds.discard(o)
            self._next[tp] = o + 1

    def ready(self, only: set[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        return {
            tp: n
            for tp, n in self._next.items()
            if n > self._committed.get(tp, -1) and (only is None or tp in only)
        }

    def position(self, tp: TopicPartition) -> int | None:
        """The offset to commit for ``tp``: one past its finished prefix, or, before any record
        of it finished, its first admitted offset (everything before it was never given to this
        instance: already committed, or not a record); ``None`` when nothing was admitted."""
        if tp in self._next:
            return self._next[tp]
        q = self._pending.get(tp)
        return q[0] if q else None

    def committed(self, tp: TopicPartition) -> int:
        """The offset last committed for ``tp`` through :meth:`mark_committed` (-1: none)."""
        return self._committed.get(tp, -1)

    def mark_committed(self, offsets: dict[TopicPartition, int]) -> None:
        for tp, n in offsets.items():
            self._committed[tp] = max(n, self._committed.get(tp, -1))

    def drop(self, tps: Iterable[TopicPartition]) -> None:
        for tp in tps:
            for d in (self._pending, self._done, self._next, self._committed):
                d.pop(tp, None)  # type: ignore[attr-defined]
