"""The at-least-once loops: :class:`RecordLoop` (one handler call per record) and :class:`BatchLoop`
(one handler call per poll). The exactly-once loop is :mod:`runtime.txn_loop`.

* :class:`RecordLoop` — up to ``handling.max_concurrency`` handler calls at once; a record's
  outputs are sent and acknowledged when its handler returns, and its offset is committed once
  it and every earlier record of its partition are finished (:class:`runtime.offsets.OffsetTracker`;
  a batched record once every event of it is). The outputs of calls that finish at the same moment
  are sent together (:meth:`runtime.kafka_io.KafkaIO.send_together`).
  With every slot busy it keeps polling (partitions paused) to stay in its group. Then ``on_tick``.
* :class:`BatchLoop` — per poll, undecodable records are dead-lettered (or given to the handler
  with ``handle_undecodable``, or left to their owner on ``observed_topics``), seen ``event_id`` s
  skipped, then ``handle_batch(records, ctx)`` runs, its queued outputs and dead letters are
  sent and acknowledged, and (``commit="after_effect"`` with a group) the poll's offsets are
  committed. Then ``on_tick``. While a batch runs it keeps polling (partitions paused) to stay in
  its group (a recorder retrying through a store outage). A batch in progress when the service
  stops or loses partitions gets ``shutdown_grace_s`` to finish; after that it is cancelled,
  nothing of it is committed, and its records are redelivered.

Each holds the instance's :class:`runtime.kafka_io.KafkaIO` and what else it needs.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from runtime.bus import Deduper, Record, TopicPartition, next_offsets
from runtime.handling import Control, HandlerCalls, Tick, count, undecodable, wait_or_force
from runtime.kafka_io import KafkaIO
from runtime.offsets import OffsetTracker
from runtime.service import BatchContext, BatchHandler, Outcome, Output, RecordHandler

log = logging.getLogger("rollstream.runtime")

__all__ = ["BatchLoop", "RecordLoop"]


class RecordLoop:
    """Record handlers, at least once (see the module doc)."""

    def __init__(self, io: KafkaIO, service: RecordHandler, control: Control, tick: Tick) -> None:
        self.io = io
        self.settings = io.settings
        self.control = control
        self.tick = tick
        self.offsets = OffsetTracker()
        self.deduper = Deduper(io.settings.delivery.dedupe_capacity)
        self.calls = HandlerCalls(io, service, control, self.offsets, self.deduper)

    async def run(self) -> None:
        con = self.settings.consume
        cap = max(con.batch_max_records, self.settings.handling.max_concurrency)
        stop = self.control.stop
        loop = asyncio.get_running_loop()
        last_poll = loop.time()
        stop_wait = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                room = cap - len(self.calls.tasks)
                if room > 0:
                    recs = await self.io.poll(min(room, con.batch_max_records))
                    last_poll = loop.time()
                    for rec in recs:
                        self._admit(rec)
                else:
                    # every slot busy: wait for one, but poll often enough to stay in the group
                    await asyncio.wait({*self.calls.tasks, stop_wait}, timeout=con.poll_timeout_s,
                                       return_when=asyncio.FIRST_COMPLETED)
                    if loop.time() - last_poll > con.max_poll_interval_s / 2:
                        await self.io.keepalive()
                        last_poll = loop.time()
                await self._commit_ready()
                if not stop.is_set():
                    await self.tick()
        finally:
            stop_wait.cancel()

    def _admit(self, rec: Record) -> None:
        self.offsets.add(rec.tp, rec.offset, rec.in_record)
        eid = rec.event_id
        if self.settings.delivery.dedupe and rec.error is None and eid is not None and self.deduper.check_and_add(eid):
            self.io.counters.duplicates += 1
            self.offsets.done(rec.tp, rec.offset, rec.index)
            return
        self.calls.start(rec, self._send_now)

    async def _send_now(self, rec: Record, outputs: list[Output], outcome: Outcome) -> None:
        # with the outputs of the calls that finished at the same moment; retried through an
        # outage; BusError past kafka.outage_timeout_s
        await self.io.send_together(outputs, f"output of {rec.topic}[{rec.partition}]@{rec.offset}")
        count(self.io.counters, outputs, outcome)

    async def _commit_ready(self, only: set[TopicPartition] | None = None) -> None:
        if not self.settings.runtime_commits:
            return
        offsets = self.offsets.ready(only)
        if offsets:
            self.offsets.mark_committed(await self.io.commit(offsets))

    async def on_revoked(self, tps: set[TopicPartition]) -> None:
        self.calls.revoking |= tps
        try:
            mine = self.calls.of(tps)
            if mine:
                await self.calls.drain(mine, "partitions revoked")
            await self._commit_ready(only=tps)
            self.offsets.drop(tps)
        finally:
            self.calls.revoking -= tps

    async def finish(self) -> None:
        if self.calls.tasks:
            await self.calls.drain(list(self.calls.tasks), "shutdown")
        if self.io.consumer.started:
            await self._commit_ready()


class BatchLoop:
    """Batch handlers, at least once (see the module doc)."""

    def __init__(self, io: KafkaIO, service: BatchHandler, control: Control, tick: Tick) -> None:
        self.io = io
        self.settings = io.settings
        self.service = service
        self.control = control
        self.tick = tick
        self.deduper = Deduper(io.settings.delivery.dedupe_capacity)
        self._batch: asyncio.Task[None] | None = None

    async def run(self) -> None:
        stop = self.control.stop
        stop_wait = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                recs = await self.io.poll()
                if recs:
                    await self._run_polled(asyncio.create_task(self._handle_polled(recs)), stop_wait)
                if not stop.is_set():
                    await self.tick()
        finally:
            stop_wait.cancel()

    async def _run_polled(self, work: asyncio.Task[None], stop_wait: asyncio.Future[Any]) -> None:
        """Wait for a batch task (or a stop, then give it the grace period); re-raise its error."""
        self._batch = work
        try:
            await self._wait_in_group(work, stop_wait)
            if not work.done():
                await self.finish()
        finally:
            self._batch = None
        if work.cancelled():
            return  # revoked or stopping: uncommitted, redelivered from the committed offsets
        exc = work.exception()
        if exc is not None:
            raise exc

    async def _wait_in_group(self, work: asyncio.Task[None], stop_wait: asyncio.Future[Any]) -> None:
        """Wait for the batch or a stop, polling with every partition paused each half
        ``max_poll_interval_s`` so that a long batch does not get the instance evicted."""
        every_s = self.settings.consume.max_poll_interval_s / 2
        while True:
            await asyncio.wait({work, stop_wait}, timeout=every_s, return_when=asyncio.FIRST_COMPLETED)
            if work.done() or stop_wait.done():
                return
            await self.io.keepalive()

    async def finish(self) -> None:
        """Give the batch in progress ``shutdown_grace_s`` (or until a forced stop); cancel it after."""
        batch = self._batch
        if batch is None or batch.done():
            return
        grace_s = self.settings.handling.shutdown_grace_s
        if await wait_or_force([batch], grace_s, self.control.force):
            log.warning("%s: batch still being handled after %.1f s; aborted (will be redelivered)",
                        self.io.service_name, grace_s)
            batch.cancel()
            await asyncio.gather(batch, return_exceptions=True)

    async def on_revoked(self, tps: set[TopicPartition]) -> None:
        await self.finish()  # its commit covers the revoked partitions too, while they are still ours

    async def _handle_polled(self, recs: list[Record]) -> None:
        s, counters = self.settings, self.io.counters
        dedupe = s.delivery.dedupe
        ctx = BatchContext(self.io, recs)
        todo: list[Record] = []
        added: list[str] = []
        for rec in recs:
            if rec.error is not None:
                action = undecodable(s, self.io.service_name, rec)
                if action == "ignore":
                    counters.ignored += 1
                    continue
                if action == "dead_letter":
                    ctx.dead_letter(rec, "decode", rec.error)
                    continue
            elif dedupe and rec.event_id is not None:
                if self.deduper.check_and_add(rec.event_id):
                    counters.duplicates += 1
                    continue
                added.append(rec.event_id)
            todo.append(rec)
        done = False
        try:
            await self.service.handle_batch(todo, ctx)  # also when todo is empty: ctx.polled moved on
            await ctx.flush()
            done = True
        finally:
            if not done:
                for eid in added:
                    self.deduper.discard(eid)
        rejected = {id(r) for r in ctx.rejected}
        counters.processed += sum(1 for r in todo if id(r) not in rejected)
        if s.runtime_commits:
            await self.io.commit(next_offsets(recs))
