"""Riding out a Kafka outage: retry what failed for a bounded time, then fail with one line.

A broker that restarts, a leader election or a network blip makes sends, transactions, commits
and metadata requests fail for a while with *retriable* errors (connection refused, request
timed out, node not ready, no leader, coordinator not available...). A running service must not
die on the first of them: the runtime retries the operation with a growing pause (0.5 s doubling
to 5 s) until it works again, and gives up only when the same operation has kept failing for
``kafka.outage_timeout_s`` seconds (then :class:`BusError` says so in one line; the supervisor
may restart the service).

* :func:`is_outage` — whether an error is one an outage produces (else it is raised at once).
* :func:`needs_new_producer` / :func:`producer_dead` — a producer the broker no longer accepts
  after a restart (out-of-order sequence, unknown producer id), or whose sender stopped: the
  runtime replaces it and sends again what it had not delivered.
* :class:`Outage` — one per service instance: logs the start of an outage once (WARNING) and its
  end (INFO, with how long it lasted), however many operations retry meanwhile.
* :class:`Retry` — one retrying operation: ``await retry.failed(error)`` after each failure
  (sleeps, or raises when the bound is passed or the error is not an outage), ``retry.done()``
  once it worked.

The operations that retry, and the producer's replacement, are :class:`runtime.kafka_io.KafkaIO`'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiokafka.errors import (
    ConcurrentTransactions,
    InvalidProducerEpoch,
    InvalidProducerIdMapping,
    KafkaConnectionError,
    KafkaError,
    KafkaTimeoutError,
    KafkaUnavailableError,
    OutOfOrderSequenceNumber,
    ProducerClosed,
    UnknownProducerId,
)

from runtime.connection import BusError
from schemas.errors import one_line

log = logging.getLogger("rollstream.runtime")

__all__ = ["Outage", "Retry", "is_outage", "needs_new_producer", "producer_dead"]

_ALSO_TRANSIENT = (KafkaConnectionError, KafkaTimeoutError, KafkaUnavailableError, ConcurrentTransactions)


_PRODUCER_STATE = (OutOfOrderSequenceNumber, UnknownProducerId, InvalidProducerEpoch, InvalidProducerIdMapping,
                   ProducerClosed)


def needs_new_producer(err: BaseException) -> bool:
    """Errors after which a producer cannot go on (its sequence numbers or producer id are no
    longer what the broker expects, e.g. after a broker restart; or it was closed): a new
    producer must send what it had not delivered."""
    return isinstance(err, _PRODUCER_STATE)


def producer_dead(producer: Any) -> bool:
    """Whether ``producer`` (a started :class:`~runtime.clients.Producer`) can no longer
    deliver: aiokafka's sender task ended (it ends on an out-of-order sequence, leaving queued
    messages unresolved)."""
    raw = getattr(producer, "_raw", None)
    task = getattr(getattr(raw, "_sender", None), "sender_task", None)
    return task is not None and task.done()


def is_outage(err: BaseException) -> bool:
    """True for the errors a broker outage (or a broker restart) produces: aiokafka's retriable
    errors, timeouts and connection errors. A :class:`BusError` of an unreachable broker counts too."""
    if isinstance(err, BusError):
        return "cannot reach Kafka" in str(err)
    return isinstance(err, KafkaError) and (isinstance(err, _ALSO_TRANSIENT) or bool(getattr(err, "retriable", False)))


class Outage:
    """The outage state of one service instance (see the module doc)."""

    def __init__(self, who: str, limit_s: float, backoff_s: float = 0.5, backoff_max_s: float = 5.0) -> None:
        self.who = who
        self.limit_s = limit_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.active = 0
        """Operations retrying now."""
        self.since: float | None = None
        """When the current outage started (monotonic), ``None`` when there is none."""
        self.outages = 0
        """Outages seen so far."""
        self.longest_s = 0.0
        """The longest outage so far, seconds."""

    def retry(self, what: str) -> Retry:
        """A new retrying operation named ``what`` (for the messages)."""
        return Retry(self, what)

    def _begin(self, what: str, err: BaseException) -> None:
        if self.active == 0:
            self.since = time.monotonic()
            self.outages += 1
            log.warning("%s: Kafka unavailable (%s: %s); retrying for up to %g s", self.who, what, one_line(err),
                        self.limit_s)
        self.active += 1

    def _end(self, what: str) -> None:
        self.active = max(0, self.active - 1)
        if self.active == 0 and self.since is not None:
            took = time.monotonic() - self.since
            self.longest_s = max(self.longest_s, took)
            self.since = None
            log.info("%s: Kafka available again after %.1f s (%s)", self.who, took, what)


class Retry:
    """One operation retrying through an outage (see the module doc)."""

    def __init__(self, outage: Outage, what: str) -> None:
        self.outage = outage
        self.what = what
        self.started: float | None = None
        self.attempts = 0
        self._pause = outage.backoff_s

    @property
    def failing(self) -> bool:
        return self.started is not None

    async def failed(self, err: BaseException, transient: bool | None = None) -> None:
        """The operation failed with ``err``: raise :class:`BusError` when ``err`` is not an
        outage (``transient`` overrides :func:`is_outage`) or the operation has been failing for
        ``outage_timeout_s``; else wait a little (the caller then tries again)."""
        o = self.outage
        if not (is_outage(err) if transient is None else transient):
            raise BusError(f"{o.who}: {self.what}: {one_line(err)}") from None
        now = time.monotonic()
        if self.started is None:
            self.started = now
            o._begin(self.what, err)
        self.attempts += 1
        failing_s = now - self.started
        if failing_s >= o.limit_s:
            self.done()
            raise BusError(f"{o.who}: Kafka unavailable for {failing_s:.0f} s (kafka.outage_timeout_s="
                           f"{o.limit_s:g}); {self.what}: {one_line(err)}") from None
        await asyncio.sleep(min(self._pause, max(0.0, o.limit_s - failing_s)))
        self._pause = min(self._pause * 2, o.backoff_max_s)

    def done(self) -> None:
        """The operation worked (or gave up): the end of its part of the outage."""
        if self.started is not None:
            self.started = None
            self._pause = self.outage.backoff_s
            self.outage._end(self.what)
