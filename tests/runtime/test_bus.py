"""runtime.bus against a real Kafka broker (fixture ``bootstrap``): no fakes."""

from __future__ import annotations

import asyncio
import logging
import time
import typing

import pytest

from runtime.bus import (
    BusError,
    Consumer,
    Deduper,
    Producer,
    Record,
    TopicAdmin,
    TopicPartition,
    kafka_kwargs,
    key_for,
    message_count,
    message_counts,
    next_offsets,
    resolve_bootstrap,
)
from runtime.quiet import quiet_aiokafka
from runtime.runner import derive_event_id
from schemas.config import KafkaSettings
from schemas.events import (
    ALL_EVENT_TYPES,
    DeadLetter,
    Drain,
    EnvObservation,
    EnvReset,
    EnvSpec,
    EnvStep,
    EvalResult,
    Event,
    Generation,
    JudgeRequest,
    Pause,
    Resume,
    RolloutTask,
    RunFinished,
    RunStarted,
    SampleOutcome,
    ScoredSample,
    ServiceFailed,
    ServiceRestarted,
    ServiceStarted,
    TrainStep,
    WeightsPublished,
)
from schemas.topics import TOPICS, topic_name

pytestmark = pytest.mark.timeout(60)


def topic_of(cls: type[Event]) -> str:
    """The logical topic whose union carries ``cls``."""
    owners = [
        name
        for name, spec in TOPICS.items()
        if cls in (typing.get_args(spec.event_type) or (spec.event_type,))
    ]
    assert len(owners) == 1, (cls, owners)
    return owners[0]


def sample_events(run_id: str) -> list[Event]:
    """A valid instance of every event type, with every optional field set to a non-default."""
    env = EnvSpec(name="arith", kwargs={"digits": 2, "hard": True, "p": 0.5, "mode": "x"})
    task = RolloutTask(
        run_id=run_id,
        sample_id="g1/0",
        group_id="g1",
        index=0,
        group_size=2,
        prompt_id="p1",
        domain="arith",
        prompt="12+30=",
        reference="42",
        env=env,
        policy_version=3,
        max_new_tokens=16,
    )
    gen = Generation(
        run_id=run_id,
        task=task,
        prompt_ids=[1, 2, 3],
        response_ids=[4, 5, 6],
        response_text="42",
        logprobs=[-0.1, -0.25, -1e-9],
        loss_mask=[1, 0, 1],
        finish_reason="stop",
        policy_version=3,
        policy_version_end=4,
        worker_id="w0",
        queued_s=0.5,
        gen_s=1.25,
        env_s=0.125,
        num_turns=2,
    )
    events: list[Event] = [
        task,
        EnvReset(run_id=run_id, episode_id="e1", sample_id="g1/0", env=env, seed=7),
        EnvStep(run_id=run_id, episode_id="e1", step=1, action="look", policy_version=3),
        EnvObservation(
            run_id=run_id,
            episode_id="e1",
            step=1,
            observation="a room",
            reward=0.5,
            terminated=True,
            truncated=False,
            info={"k": 1, "ok": True},
            error="",
        ),
        gen,
        ScoredSample(
            run_id=run_id,
            generation=gen,
            reward=1.0,
            rewards={"correct": 1.0, "format": 0.5},
            verifier="arith",
            details="extracted 42",
            reward_s=0.01,
            policy_version=3,
        ),
        JudgeRequest(
            run_id=run_id, judge="quality",
            scored=ScoredSample(run_id=run_id, generation=gen, reward=1.0, rewards={"correct": 1.0, "verifier": 1.0}),
        ),
        WeightsPublished(
            run_id=run_id, policy_version=4, step=4, uri="/tmp/w/4", checksum="ab" * 32, num_bytes=123
        ),
        TrainStep(
            run_id=run_id,
            step=4,
            policy_version=3,
            metrics={"loss/policy": 0.25, "rollout/reward_mean": 0.75},
            sample_ids=["g1/0", "g1/1"],
            staleness_hist={0: 3, 1: 1},
        ),
        SampleOutcome(
            run_id=run_id,
            sample_id="g1/1",
            group_id="g1",
            status="dropped_stale",
            reason="stale: gap 3 > 2",
            policy_version=1,
            trained_version=4,
            step=4,
        ),
        EvalResult(run_id=run_id, step=4, policy_version=4, split="heldout", metrics={"eval/accuracy": 0.5}),
        RunStarted(run_id=run_id, config_json='{"train": {"steps": 2}}', host="h"),
        RunFinished(run_id=run_id, status="completed", summary_json='{"steps": 2}', error=""),
        Pause(run_id=run_id, reason="maintenance"),
        Resume(run_id=run_id),
        Drain(run_id=run_id, reason="done"),
        DeadLetter(
            run_id=run_id,
            source_topic=topic_name(run_id, "tasks"),
            partition=2,
            offset=17,
            key=b"g1/0",
            value=b"\xc1\x00\xff",
            error="DecodeError: bad",
            service="rollout",
            stage="decode",
        ),
        ServiceStarted(run_id=run_id, service="rollout", pid=4321, host="h"),
        ServiceRestarted(run_id=run_id, service="rollout", pid=4400, exit_code=-9, restarts=1,
                         reason="killed by SIGKILL", backoff_s=1.0, previous_pid=4321),
        ServiceFailed(run_id=run_id, service="rollout", pid=4500, exit_code=1, restarts=3, reason="boom"),
    ]
    assert {type(e) for e in events} == set(ALL_EVENT_TYPES), "add the new event type to sample_events"
    return events


