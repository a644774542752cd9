"""The recorder: every message of a run's topics into the run's ClickHouse store.

It runs as a batch service in its consumer group (:data:`schemas.services.SERVICES`; one recorder
of every run subscribes by pattern): :meth:`Recorder.handle_batch` writes each poll with one
insert per table (``events`` last), and the runtime commits the poll's offsets once it returned.
Every message is recorded: the runtime's dedupe is off, and undecodable bytes are handed over too
(``handle_undecodable``) and stored as kind ``undecodable``. Ingestion is idempotent on (topic,
partition, offset): at start it reads the highest stored offset of each partition and skips
anything at or below it. An insert that fails with a connection, timeout or I/O error
(:func:`is_transient`: the store down) is retried with backoff (1, 2, 4 ... up to
``store_retry_max_backoff_s``) for up to ``store_retry_for_s``; the poll's offsets are committed
only once it is stored, so nothing unwritten is committed and the recorder catches up from Kafka
when the store is back. Past ``store_retry_for_s`` the insert's error stops the recorder; any
other insert error (a bad column, a wrong type) stops it at once. Each insert carries a
deduplication token of its batch (:func:`batch_token`, ``infra/clickhouse/009_insert_dedup.sql``):
a retried batch that was stored in part is not stored twice. A stop during an outage ends the
retries at once: the batch is left uncommitted (:class:`StoreDown`). The runtime keeps the
recorder in its group while a batch is retried (:class:`runtime.loops.BatchLoop`).
While it retries, :attr:`Recorder.outage` says since when and how many messages wait, and with
``run_dir`` set the same goes to ``<run_dir>/recorder_store.json`` (:func:`write_outage`).

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
import contextlib
import logging
import os
import threading
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

import store as st
from runtime import gc_tuning
from runtime.bus import Consumer, Record
from runtime.reading import behind
from runtime.runner import BatchContext, BatchService, Runner, ServiceSettings
from runtime.settings import Consume, Delivery, Handling, Subscription
from schemas import events as ev
from schemas.config import KafkaSettings, RunConfig
from schemas.errors import one_line, to_thread
from schemas.services import SERVICES
from schemas.topics import parse_topic
from services import ServiceStart
from store.compact import drop_outdated_parts
from store.outage import (
    OUTAGE_FILE,
    StoreDown,
    StoreOutage,
    backoff_s,
    batch_token,
    is_transient,
    write_outage,
)
from store.rows import COLUMNS, event_row, lag_row, typed_row
from store.runs import PRODUCERS_DONE, store_dsn_of
from store.tracking import TrackerFeed, make_trackers

log = logging.getLogger("rollstream.recorder")

SPEC = SERVICES["recorder"]

FETCH_MIN_BYTES = 4 * 1024 * 1024
"""The recorder's fetches wait for this many bytes (or :data:`FETCH_MAX_WAIT_MS`): fewer, fuller
polls, one insert per table each, each with a fixed cost. In bench/pipeline_ceiling.py 4 MiB or
1 s rather than 1 MiB or 0.5 s took the recorder from 0.118-0.122 to 0.102-0.109 ms of CPU per
sample, its peak memory the same (bench/README.md, "The recorder's fetches")."""
FETCH_MAX_WAIT_MS = 1000
"""How long the broker may hold one of the recorder's fetches, milliseconds: the most an event
waits before the recorder reads it on a quiet run."""
GC_YOUNG_THRESHOLD = 1_000_000
"""The recorder process's young-generation threshold (:func:`runtime.gc_tuning.hold_batches`): above
what one poll holds (the main example's: some 12,000 events, 120,000 objects the collector tracks),
so a poll is freed by reference counting, not walked again and again by the collector (at 20,000
it ran six times a second; decoding and encoding such a poll took 13% less CPU without)."""


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
    store_retry_for_s: float = 600.0
    """How long an insert failing with a transient error (:func:`is_transient`) is retried before
    the recorder stops with that error, seconds (the run's ``store.retry_for_s``)."""
    store_retry_backoff_s: float = 1.0
    """The first wait between insert attempts, seconds (doubled after each failure)."""
    store_retry_max_backoff_s: float = 5.0
    """The longest wait between insert attempts, seconds."""


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
        self._types: dict[str, list[str]] = {}  # table -> its recorded columns' types (_column_types)
        self._quiet_since: float | None = None
        self._next_report = 0.0
        self.tracking: TrackerFeed | None = None
        """The experiment trackers fed with this run's train steps and evals (None when off)."""
        self.compacted: tuple[int, int] | None = None
        """``(parts, bytes)`` deleted when the store was compacted at the end (None: it was not)."""
        if settings.store_retry_for_s < 0 or not 0 < settings.store_retry_backoff_s <= settings.store_retry_max_backoff_s:
            raise ValueError("store_retry_for_s must be >= 0 and 0 < store_retry_backoff_s <= store_retry_max_backoff_s")
        self.outage = StoreOutage()
        """The store's state: up, or down since when (published to ``recorder_store.json``)."""
        self._stop: asyncio.Event | None = None  # the runner's: a stop ends the retries
        self._sleep: Callable[[float], Awaitable[None]] = self._pause  # tests replace it to retry in milliseconds

    def _publish_outage(self) -> None:
        if not self.settings.run_dir:
            return
        try:
            write_outage(os.path.join(self.settings.run_dir, OUTAGE_FILE), self.outage)
        except OSError as e:
            log.warning("could not write %s: %s", OUTAGE_FILE, e)

    async def _pause(self, wait_s: float) -> None:
        """Wait ``wait_s`` between insert attempts, less when the service is told to stop."""
        if self._stop is None:
            await asyncio.sleep(wait_s)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), wait_s)

    def _stopping(self) -> bool:
        return self._stop is not None and self._stop.is_set()

    async def insert_retrying(self, tables: dict[str, list[list[Any]]]) -> None:
        """:meth:`insert`, retried with backoff while the store fails transiently
        (:func:`is_transient`), for up to ``store_retry_for_s``; then the last error is raised.
        Other errors are raised at once; a stop during the retries raises :class:`StoreDown`."""
        s, o = self.settings, self.outage
        while True:
            try:
                await to_thread(self.insert, tables)
            except Exception as e:
                if not is_transient(e):
                    log.error("store insert failed, not retried (a bad row or schema, not the store down): %s",
                              one_line(e, 300))
                    raise
                now = time.time()
                if o.down_since is None:
                    o.down_since, o.attempts = now, 0
                o.attempts += 1
                o.behind = len(tables.get("events", []))
                o.last_error = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
                if now - o.down_since >= s.store_retry_for_s:
                    log.error("store down for %.0f s, giving up: %s", now - o.down_since, o.last_error)
                    raise
                self._publish_outage()
                if self._stopping():
                    raise StoreDown(f"store down while stopping ({o.behind} events not stored): {o.last_error}") from e
                wait = backoff_s(o.attempts, s.store_retry_backoff_s, s.store_retry_max_backoff_s)
                log.warning("store insert failed (attempt %d, retrying in %.1f s): %s", o.attempts, wait, o.last_error)
                await self._sleep(wait)
                if self._stopping():
                    raise StoreDown(f"store down while stopping ({o.behind} events not stored): {o.last_error}") from e
                continue
            if o.down_since is not None:
                o.last_outage_s, o.outages = time.time() - o.down_since, o.outages + 1
                log.warning("store back after %.1f s (%d failed attempts); catching up", o.last_outage_s, o.attempts)
                o.down_since, o.attempts, o.behind, o.last_error = None, 0, 0, ""
                self._publish_outage()
            return

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
            typed = typed_row(rec.event) if rec.event is not None else None
            if typed is not None:
                tables[typed[0]].append(typed[1])
        return tables

    def insert(self, tables: dict[str, list[list[Any]]]) -> None:
        """One insert per table (``events`` last), under the store lock, each with the batch's
        deduplication token (:func:`batch_token`): inserting the same batch again adds nothing."""
        # events last: its max(offset) is what marks a batch as stored
        token = batch_token(tables)
        with self._lock:
            for table in sorted(tables, key=lambda t: t == "events"):
                rows = tables[table]
                if rows:
                    self._client.insert(table, rows, column_names=COLUMNS[table],
                                        column_type_names=self._column_types(table),
                                        settings={"insert_deduplication_token": f"{token}-{table}"})

    def _column_types(self, table: str) -> list[str]:
        """``table``'s recorded column types, asked once: an insert naming them is one query, not two."""
        types = self._types.get(table)
        if types is None:
            described = {row[0]: row[1] for row in self._client.query(f"DESCRIBE TABLE {table}").result_rows}
            types = self._types[table] = [described[c] for c in COLUMNS[table]]
        return types

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
        await self._insert_lag(row)
        return rep

    async def _insert_lag(self, row: list[Any]) -> None:
        """Write one lag row, once: with the store down it is left out (logged), not retried, so that
        the loop goes on to the batches, which wait for the store."""
        try:
            await to_thread(self.insert, {"recorder_lag": [row]})
        except Exception as e:
            if not is_transient(e):
                raise
            log.warning("lag not written, the store is down: %s", one_line(e, 200))

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
        self._stop = runner.stop
        gc_tuning.hold_batches(GC_YOUNG_THRESHOLD)  # a poll's events stay alive until their insert
        self.open_store()
        self._start_server()
        self._start_trackers()
        self._quiet_since = None
        self._next_report = 0.0  # the first poll that finds partitions assigned reports at once

    async def handle_batch(self, records: list[Record], ctx: BatchContext) -> None:
        """One insert per table for the poll's messages not stored yet (the runtime commits the
        poll's offsets after this returns)."""
        new = [r.event for r in records if r.offset > self._stored.get((r.topic, r.partition), -1)]
        tables = self.rows_for(records)
        try:
            await self.insert_retrying(tables)
        except StoreDown as e:  # stopping during an outage: the batch stays uncommitted, read again later
            log.warning("%s; the batch is left uncommitted", e)
            raise asyncio.CancelledError from e
        self._stored_now(records, tables)
        if self.tracking is not None:  # after the insert: trackers see what the record holds
            await to_thread(self.tracking.feed, new)

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
                await to_thread(self.tracking.close)
            if self.finished_seen and self._client is not None and st.check_dsn(self.settings.dsn) == "chdb":
                await to_thread(self.compact)

    def compact(self) -> None:
        """Delete the parts of the embedded store that merges made obsolete (:mod:`store.compact`)."""
        with self._lock:
            parts, n_bytes = self.compacted = drop_outdated_parts(self._client, st.chdb_path(self.settings.dsn))
        log.info("record compacted: %d merged-away parts deleted (%.1f MB)", parts, n_bytes / 1e6)

    # ----------------------------------------------------------------- the record built later

    def open_store(self) -> None:
        """Open the store, apply the DDL and read what it holds already (:meth:`on_start` begins
        with it; ``rollstream record`` (:mod:`launch.record`) records with this instance, no service)."""
        self._client = st.connect(self.settings.dsn)
        st.apply_ddl(self._client)
        self._load_stored_offsets()

    def record(self, records: list[Record]) -> dict[str, int]:
        """Store ``records`` as :meth:`handle_batch` does (:meth:`rows_for`, one insert per table),
        outside the runtime; table -> rows written."""
        tables = self.rows_for(records)
        self.insert(tables)
        self._stored_now(records, tables)
        return {table: len(rows) for table, rows in tables.items()}

    def _stored_now(self, records: list[Record], tables: dict[str, list[list[Any]]]) -> None:
        """Count ``tables``' events as recorded and ``records``' offsets as stored."""
        self.recorded += len(tables.get("events", []))
        for r in records:
            self._stored[(r.topic, r.partition)] = max(r.offset, self._stored.get((r.topic, r.partition), -1))

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
        store_retry_for_s=cfg.store.retry_for_s,
        config=cfg, run_dir=str(start.run_dir), producers_done_file=str(start.run_dir / PRODUCERS_DONE))


async def run(settings: RecorderSettings, stop: asyncio.Event | None = None) -> int:
    """Record until stopped (or until the run finished, see ``stop_when_finished``).
    Returns the number of messages recorded by this instance."""
    return await Recorder(settings).run(stop)
