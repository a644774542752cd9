"""The recorder: every message of a run's topics into the run's ClickHouse store.

It runs as a batch service in its consumer group (:data:`schemas.services.SERVICES`; one recorder
of every run subscribes by pattern): :meth:`Recorder.handle_batch` writes each poll with one
insert per table (``events`` last), and the runtime commits the poll's offsets once it returned.
Every message is recorded: the runtime's dedupe is off, and undecodable bytes are handed over too
(``handle_undecodable``) and stored as kind ``undecodable``. Ingestion is idempotent on (topic,
partition, offset): at start it reads the highest stored offset of each partition and skips
anything at or below it. An insert that fails stops the recorder (nothing of the poll committed).

* Lag: every ``lag_report_every_s`` (and at a clean exit) it measures its consumer lag, logs it
  and writes it to the ``recorder_lag`` table.
* With an embedded (chDB) store it serves read-only queries to other processes
  (:mod:`store.server`), under one lock with its own inserts.
* With ``stop_when_finished`` it exits once it has seen ``RunFinished`` and then an idle poll with
  zero lag: at once when ``producers_done_file`` exists, else after ``idle_exit_s`` of quiet.
* Once it has seen ``RunFinished``, a recorder of an embedded store compacts it when it stops: the
  parts merges made obsolete are deleted from disk (:mod:`store.compact`).
* Experiment trackers (``tracking``, :mod:`store.tracking`) get each newly stored ``TrainStep`` /
  ``EvalResult`` of its run after the insert.
* ``rollstream record`` (:mod:`launch.record`) builds a run's record later from its retained
  topics through :meth:`Recorder.open_store` and :meth:`Recorder.record`: the same rows.

docs/architecture.md, "Services", tells more.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import defaultdict, deque
from typing import Any

import msgspec

import store as st
from runtime.bus import Consumer, Record
from runtime.reading import behind
from runtime.runner import BatchContext, BatchService, Runner, ServiceSettings
from runtime.settings import Consume, Delivery, Handling, Subscription
from schemas import events as ev
from schemas.config import KafkaSettings, RunConfig
from schemas.services import SERVICES
from schemas.topics import parse_topic
from services import ServiceStart
from store.compact import drop_outdated_parts
from store.rows import COLUMNS, event_row, lag_row, typed_rows
from store.runs import PRODUCERS_DONE, store_dsn_of
from store.tracking import TrackerFeed, make_trackers

log = logging.getLogger("rollstream.recorder")

SPEC = SERVICES["recorder"]

FETCH_MIN_BYTES = 256 * 1024
"""The recorder's fetches wait for this many bytes (or :data:`FETCH_MAX_WAIT_MS`): a run's events
reach the store in fewer, fuller batches (bench/bus.py: the recorder's fetch requests, one per
event burst at the 1-byte default, were most of its Kafka CPU)."""
FETCH_MAX_WAIT_MS = 500
"""How long the broker may hold one of the recorder's fetches, milliseconds: the most an event
waits before the recorder reads it on a quiet run."""


class RecorderSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Settings of one recorder instance."""

    run_id: str = ""
    """Record this run's topics; empty = every run (``^rs\\..*``)."""
    dsn: str
    """Store DSN (``chdb:///path`` or ``http(s)://host:8123``)."""
    kafka: KafkaSettings = msgspec.field(default_factory=KafkaSettings)
    """How to reach Kafka."""
    group_id: str = ""
    """Consumer group; empty = the recorder's (``rs-recorder-<run_id or all>``)."""
    batch_max_records: int = 2000
    """Most records per poll (one insert per table per poll)."""
    lag_report_every_s: float = 10.0
    """How often the consumer lag is measured, logged and written to ``recorder_lag``, seconds
    (0 = after every poll)."""
    serve_queries: bool = True
    """With an embedded store: serve read-only queries to other processes while recording."""
    query_timeout_s: float = 60.0
    """``max_execution_time`` of each served query, seconds."""
    poll_timeout_s: float = 0.5
    """Longest wait for records per poll, seconds."""
    stop_when_finished: bool = False
    """Exit after the run's ``RunFinished`` was recorded and the recorder has caught up."""
    idle_exit_s: float = 2.0
    """With ``stop_when_finished``: how long the topics must stay quiet after ``RunFinished``, seconds."""
    producers_done_file: str = ""
    """With ``stop_when_finished``: a file whose existence says that every other service of the run
    has exited; once it exists the recorder exits at the first idle poll with zero lag after
    ``RunFinished``, without waiting ``idle_exit_s``. Empty = none."""
    config: RunConfig | None = None
    """The run's config: its ``tracking`` section turns experiment trackers on (needs ``run_id``)."""
    run_dir: str = ""
    """The run's folder, where trackers write; empty = ``<config.run.runs_dir>/<run_id>``."""


