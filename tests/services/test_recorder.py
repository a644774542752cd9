"""The recorder against the real broker and the real ClickHouse engine: every event lands in
`events` and the typed tables, undecodable bytes are kept, and a restart duplicates nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec

import store as st
from runtime.bus import Producer, Record, TopicAdmin
from schemas import events as ev
from schemas.config import KafkaSettings
from schemas.topics import TOPICS, topic_name
from services.recorder import Recorder, RecorderSettings
from store.outage import OUTAGE_FILE, StoreOutage, describe_outage
from store.rows import COLUMNS
from tests.schemas.examples import example_events


def topic_of(event: ev.Event) -> str:
    for name, spec in TOPICS.items():
        if type(event) in getattr(spec.event_type, "__args__", (spec.event_type,)):
            return name
    raise AssertionError(type(event))


async def publish_examples(bootstrap: str, run_id: str) -> int:
    settings = KafkaSettings()
    async with TopicAdmin(settings, bootstrap) as admin:
        await admin.ensure_run_topics(run_id)
    events = [msgspec.structs.replace(e, run_id=run_id) for e in example_events()
              if not isinstance(e, ev.RunFinished)]
    async with Producer(settings, bootstrap) as producer:
        for e in events:
            await producer.send_and_wait(topic_name(run_id, topic_of(e)), e)
        await producer.raw.send_and_wait(topic_name(run_id, "tasks"), b"\xc1not msgpack", key=b"junk")
        await producer.send_and_wait(topic_name(run_id, "control"),
                                     ev.RunFinished(run_id=run_id, status="completed"))
    return len(events) + 2


async def record(bootstrap: str, run_id: str, dsn: str, group: str) -> int:
    settings = RecorderSettings(run_id=run_id, dsn=dsn, kafka=KafkaSettings(bootstrap=bootstrap), group_id=group,
                                stop_when_finished=True, idle_exit_s=0.5)
    return await asyncio.wait_for(Recorder(settings).run(), timeout=60)


async def test_the_producers_done_file_ends_the_wait_for_quiet_topics(bootstrap: str, run_id: str, store_dsn: str,
                                                                     tmp_path: Path) -> None:
    """With the supervisor's file present the recorder exits once it has recorded everything after
    ``RunFinished``, long before ``idle_exit_s`` of quiet polls would have passed."""
    sent = await publish_examples(bootstrap, run_id)
    done = tmp_path / "producers.done"
    done.touch()
    settings = RecorderSettings(run_id=run_id, dsn=store_dsn, kafka=KafkaSettings(bootstrap=bootstrap),
                                group_id=f"{run_id}-done", stop_when_finished=True, idle_exit_s=600,
                                producers_done_file=str(done))
    rec = Recorder(settings)
    assert await asyncio.wait_for(rec.run(), timeout=120) == sent
    assert rec.finished_seen and rec.lag == 0
    assert rec.compacted is not None  # the run finished: its embedded store was compacted at the end


async def test_records_everything_once(bootstrap: str, run_id: str, store_dsn: str) -> None:
    sent = await publish_examples(bootstrap, run_id)
    assert await record(bootstrap, run_id, store_dsn, f"{run_id}-g1") == sent
    # a second recorder (new group: it re-reads everything) must not duplicate rows
    assert await record(bootstrap, run_id, store_dsn, f"{run_id}-g2") == 0

    client = st.connect(store_dsn)
    p = {"r": run_id}

    def one(q: str) -> object:
        return client.query(q, parameters=p).result_rows[0][0]

    assert one("SELECT count() FROM events WHERE run_id = {r:String}") == sent
    kinds = {k for (k,) in client.query("SELECT DISTINCT kind FROM events WHERE run_id = {r:String}",
                                          parameters=p).result_rows}
    assert kinds == {type(e).__name__ for e in example_events()} | {"undecodable"}
    assert one("SELECT count() FROM sample_tasks FINAL WHERE run_id = {r:String}") == 1
    assert one("SELECT reward FROM sample_rewards FINAL WHERE run_id = {r:String}") == 1.0
    assert one("SELECT metrics['loss/policy'] FROM train_steps FINAL WHERE run_id = {r:String}") == 0.1
    assert one("SELECT status FROM samples WHERE run_id = {r:String}") == "trained"
    assert one("SELECT error FROM dlq FINAL WHERE run_id = {r:String}") == "decode: bad bytes"
    payload = one("SELECT payload FROM events WHERE run_id = {r:String} AND kind = 'Generation'")
    decoded = msgspec.json.decode(str(payload).encode(), type=ev.Generation)
    assert decoded.response_text == "19" and decoded.run_id == run_id


async def test_lag_is_measured_and_inserts_are_batched(bootstrap: str, run_id: str, store_dsn: str) -> None:
    """N messages wait on the bus before the recorder starts: every lag report accounts for all
    of them (lag + recorded = N), the first sees about N, the last 0; polls are bounded by
    ``batch_max_records`` and written with one insert per table; the reports reach the store."""
    from tests.store.recorded_run import publish

    n, batch = 300, 40
    tasks: list[ev.Event] = [
        ev.RolloutTask(run_id=run_id, sample_id=f"g{i}/0", group_id=f"g{i}", index=0, group_size=1,
                       prompt_id=f"p{i}", domain="arith", prompt="1+1=") for i in range(n - 1)]
    assert await publish(bootstrap, run_id, [*tasks, ev.RunFinished(run_id=run_id, status="completed")],
                         junk=False) == n
    inserts: list[dict[str, int]] = []

    class Counting(Recorder):
        def insert(self, tables: dict[str, list[list[Any]]]) -> None:
            inserts.append({t: len(rows) for t, rows in tables.items()})
            super().insert(tables)

    rec = Counting(RecorderSettings(run_id=run_id, dsn=store_dsn, kafka=KafkaSettings(bootstrap=bootstrap),
                                    group_id=f"{run_id}-lag", stop_when_finished=True, idle_exit_s=0.5,
                                    batch_max_records=batch, lag_report_every_s=0.0))
    assert await asyncio.wait_for(rec.run(), timeout=120) == n

    reports = list(rec.lag_reports)
    assert len(reports) >= 2
    for r in reports:
        assert r.lag_records + r.recorded_total == n, r
        assert r.partitions == sum(spec.partitions for spec in TOPICS.values())
    assert reports[0].lag_records >= n - batch  # measured after at most one batch
    assert reports[-1].lag_records == 0 and reports[-1].recorded_total == n and rec.lag == 0

    event_batches = [i["events"] for i in inserts if "events" in i]
    assert sum(event_batches) == n and max(event_batches) <= batch and len(event_batches) >= n // batch
    assert all(i.get("sample_tasks", 0) <= batch for i in inserts)

    client = st.connect(store_dsn)
    stored = client.query("SELECT lag_records, recorded_total, partitions FROM recorder_lag "
                          "WHERE run_id = {r:String} AND group_id = {g:String} ORDER BY ts",
                          parameters={"r": run_id, "g": f"{run_id}-lag"}).result_rows
    assert [tuple(s) for s in stored] == [(r.lag_records, r.recorded_total, r.partitions) for r in reports]


# ----------------------------------------------------------------- store outages (unit: a failing client)


class _FlakyClient:
    """A store client whose first ``failures`` inserts raise, as an unreachable server's do."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.inserted: list[tuple[str, int]] = []

    def _reach(self) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise ConnectionError("HTTPConnectionPool(host='127.0.0.1', port=1): Connection refused")

    def query(self, sql: str) -> SimpleNamespace:  # the recorder's DESCRIBE TABLE of a table's column types
        self._reach()
        table = sql.split()[-1]
        return SimpleNamespace(result_rows=[(c, "String") for c in COLUMNS[table]])

    def insert(self, table, rows, column_names, column_type_names, settings):  # type: ignore[no-untyped-def]
        self._reach()
        assert len(column_type_names) == len(column_names)
        self.inserted.append((table, len(rows)))


