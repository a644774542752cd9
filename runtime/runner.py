"""The service runtime: consume → decode → handle → produce → commit, for every rollstream service.

A concrete service is a small class::

    class Scorer(Service):
        name = "reward-router"

        async def handle(self, rec: Record, ctx: Context) -> None:
            gen: Generation = rec.event
            ctx.emit("scored", ScoredSample(run_id=gen.run_id, generation=gen, reward=score(gen)))

    counters = await run_service(Scorer(), ServiceSettings(group_id="rr", run_id=run, topics=["generations"]))

Two kinds of handler, one core:

* :class:`Service` ``handle(rec, ctx)`` — one call per record, up to ``max_concurrency`` at
  once (rollout), or inside Kafka transactions (``transactional``: reward, judge).
* :class:`BatchService` ``handle_batch(records, ctx)`` — one call per poll with every decoded
  record of it (the recorder inserts one batch per table; the trainer adds scored samples to
  its buffer and trains when complete groups fill a batch). ``ctx.reject(rec, error)``
  dead-letters one record; ``ctx.flush()`` sends what is queued now. A batch handler that
  raises stops the service (its batch is not committed, the next instance gets it again).

Hooks every service may implement: ``on_start`` (after the Kafka clients are up, before the
first poll), ``on_tick`` (after every poll, records or not — at least every ``poll_timeout_s``:
the feeder issues groups there, the recorder measures its lag, a service may set
``runner.stop``), ``on_assigned`` (partitions given to this instance: seek there) and
``on_stop`` (after in-flight work finished, before the clients close).

What :func:`run_service` guarantees:

* **Commit after effect** (``commit="after_effect"``, default). A record's offset is committed
  only after every output its handler emitted (or its dead letter) was acknowledged by Kafka
  (``acks=all``, idempotent producer). Offsets are committed per partition up to the first
  record not finished yet, so concurrent handlers never commit past unfinished work; a batch
  handler's poll is committed after the handler returned and its outputs were acknowledged.
* **Commit by the service** (``commit="by_service"``): the runtime commits nothing; the service
  calls :meth:`Runner.commit` with the positions its durable state covers (the trainer: the
  positions saved in a checkpoint) and seeks there in ``on_assigned`` after a restart.
* **No group** (``group_id=None``): every partition is read from ``auto_offset_reset`` on each
  start and nothing is committed (the feeder rebuilds its state from the run's topics).
* **Exactly once with ``transactional=True``.** Records are handled concurrently (up to
  ``max_concurrency``, across polls: no batch barrier); every ``txn_interval_s`` (sooner once
  the input goes quiet: :mod:`runtime.txn_loop`) one Kafka transaction commits the outputs of every finished record together with the offsets
  (consume-transform-produce). A record finished after a slower one of its partition is committed
  at once: the offset stays at the slower one and the commit's metadata lists the records after it
  that are done (:mod:`runtime.offsets`), which the partition's next reader skips. Readers
  with ``read_committed`` never see the outputs of an aborted transaction. Work not committed
  (stop, revocation, failed transaction) is reprocessed from the committed offsets.
  Limits: aiokafka's ``send_offsets_to_transaction`` does not carry the group generation
  (KIP-447), so fencing a zombie instance relies on a stable ``transactional_id`` per instance;
  and transactional offsets become visible to a restarting consumer a moment after the commit
  returns. The derived output ids below cover both edges for consumers that dedupe.
* **At least once otherwise, made effectively once by ids.** A record redelivered after a crash
  is handled again. Two things keep its effect single: (1) an in-process :class:`Deduper`
  skips a redelivered ``event_id`` this process already handled (counted in ``duplicates``;
  ``dedupe=False`` turns it off); (2) with ``deterministic_output_ids`` (default) every emitted
  event gets an ``event_id`` derived from the input's ``event_id``, the service name and the
  output's index, so the outputs of a re-handled input carry the same ids as the first time.
* **Nothing dropped silently.** Undecodable bytes become a ``DeadLetter(stage="decode")`` on
  the run's ``dlq`` topic; a handler that raises (after ``handler_retries`` retries) or rejects
  a record becomes a ``DeadLetter(stage="handle", error="ExcType: msg")``; then the runtime
  goes on. A dead letter names the ``sample_id`` / ``group_id`` the record is about whenever it
  can tell (:mod:`runtime.deadletter`). Exceptions, each logged: ``handle_undecodable``
  gives undecodable records to the handler (the recorder stores their bytes); a record of an
  ``observed_topics`` topic is left to the group that owns it (counted ``ignored``); a record of
  a ``dlq`` topic is never dead-lettered again (no loop); with ``dlq=False`` failures are only
  logged at ERROR and counted in ``failed``.
* **Graceful stop.** SIGTERM/SIGINT (handlers installed only in the main thread) or the ``stop``
  event stop consumption; in-flight handler calls get ``shutdown_grace_s`` to finish (a second
  signal cuts it short), records fetched but not started yet are not started, finished work is
  committed, then producer and consumer close. Work cancelled at the deadline or never started is
  not committed and is redelivered to the next owner.
* **Stays in its group while busy.** When every slot is taken by long handler calls the runtime
  still polls (with partitions paused) often enough not to exceed ``max_poll_interval_s``.
* **Rides out a Kafka outage** (:mod:`runtime.outage`). Sends, polls, commits, ``on_tick``
  (its Kafka calls) and transactions that fail with retriable errors are retried, 0.5 s doubling
  to 5 s apart, for at most ``kafka.outage_timeout_s`` of consecutive failures, then the service
  fails with one line; a failed transaction is aborted and done again by a new producer of the
  same transactional id; a producer the broker no longer accepts after its restart is replaced.
* **Rebalance-safe.** When partitions are revoked, in-flight work of those partitions gets
  ``shutdown_grace_s`` to finish, is committed, and the rest is cancelled (and its ids removed
  from the dedupe set so a later redelivery is handled); a batch in progress is finished first.

Settings, counters and contexts: :mod:`runtime.service`; offsets of concurrent handlers:
:mod:`runtime.offsets`; the record and batch loops: :mod:`runtime.loops`; the
transactional loop: :mod:`runtime.txn_loop`.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import signal
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Literal

from aiokafka.errors import CommitFailedError, KafkaError

from runtime.bus import (
    BusError,
    Consumer,
    Deduper,
    KeyLike,
    Producer,
    Record,
    RecordMetadata,
    TopicAdmin,
    TopicPartition,
    new_group_suffix,
)
from runtime.deadletter import dead_letter_for
from runtime.offsets import OffsetTracker
from runtime.outage import Outage, Renewal, is_outage
from runtime.service import (
    BatchContext,
    Context,
    Counters,
    Outcome,
    Output,
    ServiceSettings,
    derive_event_id,
    make_output,
    resolve_topic,
    send_outputs,
)
from runtime.txn_loop import TxnLoop
from schemas.config import KafkaSettings
from schemas.errors import one_line
from schemas.events import Event
from schemas.topics import parse_topic, topic_name

log = logging.getLogger("rollstream.runtime")

__all__ = [
    "BatchContext",
    "BatchService",
    "Context",
    "Counters",
    "FunctionService",
    "Output",
    "Runner",
    "Service",
    "ServiceSettings",
    "derive_event_id",
    "publish",
    "resolve_topic",
    "run_service",
]

# --------------------------------------------------------------------------- services


class Service(abc.ABC):
    """Base of a rollstream service: set ``name``, implement :meth:`handle` (one record at a
    time; see :class:`BatchService` for one call per poll). Every hook is optional."""

    name: str = "service"

    @abc.abstractmethod
    async def handle(self, rec: Record, ctx: Context) -> None:
        """Handle one decoded record; emit outputs with ``ctx.emit``. Raising dead-letters it."""

    async def on_start(self, runner: Runner) -> None:
        """After the Kafka clients are up, before the first poll (a source such as the feeder
        may start its own work here and publish with ``runner.send``)."""
        return None

    async def on_tick(self, runner: Runner) -> None:
        """After every poll (``runner.last_polled`` records, maybe 0): periodic work. Raising
        stops the service with that error."""
        return None

    async def on_assigned(self, runner: Runner, tps: set[TopicPartition]) -> None:
        """Partitions were assigned to this instance (with a group): seek them with
        ``runner.consumer.seek`` to resume at the service's own positions."""
        return None

    async def on_stop(self, runner: Runner) -> None:
        """After in-flight work finished, before the clients close."""
        return None