async def consume_n(
    consumer: Consumer, n: int, timeout_s: float = 15.0, settle_s: float = 0.0
) -> list[Record]:
    """Consume until ``n`` records arrived (then keep polling ``settle_s`` to catch extras)."""
    out: list[Record] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        out += await consumer.getmany(timeout_ms=200)
    settle_end = time.monotonic() + settle_s
    while time.monotonic() < settle_end:
        out += await consumer.getmany(timeout_ms=100)
    return out


def task_event(run_id: str, i: int) -> RolloutTask:
    return RolloutTask(
        run_id=run_id,
        sample_id=f"g{i}/0",
        group_id=f"g{i}",
        index=0,
        group_size=1,
        prompt_id=f"p{i}",
        domain="arith",
        prompt=f"{i}+{i}=",
    )


# --------------------------------------------------------------------------- round trip


async def test_round_trip_every_event_type(kafka: KafkaSettings, run_id: str, topics: list[str]) -> None:
    events = sample_events(run_id)
    async with Producer(kafka) as producer:
        futs = [await producer.send(topic_name(run_id, topic_of(type(e))), e) for e in events]
        metas = await asyncio.gather(*futs)
    assert all(m.offset >= 0 for m in metas)
    used = sorted({topic_name(run_id, topic_of(type(e))) for e in events})
    async with Consumer(kafka, group_id=f"g-{run_id}", topics=used) as consumer:
        recs = await consume_n(consumer, len(events))
    assert [r.error for r in recs if r.error] == []
    got = {r.event.event_id: r for r in recs}
    assert len(recs) == len(events)
    for e in events:
        rec = got[e.event_id]
        assert rec.event == e
        assert type(rec.event) is type(e)
        assert rec.topic == topic_name(run_id, topic_of(type(e)))
        spec = TOPICS[topic_of(type(e))]
        assert rec.key == key_for(spec, e)  # registry key, derived by the producer
    keys = {type(r.event).__name__: r.key for r in recs}
    assert keys["Generation"] == b"g1/0"  # task.sample_id
    assert keys["ScoredSample"] == b"g1"  # generation.task.group_id
    assert keys["JudgeRequest"] == b"g1/0"  # scored.generation.task.sample_id
    assert keys["WeightsPublished"] == b"latest"
    # what the topics hold, per topic and in all
    infos = {TOPICS[n].topic(run_id): TOPICS[n].partitions for n in TOPICS}
    per_topic = await message_counts(kafka, kafka.bootstrap or "", infos)
    assert per_topic == {t: sum(1 for r in recs if r.topic == t) for t in infos}
    assert await message_count(kafka, kafka.bootstrap or "", infos) == len(events)