def _outage_recorder(tmp_path: Path, failures: int, retry_for_s: float = 600.0,
                     behind: int | None = 2) -> tuple[Recorder, list[float]]:
    rec = Recorder(RecorderSettings(dsn="http://127.0.0.1:1", run_dir=str(tmp_path), store_retry_for_s=retry_for_s,
                                    store_retry_backoff_s=1.0, store_retry_max_backoff_s=5.0))
    rec._client = _FlakyClient(failures)
    waits: list[float] = []

    async def sleep(s: float) -> None:
        waits.append(s)
        published = msgspec.json.decode((tmp_path / OUTAGE_FILE).read_bytes(), type=StoreOutage)
        assert published.down_since is not None  # status sees the outage meanwhile
        assert behind is None or published.behind == behind

    rec._sleep = sleep  # type: ignore[method-assign]
    return rec, waits


def _event_rows(n: int) -> list[list[object]]:
    """``n`` rows of ``events`` (offsets 0..n-1 of one partition)."""
    return [["rs.t.tasks", 0, i, "t", "tasks", "RolloutTask", "", f"e{i}", 0.0, 0, "{}", 0] for i in range(n)]


async def test_a_failing_insert_is_retried_with_backoff_and_the_recovery_published(tmp_path: Path) -> None:
    rec, waits = _outage_recorder(tmp_path, failures=4)
    await rec.insert_retrying({"events": _event_rows(2), "recorder_lag": [[3]]})
    assert waits == [1.0, 2.0, 4.0, 5.0]
    assert rec._client.inserted == [("recorder_lag", 1), ("events", 2)]  # events last, once
    published = msgspec.json.decode((tmp_path / OUTAGE_FILE).read_bytes(), type=StoreOutage)
    assert published.down_since is None and published.outages == 1 and published.behind == 0
    assert describe_outage(published, 0.0).startswith("store: up (caught up after 1 outage")


