"""``rollstream record RUN``: a run's record built later from its retained topics.

A run with ``store.record_live: false`` starts no recorder (no chDB on its node); its topics keep
every event for their ``retention.ms`` (7 days), and they are its record until this builds the
store from them, on the same machine or on another one that reaches the broker.

* :func:`read_run` reads topics of a run from their beginning to the end they have once every
  partition is assigned (no consumer group, nothing committed), through the runtime's consumer:
  a batched Kafka record comes back as one :class:`~runtime.records.Record` per event, as the
  recorder gets them. The summary of such a run reads its topics so too
  (:func:`launch.progress.summarize_topics`).
* :func:`record_run` stores what it reads through the recorder's own code
  (:meth:`services.recorder.Recorder.open_store`, :meth:`~services.recorder.Recorder.record`):
  the rows a live recorder writes. Idempotent as the recorder is: offsets the store holds already
  are skipped, so running it twice, or over a live record, adds only what is missing.
* :func:`record_log` does the same on a machine with no broker, from a copy of the broker's log
  directory or an archive of ``rollstream runs export-log`` (:mod:`infra.kafka.logdir`): the same
  records, read from the segment files.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from runtime.bus import BusError, Consumer, Record, TopicAdmin, TopicPartition
from runtime.clients import records_of
from runtime.reading import behind
from schemas.config import KafkaSettings
from schemas.errors import to_thread
from schemas.topics import check_run_id, spec_for_topic, topic_name

__all__ = ["RecordError", "RecordResult", "RunTopics", "read_run", "record_log", "record_run", "run_topics"]

STALL_S = 60.0
"""A read that gets no record for this long before the topics' ends fails, seconds."""


class RecordError(BusError):
    """The record cannot be built (unknown run, a read that stalls), as one line."""


@dataclass(frozen=True)
class RunTopics:
    """The partitions read and their offsets when the read found them all."""

    begins: dict[TopicPartition, int]
    """The first offset Kafka still holds (above 0: retention deleted what came before)."""
    ends: dict[TopicPartition, int]
    """The end offset read to."""

    @property
    def messages(self) -> int:
        """Kafka records between beginnings and ends (transaction markers count too)."""
        return sum(self.ends[tp] - self.begins[tp] for tp in self.ends)

    @property
    def trimmed(self) -> int:
        """Kafka records retention deleted before the read (their events are not in the record)."""
        return sum(self.begins.values())


async def run_topics(kafka: KafkaSettings, bootstrap: str, run_id: str, names: Iterable[str] | None = None) -> list[str]:
    """The Kafka topics of ``run_id`` (of logical ``names``, default all) that exist; :class:`RecordError`
    when it has none."""
    check_run_id(run_id)
    async with TopicAdmin(kafka, bootstrap) as admin:
        topics = await admin.run_topics(run_id)
    if names is not None:
        wanted = {topic_name(run_id, n) for n in names}
        topics = [t for t in topics if t in wanted]
    if not topics:
        raise RecordError(f"run {run_id} has no topics on the Kafka broker at {bootstrap} (an unknown run, "
                          "its topics deleted, or another broker: --bootstrap)")
    return topics


Take = Callable[[list[Record]], Awaitable[None] | None]


async def read_run(kafka: KafkaSettings, bootstrap: str, topics: list[str], take: Take, *,
                   batch_max_records: int = 2000, on_ready: Callable[[RunTopics], None] | None = None,
                   stall_s: float = STALL_S) -> RunTopics:
    """Read ``topics`` from their beginning to their ends, handing each poll's records to ``take``
    (awaited when it returns an awaitable); ``on_ready`` gets the offsets once every partition is
    assigned. Aborted transactions are not read (``read_committed``)."""
    clock = asyncio.get_running_loop().time
    async with Consumer(kafka, bootstrap, group_id=None, topics=topics, client_suffix="record") as consumer:
        raw, span, last = consumer.raw, None, clock()
        while True:
            records = await consumer.getmany(timeout_ms=500, max_records=batch_max_records)
            if records:
                last = clock()
                res = take(records)
                if inspect.isawaitable(res):
                    await res
            if span is None and {tp.topic for tp in raw.assignment()} == set(topics):
                tps = sorted(raw.assignment())
                span = RunTopics(begins=dict(await raw.beginning_offsets(tps)), ends=dict(await raw.end_offsets(tps)))
                if on_ready is not None:
                    on_ready(span)
            if span is not None and not any((await behind(raw, span.ends, span.ends)).values()):
                return span
            if clock() - last > stall_s:
                left = sum((await behind(raw, span.ends, span.ends)).values()) if span else None
                raise RecordError(f"reading {len(topics)} topics from {bootstrap} stalled: no record for {stall_s:g} s"
                                  + (f" with {left} still to read" if left is not None else ""))


