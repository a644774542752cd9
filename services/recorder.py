"""The recorder: every message of a run's topics into the run's ClickHouse store.

It consumes ``^rs\\.<run_id>\\..*`` (or ``^rs\\..*`` for all runs) with manual commits, and per
poll inserts one batch per table, then commits the polled offsets. Ingestion is idempotent on
(topic, partition, offset): at start it reads the highest stored offset of each partition and
skips anything at or below it (a crash between insert and commit re-delivers a batch that is
then skipped), and the tables are ReplacingMergeTree on their natural keys besides.

Undecodable messages are still recorded in ``events`` (kind ``undecodable``, raw bytes as
base64) so nothing that crossed the bus is missing from the record.

With ``stop_when_finished`` the recorder exits by itself once it has seen the run's
``RunFinished`` and then an idle poll with zero lag.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import defaultdict
from typing import Any

import msgspec

from schemas import events as ev
from schemas.config import KafkaSettings
from schemas.topics import parse_topic
from services import store as st
from services.bus import Consumer, Record, TopicPartition, next_offsets
from services.recorder_rows import COLUMNS, event_row, typed_rows

log = logging.getLogger("rollstream.recorder")


class RecorderSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Settings of one recorder instance."""

    run_id: str = ""
    """Record this run's topics; empty = every run (``^rs\\..*``)."""
    dsn: str
    """Store DSN (``chdb:///path`` or ``http(s)://host:8123``)."""
    kafka: KafkaSettings = msgspec.field(default_factory=KafkaSettings)
    """How to reach Kafka."""
    group_id: str = ""
    """Consumer group; empty = ``rs-recorder-<run_id or all>``."""
    batch_max_records: int = 2000
    """Most records per poll (one insert per table per poll)."""
    poll_timeout_s: float = 0.5
    """Longest wait for records per poll, seconds."""
    stop_when_finished: bool = False
    """Exit after the run's ``RunFinished`` was recorded and the recorder has caught up."""
    idle_exit_s: float = 2.0
    """With ``stop_when_finished``: how long the topics must stay quiet after ``RunFinished``, seconds."""


class Recorder:
    """State of a running recorder (counters are read by tests and progress displays)."""

    def __init__(self, settings: RecorderSettings) -> None:
        self.settings = settings
        self.recorded = 0
        self.skipped = 0
        self.finished_seen = False
        self.lag = 0
        self._client: Any = None
        self._stored: dict[tuple[str, int], int] = {}

    def _load_stored_offsets(self) -> None:
        where = "WHERE run_id = {r:String}" if self.settings.run_id else ""
        q = self._client.query(
            f"SELECT topic, partition, max(offset) FROM events {where} GROUP BY topic, partition",
            parameters={"r": self.settings.run_id},
        )
        self._stored = {(t, int(p)): int(o) for t, p, o in q.result_rows}

    def rows_for(self, records: list[Record]) -> dict[str, list[list[Any]]]:
        """Table -> rows for the records not stored yet (updates the skip bookkeeping)."""
        tables: dict[str, list[list[Any]]] = defaultdict(list)
        for rec in records:
            if isinstance(rec.event, ev.RunFinished):
                self.finished_seen = True
            if rec.offset <= self._stored.get((rec.topic, rec.partition), -1):
                self.skipped += 1
                continue
            parsed = parse_topic(rec.topic)
            run_id, name = parsed if parsed else ("", rec.topic)
            tables["events"].append(
                event_row(rec.topic, rec.partition, rec.offset, run_id, name, rec.key, rec.event,
                          rec.value_bytes, rec.ts)
            )
            if rec.event is not None:
                for table, rows in typed_rows(rec.event).items():
                    tables[table].extend(rows)
        return tables

    def insert(self, tables: dict[str, list[list[Any]]]) -> None:
        # events last: its max(offset) is what marks a batch as stored
        for table in sorted(tables, key=lambda t: t == "events"):
            rows = tables[table]
            if rows:
                self._client.insert(table, rows, column_names=COLUMNS[table])

    async def run(self, stop: asyncio.Event | None = None) -> int:
        s = self.settings
        stop = stop or asyncio.Event()
        self._client = st.connect(s.dsn)
        st.apply_ddl(self._client)
        self._load_stored_offsets()
        pattern = rf"^rs\.{re.escape(s.run_id)}\..*" if s.run_id else r"^rs\..*"
        consumer = Consumer(
            s.kafka, group_id=s.group_id or f"rs-recorder-{s.run_id or 'all'}", pattern=pattern,
            auto_offset_reset="earliest", client_suffix="recorder",
        )
        await consumer.start()
        quiet_since: float | None = None
        try:
            while not stop.is_set():
                records = await consumer.getmany(timeout_ms=int(s.poll_timeout_s * 1000),
                                                  max_records=s.batch_max_records)
                if records:
                    tables = self.rows_for(records)
                    await asyncio.to_thread(self.insert, tables)
                    await consumer.commit(next_offsets(records))
                    self.recorded += len(tables.get("events", []))
                    for r in records:
                        self._stored[(r.topic, r.partition)] = max(
                            r.offset, self._stored.get((r.topic, r.partition), -1))
                    quiet_since = None
                    continue
                self.lag = await _lag(consumer)
                if s.stop_when_finished and self.finished_seen and self.lag == 0:
                    quiet_since = quiet_since or time.monotonic()
                    if time.monotonic() - quiet_since >= s.idle_exit_s:
                        break
        finally:
            await consumer.stop()
        return self.recorded


async def _lag(consumer: Consumer) -> int:
    """Messages between the consumer's position and the end of its assigned partitions."""
    assigned: set[TopicPartition] = consumer.assignment()
    if not assigned:
        return 0
    ends = await consumer.raw.end_offsets(list(assigned))
    lag = 0
    for tp in assigned:
        try:
            pos = await consumer.raw.position(tp)
        except Exception:
            continue
        lag += max(0, ends[tp] - pos)
    return lag


async def run(settings: RecorderSettings, stop: asyncio.Event | None = None) -> int:
    """Record until stopped (or until the run finished, see ``stop_when_finished``).
    Returns the number of messages recorded by this instance."""
    return await Recorder(settings).run(stop)
