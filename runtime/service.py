"""What a service's handlers get: counters, outputs and the per-record and per-batch contexts.

* :class:`Counters` — what the instance did.
* :class:`Context` — per record: ``emit`` queues outputs, sent after the handler returns.
* :class:`BatchContext` — per polled batch (batch handlers): ``emit`` / ``reject`` queue outputs
  and dead letters, ``flush`` sends what is queued now (a trainer publishes each step's weights
  at once); the rest is sent when the handler returns, before any commit.
* :class:`Host` — what a context needs of whoever made it (the runner, or its Kafka I/O);
  :class:`RecordHandler` / :class:`BatchHandler` — what the loops need of a service.
* :func:`derive_event_id` — the deterministic id of a re-handled input's outputs.

The services themselves (:class:`runtime.runner.Service` and friends) and :func:`run_service`
live in :mod:`runtime.runner`; their settings in :mod:`runtime.settings`.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter as _Tally
from dataclasses import asdict, dataclass
from typing import Literal, Protocol

import msgspec

from runtime.bus import KeyLike, Producer, Record, RecordMetadata, encode_key, key_for
from runtime.settings import ServiceSettings, resolve_topic
from schemas.events import DeadLetter, Event
from schemas.topics import spec_for_topic

log = logging.getLogger("rollstream.runtime")

__all__ = [
    "BatchContext",
    "BatchHandler",
    "Context",
    "Counters",
    "Host",
    "Outcome",
    "Output",
    "RecordHandler",
    "derive_event_id",
    "make_output",
    "resolve_topic",
]

Outcome = Literal["processed", "failed", "ignored"]
"""How one record ended: handled, dead-lettered (or logged), or left to its owner group."""


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


@dataclass(slots=True)
class Output:
    """One message to produce: encoded and size-checked when emitted."""

    topic: str
    key: bytes | None
    value: bytes
    event: Event
    dead_letter: bool = False


class Host(Protocol):
    """What a context needs of whoever made it: the runner (:class:`runtime.runner.Runner`) or
    its Kafka I/O (:class:`runtime.kafka_io.KafkaIO`)."""

    settings: ServiceSettings
    counters: Counters

    @property
    def producer(self) -> Producer: ...

    @property
    def service_name(self) -> str: ...

    def dead_letter(self, rec: Record, stage: Literal["decode", "handle"], error: str) -> list[Output]: ...

    async def send_outputs(self, outs: list[Output], what: str, count: bool = True) -> list[RecordMetadata]: ...


class RecordHandler(Protocol):
    """What the record loops need of a service (:class:`runtime.runner.Service`)."""

    name: str

    async def handle(self, rec: Record, ctx: Context) -> None: ...


class BatchHandler(Protocol):
    """What the batch loop needs of a service (:class:`runtime.runner.BatchService`)."""

    name: str

    async def handle_batch(self, records: list[Record], ctx: BatchContext) -> None: ...


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
        if self.runner.settings.delivery.deterministic_output_ids and parent:
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
        if pid and self.runner.settings.delivery.deterministic_output_ids:
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
        return await self.runner.send_outputs(outs, "batch output")
