"""runtime.runner against a real Kafka broker (fixture ``bootstrap``): no fakes."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import pytest

from runtime.bus import (
    BusError,
    Consumer,
    Deduper,
    Producer,
    Record,
    TopicPartition,
    next_offsets,
)
from runtime.loops import BatchLoop, RecordLoop
from runtime.runner import (
    BatchContext,
    BatchService,
    Consume,
    Context,
    Counters,
    Delivery,
    FunctionService,
    Handling,
    Runner,
    Service,
    ServiceSettings,
    Subscription,
    derive_event_id,
    publish,
    run_service,
)
from runtime.txn_loop import TxnLoop
from schemas.config import KafkaSettings
from schemas.events import DeadLetter, Generation, Pause, RolloutTask, ScoredSample
from schemas.topics import topic_name

pytestmark = pytest.mark.timeout(60)


def task(run_id: str, i: int) -> RolloutTask:
    return RolloutTask(
        run_id=run_id,
        sample_id=f"g{i}/0",
        group_id=f"g{i}",
        index=0,
        group_size=1,
        prompt_id=f"p{i}",
        domain="arith",
        prompt=f"{i}+{i}=",
        reference=str(2 * i),
    )


def generate(t: RolloutTask) -> Generation:
    return Generation(
        run_id=t.run_id,
        task=t,
        prompt_ids=[1, 2],
        response_ids=[3],
        response_text=t.reference,
        logprobs=[-0.5],
        loss_mask=[1],
        finish_reason="stop",
        policy_version=0,
        policy_version_end=0,
    )


class Rollout(Service):
    """Turns each task into a generation; optional delay and failure on chosen prompts."""

    name = "rollout"

    def __init__(self, delay_s: float = 0.0, fail_on: set[str] | None = None) -> None:
        self.delay_s = delay_s
        self.fail_on = fail_on or set()
        self.started: list[str] = []
        self.calls = 0

    async def handle(self, rec: Record, ctx: Context) -> None:
        self.calls += 1
        t: RolloutTask = rec.event
        self.started.append(t.sample_id)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if t.prompt_id in self.fail_on:
            raise RuntimeError(f"engine exploded on {t.prompt_id}\nsecond line")
        ctx.emit("generations", generate(t))


def settings(kafka: KafkaSettings, run_id: str, *, subscription: Mapping[str, Any] = {},
             consume: Mapping[str, Any] = {}, handling: Mapping[str, Any] = {},
             delivery: Mapping[str, Any] = {}) -> ServiceSettings:
    """A test service's settings: group ``svc-<run>`` on the run's ``tasks``, 0.2 s polls, a 5 s
    grace; each group's fields given override those."""
    return ServiceSettings(
        run_id=run_id,
        kafka=kafka,
        subscription=Subscription(**{"group_id": f"svc-{run_id}", "topics": ["tasks"], **subscription}),
        consume=Consume(**{"poll_timeout_s": 0.2, **consume}),
        handling=Handling(**{"shutdown_grace_s": 5.0, **handling}),
        delivery=Delivery(**delivery),
    )


async def run_until(runner: Runner, cond: Callable[[Counters], bool], timeout_s: float = 20.0) -> Counters:
    """Run ``runner`` until ``cond(counters)`` holds, then stop it; return the final counters."""
    job = asyncio.create_task(runner.run(install_signal_handlers=False))
    deadline = time.monotonic() + timeout_s
    try:
        while not cond(runner.counters):
            assert not job.done(), (
                f"service ended early: {job.exception() if not job.cancelled() else 'cancelled'}"
            )
            assert time.monotonic() < deadline, f"condition not reached: {runner.counters}"
            await asyncio.sleep(0.05)
    finally:
        runner.stop.set()
    return await asyncio.wait_for(job, timeout=30)


async def read_topic(
    kafka: KafkaSettings, topic: str, n: int, timeout_s: float = 15.0, settle_s: float = 0.5
) -> list[Record]:
    out: list[Record] = []
    async with Consumer(kafka, group_id=None, topics=[topic]) as c:
        deadline = time.monotonic() + timeout_s
        while len(out) < n and time.monotonic() < deadline:
            out += await c.getmany(timeout_ms=200)
        end = time.monotonic() + settle_s
        while time.monotonic() < end:
            out += await c.getmany(timeout_ms=100)
    return out


async def committed(kafka: KafkaSettings, group: str, topic: str, partitions: int) -> dict[int, int | None]:
    async with Consumer(kafka, group_id=group, topics=[topic]) as c:
        return {p: await c.committed(TopicPartition(topic, p)) for p in range(partitions)}


async def assert_committed_to_end(kafka: KafkaSettings, group: str, topic: str, partitions: int) -> None:
    """The group's committed offsets reach the end of every partition (polled briefly: offsets
    committed in a transaction show up once the coordinator has written the markers)."""
    ends = await end_offsets(kafka, topic, partitions)
    want = {p: (e or None) for p, e in ends.items()}
    deadline = time.monotonic() + 10
    while (got := await committed(kafka, group, topic, partitions)) != want:
        assert time.monotonic() < deadline, f"committed {got} != end {want}"
        await asyncio.sleep(0.1)


async def end_offsets(kafka: KafkaSettings, topic: str, partitions: int) -> dict[int, int]:
    async with Consumer(kafka, group_id=None, topics=[topic]) as c:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        ends = await c.raw.end_offsets(tps)
    return {tp.partition: off for tp, off in ends.items()}


# --------------------------------------------------------------------------- the happy path


async def test_consume_handle_produce_commit(kafka: KafkaSettings, run_id: str, topics: list[str]) -> None:
    n = 40
    tasks = [task(run_id, i) for i in range(n)]
    metas = await publish(kafka, None, "tasks", tasks)  # logical name, run from the events
    assert len(metas) == n
    svc = Rollout()
    s = settings(kafka, run_id, handling={"max_concurrency": 4}, consume={"batch_max_records": 16})
    counters = await run_until(Runner(svc, s), lambda c: c.processed >= n)
    assert counters == Counters(processed=n, emitted=n)
    gens = await read_topic(kafka, topic_name(run_id, "generations"), n)
    assert sorted(r.event.task.sample_id for r in gens) == sorted(t.sample_id for t in tasks)
    # deterministic output ids: derived from the task's id and the service
    assert {r.event.event_id for r in gens} == {derive_event_id(t.event_id, "rollout", 0) for t in tasks}
    assert all(r.key == r.event.task.sample_id.encode() for r in gens)  # registry key
    # everything handled is committed: the group is at the end of every partition
    tasks_t = topic_name(run_id, "tasks")
    await assert_committed_to_end(kafka, s.subscription.group_id, tasks_t, 4)


PATTERN = Subscription(group_id="g", topic_pattern="^rs\\..*")


