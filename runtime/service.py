"""What a service declares and what its handlers get: settings, counters, output contexts.

* :class:`ServiceSettings` — how one service instance consumes, handles, produces and commits
  (consumer group or none, batch size, concurrency, dead letters, transactions, commit mode,
  dedupe, topics it only observes).
* :class:`Counters` — what the instance did.
* :class:`Context` — per record: ``emit`` queues outputs, sent after the handler returns.
* :class:`BatchContext` — per polled batch (batch handlers): ``emit`` / ``reject`` queue outputs
  and dead letters, ``flush`` sends what is queued now (a trainer publishes each step's weights
  at once); the rest is sent when the handler returns, before any commit.

The services themselves (:class:`runtime.runner.Service` and friends) and the loop that
drives them live in :mod:`runtime.runner`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter as _Tally
from dataclasses import asdict, dataclass
from typing import Literal, Protocol

import msgspec
from aiokafka.errors import KafkaConnectionError, KafkaError

from runtime.bus import (
    BusError,
    Compression,
    Consumer,
    KeyLike,
    Producer,
    Record,
    RecordMetadata,
    encode_key,
    key_for,
)
from runtime.outage import Outage, Retry, needs_new_producer, producer_dead
from schemas.config import KafkaSettings
from schemas.events import DeadLetter, Event
from schemas.topics import TOPICS, spec_for_topic, topic_name

log = logging.getLogger("rollstream.runtime")

__all__ = [
    "BatchContext",
    "CommitMode",
    "Context",
    "Counters",
    "Host",
    "Outcome",
    "Output",
    "ServiceSettings",
    "derive_event_id",
    "make_output",
    "resolve_topic",
    "send_outputs",
]

CommitMode = Literal["after_effect", "by_service"]
Outcome = Literal["processed", "failed", "ignored"]
"""How one record ended: handled, dead-lettered (or logged), or left to its owner group."""


# --------------------------------------------------------------------------- settings


class ServiceSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How one service instance consumes, handles and produces."""

    group_id: str | None
    """Kafka consumer group; instances with the same group share the partitions. ``None``: no
    group — the instance reads every partition from ``auto_offset_reset`` on each start and
    commits nothing (the feeder rebuilds its state from the run's topics this way)."""
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
    """Most records taken per poll (per transaction in transactional mode, per call of a batch
    handler)."""
    max_concurrency: int = 1
    """Handler calls in flight at once (record handlers). 1 = strictly in order per instance.
    With more, outputs of different records may interleave, but offsets are still committed only
    up to the first unfinished record of each partition."""
    poll_timeout_s: float = 0.5
    """Longest wait for new records per poll, seconds (also bounds how late a stop is noticed
    and how often ``on_tick`` runs when the topics are quiet)."""
    txn_interval_s: float = 0.1
    """Transactional services: how often finished work is committed (one transaction holding the
    outputs of every record finished since the last one, and the offsets), seconds. When no
    handler runs and no record came for ``QUIET_COMMIT_S`` (0.01 s), finished records commit
    sooner, at most every ``txn_interval_s / 4`` (:mod:`runtime.txn_loop`)."""
    shutdown_grace_s: float = 10.0
    """On stop or partition revocation, how long in-flight handler calls may still run, seconds."""
    dedupe: bool = True
    """Skip a record whose ``event_id`` this process already handled (counted in ``duplicates``).
    False: every record reaches the handler (the recorder stores every message, duplicates too)."""
    dedupe_capacity: int = 100_000
    """How many handled ``event_id`` s the in-process dedupe set remembers (LRU)."""
    dlq: bool = True
    """Send records that fail to decode or handle to the run's ``dlq`` topic as ``DeadLetter``.
    False: log them at ERROR and count them in ``failed`` only."""
    handle_undecodable: bool = False
    """Give records that fail to decode to the handler (``rec.event is None``, ``rec.error`` says
    why) instead of dead-lettering them: for a service whose job is the bytes (the recorder)."""
    observed_topics: list[str] = msgspec.field(default_factory=list)
    """Topics (logical or full names) this service reads only to follow what others do, while
    another consumer group owns their records (the feeder reads back ``tasks``, which the
    rollout group consumes): a record of these that fails to decode is left to its owner, who
    dead-letters it, and is counted in ``ignored`` here (logged at WARNING), so one bad record
    makes one dead letter."""
    handler_retries: int = 0
    """Extra attempts of a record handler that raised before the record is dead-lettered."""
    retry_backoff_s: float = 0.2
    """Pause between handler attempts, seconds."""
    commit: CommitMode = "after_effect"
    """``after_effect``: the runtime commits a record's offset once its outputs (or its dead
    letter) are acknowledged. ``by_service``: the runtime never commits; the service commits
    the positions its own durable state covers with ``runner.commit`` (the trainer commits the
    positions saved in each checkpoint). Ignored without a ``group_id``."""
    transactional: bool = False
    """Commit outputs and consumed offsets together in Kafka transactions (exactly once): every
    ``txn_interval_s``, the outputs of every finished record, each partition's offset up to its
    first unfinished record, and the records finished after that in the offset's metadata (its
    next reader skips them). Record handlers only, with a ``group_id`` and
    ``commit="after_effect"``."""
    transactional_id: str = ""
    """Transactional id of this instance (stable across restarts to fence zombies); empty =
    ``<group_id>.<random>``."""
    transaction_timeout_s: float = 60.0
    """Transaction timeout: the broker aborts a transaction left open this long (an instance killed
    mid-transaction with a per-start ``transactional_id`` holds back ``read_committed`` readers of
    its partitions until then), seconds."""
    auto_offset_reset: Literal["earliest", "latest"] = "earliest"
    """Where a group without committed offsets (or an instance without a group) starts."""
    deterministic_output_ids: bool = True
    """Give each emitted event an ``event_id`` derived from (input event_id, service name,
    output index), so a re-handled input produces the same ids (downstream dedupe). Batch
    handlers get this for outputs emitted with a ``parent`` record."""
    compression: Compression = "zstd"
    """Producer compression codec (zstd: faster than aiokafka's LZ4-HC, see bench/bus.py)."""
    linger_ms: int = 5
    """Producer batching delay, milliseconds."""
    fetch_min_bytes: int = 1
    """The broker answers a fetch once this many bytes are ready (or ``fetch_max_wait_ms`` passed):
    1 = at once. Larger: fewer, fuller fetches for a service that need not see each record at
    once (the recorder)."""
    fetch_max_wait_ms: int = 100
    """Longest the broker holds a fetch waiting for ``fetch_min_bytes``, milliseconds. It also
    bounds how late a record can reach a busy consumer: aiokafka fetches nothing for a partition
    whose fetched records the service has not taken yet, and after 0.1 s sends one fetch for the
    other partitions; the broker holds that fetch up to this long when they are quiet, and the
    drained partition is fetched only after it returns. Kafka's own default, 500 ms, made the
    trainer wait up to half a second per step for samples that were already committed."""
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
        if self.group_id == "":
            raise ValueError("ServiceSettings.group_id must not be empty (None: no consumer group)")
        for name in ("batch_max_records", "max_concurrency", "dedupe_capacity", "fetch_min_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServiceSettings.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("poll_timeout_s", "shutdown_grace_s", "retry_backoff_s", "txn_interval_s", "fetch_max_wait_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"ServiceSettings.{name} must be >= 0, got {getattr(self, name)}")
        if self.handler_retries < 0:
            raise ValueError(f"ServiceSettings.handler_retries must be >= 0, got {self.handler_retries}")
        if any(t in TOPICS for t in [*self.topics, *self.observed_topics]) and not self.run_id:
            raise ValueError("ServiceSettings: logical topic names need run_id")
        if self.transactional and (self.group_id is None or self.commit != "after_effect"):
            raise ValueError("ServiceSettings: transactional needs a group_id and commit='after_effect'")

    def observed(self, topic: str) -> bool:
        """Whether ``topic`` (a full Kafka name) is one of ``observed_topics``."""
        return any(resolve_topic(t, self.run_id) == topic for t in self.observed_topics)

    @property
    def commits(self) -> bool:
        """Whether the runtime itself commits offsets (a group and ``commit="after_effect"``)."""
        return self.group_id is not None and self.commit == "after_effect"