async def test_large_generation_fits(kafka: KafkaSettings, run_id: str, topics: list[str]) -> None:
    """A generation far above Kafka's 1 MiB default goes through (producer and topic limits raised)."""
    n = 150_000
    gen = Generation(
        run_id=run_id,
        task=task_event(run_id, 0),
        prompt_ids=list(range(1000)),
        response_ids=[(i * 7919) % 150_000 for i in range(n)],
        response_text="x" * n,
        logprobs=[-(i % 97) / 13.0 for i in range(n)],
        loss_mask=[1] * n,
        finish_reason="length",
        policy_version=0,
        policy_version_end=0,
    )
    async with Producer(kafka) as producer:
        assert len(producer.encode(gen)) > 2 * 1024 * 1024
        await producer.send_and_wait(topic_name(run_id, "generations"), gen)
    async with Consumer(
        kafka, group_id=f"g-{run_id}", topics=[topic_name(run_id, "generations")]
    ) as consumer:
        recs = await consume_n(consumer, 1)
    assert len(recs) == 1 and recs[0].event == gen


# --------------------------------------------------------------------------- producer settings


async def test_idempotent_producer_is_on(kafka: KafkaSettings, run_id: str, topics: list[str]) -> None:
    async with Producer(kafka) as producer:
        assert producer.config["enable_idempotence"] is True
        assert producer.config["acks"] == "all"
        assert producer.config["compression_type"] == "zstd"
        assert producer.config["max_request_size"] == 8 * 1024 * 1024
        raw = producer.raw
        assert raw._txn_manager is not None  # aiokafka only creates it with idempotence on
        assert raw._sender._acks == -1  # acks=all as sent to the broker
        await producer.send_and_wait(topic_name(run_id, "tasks"), task_event(run_id, 1))
        # the broker handed out a producer id: idempotent produce requests were actually used
        assert raw._txn_manager.producer_id >= 0
        assert raw._txn_manager.producer_epoch >= 0


def test_kafka_kwargs_security(tmp_path: typing.Any) -> None:
    plain = kafka_kwargs(KafkaSettings(client_id="rs"), "h:1", client_suffix="x")
    assert plain == {
        "bootstrap_servers": "h:1",
        "client_id": "rs-x",
        "request_timeout_ms": 30_000,
        "security_protocol": "PLAINTEXT",
    }
    sasl = kafka_kwargs(
        KafkaSettings(
            security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_username="u", sasl_password="p"
        ),
        "h:1",
    )
    assert sasl["sasl_mechanism"] == "SCRAM-SHA-512"
    assert (sasl["sasl_plain_username"], sasl["sasl_plain_password"]) == ("u", "p")
    assert sasl["ssl_context"] is not None
    with pytest.raises(BusError, match="TLS context"):
        kafka_kwargs(KafkaSettings(security_protocol="SSL", ssl_cafile=str(tmp_path / "missing.pem")), "h:1")


async def test_unreachable_bootstrap_fails_fast_with_one_line() -> None:
    settings = KafkaSettings(bootstrap="127.0.0.1:1", connect_timeout_s=1.5)
    for make in (
        lambda: Producer(settings),
        lambda: Consumer(settings, group_id="g", topics=["rs.x.tasks"]),
        lambda: TopicAdmin(settings),
    ):
        client = make()
        t0 = time.monotonic()
        with pytest.raises(BusError) as err:
            await client.start()
        assert time.monotonic() - t0 < 1.5 + 2.0
        msg = str(err.value)
        assert "\n" not in msg
        assert msg.startswith("cannot reach Kafka at 127.0.0.1:1 within 1.5 s")


async def test_failed_start_reports_once_and_aiokafka_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    with pytest.raises(BusError):
        await TopicAdmin(KafkaSettings(bootstrap="127.0.0.1:1", connect_timeout_s=1.0)).start()
    assert not [r for r in caplog.records if r.name.startswith("aiokafka")]  # the BusError said it


async def test_clients_share_one_lifecycle(kafka: KafkaSettings) -> None:
    for client in (Producer(kafka), Consumer(kafka, group_id=None, topics=["rs.x.tasks"])):
        with pytest.raises(BusError, match=f"{client.what} not started"):
            _ = client.raw
        assert not client.started
        async with client as same:
            assert same is client and client.started
            assert await client.start() is client  # idempotent
        assert not client.started
        await client.stop()  # idempotent
        with pytest.raises(BusError, match=f"{client.what} was stopped"):
            await client.start()


def test_resolve_bootstrap_argument_then_config_then_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSTREAM_BOOTSTRAP", " env:1 ")
    assert resolve_bootstrap(KafkaSettings(bootstrap="cfg:1"), " arg:1 ") == "arg:1"
    assert resolve_bootstrap(KafkaSettings(bootstrap="cfg:1"), "  ") == "cfg:1"
    assert resolve_bootstrap(KafkaSettings()) == "env:1"
    monkeypatch.delenv("ROLLSTREAM_BOOTSTRAP")
    with pytest.raises(BusError, match="no Kafka broker: start one with `rollstream stack up`"):
        resolve_bootstrap(KafkaSettings())