BAD_SETTINGS: list[tuple[Callable[[], object], str]] = [
    (lambda: ServiceSettings(subscription=Subscription(group_id="g")),
     "set exactly one of subscription.topics / subscription.topic_pattern"),
    (lambda: ServiceSettings(subscription=Subscription(group_id="g", topics=["x"], topic_pattern="x")),
     "set exactly one of subscription.topics / subscription.topic_pattern"),
    (lambda: ServiceSettings(subscription=Subscription(group_id="g", topics=["tasks"])), "logical topic names need run_id"),
    (lambda: ServiceSettings(subscription=Subscription(group_id="g", topic_pattern="x", observed_topics=["tasks"])),
     "logical topic names need run_id"),
    (lambda: ServiceSettings(subscription=Subscription(group_id=None, topic_pattern="x"),
                             delivery=Delivery(transactional=True)),
     "delivery.transactional needs a subscription.group_id and delivery.commit='after_effect'"),
    (lambda: ServiceSettings(subscription=PATTERN, delivery=Delivery(transactional=True, commit="by_service")),
     "delivery.transactional needs a subscription.group_id and delivery.commit='after_effect'"),
    (lambda: Subscription(group_id="", topic_pattern="x"), "Subscription.group_id must not be empty, got ''"),
    (lambda: Handling(max_concurrency=0), "Handling.max_concurrency must be >= 1, got 0"),
    (lambda: Handling(handler_retries=-1), "Handling.handler_retries must be >= 0, got -1"),
    (lambda: Consume(fetch_min_bytes=0), "Consume.fetch_min_bytes must be >= 1, got 0"),
    (lambda: Consume(fetch_max_wait_ms=-1), "Consume.fetch_max_wait_ms must be >= 0, got -1"),
    (lambda: Consume(poll_timeout_s=-0.5), "Consume.poll_timeout_s must be >= 0, got -0.5"),
    (lambda: Consume(session_timeout_s=0), "Consume.session_timeout_s must be > 0, got 0"),
    (lambda: Delivery(txn_interval_s=-1.0), "Delivery.txn_interval_s must be >= 0, got -1.0"),
    (lambda: Delivery(dedupe_capacity=0), "Delivery.dedupe_capacity must be >= 1, got 0"),
]


@pytest.mark.parametrize(("make", "error"), BAD_SETTINGS, ids=[e for _, e in BAD_SETTINGS])
def test_bad_settings_are_refused_with_one_line(make: Callable[[], object], error: str) -> None:
    with pytest.raises(ValueError, match=f"^(ServiceSettings: )?{re.escape(error)}$"):
        make()


def test_decoded_settings_are_strict_and_bounded() -> None:
    # decoded settings: msgspec applies the same bounds, and no unknown field passes
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.convert({"subscription": {"group_id": "g", "topic_pattern": "x"}, "bogus": 1}, ServiceSettings)
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.convert({"subscription": {"group_id": "g", "topic_pattern": "x", "max_concurrency": 2}}, ServiceSettings)
    with pytest.raises(msgspec.ValidationError, match=r">= 1 - at `\$.handling.max_concurrency`"):
        msgspec.convert({"subscription": {"group_id": "g", "topic_pattern": "x"}, "handling": {"max_concurrency": 0}},
                        ServiceSettings)
    decoded = msgspec.convert({"subscription": {"group_id": "g", "topic_pattern": "x"}, "consume": {"poll_timeout_s": 1}},
                              ServiceSettings)
    assert decoded.consume.poll_timeout_s == 1 and decoded.handling == Handling() and decoded.runtime_commits


def test_the_service_kind_and_the_settings_pick_the_loop() -> None:
    """Per record, batched or transactional: one loop each, holding the runner's one Kafka I/O."""
    kafka = KafkaSettings(bootstrap="127.0.0.1:9")  # never connected
    plain = ServiceSettings(subscription=PATTERN, kafka=kafka)
    exactly_once = ServiceSettings(subscription=PATTERN, kafka=kafka, delivery=Delivery(transactional=True))
    for service, s, kind in [(Rollout(), plain, RecordLoop), (Collect(), plain, BatchLoop),
                             (Scorer(), exactly_once, TxnLoop)]:
        runner = Runner(service, s)
        assert type(runner.loop) is kind and runner.loop.io is runner.io
        assert runner.producer is runner.io.producer and runner.consumer is runner.io.consumer
        assert (runner.io.transactional_id or "").startswith("g.") == (kind is TxnLoop)
    with pytest.raises(ValueError, match="collect: transactional mode takes a record handler, not handle_batch"):
        Runner(Collect(), exactly_once)


async def test_fetch_settings_reach_the_consumer() -> None:
    """A service's fetch_min_bytes / fetch_max_wait_ms are what its aiokafka consumer is built with
    (the recorder's larger ones included)."""
    from services.recorder import FETCH_MAX_WAIT_MS, FETCH_MIN_BYTES, Recorder, RecorderSettings

    default = Runner(FunctionService("f", lambda rec, ctx: asyncio.sleep(0)),
                     ServiceSettings(subscription=PATTERN))
    assert (default.consumer._kwargs["fetch_min_bytes"], default.consumer._kwargs["fetch_max_wait_ms"]) == (1, 100)
    recorder = Recorder(RecorderSettings(dsn="chdb:///nowhere"))
    runner = Runner(recorder, recorder.service_settings())
    assert runner.consumer._kwargs["fetch_min_bytes"] == FETCH_MIN_BYTES > 1
    assert runner.consumer._kwargs["fetch_max_wait_ms"] == FETCH_MAX_WAIT_MS


# --------------------------------------------------------------------------- failures go to dlq


async def test_undecodable_bytes_go_to_dlq_and_next_message_is_processed(
    kafka: KafkaSettings, run_id: str, topics: list[str]
) -> None:
    tasks_t = topic_name(run_id, "tasks")
    good = task(run_id, 1)
    async with Producer(kafka) as p:
        # same key => same partition, so "next message" really is the next offset
        bad_md = await (await p.send_raw(tasks_t, b"\xc1 definitely not msgpack", good.sample_id))
        wrong_md = await (await p.send_raw(tasks_t, p.encode(generate(good)), good.sample_id))  # wrong type
        good_md = await p.send_and_wait(tasks_t, good)
    assert bad_md.partition == good_md.partition and good_md.offset == bad_md.offset + 2
    svc = Rollout()
    counters = await run_until(Runner(svc, settings(kafka, run_id)), lambda c: c.processed + c.failed >= 3)
    assert counters == Counters(processed=1, failed=2, dead_lettered=2, emitted=1)
    assert svc.started == [good.sample_id]
    dlq = await read_topic(kafka, topic_name(run_id, "dlq"), 2)
    letters: list[DeadLetter] = sorted((r.event for r in dlq), key=lambda d: d.offset)
    assert [(d.stage, d.offset, d.source_topic) for d in letters] == [
        ("decode", bad_md.offset, tasks_t),
        ("decode", wrong_md.offset, tasks_t),
    ]
    assert letters[0].value == b"\xc1 definitely not msgpack"
    assert letters[0].key == good.sample_id.encode()
    assert "DecodeError" in letters[0].error and "\n" not in letters[0].error
    assert "Generation" in letters[1].error  # the tag did not match the topic's union
    assert letters[0].service == f"svc-{run_id}"
    gens = await read_topic(kafka, topic_name(run_id, "generations"), 1)
    assert [r.event.task for r in gens] == [good]


