"""The runtime's loops (mixed into :class:`runtime.runner.Runner`).

* :meth:`Loops._loop` — record handlers, at least once: up to ``max_concurrency`` handler
  calls at once; a record's offset is committed once it and every earlier record of its
  partition are finished (:class:`runtime.offsets.OffsetTracker`). Then ``on_tick``.
* :meth:`Loops._loop_batch` — batch handlers: per poll, undecodable records are
  dead-lettered (or given to the handler with ``handle_undecodable``, or left to their owner on
  ``observed_topics``), seen ``event_id`` s skipped, then ``handle_batch(records, ctx)`` runs,
  its queued outputs and dead letters are sent and acknowledged, and (``commit="after_effect"``
  with a group) the poll's offsets are committed. Then ``on_tick``.
* :meth:`runtime.txn_loop.TxnLoop._loop_txn` — transactional record handlers (exactly once;
  its own module).

A batch in progress when the service stops or loses partitions gets ``shutdown_grace_s`` to
finish (a transaction being committed always finishes); after that it is cancelled, nothing of
it is committed, and its records are redelivered. Transactional handlers still running then are
cancelled likewise; what finished is committed first, the rest is redelivered.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal

from aiokafka.errors import KafkaError

from runtime.bus import (
    Consumer,
    Deduper,
    Producer,
    Record,
    TopicPartition,
    next_offsets,
)
from runtime.offsets import OffsetTracker
from runtime.outage import Outage, Retry
from runtime.service import (
    BatchContext,
    Context,
    Counters,
    Outcome,
    Output,
    ServiceSettings,
    send_outputs,
)
from schemas.errors import one_line

log = logging.getLogger("rollstream.runtime")

__all__ = ["Loops"]


class Loops:
    """The runtime's loops; the attributes and the few methods stubbed here are the Runner's."""

    service: Any
    settings: ServiceSettings
    producer: Producer
    consumer: Consumer
    counters: Counters
    deduper: Deduper
    stop: asyncio.Event
    polls: int
    last_polled: int
    _force: asyncio.Event
    _sem: asyncio.Semaphore
    _offsets: OffsetTracker
    _tasks: dict[asyncio.Task[None], Record]
    _task_finished: asyncio.Event
    _revoking: set[TopicPartition]
    _batch: asyncio.Task[None] | None
    _txn_committing: bool
    _fatal: BaseException | None
    _txn_done: dict[tuple[TopicPartition, int], tuple[list[Output], Outcome | None, str | None]]
    outage: Outage
    _poll_retry: Retry
    _closing: set[asyncio.Task[Any]]

    async def _renew_producer(self, retry: Retry) -> None:
        raise NotImplementedError

    async def renew_producer(self, failed: Producer, retry: Retry) -> None:
        raise NotImplementedError

    @property
    def service_name(self) -> str:
        return str(self.service.name)

    async def _tick(self) -> None:
        raise NotImplementedError

    def _set_fatal(self, err: BaseException) -> None:
        raise NotImplementedError

    def dead_letter(self, rec: Record, stage: Literal["decode", "handle"], error: str) -> list[Output]:
        raise NotImplementedError

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> dict[TopicPartition, int]:
        raise NotImplementedError

    async def _poll(self, max_records: int | None = None, timeout_s: float | None = None) -> list[Record]:
        """One poll (at most ``max_records``, default ``batch_max_records``). A poll that fails
        with an outage error returns nothing after a pause (retried by the next call, for at most
        ``kafka.outage_timeout_s`` of consecutive failures)."""
        s = self.settings
        try:
            wait_s = s.poll_timeout_s if timeout_s is None else timeout_s
            recs = await self.consumer.getmany(timeout_ms=math.ceil(wait_s * 1000),
                                               max_records=max_records or s.batch_max_records)
        except KafkaError as e:
            await self._poll_retry.failed(e)
            recs = []
        else:
            self._poll_retry.done()
        self.polls += 1
        self.last_polled = len(recs)
        return recs

    async def _run_polled(self, work: asyncio.Task[None], stop_wait: asyncio.Future[Any]) -> None:
        """Wait for a batch task (or a stop, then give it the grace period); re-raise its error."""
        self._batch = work
        try:
            await asyncio.wait({work, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                await self._finish_batch(self.settings.shutdown_grace_s)
        finally:
            self._batch = None
        if work.cancelled():
            return  # revoked or stopping: uncommitted, redelivered from the committed offsets
        exc = work.exception()
        if exc is not None:
            raise exc

    async def _finish_batch(self, grace_s: float) -> None:
        batch = self._batch
        if batch is None or batch.done():
            return
        force = asyncio.ensure_future(self._force.wait())
        try:
            await asyncio.wait({batch, force}, timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
            if not batch.done() and self._txn_committing:
                # never cancel a transaction half-committed: it finishes within the request timeout
                await asyncio.wait({batch}, timeout=self.settings.kafka.request_timeout_s + 5)
        finally:
            force.cancel()
        if not batch.done():
            log.warning(
                "%s: batch still being handled after %.1f s; aborted (will be redelivered)",
                self.service.name,
                grace_s,
            )
            batch.cancel()
            await asyncio.gather(batch, return_exceptions=True)

    async def _drain(self, tasks: list[asyncio.Task[None]], grace_s: float, why: str) -> None:
        """Give ``tasks`` ``grace_s`` (or until a forced stop) to finish; cancel the rest."""
        pending = {t for t in tasks if not t.done()}
        if pending:
            force = asyncio.ensure_future(self._force.wait())
            try:
                pending = await self._wait_all_or_force(pending, force, grace_s)
            finally:
                force.cancel()
        if pending:
            log.warning(
                "%s: %s: %d handler call(s) still running after %.1f s; cancelled (not committed, "
                "they will be redelivered)",
                self.service.name,
                why,
                len(pending),
                grace_s,
            )
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    @staticmethod
    async def _wait_all_or_force(
        pending: set[asyncio.Task[None]], force: asyncio.Future[Any], grace_s: float
    ) -> set[asyncio.Task[None]]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while pending and not force.done():
            left = deadline - loop.time()
            if left <= 0:
                break
            await asyncio.wait({*pending, force}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            pending = {t for t in pending if not t.done()}
        return pending

    # -- undecodable records

    def _undecodable(self, rec: Record) -> Literal["ignore", "handler", "dead_letter"]:
        """What to do with a record that did not decode (and log it)."""
        if self.settings.observed(rec.topic):
            log.warning("%s: undecodable record %s[%d]@%d left to the group that owns the topic: %s",
                        self.service.name, rec.topic, rec.partition, rec.offset, rec.error)
            return "ignore"
        if self.settings.handle_undecodable:
            return "handler"
        log.error("%s: cannot decode %s[%d]@%d: %s", self.service.name, rec.topic, rec.partition, rec.offset,
                  rec.error)
        return "dead_letter"

    # -- at-least-once loop (record handlers)

    async def _loop(self) -> None:
        s = self.settings
        cap = max(s.batch_max_records, s.max_concurrency)
        loop = asyncio.get_running_loop()
        last_poll = loop.time()
        stop_wait = asyncio.ensure_future(self.stop.wait())
        try:
            while not self.stop.is_set():
                room = cap - len(self._tasks)
                if room > 0:
                    recs = await self._poll(min(room, s.batch_max_records))
                    last_poll = loop.time()
                    for rec in recs:
                        self._admit(rec)
                else:
                    # every slot busy: wait for one, but poll often enough to stay in the group
                    await asyncio.wait(
                        {*self._tasks, stop_wait},
                        timeout=s.poll_timeout_s,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                    if loop.time() - last_poll > s.max_poll_interval_s / 2:
                        await self.consumer.keepalive()
                        last_poll = loop.time()
                await self._commit_ready()
                if not self.stop.is_set():
                    await self._tick()
        finally:
            stop_wait.cancel()

    def _admit(self, rec: Record) -> None:
        self._offsets.add(rec.tp, rec.offset)
        eid = rec.event_id
        if self.settings.dedupe and rec.error is None and eid is not None and self.deduper.check_and_add(eid):
            self.counters.duplicates += 1
            self._offsets.done(rec.tp, rec.offset)
            return
        task = asyncio.create_task(self._process(rec), name=f"{self.service.name}:{rec.topic}@{rec.offset}")
        self._tasks[task] = rec
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)
        self._task_finished.set()
        if not task.cancelled() and task.exception() is not None:
            self._set_fatal(task.exception())  # type: ignore[arg-type]

    async def _process(self, rec: Record) -> None:
        """Handle ``rec`` and send its outputs at once (at-least-once loops)."""
        await self._process_with(rec, self._send_now)

    async def _process_with(self, rec: Record, settle: Callable[[Record, list[Output], Outcome], Awaitable[None]]) -> None:
        """Run ``rec``'s handler (concurrency-bounded), ``settle`` its outputs, mark its offset done; an
        unfinished record (stopping, revoked, settle failed) leaves the deduper, to be handled again."""
        eid = rec.event_id
        finished = False
        try:
            async with self._sem:
                if self.stop.is_set() or rec.tp in self._revoking:
                    return  # not started: left uncommitted for whoever reads the partition next
                outputs, outcome = await self._outputs_for(rec)
            await settle(rec, outputs, outcome)
            self._offsets.done(rec.tp, rec.offset)
            finished = True
        finally:
            if not finished and eid is not None and self.settings.dedupe:
                self.deduper.discard(eid)

    async def _send_now(self, rec: Record, outputs: list[Output], outcome: Outcome) -> None:
        # retried through an outage; BusError past kafka.outage_timeout_s
        await send_outputs(self, outputs, f"output of {rec.topic}[{rec.partition}]@{rec.offset}", count=False)
        self._count(outputs, outcome)

    def _count(self, outputs: list[Output], outcome: Outcome) -> None:
        c = self.counters
        if outcome == "processed":
            c.processed += 1
        elif outcome == "failed":
            c.failed += 1
        else:
            c.ignored += 1
        for o in outputs:
            if o.dead_letter:
                c.dead_lettered += 1
            else:
                c.emitted += 1

    async def _outputs_for(self, rec: Record) -> tuple[list[Output], Outcome]:
        """Run the handler (with retries): ``(outputs, "processed")``, ``(dead letters, "failed")``
        or ``([], "ignored")``."""
        if rec.error is not None:
            action = self._undecodable(rec)
            if action == "ignore":
                return [], "ignored"
            if action == "dead_letter":
                return self.dead_letter(rec, "decode", rec.error), "failed"
        s = self.settings
        error = ""
        for attempt in range(1 + s.handler_retries):
            ctx = Context(self, rec)
            try:
                await self.service.handle(rec, ctx)
                return ctx.outputs, "processed"
            except Exception as e:
                error = one_line(e)
                left = s.handler_retries - attempt
                log.log(
                    logging.WARNING if left else logging.ERROR,
                    "%s: handler failed on %s[%d]@%d (%s)%s",
                    self.service.name,
                    rec.topic,
                    rec.partition,
                    rec.offset,
                    error,
                    f"; retrying ({left} left)" if left else "",
                )
                if left:
                    await asyncio.sleep(s.retry_backoff_s)
        return self.dead_letter(rec, "handle", error), "failed"

    async def _commit_ready(self, only: set[TopicPartition] | None = None) -> None:
        if not self.settings.commits:
            return
        offsets = self._offsets.ready(only)
        if offsets:
            self._offsets.mark_committed(await self.commit(offsets))

    # -- batch handlers

    async def _loop_batch(self) -> None:
        stop_wait = asyncio.ensure_future(self.stop.wait())
        try:
            while not self.stop.is_set():
                recs = await self._poll()
                if recs:
                    await self._run_polled(asyncio.create_task(self._handle_polled(recs)), stop_wait)
                if not self.stop.is_set():
                    await self._tick()
        finally:
            stop_wait.cancel()

    async def _handle_polled(self, recs: list[Record]) -> None:
        s = self.settings
        ctx = BatchContext(self, recs)
        todo: list[Record] = []
        added: list[str] = []
        for rec in recs:
            if rec.error is not None:
                action = self._undecodable(rec)
                if action == "ignore":
                    self.counters.ignored += 1
                    continue
                if action == "dead_letter":
                    ctx.dead_letter(rec, "decode", rec.error)
                    continue
            elif s.dedupe and rec.event_id is not None:
                if self.deduper.check_and_add(rec.event_id):
                    self.counters.duplicates += 1
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
        self.counters.processed += sum(1 for r in todo if id(r) not in rejected)
        if s.commits:
            await self.commit(next_offsets(recs))
