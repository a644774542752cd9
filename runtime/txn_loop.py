"""The exactly-once loop: :class:`TxnLoop`, transactional record handlers.

No batch barrier: up to ``handling.max_concurrency`` handler calls at once across polls; every
``delivery.txn_interval_s`` (sooner when the input goes quiet: :meth:`TxnLoop.run`) one Kafka
transaction commits the outputs of every finished record and, per partition, the offset one
past its longest finished prefix, with the *ahead list* of the records finished after an
unfinished one in the offset's metadata (:mod:`runtime.offsets`). Whoever reads the partition
next (a restart, a rebalance) reads that list first and skips those records (counted in
``duplicates``): no head-of-line blocking, and each record's outputs are committed once. A
partition's ahead list is kept under ``AHEAD_MAX_CHARS``; finished records beyond it wait in
memory for a later transaction.

Handlers still running when the service stops or loses partitions are cancelled after
``shutdown_grace_s``; what finished is committed first, the rest is redelivered. The
transactions themselves are :meth:`runtime.kafka_io.KafkaIO.transaction`.
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka.errors import KafkaError

from runtime.bus import BusError, Deduper, Record, TopicPartition
from runtime.handling import Control, HandlerCalls, Tick, count
from runtime.kafka_io import KafkaIO
from runtime.offsets import (
    AHEAD_MAX_CHARS,
    Entry,
    OffsetTracker,
    decode_ahead,
    encode_ahead,
    holds,
    whole_records,
)
from runtime.service import Outcome, Output, RecordHandler
from schemas.errors import one_line

log = logging.getLogger("rollstream.runtime")

__all__ = ["QUIET_COMMIT_S", "TxnLoop"]

QUIET_COMMIT_S = 0.003
"""How long the input must stay quiet, with no handler running, before finished records commit
without waiting out ``txn_interval_s``, seconds. The last samples of a step wait this long before
the trainer can read them: in ``bench/pipeline_ceiling.py`` 3 ms rather than 10 gave about 5% more
samples/s with about as many transactions a second (13.8 against 13.1; the ``txn_interval_s / 4``
floor bounds them)."""

Finished = tuple[list[Output], Outcome | None, str | None]
"""A finished record waiting for its transaction: its outputs, how it ended (``None``: skipped as
a duplicate, nothing to count) and its ``event_id``."""
Key = tuple[TopicPartition, int, int]
"""A finished event: partition, offset, index in its Kafka record."""
Plan = tuple[list[Key], dict[TopicPartition, tuple[int, str]], dict[TopicPartition, set[Entry]]]
"""What a transaction commits: finished events, offsets with their ahead lists, new ahead sets."""


class TxnLoop:
    """Transactional record handlers, exactly once (see the module doc)."""

    def __init__(self, io: KafkaIO, service: RecordHandler, control: Control, tick: Tick) -> None:
        self.io = io
        self.settings = io.settings
        self.control = control
        self.tick = tick
        self.offsets = OffsetTracker()
        self.deduper = Deduper(io.settings.delivery.dedupe_capacity)
        self.calls = HandlerCalls(io, service, control, self.offsets, self.deduper)
        self.done: dict[Key, Finished] = {}
        """Events finished since the last transaction, by partition, offset and index."""
        self.sizes: dict[tuple[TopicPartition, int], int] = {}
        """Events per admitted batched record (records of one event are left out)."""
        self.ahead: dict[TopicPartition, set[Entry]] = {}
        """Per partition, the records (and events of records partly done) at or after the committed
        offset whose outputs a committed transaction holds (the ahead list committed with the offset)."""
        self.txn_lock = asyncio.Lock()
        """One transaction at a time: the periodic commit and the revoke hook (the consumer's
        rebalance task) would otherwise begin a second one on the same producer."""
        self.ahead_read: set[TopicPartition] = set()
        """Partitions whose committed ahead list was read since they were assigned. Not the keys of
        ``ahead``: a transaction that was already committing when its partition was revoked puts
        the partition back into ``ahead`` afterwards, and its list must still be read again (from
        the group, where the new owner may have moved it) when the partition comes back."""

    async def run(self) -> None:
        """Poll, start handlers, commit. A transaction commits what finished when ``txn_interval_s``
        passed since the last one, or earlier when the input went quiet: no handler running and
        nothing new for :data:`QUIET_COMMIT_S` (then at most every ``txn_interval_s / 4``), so the
        last records of a burst (an on-policy step's last samples) do not wait out the interval.
        A poll returns when a running handler finishes, so its outputs are not held up by the poll."""
        con, interval_s = self.settings.consume, self.settings.delivery.txn_interval_s
        cap = max(con.batch_max_records, self.settings.handling.max_concurrency)
        tasks, stop = self.calls.tasks, self.control.stop
        loop = asyncio.get_running_loop()
        last_poll = last_txn = loop.time()
        stop_wait = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                room = cap - len(tasks)
                quiet = False  # the input stayed quiet for a whole poll with no handler running
                if room > 0:
                    now = loop.time()
                    wait_s: float | None = None  # nothing finished: the plain poll timeout
                    if self._waiting():  # finished records wait: poll no longer than until they commit
                        due = last_txn + interval_s
                        if not tasks:
                            due = min(due, max(now + QUIET_COMMIT_S, last_txn + interval_s / 4))
                        wait_s = max(0.0, min(con.poll_timeout_s, due - now))
                    recs, whole = await self._poll_or_finished(min(room, con.batch_max_records), wait_s)
                    last_poll = loop.time()
                    quiet = whole and not recs and not tasks
                    unread = {r.tp for r in recs} - self.ahead_read
                    if unread:
                        await self._read_ahead(unread)
                    for rec in recs:
                        self._admit(rec)
                else:
                    await asyncio.wait({*tasks, stop_wait}, timeout=interval_s, return_when="FIRST_COMPLETED")
                    if loop.time() - last_poll > con.max_poll_interval_s / 2:
                        await self.io.keepalive()
                        last_poll = loop.time()
                since = loop.time() - last_txn
                if self._waiting() and (since >= interval_s or (quiet and since >= interval_s / 4)):
                    await self._commit_txn_ready()
                    last_txn = loop.time()  # also when nothing could commit yet: it waits for the next interval
                if not stop.is_set():
                    await self.tick()
        finally:
            stop_wait.cancel()

    def _waiting(self) -> bool:
        """Whether the next transaction has something to commit: finished records' outputs, or
        offsets that moved (records skipped as already committed by an earlier owner move them too)."""
        return bool(self.done) or bool(self.offsets.ready())

    async def _poll_or_finished(self, max_records: int, wait_s: float | None) -> tuple[list[Record], bool]:
        """``(records, whole)``: a poll of up to ``wait_s``, cut short (with no records) when a running
        handler finishes first; ``whole`` says it was not. Records the poll took are never lost: a
        cut-short poll that got records meanwhile returns them."""
        if not self.calls.tasks:
            return await self.io.poll(max_records, wait_s), True
        self.calls.finished.clear()  # one event for all handlers: a wait costs the same with 1 or 500 running
        poll = asyncio.ensure_future(self.io.poll(max_records, wait_s))
        finished = asyncio.ensure_future(self.calls.finished.wait())
        try:
            await asyncio.wait({poll, finished}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            poll.cancel()  # we are being cancelled: no poll is left running
            raise
        finally:
            finished.cancel()
        if poll.done():
            return poll.result(), True
        poll.cancel()
        try:
            return await poll, False  # it finished before the cancel took effect
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # we are being cancelled ourselves
            return [], False

    async def _read_ahead(self, tps: set[TopicPartition]) -> None:
        """Before the first record of each of ``tps`` is admitted: the ahead list committed with
        the group's offset (:func:`runtime.offsets.decode_ahead`), the records that an
        earlier owner of the partition already committed with their outputs."""
        who = self.io.service_name
        found = await self.io.consumer.committed_with_metadata(tps)
        for tp in tps:
            offset, metadata = found.get(tp, (0, ""))
            try:
                self.ahead[tp] = decode_ahead(offset, metadata)
            except ValueError as e:
                raise BusError(f"{who}: {tp.topic}[{tp.partition}]: {e}; the group's offsets were "
                               f"written by another program: reset them (kafka-consumer-groups.sh --reset-offsets)") from None
            if self.ahead[tp]:
                log.info("%s: %s[%d]: %d record(s) after the committed offset %d were already committed with "
                         "their outputs; skipping them", who, tp.topic, tp.partition, len(self.ahead[tp]), offset)
        self.ahead_read |= tps

    def _admit(self, rec: Record) -> None:
        tp, off, idx = rec.tp, rec.offset, rec.index
        self.offsets.add(tp, off, rec.in_record)
        if rec.in_record > 1:
            self.sizes[(tp, off)] = rec.in_record
        eid = rec.event_id
        dedupe = self.settings.delivery.dedupe
        if holds(self.ahead.get(tp, set()), off, idx):  # committed with its outputs by an earlier owner
            self.io.counters.duplicates += 1
            if dedupe and rec.error is None and eid is not None:
                self.deduper.check_and_add(eid)
            self.offsets.done(tp, off, idx)
            return
        if dedupe and rec.error is None and eid is not None and self.deduper.check_and_add(eid):
            self.io.counters.duplicates += 1
            self.done[(tp, off, idx)] = ([], None, None)
            self.offsets.done(tp, off, idx)
            return
        self.calls.start(rec, self._keep_for_txn)

    async def _keep_for_txn(self, rec: Record, outputs: list[Output], outcome: Outcome) -> None:
        self.done[(rec.tp, rec.offset, rec.index)] = (outputs, outcome, rec.event_id)

    def _txn_plan(self, only: set[TopicPartition] | None) -> Plan:
        """What the next transaction commits: the finished events (keys of ``done``), per
        partition the offset (one past its finished prefix) with its ahead list, and the new
        ahead sets. A partition's finished events after an unfinished record go in while its ahead
        list stays within :data:`AHEAD_MAX_CHARS` (the rest wait in memory for a later one)."""
        by_tp: dict[TopicPartition, list[tuple[int, int]]] = {}
        for tp, off, idx in self.done:
            if only is None or tp in only:
                by_tp.setdefault(tp, []).append((off, idx))
        keys: list[Key] = []
        offsets: dict[TopicPartition, tuple[int, str]] = {}
        ahead: dict[TopicPartition, set[Entry]] = {}
        for tp in set(by_tp) | set(self.offsets.ready(only)):
            pos = self.offsets.position(tp)
            if pos is None:
                continue
            finished = sorted(by_tp.get(tp, []))
            take = [e for e in finished if e[0] < pos]  # the finished prefix
            kept = {e for e in self.ahead.get(tp, ()) if e[0] >= pos}  # committed before: always listed
            later = [e for e in finished if e[0] >= pos]  # finished after an unfinished record
            sizes = {off: n for (t, off), n in self.sizes.items() if t == tp and off >= pos} if later else {}
            listed = whole_records(kept | set(later), sizes)
            if len(encode_ahead(pos, listed)) <= AHEAD_MAX_CHARS:  # the usual case: all fit
                kept = listed
                take += later
            else:  # the first ones, while the list fits
                for e in later:
                    more = whole_records(kept | {e}, sizes)
                    if len(encode_ahead(pos, more)) > AHEAD_MAX_CHARS:
                        break
                    kept = more
                    take.append(e)
            if not take and pos <= self.offsets.committed(tp):
                continue
            keys += [(tp, off, idx) for off, idx in take]
            offsets[tp] = (pos, encode_ahead(pos, kept))
            ahead[tp] = kept
        return sorted(keys, key=lambda k: (k[0].topic, k[0].partition, k[1], k[2])), offsets, ahead

    async def _commit_txn_ready(self, only: set[TopicPartition] | None = None) -> None:
        """One transaction: the outputs of every finished record not committed yet, and per
        partition the offset one past its finished prefix with the ahead list of the finished
        records after it (:mod:`runtime.offsets`). Transactions never overlap (``txn_lock``)."""
        async with self.txn_lock:
            await self._commit_txn_locked(only)

    async def _commit_txn_locked(self, only: set[TopicPartition] | None) -> None:
        keys, offsets, ahead = self._txn_plan(only)
        if not offsets:
            return
        entries = [self.done[k] for k in keys]
        await self.io.transaction([o for outputs, _, _ in entries for o in outputs], offsets)
        for k in keys:
            del self.done[k]
        self.ahead.update(ahead)
        self.offsets.mark_committed({tp: pos for tp, (pos, _) in offsets.items()})
        for tp, (pos, _) in offsets.items():  # records before the offset are done with
            for sk in [sk for sk in self.sizes if sk[0] == tp and sk[1] < pos]:
                del self.sizes[sk]
        for outputs, outcome, _ in entries:
            if outcome is not None:
                count(self.io.counters, outputs, outcome)

    def _drop_txn(self, tps: set[TopicPartition] | None = None) -> None:
        """Forget the uncommitted outputs (of ``tps``; all when None): their records are
        redelivered. The ahead lists are read again when the partitions come back."""
        for k in [k for k in self.done if tps is None or k[0] in tps]:
            _, _, eid = self.done.pop(k)
            if eid is not None and self.settings.delivery.dedupe:
                self.deduper.discard(eid)
        for tp in list(self.ahead) if tps is None else tps:
            self.ahead.pop(tp, None)
        for sk in [sk for sk in self.sizes if tps is None or sk[0] in tps]:
            del self.sizes[sk]
        self.ahead_read -= set(self.ahead_read) if tps is None else tps

    async def on_revoked(self, tps: set[TopicPartition]) -> None:
        self.calls.revoking |= tps
        try:
            mine = self.calls.of(tps)
            if mine:
                await self.calls.drain(mine, "partitions revoked")
            await self._commit_txn_ready(only=tps)
            self._drop_txn(tps)
            self.offsets.drop(tps)
        finally:
            self.calls.revoking -= tps

    async def finish(self) -> None:
        if self.calls.tasks:
            await self.calls.drain(list(self.calls.tasks), "shutdown")
        if self.io.consumer.started and self._waiting():
            try:
                await self._commit_txn_ready()
            except (KafkaError, BusError) as e:  # redelivered to the next instance
                log.warning("%s: finished work not committed at shutdown: %s", self.io.service_name, one_line(e))
            self._drop_txn()
