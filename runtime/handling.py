"""What the three loops share: the stop they obey, how a handler call runs, the calls in flight.

* :class:`Loop` — what the runner needs of a loop: ``run``, ``on_revoked``, ``finish``.
* :class:`Control` — the stop event, the forced stop (a second signal) and the first fatal
  error, shared by the runner and its loop.
* :func:`undecodable` — what becomes of a record that did not decode.
* :func:`count` — one finished record in the counters.
* :func:`wait_or_force` — give tasks a grace period, cut short by a forced stop.
* :class:`HandlerCalls` — record handler calls in flight (the per-record and the transactional
  loop): at most ``handling.max_concurrency`` at once, each with ``handling.handler_retries``
  retries, its record's offset marked done once its outputs are settled.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from runtime.bus import Deduper, Record, TopicPartition
from runtime.kafka_io import KafkaIO
from runtime.offsets import OffsetTracker
from runtime.service import Context, Counters, Outcome, Output, RecordHandler
from runtime.settings import ServiceSettings
from schemas.errors import one_line

log = logging.getLogger("rollstream.runtime")

__all__ = ["Control", "HandlerCalls", "Loop", "Settle", "Tick", "count", "undecodable", "wait_or_force"]

Tick = Callable[[], Awaitable[None]]
"""The service's ``on_tick`` as the runner calls it (retried through an outage)."""
Settle = Callable[[Record, list[Output], Outcome], Awaitable[None]]
"""What becomes of a finished record's outputs: sent now, or kept for the next transaction."""


class Loop(Protocol):
    """One of the runtime's loops (:mod:`runtime.loops`, :mod:`runtime.txn_loop`)."""

    async def run(self) -> None:
        """Poll, handle, commit until the stop."""

    async def on_revoked(self, tps: set[TopicPartition]) -> None:
        """The group takes ``tps`` away: finish (within the grace) and commit their work."""

    async def finish(self) -> None:
        """At the stop: give work in flight the grace period, commit what finished."""


