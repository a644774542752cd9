"""runtime.reading against a real Kafka broker: reading to the ends a read started with, from the
beginning, from offsets or along a subscription; the time bound; how far behind a consumer is."""

from __future__ import annotations

import pytest
from aiokafka import AIOKafkaConsumer

from runtime.bus import Consumer, Producer, TopicPartition, kafka_kwargs
from runtime.reading import ReadTimeout, behind, read_to_end
from schemas import events as ev
from schemas.config import KafkaSettings
from schemas.topics import TOPICS, topic_name

pytestmark = pytest.mark.timeout(60)


def drains(run_id: str, n: int) -> list[ev.Drain]:
    return [ev.Drain(run_id=run_id, reason=f"d{i}") for i in range(n)]


def control_partitions(run_id: str) -> list[TopicPartition]:
    return [TopicPartition(topic_name(run_id, "control"), p) for p in range(TOPICS["control"].partitions)]


async def raw_consumer(kafka: KafkaSettings) -> AIOKafkaConsumer:
    consumer = AIOKafkaConsumer(**kafka_kwargs(kafka, kafka.bootstrap or "", client_suffix="test-reading"),
                                enable_auto_commit=False, isolation_level="read_committed")
    await consumer.start()
    return consumer


async def test_reads_from_the_beginning_and_from_offsets_to_the_end(kafka: KafkaSettings, run_id: str,
                                                                    topics: list[str]) -> None:
    async with Producer(kafka) as p:
        for d in drains(run_id, 5):
            await p.send_and_wait(topic_name(run_id, "control"), d)
    tps = control_partitions(run_id)
    consumer = await raw_consumer(kafka)
    try:
        offsets: list[int] = []
        await read_to_end(consumer, lambda tp, m: offsets.append(m.offset), start=tps)
        assert offsets == [0, 1, 2, 3, 4]
        assert await behind(consumer, tps) == dict.fromkeys(tps, 0)
        later: list[int] = []
        await read_to_end(consumer, lambda tp, m: later.append(m.offset), start={tps[0]: 3})
        assert later == [3, 4]
        nothing: list[int] = []
        await read_to_end(consumer, lambda tp, m: nothing.append(m.offset), start={tps[0]: 5})
        await read_to_end(consumer, lambda tp, m: nothing.append(m.offset), start=[])
        assert nothing == []
        consumer.assign(tps)
        consumer.seek(tps[0], 1)
        assert await behind(consumer, tps) == {tps[0]: 4}
    finally:
        await consumer.stop()


async def test_reads_a_subscription_once_its_partitions_are_assigned(kafka: KafkaSettings, run_id: str,
                                                                     topics: list[str]) -> None:
    names = [topic_name(run_id, n) for n in ("control", "weights")]
    sent = drains(run_id, 3)
    async with Producer(kafka) as p:
        for d in sent:
            await p.send_and_wait(names[0], d)
    got: list[object] = []
    async with Consumer(kafka, group_id=None, topics=names, auto_offset_reset="earliest",
                        client_suffix="test-reading") as c:
        await read_to_end(c.raw, lambda tp, m: got.append(c.decode(tp.topic, m.value)[0]), timeout_s=30)
        assert {tp.topic for tp in c.assignment()} == set(names)
    assert got == sent


async def test_a_read_that_cannot_end_names_what_it_read(kafka: KafkaSettings, run_id: str) -> None:
    """A subscription to a topic that does not exist is never assigned: the time bound ends the read."""
    missing = topic_name(run_id, "control")  # no topics were created for this run
    consumer = AIOKafkaConsumer(**kafka_kwargs(kafka, kafka.bootstrap or "", client_suffix="test-reading"),
                                enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.subscribe([missing])
        with pytest.raises(ReadTimeout, match=rf"could not read the control of {run_id} within 1 s"):
            await read_to_end(consumer, lambda tp, m: None, timeout_s=1.0, poll_ms=100,
                              what=f"the control of {run_id}")
    finally:
        await consumer.stop()


async def test_idle_polls_end_a_read_quietly(kafka: KafkaSettings, run_id: str, topics: list[str]) -> None:
    """Ends beyond what can be read (a caller's stale ends) stop after the empty polls allowed."""
    tps = control_partitions(run_id)
    consumer = await raw_consumer(kafka)
    try:
        got: list[int] = []
        await read_to_end(consumer, lambda tp, m: got.append(m.offset), start=tps, ends=dict.fromkeys(tps, 3),
                          idle_polls=2, poll_ms=100)
        assert got == []
        with pytest.raises(ReadTimeout):
            await read_to_end(consumer, lambda tp, m: None, start=tps, ends=dict.fromkeys(tps, 3), timeout_s=0.5,
                              poll_ms=100)
    finally:
        await consumer.stop()
