"""``launch.runinfo.probe_run`` against the real broker, with batched records on ``tasks``: the
feeder's tasks and a group's lag are counted in events, not in records."""

from __future__ import annotations

import msgspec
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from launch.runinfo import probe_run
from runtime.bus import Producer, TopicAdmin, kafka_kwargs
from schemas import events as ev
from schemas.config import KafkaSettings
from schemas.services import SERVICES
from schemas.topics import pack_values, topic_name


def tasks_of(run_id: str, k: int, width: int) -> list[bytes]:
    gid = ev.group_id_of(k)
    return [msgspec.msgpack.encode(ev.RolloutTask(
        run_id=run_id, sample_id=ev.sample_id_of(gid, j), group_id=gid, index=j, group_size=width - 1,
        redundancy=1, prompt_id="p", domain="arith", prompt="1+1=")) for j in range(width)]


async def test_tasks_issued_and_lag_count_events_of_batched_records(bootstrap: str, run_id: str) -> None:
    kafka = KafkaSettings()
    topic = topic_name(run_id, "tasks")
    async with TopicAdmin(kafka, bootstrap) as admin:
        await admin.ensure_run_topics(run_id)
    async with Producer(kafka, bootstrap) as producer:
        # groups 0-2 in one record, group 3 in another, all on partition 0: 16 tasks in 2 records
        first = pack_values([v for k in range(3) for v in tasks_of(run_id, k, 4)])
        await (await producer.send_raw(topic, first, partition=0))
        await (await producer.send_raw(topic, pack_values(tasks_of(run_id, 3, 4)), partition=0))
    # the rollout group has read nothing: its lag on tasks is every event from offset 0
    group = AIOKafkaConsumer(**kafka_kwargs(kafka, bootstrap, client_suffix="test"),
                             group_id=SERVICES["rollout"].group_id(run_id), enable_auto_commit=False)
    await group.start()
    try:
        tp = TopicPartition(topic, 0)
        group.assign([tp])
        await group.commit({tp: 0})
    finally:
        await group.stop()
    info = await probe_run(kafka, bootstrap, run_id)
    assert info is not None
    assert info.messages["tasks"] == 2  # records
    assert info.tasks_issued == 16  # events: 4 groups of 3 + 1 redundant
    assert info.lags["rollout"]["tasks"] == 16