async def test_handler_error_is_retried_then_dead_lettered(
    kafka: KafkaSettings, run_id: str, topics: list[str]
) -> None:
    await publish(kafka, None, "tasks", [task(run_id, 1), task(run_id, 2)])
    svc = Rollout(fail_on={"p1"})
    s = settings(kafka, run_id, handling={"handler_retries": 2, "retry_backoff_s": 0.01})
    counters = await run_until(Runner(svc, s), lambda c: c.processed + c.failed >= 2)
    assert counters == Counters(processed=1, failed=1, dead_lettered=1, emitted=1)
    assert svc.calls == 1 + 3  # p2 once, p1 three times
    dlq = await read_topic(kafka, topic_name(run_id, "dlq"), 1)
    assert len(dlq) == 1
    d: DeadLetter = dlq[0].event
    assert d.stage == "handle"
    assert (d.sample_id, d.group_id) == ("g1/0", "g1")  # named from the decoded task
    assert d.error.startswith("RuntimeError: engine exploded on p1") and "\n" not in d.error
    rec_value = d.value
    assert rec_value is not None
    # the raw bytes are kept: the dead letter decodes back to the original task
    assert msgspec.msgpack.decode(rec_value, type=RolloutTask).prompt_id == "p1"


# --------------------------------------------------------------------------- dedupe


async def test_redelivered_event_id_is_skipped(kafka: KafkaSettings, run_id: str, topics: list[str]) -> None:
    t = task(run_id, 1)
    await publish(kafka, None, "tasks", [t, t, task(run_id, 2)])  # the same event twice
    svc = Rollout()
    counters = await run_until(
        Runner(svc, settings(kafka, run_id)), lambda c: c.processed + c.duplicates >= 3
    )
    assert counters == Counters(processed=2, duplicates=1, emitted=2)
    assert sorted(svc.started) == ["g1/0", "g2/0"]


async def test_crash_before_commit_redelivers_but_effect_stays_single(
    kafka: KafkaSettings, run_id: str, topics: list[str]
) -> None:
    """Instance A handles a task and its output is acknowledged, then A dies before committing.
    Instance B (same group) gets the task again and handles it again. Both outputs carry the same
    derived event_id, so a downstream consumer deduping by event_id sees one effect."""
    tasks_t = topic_name(run_id, "tasks")
    s = settings(kafka, run_id)
    t = task(run_id, 7)
    await publish(kafka, None, "tasks", [t])

    # A: the runtime's handling, but the process "dies" between the ack and the commit
    a_runner = Runner(Rollout(), s)
    async with a_runner.producer, Consumer(kafka, group_id=s.subscription.group_id, topics=[tasks_t]) as a:
        recs: list[Record] = []
        deadline = time.monotonic() + 15
        while not recs and time.monotonic() < deadline:
            recs = await a.getmany(timeout_ms=200)
        assert [r.event for r in recs] == [t]
        ctx = Context(a_runner, recs[0])
        await a_runner.service.handle(recs[0], ctx)
        for o in ctx.outputs:
            await (await a_runner.producer.send_raw(o.topic, o.value, o.key))
        # no commit: leave abruptly
    assert await committed(kafka, s.subscription.group_id, tasks_t, 4) == dict.fromkeys(range(4))

    # B: a fresh instance of the service in the same group
    b = Rollout()
    counters = await run_until(Runner(b, s), lambda c: c.processed >= 1)
    assert counters == Counters(processed=1, emitted=1)
    assert b.started == [t.sample_id]

    gens = await read_topic(kafka, topic_name(run_id, "generations"), 2)
    assert len(gens) == 2  # the effect was produced twice (at least once) ...
    dedupe = Deduper(100)
    effects = [r for r in gens if not dedupe.check_and_add(r.event.event_id)]
    assert len(effects) == 1  # ... and is one effect by event_id
    assert effects[0].event.event_id == derive_event_id(t.event_id, "rollout", 0)
    await assert_committed_to_end(kafka, s.subscription.group_id, tasks_t, 4)


# --------------------------------------------------------------------------- graceful stop


async def test_stop_finishes_in_flight_handlers_and_commits(
    kafka: KafkaSettings, run_id: str, topics: list[str]
) -> None:
    n = 6
    await publish(kafka, None, "tasks", [task(run_id, i) for i in range(n)])
    svc = Rollout(delay_s=0.8)
    s = settings(kafka, run_id, handling={"max_concurrency": n, "shutdown_grace_s": 5.0})
    runner = Runner(svc, s)
    job = asyncio.create_task(runner.run(install_signal_handlers=False))
    deadline = time.monotonic() + 15
    while len(svc.started) < n:  # all n handler calls are in flight, none finished
        assert time.monotonic() < deadline and not job.done()
        await asyncio.sleep(0.02)
    assert runner.counters.processed == 0
    runner.stop.set()  # what SIGTERM does
    counters = await asyncio.wait_for(job, 15)
    assert counters == Counters(processed=n, emitted=n)
    tasks_t = topic_name(run_id, "tasks")
    await assert_committed_to_end(kafka, s.subscription.group_id, tasks_t, 4)
    assert len(await read_topic(kafka, topic_name(run_id, "generations"), n)) == n


async def test_stop_after_grace_cancels_and_leaves_work_uncommitted(
    kafka: KafkaSettings, run_id: str, topics: list[str]
) -> None:
    """Handlers slower than the grace period are cancelled; their records are not committed and
    the next instance handles them."""
    t = task(run_id, 1)
    await publish(kafka, None, "tasks", [t])
    slow = Rollout(delay_s=30)
    s = settings(kafka, run_id, handling={"shutdown_grace_s": 0.3})
    runner = Runner(slow, s)
    job = asyncio.create_task(runner.run(install_signal_handlers=False))
    deadline = time.monotonic() + 15
    while not slow.started:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    runner.stop.set()
    t0 = time.monotonic()
    counters = await asyncio.wait_for(job, 10)
    assert time.monotonic() - t0 < 3
    assert counters == Counters()
    fast = Rollout()
    counters = await run_until(Runner(fast, s), lambda c: c.processed >= 1)
    assert counters.processed == 1 and fast.started == [t.sample_id]


async def test_unreachable_kafka_raises_bus_error() -> None:
    s = ServiceSettings(subscription=PATTERN, kafka=KafkaSettings(bootstrap="127.0.0.1:1", connect_timeout_s=1.0))
    t0 = time.monotonic()
    with pytest.raises(BusError, match=r"^cannot reach Kafka at 127.0.0.1:1 within 1 s"):
        await run_service(
            FunctionService("x", lambda rec, ctx: asyncio.sleep(0)), s, install_signal_handlers=False
        )
    assert time.monotonic() - t0 < 4