@dataclass
class Counters:
    """What a service did. Every polled record ends in exactly one of processed / failed /
    duplicates / ignored, or is still unfinished when the service stops (then it is not
    committed)."""

    processed: int = 0
    """Records handled successfully (outputs acknowledged)."""
    failed: int = 0
    """Records that could not be decoded or that their handler raised on or rejected."""
    dead_lettered: int = 0
    """``DeadLetter`` events acknowledged on a ``dlq`` topic."""
    duplicates: int = 0
    """Records skipped because their ``event_id`` was already handled by this process, or
    (transactional) because an earlier owner of the partition committed them with their outputs."""
    emitted: int = 0
    """Output events acknowledged (dead letters not included)."""
    ignored: int = 0
    """Undecodable records of ``observed_topics``, left to the consumer group that owns them."""

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


class Host(Protocol):
    """What a context needs of the runner that made it (:class:`runtime.runner.Runner`)."""

    settings: ServiceSettings
    producer: Producer
    consumer: Consumer
    counters: Counters
    outage: Outage

    @property
    def service_name(self) -> str: ...

    def dead_letter(self, rec: Record, stage: Literal["decode", "handle"], error: str) -> list[Output]: ...

    async def renew_producer(self, failed: Producer, retry: Retry) -> None: ...


def make_output(host: Host, topic: str, event: Event, key: KeyLike) -> Output:
    """Encode and size-check ``event`` for ``topic`` (a full name); ``key=None`` uses the
    registry key of the topic."""
    kbytes = encode_key(key)
    if kbytes is None:
        spec = spec_for_topic(topic)
        kbytes = key_for(spec, event) if spec is not None else None
    value = host.producer.encode(event)
    host.producer.check_size(kbytes, value)
    return Output(topic, kbytes, value, event)