async def test_quiet_aiokafka_downgrades_only_the_calling_task(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    aiokafka_log = logging.getLogger("aiokafka")
    inside = asyncio.Event()

    async def other_task() -> None:  # runs while the block below is open, outside its scope
        await inside.wait()
        aiokafka_log.error("other task")

    async def started_inside() -> None:  # started in the scope, logs after it ended
        await asyncio.sleep(0.05)
        aiokafka_log.error("after the scope")

    other = asyncio.create_task(other_task())
    with quiet_aiokafka():
        late = asyncio.create_task(started_inside())
        inside.set()
        aiokafka_log.error("inside the scope")
        await other
    aiokafka_log.error("outside the scope")
    await late
    errors = [r.getMessage() for r in caplog.records if r.name == "aiokafka" and r.levelno == logging.ERROR]
    assert errors == ["other task", "outside the scope", "after the scope"]


# --------------------------------------------------------------------------- admin


async def test_ensure_run_topics_is_idempotent_and_follows_registry(
    kafka: KafkaSettings, run_id: str
) -> None:
    async with TopicAdmin(kafka) as admin:
        try:
            first = await admin.ensure_run_topics(run_id)
            second = await admin.ensure_run_topics(run_id)
            # the brokers-only metadata request counts what the all-topics one does
            assert await admin.broker_count() == len((await admin.raw.describe_cluster())["brokers"]) >= 1
            assert first == second == [topic_name(run_id, n) for n in TOPICS]
            info = await admin.describe(run_id)
            assert set(info) == set(TOPICS)
            for name, spec in TOPICS.items():
                assert info[name].partitions == spec.partitions, name
                assert info[name].configs["cleanup.policy"] == spec.cleanup, name
                assert int(info[name].configs["max.message.bytes"]) >= 8 * 1024 * 1024
            weights = await admin.topic_config(topic_name(run_id, "weights"))  # describe_configs
            assert weights["cleanup.policy"] == "compact"
            tasks = await admin.topic_config(topic_name(run_id, "tasks"))
            assert tasks["cleanup.policy"] == "delete"
            assert run_id in await admin.list_runs()
        finally:
            deleted = await admin.delete_run_topics(run_id)
        assert sorted(deleted) == sorted(first)
        assert await admin.describe(run_id) == {}


# --------------------------------------------------------------------------- at least once + dedupe


async def test_uncommitted_message_is_redelivered_and_dedupe_keeps_effect_single(
    kafka: KafkaSettings, run_id: str, topics: list[str]
) -> None:
    """A consumer handles a task, publishes its effect (a Generation), then dies before committing.

    The group's next consumer gets the task again and handles it again; the effect is written
    twice to Kafka, but with the same derived event_id, so downstream dedupe counts it once.
    """
    tasks_t, gens_t = topic_name(run_id, "tasks"), topic_name(run_id, "generations")
    group = f"g-{run_id}"
    task = task_event(run_id, 1)

    def handle(rec: Record) -> Generation:
        t = rec.event
        return Generation(
            run_id=t.run_id,
            event_id=derive_event_id(t.event_id, "rollout", 0),
            task=t,
            prompt_ids=[1],
            response_ids=[2],
            response_text="2",
            logprobs=[-0.5],
            loss_mask=[1],
            finish_reason="stop",
            policy_version=0,
            policy_version_end=0,
        )

    async with Producer(kafka) as producer:
        await producer.send_and_wait(tasks_t, task)
        # consumer A: handle, effect acknowledged, then "crash" (close without committing)
        a = Consumer(kafka, group_id=group, topics=[tasks_t])
        await a.start()
        got_a = await consume_n(a, 1)
        assert [r.event for r in got_a] == [task]
        await producer.send_and_wait(gens_t, handle(got_a[0]))
        await a.stop()
        # consumer B, same group: the task comes back (nothing was committed)
        async with Consumer(kafka, group_id=group, topics=[tasks_t]) as b:
            got_b = await consume_n(b, 1)
            assert [(r.partition, r.offset) for r in got_b] == [(r.partition, r.offset) for r in got_a]
            await producer.send_and_wait(gens_t, handle(got_b[0]))
            await b.commit(next_offsets(got_b))
        # consumer C, same group: nothing left (B committed)
        async with Consumer(kafka, group_id=group, topics=[tasks_t]) as c:
            assert await consume_n(c, 1, timeout_s=2.0) == []

    async with Consumer(kafka, group_id=f"down-{run_id}", topics=[gens_t]) as down:
        outputs = await consume_n(down, 2, settle_s=0.5)
    assert len(outputs) == 2  # at least once: the effect was produced twice ...
    dedupe = Deduper(1000)
    effects = [r.event for r in outputs if not dedupe.check_and_add(r.event.event_id)]
    assert len(effects) == 1  # ... and counted once downstream, by event_id
    assert effects[0].task == task


def test_deduper_lru_and_ttl() -> None:
    d = Deduper(capacity=3)
    assert [d.check_and_add(k) for k in "abc"] == [False] * 3
    assert d.check_and_add("a") is True  # refreshes a
    d.add("d")  # evicts b (least recently used)
    assert "b" not in d and "a" in d and "c" in d and "d" in d
    assert d.evicted == 1
    d.discard("a")
    assert d.check_and_add("a") is False
    t = Deduper(capacity=10, ttl_s=0.05)
    t.add("x")
    assert "x" in t
    time.sleep(0.08)
    assert "x" not in t and t.check_and_add("x") is False
    with pytest.raises(ValueError):
        Deduper(0)


# --------------------------------------------------------------------------- transactions


async def test_aborted_transaction_is_invisible_to_read_committed(
    kafka: KafkaSettings, run_id: str, topics: list[str]
) -> None:
    """Consume-transform-produce: an aborted transaction's outputs and offsets both vanish."""
    tasks_t, gens_t = topic_name(run_id, "tasks"), topic_name(run_id, "control")
    group = f"g-{run_id}"
    async with Producer(kafka) as plain:
        await plain.send_and_wait(tasks_t, task_event(run_id, 1))
    txp = Producer(kafka, transactional_id=f"tx-{run_id}")
    async with txp, Consumer(kafka, group_id=group, topics=[tasks_t]) as consumer:
        recs = await consume_n(consumer, 1)
        assert len(recs) == 1
        aborted = Pause(run_id=run_id, reason="aborted")

        class Boom(Exception):
            pass

        with pytest.raises(Boom):
            async with txp.transaction():
                await txp.send(gens_t, aborted)
                await txp.send_offsets_to_transaction(next_offsets(recs), group)
                await txp.flush()  # the aborted record really is in the log
                raise Boom
        tp = recs[0].tp
        assert await consumer.committed(tp) is None  # offsets of the aborted transaction vanished too
        committed = Resume(run_id=run_id)
        async with txp.transaction():
            await txp.send(gens_t, committed)
            await txp.send_offsets_to_transaction(next_offsets(recs), group)
        # transactional offsets become visible once the coordinator wrote the commit markers
        deadline = time.monotonic() + 10
        while await consumer.committed(tp) != recs[0].offset + 1:
            assert time.monotonic() < deadline, "offsets of the committed transaction never showed up"
            await asyncio.sleep(0.05)

    async with Consumer(kafka, group_id=f"rc-{run_id}", topics=[gens_t]) as rc:
        seen = [r.event for r in await consume_n(rc, 1, settle_s=0.5)]
    assert seen == [committed]
    async with Consumer(
        kafka, group_id=f"ru-{run_id}", topics=[gens_t], isolation_level="read_uncommitted"
    ) as ru:
        raw = [r.event for r in await consume_n(ru, 2, settle_s=0.3)]
    assert aborted in raw and committed in raw  # both were written; only one was committed


async def test_commit_skips_partitions_not_assigned(
    kafka: KafkaSettings, run_id: str, topics: list[str]
) -> None:
    tasks_t = topic_name(run_id, "tasks")
    async with Producer(kafka) as producer:
        await producer.send_and_wait(tasks_t, task_event(run_id, 3))
    async with Consumer(kafka, group_id=f"g-{run_id}", topics=[tasks_t]) as consumer:
        recs = await consume_n(consumer, 1)
        offsets = next_offsets(recs)
        offsets[TopicPartition("rs.elsewhere.tasks", 0)] = 5
        done = await consumer.commit(offsets)
        assert done == next_offsets(recs)
