"""A burst of hostile records on a run's ``generations``, against the real reward router (the
runtime's exactly-once transactional loop and its sanity checks) on the real broker: every record
ends processed (a ``scored`` output) or dead-lettered (a ``dlq`` record naming its offset), the
group's offsets reach the end, and the service is still running and scoring afterwards.

The burst is drawn by hypothesis (derandomized, so the same every run) from the strategies in
tests/schemas/fuzzing.py: arbitrary and mutated bytes, type-swapped fields, deep nesting, strings
that are not UTF-8, and generations that decode but hold impossible values.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from runtime.bus import Consumer, Producer
from runtime.deadletter import dead_letter_for
from runtime.records import Record
from runtime.runner import Consume, Delivery, Handling, Runner, ServiceSettings, Subscription
from schemas import events as ev
from schemas.config import KafkaSettings, parse_config
from schemas.services import SERVICES
from schemas.topics import topic_name
from services.reward_router import RewardRouter, RewardSettings
from tests.runtime.test_runtime import assert_committed_to_end, generate, read_topic, task
from tests.schemas.fuzzing import deeply_nested, hostile_bytes, hostile_generations

pytestmark = pytest.mark.timeout(120)

ENC = msgspec.msgpack.Encoder()


def draw(strategy: st.SearchStrategy[Any], n: int) -> list[Any]:
    """``n`` examples of ``strategy``, the same every run."""
    out: list[Any] = []

    @settings(max_examples=n, database=None, derandomize=True, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(value: Any) -> None:
        out.append(value)

    collect()
    return out


def burst(run_id: str) -> list[bytes]:
    """Hostile bytes, impossible generations, and a few sound generations, interleaved."""
    hostile = draw(hostile_bytes(), 60)
    impossible = [ENC.encode(msgspec.structs.replace(g, run_id=run_id, event_id=f"imp{i}"))
                  for i, g in enumerate(draw(hostile_generations(), 30))]
    sound = [ENC.encode(generate(task(run_id, i))) for i in range(10)]
    text = msgspec.structs.replace(generate(task(run_id, 100)), response_text="ZZZZ")
    not_utf8 = [ENC.encode(text).replace(b"\xa4ZZZZ", b"\xa4\xff\xfe\xfd\xfc")]  # took the consumer down once
    values = hostile + impossible + sound + not_utf8
    random.Random(0).shuffle(values)  # interleaved, the same every run
    return values


async def test_a_burst_of_hostile_records_never_takes_the_reward_router_down(
    kafka: KafkaSettings, run_id: str, topics: list[str]
) -> None:
    values = burst(run_id)
    gens_t = topic_name(run_id, "generations")
    async with Producer(kafka) as p:
        futs = [await p.send_raw(gens_t, v, f"k{i % 5}") for i, v in enumerate(values)]
        metas = await asyncio.gather(*futs)
    offsets = {(m.partition, m.offset) for m in metas}

    cfg = parse_config("rollout: {group_size: 1}\ntrain: {batch_size: 1}")
    group = SERVICES["reward"].group_id(run_id)
    runner = Runner(RewardRouter(RewardSettings(run_id=run_id, config=cfg)), ServiceSettings(
        run_id=run_id, kafka=kafka, subscription=Subscription(group_id=group, topics=["generations"]),
        consume=Consume(batch_max_records=64, poll_timeout_s=0.2), handling=Handling(max_concurrency=4),
        delivery=Delivery(transactional=True, transactional_id=group)))
    job = asyncio.create_task(runner.run(install_signal_handlers=False))

    async def settled(n: int) -> None:
        deadline = time.monotonic() + 60
        c = runner.counters
        while c.processed + c.failed + c.duplicates + c.ignored < n:
            assert not job.done(), f"the service ended: {job.exception() if not job.cancelled() else 'cancelled'}"
            assert time.monotonic() < deadline, f"records left unsettled: {c}"
            await asyncio.sleep(0.1)

    try:
        await settled(len(values))
        # still running and still scoring: a sound generation after the burst is processed
        after = generate(task(run_id, 999))
        async with Producer(kafka) as p:
            await p.send_and_wait(gens_t, after)
        await settled(len(values) + 1)
        assert not job.done()
    finally:
        runner.stop.set()
        counters = await asyncio.wait_for(job, timeout=30)

    assert counters.ignored == 0
    assert counters.processed + counters.failed + counters.duplicates == len(values) + 1
    assert counters.processed >= 11 and counters.failed >= 60  # the sound ones scored, the hostile ones not
    dlq = await read_topic(kafka, topic_name(run_id, "dlq"), counters.dead_lettered)
    scored = await read_topic(kafka, topic_name(run_id, "scored"), counters.emitted)
    letters: list[ev.DeadLetter] = [r.event for r in dlq]
    assert len(letters) == counters.failed == counters.dead_lettered
    assert len({(d.partition, d.offset) for d in letters}) == len(letters)  # one letter per record
    assert {(d.partition, d.offset) for d in letters} <= offsets
    assert all(d.source_topic == gens_t and d.error and "\n" not in d.error for d in letters)
    assert {d.stage for d in letters} == {"decode", "handle"}  # undecodable and impossible values
    assert len(scored) == counters.processed
    assert after.event_id in {r.event.generation.event_id for r in scored}
    await assert_committed_to_end(kafka, group, gens_t, 4)


def test_a_deeply_nested_record_can_be_dead_lettered() -> None:
    for value in draw(deeply_nested(), 5):
        event, error = Consumer(KafkaSettings(), "127.0.0.1:1", group_id=None, topics=["unused"]).decode(
            topic_name("fuzz", "generations"), value)
        assert event is None and error
        rec = Record(topic="rs.fuzz.generations", partition=0, offset=1, key=b"g/0", value_bytes=value, event=None,
                     error=error, ts=0.0)
        letter = dead_letter_for(rec, run_id="fuzz", event_id="e", service="reward", stage="decode", error=error)
        assert letter.value == value