class Context:
    """Per-record handle a record handler uses to emit outputs.

    Outputs are collected, then sent after the handler returns (nothing is sent if it raises),
    and the record is committed only once they are acknowledged.
    """

    def __init__(self, runner: Host, record: Record) -> None:
        self.runner = runner
        self.record = record
        self.service = runner.service_name
        self.run_id: str | None = runner.settings.run_id or record.run_id
        """The run outputs go to (settings.run_id, else the record's run)."""
        self.outputs: list[Output] = []

    def topic(self, name: str) -> str:
        """Kafka topic for a logical ``name`` of this context's run (full names pass through)."""
        return resolve_topic(name, self.run_id)

    def emit(self, topic: str, event: Event, key: KeyLike = None) -> Event:
        """Queue ``event`` for ``topic`` (logical or full name); returns the event as it will be
        sent (with the derived ``event_id`` when ``deterministic_output_ids`` is on).

        ``key=None`` uses the registry key of the topic (:func:`runtime.bus.key_for`).
        Raises ``ValueError`` if the encoded message is larger than the producer allows, which
        fails the handler call like any exception.
        """
        parent = self.record.event_id
        if self.runner.settings.deterministic_output_ids and parent:
            event = msgspec.structs.replace(
                event, event_id=derive_event_id(parent, self.service, len(self.outputs))
            )
        out = make_output(self.runner, self.topic(topic), event, key)
        self.outputs.append(out)
        return out.event


class BatchContext:
    """Per-batch handle of a batch handler: queue outputs, reject records, send now.

    ``polled`` is every record of the poll (positions to checkpoint cover them all, including
    undecodable ones the runtime dead-lettered and duplicates it skipped). Outputs queued with
    :meth:`emit` and dead letters of :meth:`reject` are sent by :meth:`flush`, which the runtime
    also calls when the handler returns; offsets are committed (``commit="after_effect"``) only
    after that. If the handler raises, nothing still queued is sent and nothing is committed.
    """

    def __init__(self, runner: Host, polled: list[Record]) -> None:
        self.runner = runner
        self.polled = polled
        self.service = runner.service_name
        self.run_id: str | None = runner.settings.run_id or None
        self.queued: list[Output] = []
        self.rejected: list[Record] = []
        self.dead_letters: list[DeadLetter] = []
        """Dead letters of this poll so far: the runtime's (undecodable records, queued before the
        handler runs) and the handler's rejections — a service can act on them at once."""
        self._per_parent: _Tally[str] = _Tally()

    def topic(self, name: str, run_id: str | None = None) -> str:
        """Kafka topic for a logical ``name`` of ``run_id`` (default: the service's run)."""
        return resolve_topic(name, run_id or self.run_id)

    def emit(self, topic: str, event: Event, key: KeyLike = None, parent: Record | None = None) -> Event:
        """Queue ``event`` for ``topic`` (a logical name is of the service's run; for a cross-run
        service, of ``parent``'s run). With ``parent`` and ``deterministic_output_ids`` the event
        gets an id derived from the parent's ``event_id`` (as record handlers do)."""
        run_id = self.run_id or (parent.run_id if parent is not None else None)
        pid = parent.event_id if parent is not None else None
        if pid and self.runner.settings.deterministic_output_ids:
            event = msgspec.structs.replace(event, event_id=derive_event_id(pid, self.service, self._per_parent[pid]))
            self._per_parent[pid] += 1
        out = make_output(self.runner, resolve_topic(topic, run_id), event, key)
        self.queued.append(out)
        return out.event

    def reject(self, rec: Record, error: str) -> DeadLetter | None:
        """Dead-letter ``rec`` (stage ``handle``) with ``error`` (one line) instead of handling
        it; returns the queued dead letter (``None`` when it cannot be routed: logged)."""
        log.error("%s: rejected %s[%d]@%d: %s", self.service, rec.topic, rec.partition, rec.offset, error)
        self.rejected.append(rec)
        return self.dead_letter(rec, "handle", error)

    def dead_letter(self, rec: Record, stage: Literal["decode", "handle"], error: str) -> DeadLetter | None:
        """Queue the dead letter of ``rec`` (counted ``failed``); the runtime calls this for
        records that did not decode."""
        self.runner.counters.failed += 1
        outs = self.runner.dead_letter(rec, stage, error)
        self.queued += outs
        letters = [o.event for o in outs if isinstance(o.event, DeadLetter)]
        self.dead_letters += letters
        return letters[0] if letters else None

    async def flush(self) -> list[RecordMetadata]:
        """Send every queued output now and wait for Kafka's acknowledgements."""
        outs, self.queued = self.queued, []
        return await send_outputs(self.runner, outs, "batch output")


