"""Which offsets are safe to commit when records of one partition finish out of order.

:class:`OffsetTracker` keeps, per partition, the offsets admitted to handler calls and those
finished; the offset safe to commit is one past the longest finished prefix, so concurrent
handlers (``max_concurrency > 1``) never commit past unfinished work.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from services.kafka.bus import TopicPartition

__all__ = ["OffsetTracker"]


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

    def mark_committed(self, offsets: dict[TopicPartition, int]) -> None:
        for tp, n in offsets.items():
            self._committed[tp] = max(n, self._committed.get(tp, -1))

    def drop(self, tps: Iterable[TopicPartition]) -> None:
        for tp in tps:
            for d in (self._pending, self._done, self._next, self._committed):
                d.pop(tp, None)  # type: ignore[attr-defined]

