"""Which offsets are safe to commit when records of one partition finish out of order.

:class:`OffsetTracker` keeps, per partition, the offsets admitted to handler calls and those
finished; the offset safe to commit is one past the longest finished prefix, so concurrent
handlers (``max_concurrency > 1``) never commit past unfinished work.

:func:`encode_ahead` / :func:`decode_ahead` write and read the *ahead list* that the
transactional loop commits with an offset (its commit metadata): the records at or after the
committed one whose outputs a committed transaction already holds, and of a batched record
partly done the events (``offset.index``) whose outputs it holds. A record finished after a
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

__all__ = ["AHEAD_MAX_CHARS", "AHEAD_TAG", "WHOLE", "Entry", "OffsetTracker", "decode_ahead", "encode_ahead", "holds",
           "whole_records"]

AHEAD_TAG = "rs-ahead1:"
"""The start of an ahead list in a commit's metadata (a different start: not an ahead list)."""
AHEAD_MAX_CHARS = 2048
"""The longest ahead list written, half of Kafka's default ``offset.metadata.max.bytes``."""


Entry = tuple[int, int]
"""One entry of an ahead set: ``(offset, index)`` of one event of a batched record, or
``(offset, WHOLE)`` for every event of the record at ``offset``."""
WHOLE = -1


def encode_ahead(committed: int, entries: Iterable[int | Entry]) -> str:
    """``entries`` (offsets ``>= committed``; a bare offset is a whole record) as commit metadata:
    :data:`AHEAD_TAG`, then comma-separated distances from ``committed``, a run of consecutive
    whole records as ``first-last``, events of a record partly done as ``distance.index`` (a run
    of indices ``distance.first-last``). ``committed`` 100, records 102, 103, 104, 107 and events 0,
    1, 2 and 5 of record 109 -> ``rs-ahead1:2-4,7,9.0-2,9.5``. No entries: ``""``."""
    whole: set[int] = set()
    parts: dict[int, set[int]] = {}
    for e in entries:
        off, idx = (e, WHOLE) if isinstance(e, int) else e
        if off < committed:
            raise ValueError(f"ahead offset {off} is before the committed offset {committed}")
        if idx == WHOLE:
            whole.add(off - committed)
        else:
            parts.setdefault(off - committed, set()).add(idx)
    if not whole and not parts:
        return ""
    tokens: list[tuple[int, str]] = [(lo, f"{lo}" if lo == hi else f"{lo}-{hi}") for lo, hi in _runs(whole)]
    for d, idxs in parts.items():
        if d not in whole:
            tokens += [(d, f"{d}.{lo}" if lo == hi else f"{d}.{lo}-{hi}") for lo, hi in _runs(idxs)]
    return AHEAD_TAG + ",".join(t for _, t in sorted(tokens, key=lambda t: t[0]))


def _runs(values: set[int]) -> list[tuple[int, int]]:
    """``values`` as runs of consecutive numbers ``(first, last)``, ascending."""
    out: list[tuple[int, int]] = []
    for v in sorted(values):
        if out and v == out[-1][1] + 1:
            out[-1] = (out[-1][0], v)
        else:
            out.append((v, v))
    return out


def decode_ahead(committed: int, metadata: str) -> set[Entry]:
    """The entries an ahead list written by :func:`encode_ahead` names (a whole record as
    ``(offset, WHOLE)``); ``set()`` for metadata that is not one (empty, or written by another
    tool). ``ValueError`` on a damaged list."""
    if not metadata.startswith(AHEAD_TAG):
        return set()
    body = metadata[len(AHEAD_TAG):]
    out: set[Entry] = set()
    try:
        for part in body.split(",") if body else []:
            dist, dot, idxs = part.partition(".")
            first, _, last = (idxs if dot else dist).partition("-")
            lo, hi = int(first), int(last or first)
            if lo < 0 or hi < lo:
                raise ValueError(part)
            if dot:
                d = int(dist)
                if d < 0:
                    raise ValueError(part)
                out.update((committed + d, i) for i in range(lo, hi + 1))
            else:
                out.update((committed + o, WHOLE) for o in range(lo, hi + 1))
    except ValueError:
        raise ValueError(f"damaged ahead list in the commit metadata: {metadata[:80]!r}") from None
    return out


def holds(ahead: set[Entry], offset: int, index: int) -> bool:
    """Whether ``ahead`` names event ``index`` of the record at ``offset``."""
    return (offset, WHOLE) in ahead or (offset, index) in ahead


def whole_records(entries: Iterable[Entry], sizes: dict[int, int]) -> set[Entry]:
    """``entries`` with every record whose events are all named (``sizes``: events per record
    offset; a record left out carries one) written as ``(offset, WHOLE)``."""
    out: set[Entry] = set()
    parts: dict[int, set[int]] = {}
    for off, idx in entries:
        if idx == WHOLE:
            out.add((off, WHOLE))
        else:
            parts.setdefault(off, set()).add(idx)
    for off, idxs in parts.items():
        if (off, WHOLE) in out:
            continue
        if len(idxs) >= sizes.get(off, 1):
            out.add((off, WHOLE))
        else:
            out.update((off, i) for i in idxs)
    return out


class OffsetTracker:
    """Per partition: which admitted records are finished (every event of a batched record), and
    the next offset safe to commit (one past the longest finished prefix)."""

    def __init__(self) -> None:
        self._pending: dict[TopicPartition, deque[int]] = {}
        self._left: dict[TopicPartition, dict[int, set[int]]] = {}
        self._next: dict[TopicPartition, int] = {}
        self._committed: dict[TopicPartition, int] = {}

    def add(self, tp: TopicPartition, offset: int, in_record: int = 1) -> None:
        """Admit an event of the record at ``offset`` (of ``in_record`` events; the first one
        admitted admits the record)."""
        left = self._left.setdefault(tp, {})
        if offset not in left:
            self._pending.setdefault(tp, deque()).append(offset)
            left[offset] = set(range(in_record))

    def done(self, tp: TopicPartition, offset: int, index: int = 0) -> None:
        """Event ``index`` of the record at ``offset`` is finished."""
        left = self._left.get(tp)
        if left is None or offset not in left:  # partition was revoked meanwhile
            return
        left[offset].discard(index)
        q = self._pending[tp]
        while q and not left[q[0]]:
            o = q.popleft()
            del left[o]
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
            for d in (self._pending, self._left, self._next, self._committed):
                d.pop(tp, None)  # type: ignore[attr-defined]
