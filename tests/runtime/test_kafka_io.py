"""runtime.kafka_io against the real broker: batched records (``kafka.samples_per_record``) are packed
per destination partition on send and handed out one record per event on consume."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import msgspec
import pytest
from aiokafka.partitioner import DefaultPartitioner

from runtime.bus import Consumer, Record, TopicPartition, message_counts
from runtime.kafka_io import KafkaIO
from runtime.runner import Delivery, Produce, ServiceSettings, Subscription
from runtime.service import Counters, make_output
from schemas.config import KafkaSettings
from schemas.events import Drain, RolloutTask
from schemas.topics import topic_name

pytestmark = pytest.mark.timeout(60)


def tasks(run_id: str, n: int) -> list[RolloutTask]:
    return [RolloutTask(run_id=run_id, sample_id=f"g{i % 5}/{i}", group_id=f"g{i % 5}", index=i, group_size=8,
                        prompt_id="p", domain="arith", prompt="1+1=", reference="2", policy_version=0,
                        max_new_tokens=4) for i in range(n)]


async def read_all(kafka: KafkaSettings, topic: str, want: int) -> list[Record]:
    out: list[Record] = []
    async with Consumer(kafka, group_id=None, topics=[topic], auto_offset_reset="earliest") as consumer:
        for _ in range(40):
            out += await consumer.getmany(timeout_ms=250)
            if len(out) >= want:
                break
    return out


@pytest.mark.parametrize("per_record", [1, 4])
async def test_events_sent_together_share_records_of_their_own_partition(
        kafka: KafkaSettings, run_id: str, topics: list[str], per_record: int) -> None:
    k = msgspec.structs.replace(kafka, samples_per_record=per_record)
    io = KafkaIO("test", ServiceSettings(run_id=run_id, kafka=k, subscription=Subscription(group_id=None, topics=["tasks"])), Counters())
    await io.start()
    try:
        events = tasks(run_id, 20)
        outs = [make_output(io, topic_name(run_id, "tasks"), e, None) for e in events]
        outs.append(make_output(io, topic_name(run_id, "control"), Drain(run_id=run_id, reason="x", origin="user"), None))
        mds = await io.send_outputs(outs, "test")
        assert len(mds) == len(outs) and io.counters.emitted == 21  # one acknowledgement and count per event
    finally:
        await io.close()
    got = await read_all(kafka, topic_name(run_id, "tasks"), 20)
    assert sorted(r.event.sample_id for r in got) == sorted(e.sample_id for e in events)  # each once
    partitions = [0, 1, 2, 3]
    per_offset: dict[tuple[int, int], list[Record]] = defaultdict(list)
    for r in got:  # every event sits on the partition its own key maps to
        assert r.partition == DefaultPartitioner()(r.event.sample_id.encode(), partitions, partitions)
        assert r.value_bytes == msgspec.msgpack.encode(r.event)  # its own encoding, as a single record has
        per_offset[(r.partition, r.offset)].append(r)
    for rs in per_offset.values():  # a record's events in their order, each knowing its place
        assert [r.index for r in rs] == list(range(len(rs))) and {r.in_record for r in rs} == {len(rs)}
        assert len(rs) <= per_record
    records = (await message_counts(kafka, kafka.bootstrap, {topic_name(run_id, "tasks"): 4}))[topic_name(run_id, "tasks")]
    if per_record == 1:
        assert records == 20 and all(len(rs) == 1 for rs in per_offset.values())
    else:  # 20 events on at most 4 partitions, at most 4 per record
        assert len(per_offset) == records < 20


async def test_events_that_finish_at_the_same_moment_are_sent_together(
        kafka: KafkaSettings, run_id: str, topics: list[str]) -> None:
    io = KafkaIO("test", ServiceSettings(run_id=run_id, kafka=kafka, subscription=Subscription(group_id=None, topics=["tasks"])),
                 Counters())
    await io.start()
    try:
        same = tasks(run_id, 6)
        outs = [[make_output(io, topic_name(run_id, "tasks"), e, "k")] for e in same]  # one key: one partition
        await asyncio.gather(*(io.send_together(o, "test") for o in outs))  # called in the same turn
    finally:
        await io.close()
    got = await read_all(kafka, topic_name(run_id, "tasks"), 6)
    assert len(got) == 6 and len({(r.partition, r.offset) for r in got}) == 1  # one record of six events
    assert [r.event.sample_id for r in got] == [e.sample_id for e in same]  # in the order they were sent
    assert TopicPartition(got[0].topic, got[0].partition) == got[0].tp


async def test_outputs_written_though_their_send_failed_are_not_sent_again(
        kafka: KafkaSettings, run_id: str, topics: list[str]) -> None:
    """A record on the topic whose acknowledgement was lost (its brokers killed after writing it, or a
    batch aiokafka expired while no leader was known) fails its send; sending it again would put a
    second copy on the topic (issue 38: a whole-cluster kill trained 16 samples twice)."""
    from aiokafka.errors import LeaderNotAvailableError

    io = KafkaIO("test", ServiceSettings(run_id=run_id, kafka=kafka, subscription=Subscription(group_id=None, topics=["tasks"])),
                 Counters())
    await io.start()
    real_send, lost = io.producer.send_raw, 0

    async def written_but_unacknowledged(topic: str, value: bytes | None, key: bytes | None = None) -> asyncio.Future:
        nonlocal lost
        acked = await (await real_send(topic, value, key))  # on the topic...
        fut = asyncio.get_running_loop().create_future()
        if lost < 3:  # ...but the first three sends hear only an error
            lost += 1
            fut.set_exception(LeaderNotAvailableError())
        else:
            fut.set_result(acked)
        return fut

    io.producer.send_raw = written_but_unacknowledged  # type: ignore[method-assign]
    try:
        events = tasks(run_id, 5)
        outs = [make_output(io, topic_name(run_id, "tasks"), e, None) for e in events]
        outs.append(make_output(io, topic_name(run_id, "control"), Drain(run_id=run_id, reason="x", origin="user"), None))
        await io.send_outputs(outs, "test")
    finally:
        await io.close()
    assert lost == 3
    got = await read_all(kafka, topic_name(run_id, "tasks"), 5)
    assert sorted(r.event.sample_id for r in got) == sorted(e.sample_id for e in events)
    tasks_t, control_t = topic_name(run_id, "tasks"), topic_name(run_id, "control")
    records = await message_counts(kafka, kafka.bootstrap, {tasks_t: 4, control_t: 1})
    assert records == {tasks_t: len({(r.partition, r.offset) for r in got}), control_t: 1}  # no second copy


@pytest.mark.parametrize("transactional", [False, True])
def test_only_a_transactional_producer_sends_without_linger(transactional: bool) -> None:
    # a transaction's outputs are all sent at its commit: a linger would only hold the commit up
    settings = ServiceSettings(run_id="r", kafka=KafkaSettings(bootstrap="localhost:1"),
                               subscription=Subscription(group_id="g", topics=["generations"]),
                               produce=Produce(linger_ms=7), delivery=Delivery(transactional=transactional))
    producer = KafkaIO("test", settings, Counters())._new_producer()
    assert producer.config["linger_ms"] == (0 if transactional else 7)
    assert ("transactional_id" in producer.config) is transactional
