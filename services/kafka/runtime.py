"""The service runtime: consume → decode → handle → produce → commit, for every rollstream service.

A concrete service is a small class::

    class Scorer(Service):
        name = "reward-router"

        async def handle(self, rec: Record, ctx: Context) -> None:
            gen: Generation = rec.event
            ctx.emit("scored", ScoredSample(run_id=gen.run_id, generation=gen, reward=score(gen)))

    counters = await run_service(Scorer(), ServiceSettings(group_id="rr", run_id=run, topics=["generations"]))

What :func:`run_service` guarantees:

* **Commit after effect.** A record's offset is committed only after every output its handler
  emitted (or its dead letter) was acknowledged by Kafka (``acks=all``, idempotent producer).
  Offsets are committed per partition up to the first record not finished yet, so concurrent
  handlers (``max_concurrency > 1``) never commit past unfinished work.
* **Exactly once with ``transactional=True``.** Each polled batch is handled, then its outputs
  and its consumed offsets are committed in one Kafka transaction (consume-transform-produce);
  readers with ``read_committed`` never see the outputs of an aborted batch. A batch not
  committed (stop, revocation, failed transaction) is reprocessed from the committed offsets.
  Limits: aiokafka's ``send_offsets_to_transaction`` does not carry the group generation
  (KIP-447), so fencing a zombie instance relies on a stable ``transactional_id`` per instance;
  and transactional offsets become visible to a restarting consumer a moment after the commit
  returns. The derived output ids below cover both edges for consumers that dedupe.
* **At least once otherwise, made effectively once by ids.** A record redelivered after a crash
  is handled again. Two things keep its effect single: (1) an in-process :class:`Deduper`
  skips a redelivered ``event_id`` this process already handled (counted in ``duplicates``);
  (2) with ``deterministic_output_ids`` (default) every emitted event gets an ``event_id``
  derived from the input's ``event_id``, the service name and the output's index, so the
  outputs of a re-handled input carry the same ids as the first time and downstream consumers
  dedupe them by ``event_id``.
* **Nothing dropped silently.** Undecodable bytes become a ``DeadLetter(stage="decode")`` on
  the run's ``dlq`` topic; a handler that raises (after ``handler_retries`` retries) becomes a
  ``DeadLetter(stage="handle", error="ExcType: msg")``; then the runtime commits past the record
  and goes on. With ``dlq=False`` (or when no dead letter can be routed) the failure is logged at
  ERROR and counted in ``failed``.
* **Graceful stop.** SIGTERM/SIGINT (handlers installed only in the main thread) or the ``stop``
  event stop consumption; in-flight handler calls get ``shutdown_grace_s`` to finish (a second
  signal cuts it short), records fetched but not started yet are not started, finished work is
  committed, then producer and consumer close. Work cancelled at the deadline or never started is
  not committed and is redelivered to the next owner.
* **Stays in its group while busy.** When every slot is taken by long handler calls the runtime
  still polls (with partitions paused) often enough not to exceed ``max_poll_interval_s``.
* **Rebalance-safe.** When partitions are revoked, in-flight work of those partitions gets
  ``shutdown_grace_s`` to finish, is committed, and the rest is cancelled (and its ids removed
  from the dedupe set so a later redelivery is handled). The dedupe set otherwise keeps ids of
  revoked partitions: harmless (bounded) and useful if the partition comes back.
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import logging
import signal
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal

import msgspec
from aiokafka.errors import CommitFailedError, KafkaError

from schemas.config import KafkaSettings
from schemas.events import DeadLetter, Event
from schemas.topics import TOPICS, parse_topic, spec_for_topic, topic_name
from services.kafka.bus import (
    BusError,
    Compression,
    Consumer,
    Deduper,
    KeyLike,
    Producer,
    Record,
    RecordMetadata,
    TopicAdmin,
    TopicPartition,
    encode_key,
    key_for,
    new_group_suffix,
    next_offsets,
    one_line,
)

log = logging.getLogger("rollstream.runtime")

__all__ = [
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


# --------------------------------------------------------------------------- settings


class ServiceSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How one service instance consumes, handles and produces."""

    group_id: str
    """Kafka consumer group; instances with the same group share the partitions."""
    run_id: str = ""
    """The run whose topics are meant by logical names (``topics``, ``ctx.emit("scored")``).
    Empty for cross-run services (pattern subscription): then the record's own run is used."""
    topics: list[str] = msgspec.field(default_factory=list)
    """Topics to consume: logical names (``generations``, resolved with ``run_id``) or full
    Kafka names. Exactly one of ``topics`` / ``topic_pattern`` is set."""
    topic_pattern: str = ""
    """Regex of topics to consume (e.g. ``^rs\\..*`` for the recorder)."""
    kafka: KafkaSettings = msgspec.field(default_factory=KafkaSettings)
    """How to reach Kafka (bootstrap, security, timeouts)."""
    batch_max_records: int = 100
    """Most records taken per poll (and, in transactional mode, per transaction)."""
    max_concurrency: int = 1
    """Handler calls in flight at once. 1 = strictly in order per instance. With more, outputs
    of different records may interleave, but offsets are still committed only up to the first
    unfinished record of each partition."""
    poll_timeout_s: float = 0.5
    """Longest wait for new records per poll, seconds (also bounds how late a stop is noticed)."""
    shutdown_grace_s: float = 10.0
    """On stop or partition revocation, how long in-flight handler calls may still run, seconds."""
    dedupe_capacity: int = 100_000
    """How many handled ``event_id`` s the in-process dedupe set remembers (LRU)."""
    dlq: bool = True
    """Send records that fail to decode or handle to the run's ``dlq`` topic as ``DeadLetter``.
    False: log them at ERROR and count them in ``failed`` only."""
    handler_retries: int = 0
    """Extra attempts of a handler that raised before the record is dead-lettered."""
    retry_backoff_s: float = 0.2
    """Pause between handler attempts, seconds."""
    transactional: bool = False
    """Commit each batch's outputs and consumed offsets in one Kafka transaction (exactly once)."""
    transactional_id: str = ""
    """Transactional id of this instance (stable across restarts to fence zombies); empty =
    ``<group_id>.<random>``."""
    auto_offset_reset: Literal["earliest", "latest"] = "earliest"
    """Where a group without committed offsets starts."""
    deterministic_output_ids: bool = True
    """Give each emitted event an ``event_id`` derived from (input event_id, service name,
    output index), so a re-handled input produces the same ids (downstream dedupe)."""
    compression: Compression = "zstd"
    """Producer compression codec (zstd: faster than aiokafka's LZ4-HC, see bench/bus.py)."""
    linger_ms: int = 5
    """Producer batching delay, milliseconds."""
    session_timeout_s: float = 10.0
    """Group session timeout: a silent instance is evicted after this long, seconds."""
    max_poll_interval_s: float = 300.0
    """An instance that does not poll for this long leaves the group (one handler call must
    finish within it), seconds."""

    ensure_topics: bool = True
    """On start, create the run's topics if missing (``TopicAdmin.ensure_run_topics``; needs
    ``run_id``), so a consumer never subscribes to (and a broker never auto-creates) a topic
    with the wrong partitions or configs."""

    def __post_init__(self) -> None:
        if bool(self.topics) == bool(self.topic_pattern):
            raise ValueError("ServiceSettings: set exactly one of topics / topic_pattern")
        if not self.group_id:
            raise ValueError("ServiceSettings.group_id must not be empty")
        for name in ("batch_max_records", "max_concurrency", "dedupe_capacity"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServiceSettings.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("poll_timeout_s", "shutdown_grace_s", "retry_backoff_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"ServiceSettings.{name} must be >= 0, got {getattr(self, name)}")
        if self.handler_retries < 0:
            raise ValueError(f"ServiceSettings.handler_retries must be >= 0, got {self.handler_retries}")
        if any(t in TOPICS for t in self.topics) and not self.run_id:
            raise ValueError("ServiceSettings: logical topic names need run_id")


@dataclass
class Counters:
    """What a service did. Every polled record ends in exactly one of processed / failed /
    duplicates, or is still unfinished when the service stops (then it is not committed)."""

    processed: int = 0
    """Records handled successfully (outputs acknowledged)."""
    failed: int = 0
    """Records that could not be decoded or whose handler raised (after retries)."""
    dead_lettered: int = 0
    """``DeadLetter`` events acknowledged on a ``dlq`` topic."""
    duplicates: int = 0
    """Records skipped because their ``event_id`` was already handled by this process."""
    emitted: int = 0
    """Output events acknowledged (dead letters not included)."""

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


# --------------------------------------------------------------------------- outputs


def derive_event_id(parent_event_id: str, service: str, index: int) -> str:
    """Deterministic 32-hex event id of output ``index`` of ``service`` for input ``parent``."""
    return hashlib.blake2b(f"{parent_event_id}/{service}/{index}".encode(), digest_size=16).hexdigest()


def resolve_topic(topic: str, run_id: str | None) -> str:
    """A logical name (``scored``) becomes ``rs.<run_id>.scored``; a full name stays."""
    if topic in TOPICS:
        if not run_id:
            raise ValueError(f"logical topic {topic!r} needs a run id")
        return topic_name(run_id, topic)
    return topic


@dataclass(slots=True)
class Output:
    """One message to produce: encoded and size-checked when emitted."""

    topic: str
    key: bytes | None
    value: bytes
    event: Event
    dead_letter: bool = False


class Context:
    """Per-record handle a handler uses to emit outputs.

    Outputs are collected, then sent after the handler returns (nothing is sent if it raises),
    and the record is committed only once they are acknowledged.
    """

    def __init__(self, runner: Runner, record: Record) -> None:
        self.runner = runner
        self.record = record
        self.service = runner.service.name
        self.run_id: str | None = runner.settings.run_id or record.run_id
        """The run outputs go to (settings.run_id, else the record's run)."""
        self.outputs: list[Output] = []

    def topic(self, name: str) -> str:
        """Kafka topic for a logical ``name`` of this context's run (full names pass through)."""
        return resolve_topic(name, self.run_id)

    def emit(self, topic: str, event: Event, key: KeyLike = None) -> Event:
        """Queue ``event`` for ``topic`` (logical or full name); returns the event as it will be
        sent (with the derived ``event_id`` when ``deterministic_output_ids`` is on).

        ``key=None`` uses the registry key of the topic (:func:`services.kafka.bus.key_for`).
        Raises ``ValueError`` if the encoded message is larger than the producer allows, which
        fails the handler call like any exception.
        """
        parent = self.record.event_id
        if self.runner.settings.deterministic_output_ids and parent:
            event = msgspec.structs.replace(
                event, event_id=derive_event_id(parent, self.service, len(self.outputs))
            )
        full = self.topic(topic)
        kbytes = encode_key(key)
        if kbytes is None:
            spec = spec_for_topic(full)
            kbytes = key_for(spec, event) if spec is not None else None
        value = self.runner.producer.encode(event)
        self.runner.producer.check_size(kbytes, value)
        self.outputs.append(Output(full, kbytes, value, event))
        return event


# --------------------------------------------------------------------------- services


class Service(abc.ABC):
    """Base of a rollstream service: set ``name``, implement :meth:`handle`.

    Optional hooks: :meth:`on_start` (after Kafka clients are up, before consuming — a source
    such as the feeder may start its own task there and publish with ``runner.producer``) and
    :meth:`on_stop` (after in-flight work finished, before the clients close).
    """

    name: str = "service"

    @abc.abstractmethod
    async def handle(self, rec: Record, ctx: Context) -> None:
        """Handle one decoded record; emit outputs with ``ctx.emit``. Raising dead-letters it."""

    async def on_start(self, runner: Runner) -> None:
        return None

    async def on_stop(self, runner: Runner) -> None:
        return None


class FunctionService(Service):
    """A service from a plain ``async def handle(rec, ctx)`` function."""

    def __init__(self, name: str, fn: Callable[[Record, Context], Awaitable[None]]) -> None:
        self.name = name
        self._fn = fn

    async def handle(self, rec: Record, ctx: Context) -> None:
        await self._fn(rec, ctx)


# --------------------------------------------------------------------------- offsets


class _OffsetTracker:
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


# --------------------------------------------------------------------------- the runner


class Runner:
    """One running service instance (what :func:`run_service` drives). Hooks get it to reach
    ``producer``, ``settings``, ``counters`` and the ``stop`` event."""

    def __init__(
        self, service: Service, settings: ServiceSettings, stop: asyncio.Event | None = None
    ) -> None:
        self.service = service
        self.settings = settings
        self.stop = stop if stop is not None else asyncio.Event()
        self.counters = Counters()
        self.revocations = 0
        """How many times the group took partitions away from this instance (rebalances)."""
        self.deduper = Deduper(settings.dedupe_capacity)
        self._force = asyncio.Event()
        self._offsets = _OffsetTracker()
        self._tasks: dict[asyncio.Task[None], Record] = {}
        self._revoking: set[TopicPartition] = set()
        self._sem = asyncio.Semaphore(settings.max_concurrency)
        self._batch: asyncio.Task[None] | None = None
        self._txn_committing = False
        self._fatal: BaseException | None = None
        self._closed = False
        s = settings
        txn_id = (s.transactional_id or f"{s.group_id}.{new_group_suffix()}") if s.transactional else None
        self.producer = Producer(
            s.kafka,
            compression=s.compression,
            linger_ms=s.linger_ms,
            transactional_id=txn_id,
            client_suffix=f"{service.name}-producer",
        )
        topics = [resolve_topic(t, s.run_id) for t in s.topics]
        grace_ms = int(s.shutdown_grace_s * 1000)
        self.consumer = Consumer(
            s.kafka,
            group_id=s.group_id,
            topics=topics,
            pattern=s.topic_pattern or None,
            auto_offset_reset=s.auto_offset_reset,
            isolation_level="read_committed",
            on_revoked=self._on_revoked,
            session_timeout_ms=int(s.session_timeout_s * 1000),
            # the revoke hook may take the grace period: give the rebalance room for it
            rebalance_timeout_ms=max(int(s.session_timeout_s * 1000), grace_ms + 10_000),
            max_poll_interval_ms=int(s.max_poll_interval_s * 1000),
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
            try:
                await self.service.on_stop(self)
            except Exception as e:
                log.error("%s: on_stop failed: %s", self.service.name, one_line(e))
        finally:
            await self.producer.stop()
            await self.consumer.stop()

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

    # -- rebalance

    async def _on_revoked(self, tps: set[TopicPartition]) -> None:
        if tps:
            self.revocations += 1
        if self.settings.transactional:
            if self._batch is not None and not self._batch.done():
                await self._finish_batch(self.settings.shutdown_grace_s)
            return
        self._revoking |= tps
        try:
            mine = [t for t, r in self._tasks.items() if r.tp in tps]
            if mine:
                await self._drain(mine, self.settings.shutdown_grace_s, "partitions revoked")
            await self._commit_ready(only=tps)
            self._offsets.drop(tps)
        finally:
            self._revoking -= tps

    # -- at-least-once loop

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
                    recs = await self.consumer.getmany(
                        timeout_ms=int(s.poll_timeout_s * 1000), max_records=min(room, s.batch_max_records)
                    )
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
        finally:
            stop_wait.cancel()

    def _admit(self, rec: Record) -> None:
        self._offsets.add(rec.tp, rec.offset)
        eid = rec.event_id
        if rec.error is None and eid is not None and self.deduper.check_and_add(eid):
            self.counters.duplicates += 1
            self._offsets.done(rec.tp, rec.offset)
            return
        task = asyncio.create_task(self._process(rec), name=f"{self.service.name}:{rec.topic}@{rec.offset}")
        self._tasks[task] = rec
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            self._set_fatal(task.exception())  # type: ignore[arg-type]

    async def _process(self, rec: Record) -> None:
        eid = rec.event_id
        finished = False
        try:
            async with self._sem:
                if self.stop.is_set() or rec.tp in self._revoking:
                    return  # not started: left uncommitted for whoever reads the partition next
                outputs, ok = await self._outputs_for(rec)
                try:
                    futs = [await self.producer.send_raw(o.topic, o.value, o.key) for o in outputs]
                except KafkaError as e:
                    raise BusError(f"{self.service.name}: cannot queue output: {one_line(e)}") from None
            try:
                await asyncio.gather(*futs)
            except KafkaError as e:
                raise BusError(
                    f"{self.service.name}: output of {rec.topic}[{rec.partition}]@{rec.offset} "
                    f"not acknowledged: {one_line(e)}"
                ) from None
            self._count(outputs, ok)
            self._offsets.done(rec.tp, rec.offset)
            finished = True
        finally:
            if not finished and eid is not None:
                self.deduper.discard(eid)

    def _count(self, outputs: list[Output], ok: bool) -> None:
        c = self.counters
        if ok:
            c.processed += 1
        else:
            c.failed += 1
        for o in outputs:
            if o.dead_letter:
                c.dead_lettered += 1
            else:
                c.emitted += 1

    async def _outputs_for(self, rec: Record) -> tuple[list[Output], bool]:
        """Run the handler (with retries); ``(outputs, True)`` or ``(dead letters, False)``."""
        if rec.error is not None:
            log.error(
                "%s: cannot decode %s[%d]@%d: %s",
                self.service.name,
                rec.topic,
                rec.partition,
                rec.offset,
                rec.error,
            )
            return self._dead_letter(rec, "decode", rec.error), False
        s = self.settings
        error = ""
        for attempt in range(1 + s.handler_retries):
            ctx = Context(self, rec)
            try:
                await self.service.handle(rec, ctx)
                return ctx.outputs, True
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
        return self._dead_letter(rec, "handle", error), False

    def _dead_letter(self, rec: Record, stage: Literal["decode", "handle"], error: str) -> list[Output]:
        if not self.settings.dlq:
            return []
        parsed = parse_topic(rec.topic)
        if parsed is not None and parsed[1] == "dlq":
            log.error(
                "%s: not dead-lettering a record of the dlq topic %s (would loop)",
                self.service.name,
                rec.topic,
            )
            return []
        run_id = self.settings.run_id or (parsed[0] if parsed else "")
        if not run_id:
            log.error(
                "%s: no run to dead-letter %s[%d]@%d into",
                self.service.name,
                rec.topic,
                rec.partition,
                rec.offset,
            )
            return []
        dl = DeadLetter(
            run_id=run_id,
            event_id=derive_event_id(f"{rec.topic}/{rec.partition}/{rec.offset}", self.service.name, 0),
            source_topic=rec.topic,
            partition=rec.partition,
            offset=rec.offset,
            key=rec.key,
            value=rec.value_bytes,
            error=error,
            service=self.settings.group_id,
            stage=stage,
        )
        topic = topic_name(run_id, "dlq")
        value = self.producer.encode(dl)
        return [Output(topic, rec.key, value, dl, dead_letter=True)]

    async def _commit_ready(self, only: set[TopicPartition] | None = None) -> None:
        offsets = self._offsets.ready(only)
        if not offsets:
            return
        try:
            committed = await self.consumer.commit(offsets)
            self._offsets.mark_committed(committed)
        except CommitFailedError as e:
            log.warning(
                "%s: commit failed, the group rebalanced (records will be redelivered): %s",
                self.service.name,
                one_line(e),
            )
        except KafkaError as e:
            log.warning("%s: commit failed, will retry: %s", self.service.name, one_line(e))

    # -- exactly-once loop

    async def _loop_txn(self) -> None:
        s = self.settings
        stop_wait = asyncio.ensure_future(self.stop.wait())
        try:
            while not self.stop.is_set():
                recs = await self.consumer.getmany(
                    timeout_ms=int(s.poll_timeout_s * 1000), max_records=s.batch_max_records
                )
                if not recs:
                    continue
                batch = self._batch = asyncio.create_task(self._txn_batch(recs))
                await asyncio.wait({batch, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
                if not batch.done():
                    await self._finish_batch(s.shutdown_grace_s)
                self._batch = None
                if batch.cancelled():
                    continue  # revoked or stopping: uncommitted, redelivered from the committed offsets
                exc = batch.exception()
                if exc is not None:
                    raise exc
        finally:
            stop_wait.cancel()

    async def _finish_batch(self, grace_s: float) -> None:
        batch = self._batch
        if batch is None or batch.done():
            return
        await self._drain_txn(batch, grace_s)

    async def _drain_txn(self, batch: asyncio.Task[None], grace_s: float) -> None:
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

    async def _txn_batch(self, recs: list[Record]) -> None:
        added: list[str] = []
        todo: list[Record] = []
        dups = 0
        for rec in recs:
            eid = rec.event_id
            if rec.error is None and eid is not None:
                if self.deduper.check_and_add(eid):
                    dups += 1
                    continue
                added.append(eid)
            todo.append(rec)
        committed = False
        try:

            async def prepare(rec: Record) -> tuple[list[Output], bool]:
                async with self._sem:
                    return await self._outputs_for(rec)

            results = await asyncio.gather(*(prepare(r) for r in todo))
            self._txn_committing = True
            futs: list[asyncio.Future[RecordMetadata]] = []
            try:
                async with self.producer.transaction():
                    for outputs, _ in results:
                        for o in outputs:
                            futs.append(await self.producer.send_raw(o.topic, o.value, o.key))
                    await self.producer.send_offsets_to_transaction(
                        next_offsets(recs), self.settings.group_id
                    )
                await asyncio.gather(*futs)
            except KafkaError as e:
                raise BusError(
                    f"{self.service.name}: transaction of {len(recs)} record(s) failed and was aborted "
                    f"(they will be reprocessed after a restart): {one_line(e)}"
                ) from None
            finally:
                self._txn_committing = False
            committed = True
        finally:
            if not committed:
                for eid in added:
                    self.deduper.discard(eid)
        self.counters.duplicates += dups
        for outputs, ok in results:
            self._count(outputs, ok)


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
