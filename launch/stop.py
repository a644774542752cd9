"""``rollstream stop RUN``: drain a run gracefully through its ``control`` topic.

It publishes ``Drain(reason="stopped by user", origin="user")`` on the run's ``control`` topic (every service
of the run follows it: the feeder stops issuing tasks and, once every issued sample has an
outcome, publishes ``RunFinished``), then, unless told not to wait, follows ``control`` and
``weights`` until ``RunFinished`` appears or ``timeout_s`` passes. A run that already finished
is left alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from runtime.bus import Producer, TopicAdmin, kafka_kwargs
from runtime.connection import start_bounded
from runtime.reading import read_to_end
from schemas import events as ev
from schemas.config import KafkaSettings
from schemas.topics import TOPICS, topic_name

USER_REASON = "stopped by user"


class NoSuchRun(LookupError):
    """The run has no topics on the broker."""


@dataclass
class StopOutcome:
    already_finished: bool = False
    """``RunFinished`` was on ``control`` before the drain: nothing was published."""
    published: bool = False
    finished: ev.RunFinished | None = None
    """``RunFinished`` once it appeared (``None``: not waited for, or timed out)."""
    waited_s: float = 0.0
    """Seconds from the drain to ``RunFinished`` (or to the timeout)."""
    step: int = 0
    """The trainer's step at the end (from the newest ``WeightsPublished``)."""
    policy_version: int = -1


async def stop_run(kafka: KafkaSettings, bootstrap: str, run_id: str, *, reason: str = USER_REASON,
                   wait: bool = True, timeout_s: float = 600.0, every_s: float = 5.0,
                   progress: Callable[[StopOutcome, float], None] | None = None) -> StopOutcome:
    """Publish ``Drain(reason)`` on ``run_id``'s ``control`` topic and (``wait``) follow the run
    until ``RunFinished`` or ``timeout_s``; ``progress(outcome, elapsed_s)`` is called every
    ``every_s`` seconds meanwhile. :class:`NoSuchRun` when the run has no topics."""
    async with TopicAdmin(kafka, bootstrap) as admin:
        described = await admin.describe(run_id)
    if "control" not in described:
        raise NoSuchRun(run_id)
    names = [n for n in ("control", "weights") if n in described]
    tps = [TopicPartition(described[n].topic, p) for n in names for p in range(described[n].partitions)]
    decoders = {topic_name(run_id, n): msgspec.msgpack.Decoder(TOPICS[n].event_type) for n in names}
    out = StopOutcome()

    def take(tp: TopicPartition, value: bytes | None) -> None:
        try:
            event = decoders[tp.topic].decode(value) if value is not None else None
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        if isinstance(event, ev.WeightsPublished) and event.policy_version >= out.policy_version:
            out.step, out.policy_version = event.step, event.policy_version
        elif isinstance(event, ev.RunFinished) and event.run_id == run_id:
            out.finished = event

    consumer = AIOKafkaConsumer(**kafka_kwargs(kafka, bootstrap, client_suffix="stop"),
                                enable_auto_commit=False, isolation_level="read_committed")
    await start_bounded("consumer", consumer.start, consumer.stop, bootstrap, kafka.connect_timeout_s)
    try:
        await read_to_end(consumer, lambda tp, m: take(tp, m.value), start=tps, idle_polls=2)
        if out.finished is not None:
            out.already_finished = True
            return out
        async with Producer(kafka, bootstrap) as producer:
            drain = ev.Drain(run_id=run_id, reason=reason, origin="user")
            await producer.send_and_wait(topic_name(run_id, "control"), drain)
        out.published = True
        if not wait:
            return out
        t0 = last = time.monotonic()
        while out.finished is None:
            elapsed = time.monotonic() - t0
            out.waited_s = elapsed
            if elapsed >= timeout_s:
                return out
            for tp, msgs in (await consumer.getmany(timeout_ms=500)).items():
                for m in msgs:
                    take(tp, m.value)
            if progress is not None and time.monotonic() - last >= every_s:
                last = time.monotonic()
                progress(out, last - t0)
        out.waited_s = time.monotonic() - t0
        return out
    finally:
        await consumer.stop()