class BatchService(Service):
    """A service whose handler takes every decoded record of a poll at once."""

    @abc.abstractmethod
    async def handle_batch(self, records: list[Record], ctx: BatchContext) -> None:
        """Handle the decoded, not yet seen records of one poll (in offset order per partition;
        called for every poll that returned records, so possibly with none left: ``ctx.polled``
        has them all, ``ctx.dead_letters`` the ones the runtime dead-lettered). ``ctx.emit``
        queues outputs, ``ctx.reject(rec, error)`` dead-letters one record, ``await ctx.flush()``
        sends what is queued now. Raising stops the service."""

    async def handle(self, rec: Record, ctx: Context) -> None:
        raise TypeError(f"{self.name} is a batch service: the runtime calls handle_batch")


class FunctionService(Service):
    """A service from a plain ``async def handle(rec, ctx)`` function."""

    def __init__(self, name: str, fn: Callable[[Record, Context], Awaitable[None]]) -> None:
        self.name = name
        self._fn = fn

    async def handle(self, rec: Record, ctx: Context) -> None:
        await self._fn(rec, ctx)


# --------------------------------------------------------------------------- the runner


class Runner(Renewal, TxnLoop):
    """One running service instance (what :func:`run_service` drives). Hooks get it to reach
    ``producer``, ``consumer``, ``settings``, ``counters``, the ``stop`` event, :meth:`send`
    and :meth:`commit`."""

    def __init__(self, service: Service, settings: ServiceSettings, stop: asyncio.Event | None = None) -> None:
        self.service = service
        self.settings = settings
        self.batch_mode = isinstance(service, BatchService)
        if self.batch_mode and settings.transactional:
            raise ValueError(f"{service.name}: transactional mode takes a record handler, not handle_batch")
        self.stop = stop if stop is not None else asyncio.Event()
        self.counters = Counters()
        self.revocations = 0
        """How many times the group took partitions away from this instance (rebalances)."""
        self.polls = 0
        """Polls so far."""
        self.last_polled = 0
        """Records the latest poll returned (``on_tick`` reads it: 0 = the topics were quiet)."""
        self.deduper = Deduper(settings.dedupe_capacity)
        self._force = asyncio.Event()
        self._offsets = OffsetTracker()
        self._tasks: dict[asyncio.Task[None], Record] = {}
        self._task_finished = asyncio.Event()  # set when a handler task ends (the exactly-once loop's polls)
        self._revoking: set[TopicPartition] = set()
        self._sem = asyncio.Semaphore(settings.max_concurrency)
        self._batch: asyncio.Task[None] | None = None
        self._txn_committing = False
        self._txn_done: dict[tuple[TopicPartition, int], tuple[list[Output], Outcome | None, str | None]] = {}
        self._ahead: dict[TopicPartition, set[int]] = {}
        """Transactional: per partition, the offsets at or after the committed one whose outputs a
        committed transaction holds (the ahead list committed with the offset)."""
        self._ahead_read: set[TopicPartition] = set()
        """Partitions whose committed ahead list was read since they were assigned. Not the keys of
        ``_ahead``: a transaction that was already committing when its partition was revoked puts
        the partition back into ``_ahead`` afterwards, and its list must still be read again (from
        the group, where the new owner may have moved it) when the partition comes back."""
        self._fatal: BaseException | None = None
        self._closed = False
        self._closing: set[asyncio.Task[Any]] = set()
        self._renew_lock = asyncio.Lock()
        s = settings
        self.outage = Outage(service.name, s.kafka.outage_timeout_s)
        """Retries through a Kafka outage (:mod:`runtime.outage`)."""
        self._tick_retry = self.outage.retry("on_tick")
        self._poll_retry = self.outage.retry("poll")
        self._txn_id = (s.transactional_id or f"{s.group_id}.{new_group_suffix()}") if s.transactional else None
        self.producer = self._new_producer()
        grace_ms = int(s.shutdown_grace_s * 1000)
        grouped = s.group_id is not None
        self.consumer = Consumer(
            s.kafka,
            group_id=s.group_id,
            topics=[resolve_topic(t, s.run_id) for t in s.topics],
            pattern=s.topic_pattern or None,
            auto_offset_reset=s.auto_offset_reset,
            isolation_level="read_committed",
            on_revoked=self._on_revoked if grouped else None,
            on_assigned=self._on_assigned if grouped else None,
            session_timeout_ms=int(s.session_timeout_s * 1000),
            # the revoke hook may take the grace period: give the rebalance room for it
            rebalance_timeout_ms=max(int(s.session_timeout_s * 1000), grace_ms + 10_000),
            max_poll_interval_ms=int(s.max_poll_interval_s * 1000),
            fetch_min_bytes=s.fetch_min_bytes,
            fetch_max_wait_ms=s.fetch_max_wait_ms,
            client_suffix=f"{service.name}-consumer",
        )

    # -- lifecycle

    async def run(self, install_signal_handlers: bool = True) -> Counters:
        """Run until ``stop`` (see :func:`run_service`); return the counters."""
        loop = asyncio.get_running_loop()
        installed: dict[signal.Signals, Any] = {}
        if install_signal_handlers and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                try:
                    previous = signal.getsignal(sig)
                    loop.add_signal_handler(sig, self._on_signal, sig)
                    installed[sig] = previous
                except (NotImplementedError, RuntimeError, ValueError):
                    pass
        error: BaseException | None = None
        try:
            if self.settings.ensure_topics and self.settings.run_id:
                async with TopicAdmin(self.settings.kafka) as admin:
                    await admin.ensure_run_topics(self.settings.run_id)
            await self.producer.start()
            await self.consumer.start()
            await self.service.on_start(self)
            if self.settings.transactional:
                await self._loop_txn()
            elif self.batch_mode:
                await self._loop_batch()
            else:
                await self._loop()
        except BusError as e:
            error = e
        except KafkaError as e:
            error = BusError(f"service {self.service.name}: Kafka failed: {one_line(e)}")
        except BaseException as e:
            error = e
        finally:
            try:
                await self._shutdown()
            finally:
                for sig, previous in installed.items():
                    loop.remove_signal_handler(sig)
                    if previous is not None:
                        signal.signal(sig, previous)  # give back whatever was there before
        if error is None:
            error = self._fatal
        if error is not None:
            raise error
        return self.counters

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.stop.is_set():
            log.warning("%s: second %s, cutting the shutdown grace short", self.service.name, sig.name)
            self._force.set()
        else:
            log.info("%s: %s received, stopping", self.service.name, sig.name)
            self.stop.set()

    def _set_fatal(self, err: BaseException) -> None:
        if self._fatal is None:
            self._fatal = err
        self.stop.set()

    def fail(self, err: BaseException) -> None:
        """Stop the service with ``err`` (raised by :meth:`run` after the graceful stop): for a
        service's own background work that cannot go on."""
        self._set_fatal(err)

    async def _shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stop.set()
        try:
            if self._batch is not None and not self._batch.done():
                await self._finish_batch(self.settings.shutdown_grace_s)
            if self._tasks:
                await self._drain(list(self._tasks), self.settings.shutdown_grace_s, "shutdown")
            if not self.settings.transactional and self.consumer.started:
                await self._commit_ready()
            if self.settings.transactional and self.consumer.started and (self._txn_done or self._offsets.ready()):
                try:
                    await self._commit_txn_ready()
                except (KafkaError, BusError) as e:  # redelivered to the next instance
                    log.warning("%s: finished work not committed at shutdown: %s", self.service.name, one_line(e))
                self._drop_txn()
            try:
                await self.service.on_stop(self)
            except Exception as e:
                log.error("%s: on_stop failed: %s", self.service.name, one_line(e))
        finally:
            await self.producer.stop()
            await self.consumer.stop()
            if self._closing:
                await asyncio.wait(set(self._closing), timeout=5.0)

    # -- what services call

    async def send(self, topic: str, *events: Event, key: KeyLike = None) -> list[RecordMetadata]:
        """Send ``events`` to ``topic`` (logical names are of ``settings.run_id``) now and wait
        for Kafka's acknowledgements (counted in ``emitted``). ``key=None``: registry key."""
        full = resolve_topic(topic, self.settings.run_id)
        return await send_outputs(self, [make_output(self, full, e, key) for e in events], f"send to {full}")

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> dict[TopicPartition, int]:
        """Commit ``offsets`` (next offset to read per partition) now; what was committed. For
        ``commit="by_service"``; without a group nothing is committed. A commit refused because
        the group rebalanced is logged and returns ``{}`` (the positions the service keeps are
        what it resumes from)."""
        if self.settings.group_id is None or not offsets:
            return {}
        try:
            return await self.consumer.commit(offsets)
        except CommitFailedError as e:
            log.warning("%s: commit failed, the group rebalanced (records will be redelivered): %s",
                        self.service.name, one_line(e))
        except KafkaError as e:
            log.log(logging.DEBUG if self.outage.active else logging.WARNING,
                    "%s: commit failed, will retry: %s", self.service.name, one_line(e))
        return {}

    def dead_letter(self, rec: Record, stage: Literal["decode", "handle"], error: str) -> list[Output]:
        """The dead letter of ``rec`` as an output to send (empty when it cannot be routed, logged)."""
        if not self.settings.dlq:
            return []
        parsed = parse_topic(rec.topic)
        if parsed is not None and parsed[1] == "dlq":
            log.error("%s: not dead-lettering a record of the dlq topic %s (would loop)", self.service.name, rec.topic)
            return []
        run_id = self.settings.run_id or (parsed[0] if parsed else "")
        if not run_id:
            log.error("%s: no run to dead-letter %s[%d]@%d into", self.service.name, rec.topic, rec.partition,
                      rec.offset)
            return []
        dl = dead_letter_for(
            rec,
            run_id=run_id,
            event_id=derive_event_id(f"{rec.topic}/{rec.partition}/{rec.offset}", self.service.name, 0),
            service=self.settings.group_id or self.service.name,
            stage=stage,
            error=error,
        )
        return [Output(topic_name(run_id, "dlq"), rec.key, self.producer.encode(dl), dl, dead_letter=True)]

    # -- rebalance

    async def _on_revoked(self, tps: set[TopicPartition]) -> None:
        if tps:
            self.revocations += 1
        if self.batch_mode:
            if self._batch is not None and not self._batch.done():
                await self._finish_batch(self.settings.shutdown_grace_s)
            return
        self._revoking |= tps
        try:
            mine = [t for t, r in self._tasks.items() if r.tp in tps]
            if mine:
                await self._drain(mine, self.settings.shutdown_grace_s, "partitions revoked")
            if self.settings.transactional:
                await self._commit_txn_ready(only=tps)
                self._drop_txn(tps)
            else:
                await self._commit_ready(only=tps)
            self._offsets.drop(tps)
        finally:
            self._revoking -= tps

    async def _on_assigned(self, tps: set[TopicPartition]) -> None:
        await self.service.on_assigned(self, tps)

    async def _tick(self) -> None:
        """``on_tick``; one that fails with an outage error is retried on the next tick (after a
        pause), for at most ``kafka.outage_timeout_s`` of consecutive failures."""
        try:
            await self.service.on_tick(self)
        except (KafkaError, BusError) as e:
            if not is_outage(e):
                raise
            await self._tick_retry.failed(e)
            return
        self._tick_retry.done()