async def test_an_outage_longer_than_the_retry_budget_stops_the_recorder(tmp_path: Path) -> None:
    rec, waits = _outage_recorder(tmp_path, failures=10**6, retry_for_s=0.0)
    try:
        await rec.insert_retrying({"events": _event_rows(2)})
    except ConnectionError as e:
        assert "Connection refused" in str(e)
    else:
        raise AssertionError("the insert should have failed")
    assert waits == [] and rec.outage.attempts == 1




# ----------------------------------------------------------------- which errors are an outage; idempotent retries

# what chDB raises when its disk refuses a write (seen with the table's folder made immutable,
# `chattr +i`, on 2026-11-28): the store down, as an unreachable server's connection errors are
CHDB_DISK_ERROR = ('Code: 1001. DB::Exception: std::__1::filesystem::filesystem_error: filesystem error: in '
                   'create_directories: Operation not permitted ["/store/040/tmp_insert_all_1_1_1"]. (STD_EXCEPTION)')


def _disk_error() -> Exception:
    from clickhouse_connect.driver.exceptions import DatabaseError

    return DatabaseError(CHDB_DISK_ERROR, code=1001, name="STD_EXCEPTION")


def _batch(run_id: str) -> list[Record]:
    """The example events of ``run_id`` as consumed records (offsets 0.. of one partition)."""
    events = [msgspec.structs.replace(e, run_id=run_id) for e in example_events()]
    return [Record(topic_name(run_id, topic_of(e)), 0, i, None, msgspec.msgpack.encode(e), e, None, 1700000000.0)
            for i, e in enumerate(events)]


class _FailingStore:
    """The real chDB client, but insert number ``fail_at`` (1-based, or every one while ``down``)
    raises chDB's disk error first: a batch stored in part, or the store down."""

    def __init__(self, client: Any, fail_at: set[int] | None = None) -> None:
        self.client, self.fail_at, self.down = client, fail_at or set(), False
        self.calls, self.written = 0, []  # type: ignore[var-annotated]

    def insert(self, table: str, rows: list[list[Any]], column_names: list[str], column_type_names: list[str],
               settings: dict[str, Any]) -> None:
        self.calls += 1
        if self.down or self.calls in self.fail_at:
            raise _disk_error()
        self.client.insert(table, rows, column_names=column_names, column_type_names=column_type_names,
                           settings=settings)
        self.written.append(table)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