async def send_outputs(host: Host, outs: list[Output], what: str, count: bool = True) -> list[RecordMetadata]:
    """Send ``outs``, wait for every acknowledgement, count them (``emitted`` / ``dead_lettered``;
    ``count=False``: the caller counts).

    A Kafka outage does not fail the call (:mod:`runtime.outage`): the idempotent producer
    retries a batch by itself while the broker is away (waited for, not sent again: that could
    duplicate it); outputs that failed are sent again (0.5 s doubling to 5 s apart); a producer
    whose state the broker no longer accepts after a restart (out-of-order sequence, unknown
    producer id) is replaced and what it had not delivered goes through the new one. Raises
    :class:`BusError` with one line when that has gone on for ``kafka.outage_timeout_s``, or at
    once when Kafka refuses the outputs for another reason."""
    if not outs:
        return []
    mds: list[RecordMetadata | None] = [None] * len(outs)
    todo = list(range(len(outs)))
    retry = host.outage.retry(f"{what} not acknowledged")
    while todo:
        producer = host.producer
        queued: list[tuple[int, asyncio.Future[RecordMetadata]]] = []
        error: BaseException | None = None
        try:
            for i in todo:
                o = outs[i]
                queued.append((i, await producer.send_raw(o.topic, o.value, o.key)))
        except KafkaError as e:
            error = e
        pending = {f for _, f in queued}
        deadline = time.monotonic() + host.outage.limit_s
        while pending:
            _, pending = await asyncio.wait(pending, timeout=1.0)
            if pending and (host.producer is not producer or producer_dead(producer)):
                break  # what it had not delivered goes through a new producer
            if pending and time.monotonic() > deadline:
                retry.done()
                raise BusError(f"{host.service_name}: {what} not acknowledged within kafka.outage_timeout_s="
                               f"{host.outage.limit_s:g} s (Kafka unavailable?)")
        failed = todo[len(queued):]
        renew = error is not None and needs_new_producer(error)
        for i, fut in queued:
            resolved = fut.done() and not fut.cancelled()
            exc = fut.exception() if resolved else None
            if resolved and exc is None:
                mds[i] = fut.result()
                continue
            if exc is not None and not isinstance(exc, KafkaError):
                raise exc
            failed.append(i)
            # unresolved: its producer stopped delivering (or was replaced meanwhile)
            renew = renew or exc is None or needs_new_producer(exc)
            error = error or exc or KafkaConnectionError("the producer stopped delivering")
        if not failed:
            break
        assert error is not None
        await retry.failed(error, transient=True if renew else None)  # waits, or raises BusError
        if renew:
            await host.renew_producer(producer, retry)
        todo = sorted(failed)
    retry.done()
    if count:
        for o in outs:
            if o.dead_letter:
                host.counters.dead_lettered += 1
            else:
                host.counters.emitted += 1
    return [md for md in mds if md is not None]