class LagReport(msgspec.Struct, frozen=True, kw_only=True):
    """One measurement of the recorder's consumer lag."""

    ts: float
    """When it was measured, unix seconds."""
    lag_records: int
    """Messages not yet recorded: end offsets minus positions, summed over the assigned partitions."""
    partitions: int
    """Partitions assigned to the recorder at that time."""
    recorded_total: int
    """Messages this recorder had stored by then."""
    skipped_total: int
    """Messages it had skipped as already stored by then."""


class Recorder(BatchService):
    """The recorder service and its state (counters are read by tests and progress displays)."""

    name = "recorder"

    def __init__(self, settings: RecorderSettings) -> None:
        if settings.batch_max_records < 1:
            raise ValueError(f"batch_max_records={settings.batch_max_records} must be >= 1")
        if settings.lag_report_every_s < 0:
            raise ValueError(f"lag_report_every_s={settings.lag_report_every_s} must be >= 0")
        self.settings = settings
        self.recorded = 0
        self.skipped = 0
        self.finished_seen = False
        self.lag = 0
        """Consumer lag at the last measurement (messages not yet recorded)."""
        self.lag_reports: deque[LagReport] = deque(maxlen=1000)
        """The latest lag reports, oldest first (also written to ``recorder_lag``)."""
        self.server: Any = None
        """The :class:`store.server.StoreServer` while recording into an embedded store."""
        self._client: Any = None
        self._lock = threading.Lock()  # one store call at a time: inserts and served queries
        self._stored: dict[tuple[str, int], int] = {}
        self._quiet_since: float | None = None
        self._next_report = 0.0
        self.tracking: TrackerFeed | None = None
        """The experiment trackers fed with this run's train steps and evals (None when off)."""
        self.compacted: tuple[int, int] | None = None
        """``(parts, bytes)`` deleted when the store was compacted at the end (None: it was not)."""

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
                          rec.value_bytes, rec.ts, rec.index)
            )
            if rec.event is not None:
                for table, rows in typed_rows(rec.event).items():
                    tables[table].extend(rows)
        return tables

    def insert(self, tables: dict[str, list[list[Any]]]) -> None:
        """One insert per table (``events`` last), under the store lock."""
        # events last: its max(offset) is what marks a batch as stored
        with self._lock:
            for table in sorted(tables, key=lambda t: t == "events"):
                rows = tables[table]
                if rows:
                    self._client.insert(table, rows, column_names=COLUMNS[table])

    async def report_lag(self, consumer: Consumer, timeout_s: float | None = None) -> LagReport | None:
        """Measure the lag now, log it, keep it and write it to ``recorder_lag``. A measurement
        that fails or takes over ``timeout_s`` (default: the Kafka request timeout) is logged
        and returns ``None``."""
        try:
            lag, partitions = await asyncio.wait_for(
                _lag(consumer), timeout=timeout_s or self.settings.kafka.request_timeout_s)
        except Exception as e:
            log.warning("could not measure the lag: %s", str(e).strip().splitlines()[0] if str(e).strip()
                        else type(e).__name__)
            return None
        self.lag = lag
        rep = LagReport(ts=time.time(), lag_records=lag, partitions=partitions, recorded_total=self.recorded,
                        skipped_total=self.skipped)
        self.lag_reports.append(rep)
        log.info("lag: %d messages not yet recorded on %d partitions (%d recorded, %d skipped)",
                 lag, partitions, self.recorded, self.skipped)
        row = lag_row(self.settings.run_id, self._group_id(), rep.ts, lag, partitions, self.recorded, self.skipped)
        await asyncio.to_thread(self.insert, {"recorder_lag": [row]})
        return rep

    def _group_id(self) -> str:
        return group_id(self.settings)

    def _start_server(self) -> None:
        s = self.settings
        if not s.serve_queries or st.check_dsn(s.dsn) != "chdb":
            return
        from store.server import StoreServer

        self.server = StoreServer(s.dsn, self._lock, max_execution_s=s.query_timeout_s).start()

    def _start_trackers(self) -> None:
        s = self.settings
        if s.config is None or not s.run_id or not (s.config.tracking.tensorboard or s.config.tracking.wandb):
            return
        from store.runs import run_dir_of

        run_dir = s.run_dir or str(run_dir_of(s.config, s.run_id))
        self.tracking = TrackerFeed(s.run_id, make_trackers(s.config, run_dir, s.run_id))
        self.tracking.seed_from_store(self._client)

    def _stop_server(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.close()

    # ----------------------------------------------------------------- the service

    def service_settings(self) -> ServiceSettings:
        """How the recorder runs on :mod:`runtime.runner` (:func:`service_settings`)."""
        return service_settings(self.settings)

    async def on_start(self, runner: Runner) -> None:
        s = self.settings
        self._client = st.connect(s.dsn)
        st.apply_ddl(self._client)
        self._load_stored_offsets()
        self._start_server()
        self._start_trackers()
        self._quiet_since = None
        self._next_report = 0.0  # the first poll that finds partitions assigned reports at once

    async def handle_batch(self, records: list[Record], ctx: BatchContext) -> None:
        """One insert per table for the poll's messages not stored yet (the runtime commits the
        poll's offsets after this returns)."""
        new = [r.event for r in records if r.offset > self._stored.get((r.topic, r.partition), -1)]
        tables = self.rows_for(records)
        await asyncio.to_thread(self.insert, tables)
        self.recorded += len(tables.get("events", []))
        for r in records:
            self._stored[(r.topic, r.partition)] = max(r.offset, self._stored.get((r.topic, r.partition), -1))
        if self.tracking is not None:  # after the insert: trackers see what the record holds
            await asyncio.to_thread(self.tracking.feed, new)

    async def on_tick(self, runner: Runner) -> None:
        """Measure the lag when due; stop once the run finished and everything is recorded."""
        s, consumer = self.settings, runner.consumer
        polled = runner.last_polled
        if polled:
            self._quiet_since = None
        measured = True
        if time.monotonic() >= self._next_report and consumer.assignment():
            measured = await self.report_lag(consumer) is not None
            self._next_report = time.monotonic() + s.lag_report_every_s
        elif not polled:
            self.lag = (await _lag(consumer))[0]
        if polled or not measured:
            return
        if s.stop_when_finished and self.finished_seen and self.lag == 0:
            if s.producers_done_file and os.path.exists(s.producers_done_file):
                runner.stop.set()  # nothing more can come: everything is recorded
                return
            self._quiet_since = self._quiet_since or time.monotonic()
            if time.monotonic() - self._quiet_since >= s.idle_exit_s:
                runner.stop.set()

    async def on_stop(self, runner: Runner) -> None:
        try:
            if runner.consumer.started and runner.consumer.assignment():
                await self.report_lag(runner.consumer, timeout_s=5.0)  # the final word: normally 0
        finally:
            self._stop_server()
            if self.tracking is not None:
                await asyncio.to_thread(self.tracking.close)
            if self.finished_seen and self._client is not None and st.check_dsn(self.settings.dsn) == "chdb":
                await asyncio.to_thread(self.compact)

    def compact(self) -> None:
        """Delete the parts of the embedded store that merges made obsolete (:mod:`store.compact`)."""
        with self._lock:
            parts, n_bytes = self.compacted = drop_outdated_parts(self._client, st.chdb_path(self.settings.dsn))
        log.info("record compacted: %d merged-away parts deleted (%.1f MB)", parts, n_bytes / 1e6)

    # ----------------------------------------------------------------- the record built later

    def open_store(self) -> None:
        """Open the store, apply the DDL and read what it holds already (what :meth:`on_start` does
        first): ``rollstream record`` (:mod:`launch.record`) records with this instance, no service."""
        self._client = st.connect(self.settings.dsn)
        st.apply_ddl(self._client)
        self._load_stored_offsets()

    def record(self, records: list[Record]) -> dict[str, int]:
        """Store ``records`` as :meth:`handle_batch` does (:meth:`rows_for`, one insert per table),
        outside the runtime; table -> rows written."""
        tables = self.rows_for(records)
        self.insert(tables)
        self.recorded += len(tables.get("events", []))
        for r in records:
            self._stored[(r.topic, r.partition)] = max(r.offset, self._stored.get((r.topic, r.partition), -1))
        return {table: len(rows) for table, rows in tables.items()}

    async def run(self, stop: asyncio.Event | None = None) -> int:
        """Record until ``stop`` (or SIGTERM/SIGINT, or the run finished with
        ``stop_when_finished``); the number of messages this instance recorded."""
        await Runner(self, self.service_settings(), stop).run()
        return self.recorded


async def _lag(consumer: Consumer) -> tuple[int, int]:
    """``(lag, partitions)``: messages between the consumer's positions and the ends of its
    assigned partitions (summed), and how many partitions that covers."""
    assigned = consumer.assignment()
    return sum((await behind(consumer.raw, assigned)).values()), len(assigned)


def group_id(s: RecorderSettings) -> str:
    """The recorder's consumer group: ``s.group_id``, else the table's (``rs-recorder-<run_id or all>``)."""
    return s.group_id or SPEC.group_id(s.run_id)


def service_settings(s: RecorderSettings) -> ServiceSettings:
    """How the recorder runs on :mod:`runtime.runner`: a batch handler over the run's topics (what
    its :data:`SPEC` subscribes: every topic of :data:`schemas.topics.TOPICS`; a recorder of every
    run subscribes by pattern), commit after each insert, every message to the handler (no dedupe,
    undecodable bytes too), fetches held by the broker until :data:`FETCH_MIN_BYTES` are ready or
    :data:`FETCH_MAX_WAIT_MS` passed (fewer, fuller fetches and inserts).

    A run's recorder names its topics rather than a pattern: a pattern subscription refreshes
    the metadata of every topic of the cluster every 5 s, which on a broker that keeps many
    runs' topics became most of the recorder's Kafka work."""
    subscription = msgspec.structs.replace(Subscription.of(SPEC, s.run_id), group_id=group_id(s))
    return ServiceSettings(
        run_id=s.run_id, kafka=s.kafka, subscription=subscription,
        consume=Consume(batch_max_records=s.batch_max_records, poll_timeout_s=s.poll_timeout_s,
                        fetch_min_bytes=FETCH_MIN_BYTES, fetch_max_wait_ms=FETCH_MAX_WAIT_MS),
        handling=Handling(handle_undecodable=True),
        delivery=Delivery(dedupe=False),
    )


def settings_from(start: ServiceStart) -> RecorderSettings:
    """The recorder's settings in a run (``rollstream service recorder``): the run's store, its
    ``store`` section, trackers, and exit once the run finished and every producer has exited."""
    cfg = start.config
    return RecorderSettings(
        run_id=start.run_id, dsn=store_dsn_of(cfg, start.run_id), kafka=cfg.kafka, stop_when_finished=True,
        batch_max_records=cfg.store.batch_max_records, lag_report_every_s=cfg.store.lag_report_every_s,
        config=cfg, run_dir=str(start.run_dir), producers_done_file=str(start.run_dir / PRODUCERS_DONE))


async def run(settings: RecorderSettings, stop: asyncio.Event | None = None) -> int:
    """Record until stopped (or until the run finished, see ``stop_when_finished``).
    Returns the number of messages recorded by this instance."""
    return await Recorder(settings).run(stop)