# --------------------------------------------------------------------------- exactly once


class Scorer(Service):
    name = "reward-router"

    def __init__(self) -> None:
        self.calls = 0

    async def handle(self, rec: Record, ctx: Context) -> None:
        self.calls += 1
        g: Generation = rec.event
        ctx.emit(
            "scored", ScoredSample(run_id=g.run_id, generation=g, reward=1.0, policy_version=g.policy_version)
        )


async def test_transactional_service_scores_each_generation_once(
    kafka: KafkaSettings, run_id: str, topics: list[str]
) -> None:
    n = 25
    gens = [generate(task(run_id, i)) for i in range(n)]
    await publish(kafka, None, "generations", gens)
    # a garbage message on the input is dead-lettered inside the same transactions
    async with Producer(kafka) as p:
        await (await p.send_raw(topic_name(run_id, "generations"), b"\x00junk", b"k"))
    scorer = Scorer()
    s = settings(kafka, run_id, subscription={"topics": ["generations"]}, delivery={"transactional": True},
                 consume={"batch_max_records": 10}, handling={"max_concurrency": 4})
    counters = await run_until(Runner(scorer, s), lambda c: c.processed + c.failed >= n + 1)
    assert counters == Counters(processed=n, failed=1, dead_lettered=1, emitted=n)

    scored = await read_topic(kafka, topic_name(run_id, "scored"), n)  # read_committed
    assert len(scored) == n
    assert sorted(r.event.generation.event_id for r in scored) == sorted(g.event_id for g in gens)
    assert all(r.key == r.event.generation.task.group_id.encode() for r in scored)
    assert len(await read_topic(kafka, topic_name(run_id, "dlq"), 1)) == 1
    gens_t = topic_name(run_id, "generations")
    await assert_committed_to_end(kafka, s.subscription.group_id, gens_t, 4)
    # a restart of the service finds nothing left to do
    again = Scorer()
    stop = asyncio.Event()
    job = asyncio.create_task(run_service(again, s, stop=stop, install_signal_handlers=False))
    await asyncio.sleep(2.0)
    stop.set()
    assert await asyncio.wait_for(job, 15) == Counters()
    assert again.calls == 0


async def test_transactional_work_cut_off_by_a_stop_is_done_once_by_the_next_instance(
    kafka: KafkaSettings, run_id: str, topics: list[str]
) -> None:
    """Stop while one record of a transactional service is still being handled: the records that
    finished are committed with their outputs, the cut-off one produces nothing, and the next
    instance handles exactly what is left: every output exactly once."""
    metas = await publish(kafka, None, "generations", [generate(task(run_id, i)) for i in range(3)])

    class SlowScorer(Scorer):
        async def handle(self, rec: Record, ctx: Context) -> None:
            await super().handle(rec, ctx)
            if rec.event.task.prompt_id == "p2":
                await asyncio.sleep(30)

    s = settings(kafka, run_id, subscription={"topics": ["generations"]}, delivery={"transactional": True},
                 handling={"shutdown_grace_s": 0.3, "max_concurrency": 3})
    slow = SlowScorer()
    runner = Runner(slow, s)
    job = asyncio.create_task(runner.run(install_signal_handlers=False))
    deadline = time.monotonic() + 15
    while slow.calls < 3:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    runner.stop.set()
    first = await asyncio.wait_for(job, 10)
    assert first.processed == first.emitted == 2  # p2 was cut off; p0, p1 committed, even behind p2
    visible = await read_topic(kafka, topic_name(run_id, "scored"), first.emitted, timeout_s=3.0)
    assert sorted(r.event.generation.task.prompt_id for r in visible) == ["p0", "p1"]

    # the next instance skips what was committed after p2 in its partition (the ahead list)
    behind = sum(m.partition == metas[2].partition and m.offset > metas[2].offset for m in metas[:2])
    again = Scorer()
    second = Runner(again, s)
    counters = await run_until(second, lambda c: c.processed >= 1 and c.duplicates >= behind)
    assert (counters.processed, counters.emitted, counters.failed) == (1, 1, 0)
    assert behind <= counters.duplicates <= behind * (1 + second.revocations)  # a rebalance re-reads
    assert again.calls <= 1 + second.revocations
    scored = await read_topic(kafka, topic_name(run_id, "scored"), 3)
    assert sorted(r.event.generation.task.prompt_id for r in scored) == ["p0", "p1", "p2"]
    await assert_committed_to_end(kafka, s.subscription.group_id or "", topic_name(run_id, "generations"), 4)


async def test_records_after_a_slow_one_of_their_partition_are_committed_at_once(
    kafka: KafkaSettings, run_id: str, topics: list[str]
) -> None:
    """No head-of-line blocking in a partition: while its first record is slow, the records after
    it are committed with their outputs (visible to read_committed readers), and the committed
    offset stays at the slow one, with the others in its ahead list. A crash-like stop cuts the
    slow one off; the next instance handles only that one and skips the rest: exactly once."""
    gens = [generate(task(run_id, i)) for i in range(6)]
    gens_t = topic_name(run_id, "generations")
    async with Producer(kafka) as p:  # all in partition 1, p0 first
        metas = [await (await p.send_raw(gens_t, p.encode(g), b"k", partition=1)) for g in gens]
    base = metas[0].offset
    gate = asyncio.Event()

    class FirstSlow(Scorer):
        async def handle(self, rec: Record, ctx: Context) -> None:
            await super().handle(rec, ctx)
            if rec.event.task.prompt_id == "p0":
                await asyncio.wait_for(gate.wait(), 30)

    s = settings(kafka, run_id, subscription={"topics": ["generations"]},
                 delivery={"transactional": True, "txn_interval_s": 0.05},
                 handling={"max_concurrency": 8, "shutdown_grace_s": 0.3})
    runner = Runner(FirstSlow(), s)
    job = asyncio.create_task(runner.run(install_signal_handlers=False))
    try:
        early = await read_topic(kafka, topic_name(run_id, "scored"), 5, timeout_s=10.0)
        assert sorted(r.event.generation.task.prompt_id for r in early) == ["p1", "p2", "p3", "p4", "p5"]
        assert not job.done() and not gate.is_set()
        async with Consumer(kafka, group_id=s.subscription.group_id, topics=[gens_t]) as c:
            got = await c.committed_with_metadata({TopicPartition(gens_t, 1)})
        assert got == {TopicPartition(gens_t, 1): (base, "rs-ahead1:1-5")}
    finally:
        runner.stop.set()  # p0 is cut off after shutdown_grace_s: nothing of it is committed
        first = await asyncio.wait_for(job, 10)
    assert (first.processed, first.emitted, first.failed) == (5, 5, 0)
    # a rebalance of the busy broker re-reads the partition: p1..p5 are skipped, not handled again
    assert first.duplicates <= 5 * runner.revocations

    again = Scorer()
    second = Runner(again, s)
    counters = await run_until(second, lambda c: c.processed >= 1 and c.duplicates >= 5)
    assert (counters.processed, counters.emitted, counters.failed) == (1, 1, 0)
    assert 5 <= counters.duplicates <= 5 * (1 + second.revocations)
    assert again.calls <= 1 + second.revocations  # p0 (again only if a rebalance cut it off); never p1..p5
    scored = await read_topic(kafka, topic_name(run_id, "scored"), 7, timeout_s=3.0)
    assert sorted(r.event.generation.task.prompt_id for r in scored) == [f"p{i}" for i in range(6)]
    await assert_committed_to_end(kafka, s.subscription.group_id or "", gens_t, 4)
    async with Consumer(kafka, group_id=s.subscription.group_id, topics=[gens_t]) as c:
        got = await c.committed_with_metadata({TopicPartition(gens_t, 1)})
    assert got == {TopicPartition(gens_t, 1): (metas[-1].offset + 1, "")}


