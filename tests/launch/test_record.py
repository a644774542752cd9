"""The record built later (``rollstream record``, :mod:`launch.record`) against the real broker and
the real ClickHouse engine: one small run (every event type, batched records, an undecodable
message) recorded live by the recorder, then again from its topics into another store by the CLI;
the two records are equal table by table, the later one adds nothing to the live one, and the
summary counted from the topics is the one counted in SQL; and the run exported from the broker's log
directory is recorded elsewhere with no broker (`record --from-log`), equal to the live record too."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

import store as st
from infra.kafka.home import read_properties
from launch.progress import tallies_of_store, tallies_of_topics
from launch.record import RecordError, record_run
from runtime.bus import Producer, TopicAdmin
from schemas import events as ev
from schemas.config import KafkaSettings
from schemas.topics import pack_values, topic_name
from services.recorder import Recorder, RecorderSettings
from tests.schemas.examples import example_events
from tests.store.record_tables import (
    COLUMNS_QUERY,
    SKIPPED_COLUMNS,
    SKIPPED_TABLES,
    by_table,
    columns_of,
    dump_query,
)
from tests.store.recorded_run import publish, run_events, topic_of

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Live:
    run_id: str
    bootstrap: str
    dsn: str
    recorded: int
    """Events the live recorder stored."""


async def _publish_and_record(bootstrap: str, run_id: str, dsn: str) -> int:
    kafka = KafkaSettings()
    async with TopicAdmin(kafka, bootstrap) as admin:
        await admin.ensure_run_topics(run_id)
    enc = msgspec.msgpack.Encoder()
    async with Producer(kafka, bootstrap) as producer:
        for e in example_events():  # every event type, one each
            if not isinstance(e, ev.RunFinished):
                await producer.send_and_wait(topic_name(run_id, topic_of(e)), msgspec.structs.replace(e, run_id=run_id))
        # batched records (kafka.samples_per_record): several events per Kafka record
        tasks = [ev.RolloutTask(run_id=run_id, sample_id=f"b/{i}", group_id="b", index=i, group_size=3,
                                prompt_id="arith-b", domain="arith", prompt="1+1=", reference="2") for i in range(3)]
        outcomes = [ev.SampleOutcome(run_id=run_id, sample_id=t.sample_id, group_id="b", status="filtered",
                                     reason="all-equal rewards") for t in tasks]
        for name, batch in (("tasks", tasks), ("metrics", outcomes)):
            await producer.raw.send_and_wait(topic_name(run_id, name), pack_values([enc.encode(e) for e in batch]),
                                             key=b"b/0")
    # a transaction aborted (its event is in the log, not in the record) and one committed
    async with Producer(kafka, bootstrap, transactional_id=f"tx-{run_id}") as txp:
        with contextlib.suppress(ZeroDivisionError):
            async with txp.transaction():
                await txp.send(topic_name(run_id, "control"), ev.Pause(run_id=run_id, reason="aborted"))
                await txp.flush()
                raise ZeroDivisionError
        async with txp.transaction():
            await txp.send(topic_name(run_id, "control"), ev.Resume(run_id=run_id))
    await publish(bootstrap, run_id, run_events(run_id))  # the run of tests/store/recorded_run.py, RunFinished last
    settings = RecorderSettings(run_id=run_id, dsn=dsn, kafka=KafkaSettings(bootstrap=bootstrap),
                                stop_when_finished=True, idle_exit_s=0.5, lag_report_every_s=0)
    return await asyncio.wait_for(Recorder(settings).run(), timeout=120)


@pytest.fixture(scope="module")
def live(bootstrap: str, store_dsn: str) -> Live:
    run_id = f"t{uuid.uuid4().hex[:12]}-later"
    return Live(run_id, bootstrap, store_dsn, asyncio.run(_publish_and_record(bootstrap, run_id, store_dsn)))


def rollstream(*args: str, bootstrap: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True, env=env,
                          timeout=180, cwd=REPO)


def test_a_record_built_later_equals_the_live_one_table_by_table(live: Live, tmp_path: Path) -> None:
    later = f"chdb://{tmp_path / 'later'}"
    res = rollstream("record", live.run_id, "--store", later, "--runs-dir", str(tmp_path / "runs"), "--format",
                     "json", bootstrap=live.bootstrap)
    assert res.returncode == 0, res.stderr
    done = json.loads(res.stdout)
    assert done["events"] == live.recorded and done["skipped"] == 0 and done["finished"], done
    # two batched records carry 3 events each; two transactions left an event and a marker each (one aborted)
    assert done["messages"] == live.recorded - 4 + 3
    assert_same_record(live, later)


def assert_same_record(live: Live, later: str) -> None:
    """The record in store ``later`` equals the live one, table by table."""
    # the live record, in this process; the later one through `rollstream sql` (one chDB store a process)
    client = st.connect(live.dsn)
    columns = columns_of(client.query(COLUMNS_QUERY).result_rows)
    query = dump_query(columns, live.run_id)
    mine = by_table(client.query(query).result_rows)
    res = rollstream("sql", query, "--store", later, "--format", "json", bootstrap=live.bootstrap)
    assert res.returncode == 0, res.stderr
    theirs = by_table(json.loads(res.stdout))
    compared = set(columns) - set(SKIPPED_TABLES)
    assert set(mine) == set(theirs) == compared, (set(mine) ^ compared, set(theirs) ^ compared)
    for table in sorted(compared):
        assert mine[table] == theirs[table], table
    # the comparison saw rows of every kind the run has
    assert len(mine["events"]) == live.recorded
    assert {t for t, rows in mine.items() if rows} >= {
        "events", "sample_tasks", "sample_generations", "sample_rewards", "sample_outcomes", "train_steps", "evals",
        "weights", "dlq", "env_events", "service_events", "schema_migrations"}
    assert '"record_index":2' in "".join(mine["events"])
    assert '"Resume"' in "".join(mine["events"]) and '"aborted"' not in "".join(mine["events"])
    assert set(SKIPPED_COLUMNS) <= {(t, c) for t, cols in columns.items() for c in cols}


def broker_log_dir(bootstrap: str) -> Path:
    """The log directory of the local broker listening at ``bootstrap`` (its server.properties, found
    through its command line): the broker the tests use is one `rollstream stack up` started."""
    port = bootstrap.rsplit(":", 1)[1]
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "kafka.Kafka" in argv and argv.index("kafka.Kafka") + 1 < len(argv):
            props = read_properties(Path(argv[argv.index("kafka.Kafka") + 1]))
            if any(item.endswith(f":{port}") for item in props.get("listeners", "").split(",")):
                return Path(props["log.dirs"])
    pytest.fail(f"no local broker process listens at {bootstrap}: the test reads its log directory")


def test_a_record_built_elsewhere_from_the_exported_log_equals_the_live_one(live: Live, tmp_path: Path) -> None:
    archive = tmp_path / "out" / f"{live.run_id}.tar.xz"
    res = rollstream("runs", "export-log", live.run_id, str(archive), "--log-dir", str(broker_log_dir(live.bootstrap)),
                     "--format", "json", bootstrap=live.bootstrap)
    assert res.returncode == 0, res.stderr
    exported = json.loads(res.stdout)
    assert exported["partitions"] >= 10 and 0 < exported["bytes"] == archive.stat().st_size < exported["bytes_unpacked"]
    later = f"chdb://{tmp_path / 'elsewhere'}"
    # no broker there: a bootstrap nothing answers at, and the record built all the same
    res = rollstream("record", live.run_id, "--from-log", str(archive), "--store", later, "--runs-dir",
                     str(tmp_path / "runs"), "--format", "json", bootstrap="127.0.0.1:9")
    assert res.returncode == 0, res.stderr
    done = json.loads(res.stdout)
    assert (done["events"], done["skipped"], done["finished"], done["trimmed"]) == (live.recorded, 0, True, 0), done
    assert done["messages"] == live.recorded - 4 + 3
    assert_same_record(live, later)


async def test_recording_over_the_live_record_adds_nothing(live: Live) -> None:
    again = await record_run(KafkaSettings(), live.bootstrap, live.run_id, live.dsn)
    assert (again.events, again.skipped, again.finished, again.trimmed) == (0, live.recorded, True, 0)
    assert again.tables == {}


async def test_the_summary_counted_from_the_topics_is_the_one_counted_in_sql(live: Live) -> None:
    from_topics = await tallies_of_topics(KafkaSettings(), live.bootstrap, live.run_id)
    from_store = tallies_of_store(st.connect(live.dsn), live.run_id)
    assert from_topics == from_store
    assert from_topics.issued == 13 + 1 + 3 and from_topics.by_status["filtered"] == 1 + 3  # batched ones too
    assert from_topics.steps >= 2 and from_topics.gen_tokens > 0


async def test_an_unknown_run_is_one_line(bootstrap: str, store_dsn: str) -> None:
    with pytest.raises(RecordError, match=r"^run t-no-such-run has no topics on the Kafka broker at "):
        await record_run(KafkaSettings(), bootstrap, "t-no-such-run", store_dsn)