async def test_a_bad_row_fails_at_once_without_a_retry(store_dsn: str, tmp_path: Path) -> None:
    rec, waits = _outage_recorder(tmp_path, failures=0)
    rec._client = st.connect(store_dsn)
    st.apply_ddl(rec._client)
    bad = _event_rows(1)
    bad[0][2] = "not an offset"  # a wrong type: a bug, retrying cannot fix it
    try:
        await rec.insert_retrying({"events": bad})
    except ValueError as e:
        assert "not an offset" in str(e)
    else:
        raise AssertionError("the bad row should have been refused")
    assert waits == [] and rec.outage.attempts == 0 and not (tmp_path / OUTAGE_FILE).exists()


async def test_a_batch_stored_in_part_then_retried_is_stored_once(store_dsn: str, run_id: str, tmp_path: Path) -> None:
    """The second table's insert fails after the first was written (real chDB): the retry inserts
    every table again, and the deduplication tokens keep the first table's rows single."""
    client = st.connect(store_dsn)
    st.apply_ddl(client)
    rec, waits = _outage_recorder(tmp_path, failures=0, behind=None)
    rec._client = store = _FailingStore(client, fail_at={2})
    tables = rec.rows_for(_batch(run_id))
    await rec.insert_retrying(tables)
    assert waits == [1.0] and store.written[0] == sorted(tables, key=lambda t: t == "events")[0]  # written, then retried
    assert store.written.count(store.written[0]) == 2
    for table, rows in tables.items():  # no FINAL: the raw rows, as stored
        n = client.query(f"SELECT count() FROM {table} WHERE run_id = {{r:String}}", parameters={"r": run_id})
        assert n.result_rows[0][0] == len(rows), table


async def test_a_stop_in_an_outage_commits_nothing_and_the_next_recorder_rides_one_out(
        bootstrap: str, run_id: str, store_dsn: str, tmp_path: Path) -> None:
    """SIGTERM while the store is down: the recorder stops within a second or so, without an error
    and without committing the batch. The next one (same group) meets the store down for three
    attempts, catches up and stores every event once; recorder_store.json says so meanwhile."""
    import os
    import signal
    import time

    sent = await publish_examples(bootstrap, run_id)
    stores: list[_FailingStore] = []

    class Outage(Recorder):
        async def on_start(self, runner: Any) -> None:
            await super().on_start(runner)
            self._client = store = _FailingStore(self._client)
            store.down = not stores  # the first recorder's store stays down, the next fails 3 times
            store.fail_at = {1, 2, 3}
            stores.append(store)

    def settings() -> RecorderSettings:
        return RecorderSettings(run_id=run_id, dsn=store_dsn, kafka=KafkaSettings(bootstrap=bootstrap),
                                group_id=f"{run_id}-out", stop_when_finished=True, idle_exit_s=0.5,
                                run_dir=str(tmp_path), store_retry_backoff_s=0.05, store_retry_max_backoff_s=0.2)

    first = Outage(settings())
    job = asyncio.create_task(first.run())  # the runner's SIGTERM handler
    deadline = time.monotonic() + 60
    while first.outage.behind == 0 or first.outage.attempts < 2:  # a batch met the outage
        assert time.monotonic() < deadline and not job.done(), "the outage was not met"
        await asyncio.sleep(0.02)
    down = msgspec.json.decode((tmp_path / OUTAGE_FILE).read_bytes(), type=StoreOutage)
    assert down.down_since is not None and down.behind > 0 and "filesystem error" in down.last_error
    t0 = time.monotonic()
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(job, 10) == 0  # a clean stop, nothing recorded
    assert time.monotonic() - t0 < 5.0  # the retries end at the stop: no wait for the 10 s grace or the outage

    second = Outage(settings())
    assert await asyncio.wait_for(second.run(), timeout=60) == sent  # nothing was committed: all read again
    assert second.outage.outages == 1 and stores[1].calls > 3
    up = msgspec.json.decode((tmp_path / OUTAGE_FILE).read_bytes(), type=StoreOutage)
    assert describe_outage(up, time.time()).startswith("store: up (caught up after 1 outage(s)")
    client = st.connect(store_dsn)
    rows = client.query("SELECT count(), uniqExact(topic, partition, offset, record_index) FROM events "
                        "WHERE run_id = {r:String}", parameters={"r": run_id}).result_rows[0]
    assert tuple(rows) == (sent, sent)