async def test_finished_records_do_not_wait_out_a_long_transaction_interval(
    kafka: KafkaSettings, run_id: str, topics: list[str]
) -> None:
    """With ``txn_interval_s`` 4 s, a record whose handler takes 0.3 s, alone on a quiet input, is
    committed about 1 s (a quarter interval) after the previous transaction at most: the poll ends
    when the handler finishes, and a quiet input commits without waiting out the interval. Before,
    each of these waited for the interval (about 4 s)."""
    gens_t, scored_t = topic_name(run_id, "generations"), topic_name(run_id, "scored")
    finished: list[float] = []

    class SlowScorer(Scorer):
        async def handle(self, rec: Record, ctx: Context) -> None:
            await asyncio.sleep(0.3)
            await super().handle(rec, ctx)
            finished.append(time.monotonic())

    s = settings(kafka, run_id, subscription={"topics": ["generations"]},
                 delivery={"transactional": True, "txn_interval_s": 4.0}, handling={"max_concurrency": 4},
                 consume={"poll_timeout_s": 5.0})
    runner = Runner(SlowScorer(), s)
    job = asyncio.create_task(runner.run(install_signal_handlers=False))
    try:
        async with Producer(kafka) as p, Consumer(kafka, group_id=None, topics=[scored_t]) as reader:
            for i in range(2):
                await (await p.send_raw(gens_t, p.encode(generate(task(run_id, i))), b"k"))
                got: list[Record] = []
                deadline = time.monotonic() + 15
                while not got:
                    assert time.monotonic() < deadline and not job.done(), "the scored sample never became visible"
                    got = await reader.getmany(timeout_ms=50)
                visible = time.monotonic()
                assert len(finished) == i + 1
                assert visible - finished[-1] < 2.5, f"record {i}: committed {visible - finished[-1]:.2f} s after it finished"
    finally:
        runner.stop.set()
        counters = await asyncio.wait_for(job, 10)
    assert (counters.processed, counters.emitted) == (2, 2)


async def test_a_slow_record_does_not_hold_back_the_other_partitions(
    kafka: KafkaSettings, run_id: str, topics: list[str]
) -> None:
    """No batch barrier: while one record sleeps, records of the other partitions are committed
    (visible to read_committed readers) and later polls are handled."""
    gens = [generate(task(run_id, i)) for i in range(12)]
    await publish(kafka, None, "generations", gens)
    slow_part: list[int] = []

    class OneSlow(Scorer):
        async def handle(self, rec: Record, ctx: Context) -> None:
            await super().handle(rec, ctx)
            if rec.event.task.prompt_id == "p0":
                slow_part.append(rec.partition)
                await asyncio.sleep(6)

    s = settings(kafka, run_id, subscription={"topics": ["generations"]}, delivery={"transactional": True},
                 consume={"batch_max_records": 12}, handling={"max_concurrency": 8, "shutdown_grace_s": 10})
    runner = Runner(OneSlow(), s)
    job = asyncio.create_task(runner.run(install_signal_handlers=False))
    try:
        others = [g for g in gens if g.task.prompt_id != "p0"]
        early = await read_topic(kafka, topic_name(run_id, "scored"), 1, timeout_s=4.0)
        assert early, "nothing committed while one record was slow"
        assert all(r.partition != slow_part[0] or r.event.generation.task.prompt_id != "p0" for r in early)
        done = await read_topic(kafka, topic_name(run_id, "scored"), len(gens), timeout_s=20.0)
        assert sorted(r.event.generation.event_id for r in done) == sorted(g.event_id for g in gens)
        assert len(others) == len(gens) - 1
    finally:
        runner.stop.set()
        await asyncio.wait_for(job, 20)


# --------------------------------------------------------------------------- rebalance