@dataclass
class Control:
    """The stop a runner and its loop share."""

    stop: asyncio.Event
    """Set to stop (a signal, ``runner.stop.set()``, a fatal error)."""
    force: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by a second signal: the grace periods end at once."""
    fatal: BaseException | None = None
    """The first error that stopped the service (raised by the runner after the graceful stop)."""

    def fail(self, err: BaseException) -> None:
        if self.fatal is None:
            self.fatal = err
        self.stop.set()


def undecodable(settings: ServiceSettings, who: str, rec: Record) -> Literal["ignore", "handler", "dead_letter"]:
    """What to do with a record that did not decode (and log it)."""
    if settings.observed(rec.topic):
        log.warning("%s: undecodable record %s[%d]@%d left to the group that owns the topic: %s",
                    who, rec.topic, rec.partition, rec.offset, rec.error)
        return "ignore"
    if settings.handling.handle_undecodable:
        return "handler"
    log.error("%s: cannot decode %s[%d]@%d: %s", who, rec.topic, rec.partition, rec.offset, rec.error)
    return "dead_letter"


def count(counters: Counters, outputs: list[Output], outcome: Outcome) -> None:
    """Count one finished record and its acknowledged outputs."""
    if outcome == "processed":
        counters.processed += 1
    elif outcome == "failed":
        counters.failed += 1
    else:
        counters.ignored += 1
    for o in outputs:
        if o.dead_letter:
            counters.dead_lettered += 1
        else:
            counters.emitted += 1


async def wait_or_force(tasks: Iterable[asyncio.Task[Any]], grace_s: float, force: asyncio.Event) -> set[asyncio.Task[Any]]:
    """Wait up to ``grace_s`` for every one of ``tasks`` to end, less once ``force`` is set; the
    tasks still running."""
    pending = {t for t in tasks if not t.done()}
    if not pending:
        return pending
    forced = asyncio.ensure_future(force.wait())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    try:
        while pending and not forced.done():
            left = deadline - loop.time()
            if left <= 0:
                break
            await asyncio.wait({*pending, forced}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            pending = {t for t in pending if not t.done()}
    finally:
        forced.cancel()
    return pending


class HandlerCalls:
    """Record handler calls in flight (see the module doc). A record not finished (stopping,
    revoked, its outputs not settled) leaves ``deduper``, to be handled again when redelivered."""

    def __init__(self, io: KafkaIO, service: RecordHandler, control: Control, offsets: OffsetTracker,
                 deduper: Deduper) -> None:
        self.io = io
        self.service = service
        self.control = control
        self.offsets = offsets
        self.deduper = deduper
        self.tasks: dict[asyncio.Task[None], Record] = {}
        """The calls in flight and their records."""
        self.finished = asyncio.Event()
        """Set whenever a call ends (the transactional loop's polls wait for it)."""
        self.revoking: set[TopicPartition] = set()
        """Partitions being revoked: their records not started yet are not started."""
        self._sem = asyncio.Semaphore(io.settings.handling.max_concurrency)

    def start(self, rec: Record, settle: Settle) -> None:
        """Start the call of ``rec``; ``settle`` its outputs when the handler returned."""
        task = asyncio.create_task(self._run(rec, settle), name=f"{self.service.name}:{rec.topic}@{rec.offset}.{rec.index}")
        self.tasks[task] = rec
        task.add_done_callback(self._ended)

    def of(self, tps: set[TopicPartition]) -> list[asyncio.Task[None]]:
        """The calls in flight for records of ``tps``."""
        return [t for t, r in self.tasks.items() if r.tp in tps]

    def _ended(self, task: asyncio.Task[None]) -> None:
        self.tasks.pop(task, None)
        self.finished.set()
        if not task.cancelled() and task.exception() is not None:
            self.control.fail(task.exception())  # type: ignore[arg-type]

    async def _run(self, rec: Record, settle: Settle) -> None:
        eid = rec.event_id
        dedupe = self.io.settings.delivery.dedupe
        finished = False
        try:
            async with self._sem:
                if self.control.stop.is_set() or rec.tp in self.revoking:
                    return  # not started: left uncommitted for whoever reads the partition next
                outputs, outcome = await self.outputs_for(rec)
            await settle(rec, outputs, outcome)
            self.offsets.done(rec.tp, rec.offset, rec.index)
            finished = True
        finally:
            if not finished and eid is not None and dedupe:
                self.deduper.discard(eid)

    async def outputs_for(self, rec: Record) -> tuple[list[Output], Outcome]:
        """Run the handler (with retries): ``(outputs, "processed")``, ``(dead letters, "failed")``
        or ``([], "ignored")``."""
        io, h = self.io, self.io.settings.handling
        if rec.error is not None:
            action = undecodable(io.settings, io.service_name, rec)
            if action == "ignore":
                return [], "ignored"
            if action == "dead_letter":
                return io.dead_letter(rec, "decode", rec.error), "failed"
        error = ""
        for attempt in range(1 + h.handler_retries):
            ctx = Context(io, rec)
            try:
                await self.service.handle(rec, ctx)
                return ctx.outputs, "processed"
            except Exception as e:
                error = one_line(e)
                left = h.handler_retries - attempt
                log.log(logging.WARNING if left else logging.ERROR, "%s: handler failed on %s[%d]@%d (%s)%s",
                        io.service_name, rec.topic, rec.partition, rec.offset, error,
                        f"; retrying ({left} left)" if left else "")
                if left:
                    await asyncio.sleep(h.retry_backoff_s)
        return io.dead_letter(rec, "handle", error), "failed"

    async def drain(self, tasks: list[asyncio.Task[None]], why: str) -> None:
        """Give ``tasks`` ``handling.shutdown_grace_s`` (or until a forced stop) to finish; cancel the rest."""
        grace_s = self.io.settings.handling.shutdown_grace_s
        pending = await wait_or_force(tasks, grace_s, self.control.force)
        if pending:
            log.warning("%s: %s: %d handler call(s) still running after %.1f s; cancelled (not committed, they "
                        "will be redelivered)", self.io.service_name, why, len(pending), grace_s)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