async def run_service(
    service: Service,
    settings: ServiceSettings,
    *,
    stop: asyncio.Event | None = None,
    install_signal_handlers: bool = True,
) -> Counters:
    """Run ``service`` until ``stop`` is set (or SIGTERM/SIGINT); return its :class:`Counters`.

    Signal handlers are installed only when running in the main thread (and unless
    ``install_signal_handlers=False``); they set ``stop``. Raises :class:`BusError` when Kafka
    cannot be reached (within ``kafka.connect_timeout_s``) or an output is not acknowledged;
    the clients are closed and finished work committed first.
    """
    return await Runner(service, settings, stop).run(install_signal_handlers)


async def publish(
    settings: KafkaSettings,
    bootstrap: str | None,
    topic: str,
    events: Iterable[Event],
    *,
    key: KeyLike = None,
) -> list[RecordMetadata]:
    """Publish ``events`` to ``topic`` with a short-lived producer; return their metadata.

    ``topic`` is a full Kafka name or a logical name (then each event's ``run_id`` picks the
    run). ``key=None`` uses the registry key of each event. Waits for every acknowledgement.
    """
    async with Producer(settings, bootstrap, client_suffix="publish") as producer:
        futs = [await producer.send(resolve_topic(topic, ev.run_id), ev, key) for ev in events]
        return list(await asyncio.gather(*futs))