async def test_rebalance_between_two_instances_loses_nothing(
    kafka: KafkaSettings, run_id: str, topics: list[str]
) -> None:
    """A second instance joins mid-stream: partitions move, in-flight work of revoked partitions
    is finished and committed first, and every task ends up handled (effects unique by id)."""
    n = 60
    tasks = [task(run_id, i) for i in range(n)]
    await publish(kafka, None, "tasks", tasks[: n // 2])
    # session 6 s (the broker's minimum) => heartbeats every 2 s, so the rebalance is prompt
    s = settings(kafka, run_id, handling={"max_concurrency": 2}, consume={"batch_max_records": 5, "session_timeout_s": 6.0})
    a_svc, b_svc = Rollout(delay_s=0.1), Rollout(delay_s=0.1)
    a, b = Runner(a_svc, s), Runner(b_svc, s)
    a_job = asyncio.create_task(a.run(install_signal_handlers=False))
    deadline = time.monotonic() + 20
    while a.counters.processed < 2:
        assert time.monotonic() < deadline and not a_job.done()
        await asyncio.sleep(0.02)
    b_job = asyncio.create_task(b.run(install_signal_handlers=False))
    while not (b.consumer.started and b.consumer.assignment()):  # B got partitions from A
        assert time.monotonic() < deadline and not b_job.done()
        await asyncio.sleep(0.02)
    await publish(kafka, None, "tasks", tasks[n // 2 :])
    gens_t = topic_name(run_id, "generations")
    seen: set[str] = set()
    async with Consumer(kafka, group_id=None, topics=[gens_t]) as down:
        while len(seen) < n:
            assert time.monotonic() < deadline + 20, f"only {len(seen)} of {n} effects"
            seen |= {r.event.event_id for r in await down.getmany(timeout_ms=200)}
    a.stop.set()
    b.stop.set()
    ca, cb = await asyncio.wait_for(asyncio.gather(a_job, b_job), 20)
    assert seen == {derive_event_id(t.event_id, "rollout", 0) for t in tasks}
    assert ca.failed == cb.failed == 0
    assert ca.processed > 0 and cb.processed > 0
    assert a.revocations >= 1  # A really gave partitions up
    assert ca.processed + cb.processed >= n  # redelivery after a failed commit may add a few
    tasks_t = topic_name(run_id, "tasks")
    await assert_committed_to_end(kafka, s.subscription.group_id, tasks_t, 4)


async def test_pattern_subscription_routes_dead_letters_to_the_records_run(
    kafka: KafkaSettings, run_id: str, topics: list[str]
) -> None:
    """A cross-run service (pattern, no run_id): failures go to the dlq of the record's own run."""
    tasks_t = topic_name(run_id, "tasks")
    async with Producer(kafka) as p:
        await (await p.send_raw(tasks_t, b"\xc1", b"k"))
        await p.send_and_wait(tasks_t, task(run_id, 1))
    seen: list[str] = []

    async def handle(rec: Record, ctx: Context) -> None:
        seen.append(rec.topic)
        assert ctx.run_id == run_id
        ctx.emit("control", Pause(run_id=run_id, reason="x"))

    s = ServiceSettings(
        subscription=Subscription(group_id=f"rec-{run_id}", topic_pattern=rf"^rs\.{run_id}\.tasks$"),
        kafka=kafka,
        consume=Consume(poll_timeout_s=0.2),
    )
    counters = await run_until(
        Runner(FunctionService("recorder", handle), s), lambda c: c.processed + c.failed >= 2
    )
    assert counters == Counters(processed=1, failed=1, dead_lettered=1, emitted=1)
    assert seen == [tasks_t]
    assert len(await read_topic(kafka, topic_name(run_id, "dlq"), 1)) == 1
    assert len(await read_topic(kafka, topic_name(run_id, "control"), 1)) == 1


def test_next_offsets_and_derive_ids() -> None:
    recs = [
        Record("t", 0, 5, None, b"", None, "x", 0.0),
        Record("t", 0, 7, None, b"", None, "x", 0.0),
        Record("t", 1, 2, None, b"", None, "x", 0.0),
    ]
    assert next_offsets(recs) == {TopicPartition("t", 0): 8, TopicPartition("t", 1): 3}
    a = derive_event_id("e1", "svc", 0)
    assert a == derive_event_id("e1", "svc", 0) and len(a) == 32
    assert (
        len(
            {
                a,
                derive_event_id("e1", "svc", 1),
                derive_event_id("e2", "svc", 0),
                derive_event_id("e1", "x", 0),
            }
        )
        == 4
    )


async def test_busy_instance_stays_in_group_past_max_poll_interval(
    kafka: KafkaSettings, run_id: str, topics: list[str]
) -> None:
    """All slots busy longer than max_poll_interval: the runtime keeps polling (paused), so the
    instance is not evicted, its commit succeeds and nothing is handled twice."""
    t = task(run_id, 1)
    await publish(kafka, None, "tasks", [t, task(run_id, 2)])
    svc = Rollout(delay_s=1.6)
    s = settings(kafka, run_id, handling={"max_concurrency": 1},
                 consume={"batch_max_records": 1, "max_poll_interval_s": 1.0, "session_timeout_s": 6.0})
    runner = Runner(svc, s)
    counters = await run_until(runner, lambda c: c.processed >= 2, timeout_s=20)
    assert counters == Counters(processed=2, emitted=2)
    assert runner.revocations == 0  # never left the group, so never lost its partitions
    assert sorted(svc.started) == ["g1/0", "g2/0"]
    await assert_committed_to_end(kafka, s.subscription.group_id, topic_name(run_id, "tasks"), 4)


async def test_sigterm_stops_gracefully(kafka: KafkaSettings, run_id: str, topics: list[str]) -> None:
    """A real SIGTERM to this process (pytest runs the loop in the main thread): the runtime's
    handler sets the stop event, the in-flight handler call finishes, and its offset is committed."""
    assert threading.current_thread() is threading.main_thread(), "pytest runs tests in the main thread"
    await publish(kafka, None, "tasks", [task(run_id, 1)])
    svc = Rollout(delay_s=0.5)
    s = settings(kafka, run_id)
    before = signal.getsignal(signal.SIGTERM)
    job = asyncio.create_task(run_service(svc, s))  # installs SIGTERM/SIGINT handlers
    deadline = time.monotonic() + 15
    while not svc.started:
        assert time.monotonic() < deadline and not job.done()
        await asyncio.sleep(0.02)
    os.kill(os.getpid(), signal.SIGTERM)
    counters = await asyncio.wait_for(job, 10)
    assert counters == Counters(processed=1, emitted=1)
    await assert_committed_to_end(kafka, s.subscription.group_id, topic_name(run_id, "tasks"), 4)
    # the runtime's handlers are gone again: SIGTERM is handled as before the service ran
    assert signal.getsignal(signal.SIGTERM) == before


async def test_stop_does_not_start_fetched_records(
    kafka: KafkaSettings, run_id: str, topics: list[str]
) -> None:
    """Records already fetched but waiting for a slot are not started once stop is set; they stay
    uncommitted and the next instance handles exactly those."""
    tasks = [task(run_id, i) for i in range(5)]
    async with Producer(kafka) as p:  # one partition (same key), so the order is fixed
        for t in tasks:
            await p.send_and_wait(topic_name(run_id, "tasks"), t, key="same")
    svc = Rollout(delay_s=0.5)
    s = settings(kafka, run_id, handling={"max_concurrency": 1}, consume={"batch_max_records": 10})
    runner = Runner(svc, s)
    job = asyncio.create_task(runner.run(install_signal_handlers=False))
    deadline = time.monotonic() + 15
    while not svc.started:
        assert time.monotonic() < deadline and not job.done()
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.1)  # the others are fetched and queued behind the busy slot
    runner.stop.set()
    assert await asyncio.wait_for(job, 10) == Counters(processed=1, emitted=1)
    assert svc.started == [tasks[0].sample_id]
    rest = Rollout()
    counters = await run_until(Runner(rest, s), lambda c: c.processed >= 4)
    assert counters == Counters(processed=4, emitted=4)
    assert rest.started == [t.sample_id for t in tasks[1:]]


# --------------------------------------------------------------------------- dead letters name their sample


async def test_dead_letters_name_sample_and_group(kafka: KafkaSettings, run_id: str, topics: list[str]) -> None:
    """From the decoded event when the handler fails, else from a schemaless decode of the bytes,
    else from the record key (tasks are keyed by sample id, scored by group id)."""
    tasks_t, scored_t = topic_name(run_id, "tasks"), topic_name(run_id, "scored")
    good = task(run_id, 1)
    wrong_shape = msgspec.msgpack.encode({"kind": "RolloutTask", "run_id": run_id, "sample_id": "g7/2",
                                          "group_id": "g7", "index": "two"})  # a mistyped field
    async with Producer(kafka) as p:
        await (await p.send_raw(tasks_t, b"\xc1 junk", "g5/3"))
        await (await p.send_raw(tasks_t, wrong_shape, "other-key"))
        await (await p.send_raw(scored_t, b"\xc1 junk", "g9"))
    await publish(kafka, None, "tasks", [good])
    svc = Rollout(fail_on={"p1"})
    s = settings(kafka, run_id, subscription={"topics": ["tasks", "scored"]})
    counters = await run_until(Runner(svc, s), lambda c: c.failed >= 4)
    assert counters == Counters(failed=4, dead_lettered=4)
    letters = {(d.stage, d.sample_id, d.group_id) for d in
               (r.event for r in await read_topic(kafka, topic_name(run_id, "dlq"), 4))}
    assert letters == {("decode", "g5/3", "g5"), ("decode", "g7/2", "g7"), ("decode", "", "g9"),
                       ("handle", good.sample_id, good.group_id)}


# --------------------------------------------------------------------------- batch handlers


class Collect(BatchService):
    """Batch handler: one output per task, rejects prompts in ``reject``; records the batches."""

    name = "collect"

    def __init__(self, reject: set[str] | None = None, fail: bool = False) -> None:
        self.reject = reject or set()
        self.fail = fail
        self.batches: list[list[Record]] = []
        self.ticks = 0
        self.assigned: set[TopicPartition] = set()

    async def handle_batch(self, records: list[Record], ctx: BatchContext) -> None:
        if self.fail:
            raise RuntimeError("store is down")
        self.batches.append(records)
        for rec in records:
            if rec.event is None:
                continue
            if rec.event.prompt_id in self.reject:
                ctx.reject(rec, f"no such prompt {rec.event.prompt_id}")
            else:
                ctx.emit("generations", generate(rec.event), parent=rec)

    async def on_tick(self, runner: Runner) -> None:
        self.ticks += 1

    async def on_assigned(self, runner: Runner, tps: set[TopicPartition]) -> None:
        self.assigned |= tps


async def test_batch_handler_commits_after_its_outputs_and_dead_letters_rejects(
    kafka: KafkaSettings, run_id: str, topics: list[str]
) -> None:
    n = 30
    tasks = [task(run_id, i) for i in range(n)]
    await publish(kafka, None, "tasks", tasks)
    async with Producer(kafka) as p:
        await (await p.send_raw(topic_name(run_id, "tasks"), b"\xc1", "g99/0"))
    svc = Collect(reject={"p3"})
    s = settings(kafka, run_id, consume={"batch_max_records": 8})
    runner = Runner(svc, s)
    counters = await run_until(runner, lambda c: c.processed + c.failed >= n + 1)
    assert counters == Counters(processed=n - 1, failed=2, dead_lettered=2, emitted=n - 1)
    assert all(len(b) <= 8 for b in svc.batches) and sum(len(b) for b in svc.batches) == n
    assert svc.ticks >= len(svc.batches) - 1 and runner.polls >= len(svc.batches)  # a tick after each poll
    gens = await read_topic(kafka, topic_name(run_id, "generations"), n - 1)
    assert {r.event.event_id for r in gens} == {derive_event_id(t.event_id, "collect", 0) for t in tasks
                                                 if t.prompt_id != "p3"}
    dlq = {(r.event.stage, r.event.sample_id) for r in await read_topic(kafka, topic_name(run_id, "dlq"), 2)}
    assert dlq == {("handle", "g3/0"), ("decode", "g99/0")}
    await assert_committed_to_end(kafka, s.subscription.group_id, topic_name(run_id, "tasks"), 4)


async def test_failing_batch_handler_stops_the_service_uncommitted(
    kafka: KafkaSettings, run_id: str, topics: list[str]
) -> None:
    await publish(kafka, None, "tasks", [task(run_id, 1)])
    s = settings(kafka, run_id)
    with pytest.raises(RuntimeError, match="store is down"):
        await asyncio.wait_for(Runner(Collect(fail=True), s).run(install_signal_handlers=False), 20)
    assert await committed(kafka, s.subscription.group_id, topic_name(run_id, "tasks"), 4) == dict.fromkeys(range(4))


async def test_commit_by_service_resumes_at_the_services_positions(
    kafka: KafkaSettings, run_id: str, topics: list[str]
) -> None:
    """commit="by_service": the runtime commits nothing; the service commits what its state
    covers, and after a restart it seeks to its own positions in on_assigned."""
    tasks_t = topic_name(run_id, "tasks")
    async with Producer(kafka) as p:  # one partition, fixed order
        for i in range(6):
            await p.send_and_wait(tasks_t, task(run_id, i), key="same")
    tp = next(iter(await _partition_of(kafka, tasks_t, "same")))
    s = settings(kafka, run_id, delivery={"commit": "by_service"})

    class Saver(Collect):
        async def on_tick(self, runner: Runner) -> None:
            seen = sum(len(b) for b in self.batches)
            if seen >= 6:
                await runner.commit({tp: 2})  # "the checkpoint covers the first two"
                runner.stop.set()

    first = Saver()
    await asyncio.wait_for(Runner(first, s).run(install_signal_handlers=False), 30)
    assert await committed(kafka, s.subscription.group_id, tasks_t, 4) == {**dict.fromkeys(range(4)), tp.partition: 2}

    class Resume(Collect):
        async def on_assigned(self, runner: Runner, tps: set[TopicPartition]) -> None:
            if tp in tps:
                runner.consumer.seek(tp, 4)  # the service's own position wins over the committed one

    again = Resume()
    counters = await run_until(Runner(again, s), lambda c: c.processed >= 2)
    assert [r.event.prompt_id for b in again.batches for r in b] == ["p4", "p5"]
    assert counters.processed == 2
    assert await committed(kafka, s.subscription.group_id, tasks_t, 4) == {**dict.fromkeys(range(4)), tp.partition: 2}


async def _partition_of(kafka: KafkaSettings, topic: str, key: str) -> set[TopicPartition]:
    async with Consumer(kafka, group_id=None, topics=[topic]) as c:
        out: set[TopicPartition] = set()
        deadline = time.monotonic() + 10
        while not out and time.monotonic() < deadline:
            out = {r.tp for r in await c.getmany(timeout_ms=200) if r.key == key.encode()}
    return out


async def test_no_group_reads_everything_each_start_and_commits_nothing(
    kafka: KafkaSettings, run_id: str, topics: list[str]
) -> None:
    await publish(kafka, None, "tasks", [task(run_id, i) for i in range(5)])
    s = settings(kafka, run_id, subscription={"group_id": None, "topics": ["tasks", "dlq"]})
    for _ in range(2):
        svc = Collect()
        runner = Runner(svc, s)
        await run_until(runner, lambda c: c.processed >= 5)
        assert sorted(r.event.prompt_id for b in svc.batches for r in b) == [f"p{i}" for i in range(5)]
        assert svc.assigned == set()  # no group: no rebalance hooks
    with pytest.raises(ValueError, match=r"transactional needs a subscription\.group_id"):
        settings(kafka, run_id, subscription={"group_id": None}, delivery={"transactional": True})


async def test_idle_tick_can_stop_the_service(kafka: KafkaSettings, run_id: str, topics: list[str]) -> None:
    class Ticker(Collect):
        async def on_tick(self, runner: Runner) -> None:
            self.ticks += 1
            assert runner.last_polled == 0
            if self.ticks == 3:
                runner.stop.set()

    svc = Ticker()
    t0 = time.monotonic()
    assert await asyncio.wait_for(Runner(svc, settings(kafka, run_id)).run(install_signal_handlers=False), 20) \
        == Counters()
    assert svc.ticks == 3 and svc.batches == [] and time.monotonic() - t0 < 15


async def test_undecodable_records_to_the_handler_or_left_to_their_owner(
    kafka: KafkaSettings, run_id: str, topics: list[str]
) -> None:
    """handle_undecodable: the handler gets the bytes (the recorder); observed_topics: a bad
    record there is the owning group's to dead-letter (the feeder on tasks); dedupe=False: a
    repeated event_id reaches the handler again."""
    t = task(run_id, 1)
    await publish(kafka, None, "tasks", [t, t])
    async with Producer(kafka) as p:
        await (await p.send_raw(topic_name(run_id, "tasks"), b"\xc1", "g8/0"))
    raw = Collect()
    s = settings(kafka, run_id, subscription={"group_id": f"raw-{run_id}"}, handling={"handle_undecodable": True},
                 delivery={"dedupe": False})
    counters = await run_until(Runner(raw, s), lambda c: c.processed >= 3)
    assert counters.processed == 3 and counters.failed == 0 and counters.duplicates == 0
    got = [r for b in raw.batches for r in b]
    assert sum(r.event is None and r.error is not None for r in got) == 1
    observer = Collect()
    observing = settings(kafka, run_id, subscription={"group_id": None, "observed_topics": ["tasks"]})
    counters = await run_until(Runner(observer, observing),
                               lambda c: c.processed + c.ignored + c.duplicates >= 3)
    assert counters == Counters(processed=1, duplicates=1, ignored=1, emitted=1)
    assert await read_topic(kafka, topic_name(run_id, "dlq"), 1, timeout_s=1.0) == []


# --------------------------------------------------------------------------- a Kafka outage


def flaky(fn: Callable[..., object], failures: int, error: type[Exception]) -> Callable[..., object]:
    """``fn`` that raises ``error`` on its first ``failures`` calls (a broker that is away)."""
    left = [failures]

    async def wrapper(*args: object, **kw: object) -> object:
        if left[0] > 0:
            left[0] -= 1
            raise error("the broker is away (injected)")
        return await fn(*args, **kw)  # type: ignore[misc]

    return wrapper


async def test_outputs_are_sent_again_through_an_outage(kafka: KafkaSettings, run_id: str, topics: list[str]) -> None:
    from aiokafka.errors import KafkaConnectionError

    n = 6
    await publish(kafka, None, "tasks", [task(run_id, i) for i in range(n)])
    runner = Runner(Rollout(), settings(kafka, run_id, handling={"max_concurrency": 2}))
    runner.producer.send_raw = flaky(runner.producer.send_raw, 4, KafkaConnectionError)  # type: ignore[method-assign]
    counters = await run_until(runner, lambda c: c.processed >= n)
    assert counters == Counters(processed=n, emitted=n)
    assert runner.outage.outages >= 1 and runner.outage.active == 0
    gens = await read_topic(kafka, topic_name(run_id, "generations"), n)
    assert sorted(r.event.task.sample_id for r in gens) == sorted(task(run_id, i).sample_id for i in range(n))


async def test_an_outage_longer_than_the_bound_fails_the_service(run_id: str, kafka: KafkaSettings,
                                                                topics: list[str]) -> None:
    from aiokafka.errors import KafkaTimeoutError

    await publish(kafka, None, "tasks", [task(run_id, 0)])
    short = msgspec.structs.replace(kafka, outage_timeout_s=1.0)
    runner = Runner(Rollout(), settings(short, run_id))
    runner.producer.send_raw = flaky(runner.producer.send_raw, 10**6, KafkaTimeoutError)  # type: ignore[method-assign]
    t0 = time.monotonic()
    with pytest.raises(BusError, match=r"Kafka unavailable for \d+ s \(kafka.outage_timeout_s=1\)"):
        await asyncio.wait_for(runner.run(install_signal_handlers=False), 30)
    assert time.monotonic() - t0 < 20


async def test_a_failed_transaction_is_done_again_with_a_new_producer(
    kafka: KafkaSettings, run_id: str, topics: list[str]
) -> None:
    from aiokafka.errors import RequestTimedOutError

    n = 8
    gens = [generate(task(run_id, i)) for i in range(n)]
    await publish(kafka, None, "generations", gens)
    s = settings(kafka, run_id, subscription={"topics": ["generations"]}, delivery={"transactional": True},
                 consume={"batch_max_records": n})
    runner = Runner(Scorer(), s)
    first = runner.producer
    first.send_offsets_to_transaction = flaky(  # type: ignore[method-assign]
        first.send_offsets_to_transaction, 1, RequestTimedOutError)
    counters = await run_until(runner, lambda c: c.processed >= n)
    assert counters.processed == n and counters.emitted == n
    assert runner.producer is not first  # renewed: the same transactional id fenced the old one
    scored = await read_topic(kafka, topic_name(run_id, "scored"), n)  # read_committed: once each
    assert sorted(r.event.generation.event_id for r in scored) == sorted(g.event_id for g in gens)
    await assert_committed_to_end(kafka, s.subscription.group_id, topic_name(run_id, "generations"), 4)


async def test_a_producer_the_broker_no_longer_accepts_is_replaced(
    kafka: KafkaSettings, run_id: str, topics: list[str]
) -> None:
    """After a broker restart an idempotent producer may get OutOfOrderSequenceNumber (and
    aiokafka's sender stops): the runtime replaces it and sends the output again."""
    from aiokafka.errors import OutOfOrderSequenceNumber

    await publish(kafka, None, "tasks", [task(run_id, 0), task(run_id, 1)])
    runner = Runner(Rollout(), settings(kafka, run_id))
    first = runner.producer
    real = first.send_raw
    calls = [0]

    async def rejected_once(*args: object, **kw: object) -> asyncio.Future[object]:
        calls[0] += 1
        if calls[0] == 1:
            fut: asyncio.Future[object] = asyncio.get_running_loop().create_future()
            fut.set_exception(OutOfOrderSequenceNumber())
            return fut
        return await real(*args, **kw)  # type: ignore[arg-type]

    first.send_raw = rejected_once  # type: ignore[method-assign]
    counters = await run_until(runner, lambda c: c.processed >= 2)
    assert counters == Counters(processed=2, emitted=2)
    assert runner.producer is not first
    gens = await read_topic(kafka, topic_name(run_id, "generations"), 2)
    assert sorted(r.event.task.sample_id for r in gens) == ["g0/0", "g1/0"]
