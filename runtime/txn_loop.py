"""The runtime's exactly-once loop (mixed into :class:`runtime.runner.Runner`).

:meth:`TxnLoop._loop_txn` runs transactional record handlers without a batch barrier: up to
``max_concurrency`` handler calls at once across polls; every ``txn_interval_s`` (sooner when the
input goes quiet: :meth:`TxnLoop._loop_txn`) one Kafka transaction commits the outputs of every
finished record, and per partition the offset one past its
longest finished prefix, with the *ahead list* of the records finished after an unfinished one in
the offset's metadata (:mod:`runtime.offsets`). Whoever reads the partition next (a
restart, a rebalance) reads that list first and skips those records (counted in ``duplicates``):
no head-of-line blocking, and each record's outputs are committed once. A partition's ahead list is
kept under ``AHEAD_MAX_CHARS``; finished records beyond it wait in memory for a later transaction.

Handlers still running when the service stops or loses partitions are cancelled after
``shutdown_grace_s``; what finished is committed first, the rest is redelivered.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from aiokafka.errors import KafkaError, ProducerFenced

from runtime.bus import BusError, Record, RecordMetadata, TopicPartition
from runtime.loops import Loops
from runtime.offsets import AHEAD_MAX_CHARS, decode_ahead, encode_ahead
from runtime.outage import is_outage
from runtime.service import Outcome, Output
from schemas.errors import one_line

log = logging.getLogger("rollstream.runtime")

__all__ = ["QUIET_COMMIT_S", "TxnLoop"]

QUIET_COMMIT_S = 0.01
"""How long the input must stay quiet, with no handler running, before finished records commit
without waiting out ``txn_interval_s``, seconds."""


class TxnLoop(Loops):
    """The exactly-once loop; the state it uses is the Runner's."""

    _ahead: dict[TopicPartition, set[int]]
    _ahead_read: set[TopicPartition]

    async def _commit_txn(self, outputs: list[Output], offsets: Mapping[TopicPartition, int | tuple[int, str]]) -> None:
        """Send ``outputs`` and commit ``offsets`` in one transaction. A transaction that fails
        (a broker outage, a coordinator moving) is aborted and done again with a new producer of
        the same transactional id, which fences the old one, until it commits or it has failed
        for ``kafka.outage_timeout_s``; then :class:`BusError` (the batch is reprocessed after a
        restart). A fenced producer (another instance took over) fails at once."""
        retry = self.outage.retry(f"transaction of {len(outputs)} output(s)")
        # one attempt waits at most this long (an abort waits for the coordinator otherwise)
        attempt_s = self.settings.kafka.request_timeout_s + 10

        async def attempt() -> None:
            futs: list[asyncio.Future[RecordMetadata]] = []
            async with self.producer.transaction():
                for o in outputs:
                    futs.append(await self.producer.send_raw(o.topic, o.value, o.key))
                await self.producer.send_offsets_to_transaction(offsets, str(self.settings.group_id))
            await asyncio.gather(*futs)

        while True:
            try:
                task = asyncio.ensure_future(attempt())
                await asyncio.wait({task}, timeout=attempt_s)
                if not task.done():  # its abort would wait for the coordinator: leave it to the old producer
                    task.cancel()
                    self._closing.add(task)
                    task.add_done_callback(self._closing.discard)
                    raise TimeoutError(f"no answer within {attempt_s:g} s")
                task.result()
            except (KafkaError, BusError, TimeoutError) as e:
                if isinstance(e, ProducerFenced) or (isinstance(e, BusError) and not is_outage(e)):
                    raise BusError(f"{self.service.name}: transaction failed and was aborted (its records "
                                   f"will be reprocessed after a restart): {one_line(e)}") from None
                # any other error of a transaction is treated as transient: a new producer (same
                # transactional id) fences this one and aborts what is left of its transaction
                await retry.failed(e, transient=True)
                await self._renew_producer(retry)
                continue
            retry.done()
            return

    async def _loop_txn(self) -> None:
        """Poll, start handlers, commit. A transaction commits what finished when ``txn_interval_s``
        passed since the last one, or earlier when the input went quiet: no handler running and
        nothing new for :data:`QUIET_COMMIT_S` (then at most every ``txn_interval_s / 4``), so the
        last records of a burst (an on-policy step's last samples) do not wait out the interval.
        A poll returns when a running handler finishes, so its outputs are not held up by the poll."""
        s = self.settings
        cap = max(s.batch_max_records, s.max_concurrency)
        loop = asyncio.get_running_loop()
        last_poll = last_txn = loop.time()
        stop_wait = asyncio.ensure_future(self.stop.wait())
        try:
            while not self.stop.is_set():
                room = cap - len(self._tasks)
                quiet = False  # the input stayed quiet for a whole poll with no handler running
                if room > 0:
                    now = loop.time()
                    wait_s: float | None = None  # nothing finished: the plain poll timeout
                    if self._txn_waiting():  # finished records wait: poll no longer than until they commit
                        due = last_txn + s.txn_interval_s
                        if not self._tasks:
                            due = min(due, max(now + QUIET_COMMIT_S, last_txn + s.txn_interval_s / 4))
                        wait_s = max(0.0, min(s.poll_timeout_s, due - now))
                    recs, whole = await self._poll_or_finished(min(room, s.batch_max_records), wait_s)
                    last_poll = loop.time()
                    quiet = whole and not recs and not self._tasks
                    unread = {r.tp for r in recs} - self._ahead_read
                    if unread:
                        await self._read_ahead(unread)
                    for rec in recs:
                        self._admit_txn(rec)
                else:
                    await asyncio.wait({*self._tasks, stop_wait}, timeout=s.txn_interval_s, return_when="FIRST_COMPLETED")
                    if loop.time() - last_poll > s.max_poll_interval_s / 2:
                        await self.consumer.keepalive()
                        last_poll = loop.time()
                since = loop.time() - last_txn
                if self._txn_waiting() and (since >= s.txn_interval_s or (quiet and since >= s.txn_interval_s / 4)):
                    await self._commit_txn_ready()
                    last_txn = loop.time()  # also when nothing could commit yet: it waits for the next interval
                if not self.stop.is_set():
                    await self._tick()
        finally:
            stop_wait.cancel()

    def _txn_waiting(self) -> bool:
        """Whether the next transaction has something to commit: finished records' outputs, or
        offsets that moved (records skipped as already committed by an earlier owner move them too)."""
        return bool(self._txn_done) or bool(self._offsets.ready())

    async def _poll_or_finished(self, max_records: int, wait_s: float | None) -> tuple[list[Record], bool]:
        """``(records, whole)``: a poll of up to ``wait_s``, cut short (with no records) when a running
        handler finishes first; ``whole`` says it was not. Records the poll took are never lost: a
        cut-short poll that got records meanwhile returns them."""
        if not self._tasks:
            return await self._poll(max_records, wait_s), True
        self._task_finished.clear()  # one event for all handlers: a wait costs the same with 1 or 500 running
        poll = asyncio.ensure_future(self._poll(max_records, wait_s))
        finished = asyncio.ensure_future(self._task_finished.wait())
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
        found = await self.consumer.committed_with_metadata(tps)
        for tp in tps:
            offset, metadata = found.get(tp, (0, ""))
            try:
                self._ahead[tp] = decode_ahead(offset, metadata)
            except ValueError as e:
                raise BusError(f"{self.service.name}: {tp.topic}[{tp.partition}]: {e}; the group's offsets were "
                               f"written by another program: reset them (kafka-consumer-groups.sh --reset-offsets)") from None
            if self._ahead[tp]:
                log.info("%s: %s[%d]: %d record(s) after the committed offset %d were already committed with "
                         "their outputs; skipping them", self.service.name, tp.topic, tp.partition,
                         len(self._ahead[tp]), offset)
        self._ahead_read |= tps

    def _admit_txn(self, rec: Record) -> None:
        self._offsets.add(rec.tp, rec.offset)
        eid = rec.event_id
        if rec.offset in self._ahead.get(rec.tp, ()):  # committed with its outputs by an earlier owner
            self.counters.duplicates += 1
            if self.settings.dedupe and rec.error is None and eid is not None:
                self.deduper.check_and_add(eid)
            self._offsets.done(rec.tp, rec.offset)
            return
        if self.settings.dedupe and rec.error is None and eid is not None and self.deduper.check_and_add(eid):
            self.counters.duplicates += 1
            self._txn_done[(rec.tp, rec.offset)] = ([], None, None)
            self._offsets.done(rec.tp, rec.offset)
            return
        self._tasks[task := asyncio.create_task(self._process_txn(rec), name=f"{rec.topic}@{rec.offset}")] = rec
        task.add_done_callback(self._task_done)

    async def _process_txn(self, rec: Record) -> None:
        """Handle ``rec``; keep its outputs until the next transaction commits them."""
        await self._process_with(rec, self._keep_for_txn)

    async def _keep_for_txn(self, rec: Record, outputs: list[Output], outcome: Outcome) -> None:
        self._txn_done[(rec.tp, rec.offset)] = (outputs, outcome, rec.event_id)

    def _txn_plan(self, only: set[TopicPartition] | None
                  ) -> tuple[list[tuple[TopicPartition, int]], dict[TopicPartition, tuple[int, str]], dict[TopicPartition, set[int]]]:
        """What the next transaction commits: the finished records (keys of ``_txn_done``), per
        partition the offset (one past its finished prefix) with its ahead list, and the new
        ahead sets. A partition's finished records after an unfinished one go in while its ahead
        list stays within :data:`AHEAD_MAX_CHARS` (the rest wait in memory for a later one)."""
        by_tp: dict[TopicPartition, list[int]] = {}
        for tp, off in self._txn_done:
            if only is None or tp in only:
                by_tp.setdefault(tp, []).append(off)
        keys: list[tuple[TopicPartition, int]] = []
        offsets: dict[TopicPartition, tuple[int, str]] = {}
        ahead: dict[TopicPartition, set[int]] = {}
        for tp in set(by_tp) | set(self._offsets.ready(only)):
            pos = self._offsets.position(tp)
            if pos is None:
                continue
            finished = sorted(by_tp.get(tp, []))
            take = [o for o in finished if o < pos]  # the finished prefix
            kept = {o for o in self._ahead.get(tp, ()) if o >= pos}  # committed before: always listed
            later = [o for o in finished if o >= pos]  # finished after an unfinished record
            if len(encode_ahead(pos, kept | set(later))) <= AHEAD_MAX_CHARS:  # the usual case: all fit
                kept.update(later)
                take += later
            else:  # the first ones, while the list fits
                for o in later:
                    if len(encode_ahead(pos, kept | {o})) > AHEAD_MAX_CHARS:
                        break
                    kept.add(o)
                    take.append(o)
            if not take and pos <= self._offsets.committed(tp):
                continue
            keys += [(tp, o) for o in take]
            offsets[tp] = (pos, encode_ahead(pos, kept))
            ahead[tp] = kept
        return sorted(keys, key=lambda k: (k[0].topic, k[0].partition, k[1])), offsets, ahead

    async def _commit_txn_ready(self, only: set[TopicPartition] | None = None) -> None:
        """One transaction: the outputs of every finished record not committed yet, and per
        partition the offset one past its finished prefix with the ahead list of the finished
        records after it (:mod:`runtime.offsets`)."""
        keys, offsets, ahead = self._txn_plan(only)
        if not offsets:
            return
        entries = [self._txn_done[k] for k in keys]
        self._txn_committing = True
        try:
            await self._commit_txn([o for outputs, _, _ in entries for o in outputs], offsets)
        finally:
            self._txn_committing = False
        for k in keys:
            del self._txn_done[k]
        self._ahead.update(ahead)
        self._offsets.mark_committed({tp: pos for tp, (pos, _) in offsets.items()})
        for outputs, outcome, _ in entries:
            if outcome is not None:
                self._count(outputs, outcome)

    def _drop_txn(self, tps: set[TopicPartition] | None = None) -> None:
        """Forget the uncommitted outputs (of ``tps``; all when None): their records are
        redelivered. The ahead lists are read again when the partitions come back."""
        for k in [k for k in self._txn_done if tps is None or k[0] in tps]:
            _, _, eid = self._txn_done.pop(k)
            if eid is not None and self.settings.dedupe:
                self.deduper.discard(eid)
        for tp in list(self._ahead) if tps is None else tps:
            self._ahead.pop(tp, None)
        self._ahead_read -= set(self._ahead_read) if tps is None else tps