@dataclass
class RecordResult:
    """What :func:`record_run` did."""

    run_id: str
    dsn: str
    messages: int = 0
    """Kafka records the topics held (transaction markers included)."""
    events: int = 0
    """Rows written to ``events`` (one per event; a batched record carries several)."""
    skipped: int = 0
    """Events skipped as already stored."""
    tables: dict[str, int] = field(default_factory=dict)
    """Rows written per table."""
    finished: bool = False
    """Whether the topics hold the run's ``RunFinished``."""
    trimmed: int = 0
    """Kafka records retention had deleted before the read."""
    compacted: tuple[int, int] | None = None
    """``(parts, bytes)`` deleted when the embedded store was compacted at the end."""
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "store": self.dsn, "messages": self.messages, "events": self.events,
                "skipped": self.skipped, "tables": dict(sorted(self.tables.items())), "finished": self.finished,
                "trimmed": self.trimmed, "wall_s": round(self.wall_s, 1)}


async def record_run(kafka: KafkaSettings, bootstrap: str, run_id: str, dsn: str, *,
                     progress: Callable[[str], None] | None = None, every_s: float = 5.0,
                     batch_max_records: int = 2000) -> RecordResult:
    """Build (or complete) the record of ``run_id`` in store ``dsn`` from its topics on ``bootstrap``
    with the recorder's code; ``progress`` gets a line every ``every_s``."""
    topics = await run_topics(kafka, bootstrap, run_id)  # an unknown run is said before a store is made

    async def read(take: Take, ready: Callable[[RunTopics], None]) -> None:
        await read_run(kafka, bootstrap, topics, take, batch_max_records=batch_max_records, on_ready=ready)

    return await _record(kafka, run_id, dsn, read, progress, every_s, batch_max_records)


async def record_log(src: Path, run_id: str, dsn: str, *, progress: Callable[[str], None] | None = None,
                     every_s: float = 5.0, batch_max_records: int = 2000) -> RecordResult:
    """:func:`record_run` from a copy of the broker's log directory instead of a broker: ``src`` is the
    directory (or a local stack's home, or an archive of ``rollstream runs export-log``), read partition
    by partition as a ``read_committed`` consumer reads it (:mod:`infra.kafka.logdir`)."""
    from infra.kafka.home import StackError
    from infra.kafka.logdir import read_partition, run_log, run_partitions, split_partition

    with contextlib.ExitStack() as stack:
        try:
            log_dir = stack.enter_context(run_log(src, run_id))
        except StackError as e:
            raise RecordError(str(e)) from None

        async def read(take: Take, ready: Callable[[RunTopics], None]) -> None:
            parts = run_partitions(log_dir, run_id)
            logs = {}
            for part in parts:
                try:
                    logs[TopicPartition(*split_partition(part.name))] = await to_thread(read_partition, part)
                except StackError as e:
                    raise RecordError(str(e)) from None
            ready(RunTopics(begins={tp: p.begin for tp, p in logs.items()}, ends={tp: p.end for tp, p in logs.items()}))
            for tp, plog in logs.items():
                dec = msgspec.msgpack.Decoder(spec.event_type) if (spec := spec_for_topic(tp.topic)) else None
                for i in range(0, len(plog.messages), batch_max_records):
                    res = take(records_of(tp.topic, tp.partition, plog.messages[i:i + batch_max_records], dec))
                    if inspect.isawaitable(res):
                        await res
            torn = sum(p.torn for p in logs.values())
            if torn and progress is not None:
                progress(f"cut {torn} bytes of a batch being written when the log was copied (as the broker would)")

        result = await _record(KafkaSettings(), run_id, dsn, read, progress, every_s, batch_max_records)
    return result


async def _record(kafka: KafkaSettings, run_id: str, dsn: str,
                  read: Callable[[Take, Callable[[RunTopics], None]], Awaitable[None]],
                  progress: Callable[[str], None] | None, every_s: float, batch_max_records: int) -> RecordResult:
    """Open the store as the recorder does and store what ``read`` hands to its ``take``."""
    import store as st
    from services.recorder import Recorder, RecorderSettings
    from store.client import redact

    t0 = time.monotonic()
    recorder = Recorder(RecorderSettings(run_id=run_id, dsn=dsn, kafka=kafka, serve_queries=False,
                                         batch_max_records=batch_max_records))
    await to_thread(recorder.open_store)
    result = RecordResult(run_id=run_id, dsn=redact(dsn))
    read_n, shown = 0, time.monotonic()

    def ready(span: RunTopics) -> None:
        result.messages, result.trimmed = span.messages, span.trimmed

    async def take(records: list[Record]) -> None:
        nonlocal read_n, shown
        for table, n in (await to_thread(recorder.record, records)).items():
            result.tables[table] = result.tables.get(table, 0) + n
        read_n += sum(r.index == 0 for r in records)
        if progress is not None and time.monotonic() - shown >= every_s:
            shown = time.monotonic()
            total = f"/{result.messages}" if result.messages else ""
            progress(f"{read_n}{total} records read, {recorder.recorded} events stored, {recorder.skipped} already there")

    await read(take, ready)
    result.events, result.skipped, result.finished = recorder.recorded, recorder.skipped, recorder.finished_seen
    if recorder.finished_seen and st.check_dsn(dsn) == "chdb":
        await to_thread(recorder.compact)
        result.compacted = recorder.compacted
    result.wall_s = time.monotonic() - t0
    return result
