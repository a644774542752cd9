"""Reading topics to their end: the one copy of that loop.

:func:`read_to_end` reads partitions from the beginning (or from given offsets) up to the end
offsets they had when the read started, handing every record to a callback: the trainer's history,
``rollstream status`` and ``rollstream stop`` read a run's topics so. :func:`behind` says how many
records a consumer still has before the end of each of its partitions now (the feeder's "caught
up", the recorder's lag). Both take a raw ``AIOKafkaConsumer`` (a :class:`runtime.clients.Consumer`
hands its own as ``.raw``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from runtime.connection import BusError

__all__ = ["ReadTimeout", "behind", "read_to_end"]

Take = Callable[[TopicPartition, Any], None]
"""``take(partition, record)``: called for every record read (an aiokafka ``ConsumerRecord``)."""


class ReadTimeout(BusError):
    """The topics were not read to their end within the time given."""


async def behind(consumer: AIOKafkaConsumer, partitions: Iterable[TopicPartition],
                 ends: Mapping[TopicPartition, int] | None = None) -> dict[TopicPartition, int]:
    """Per partition: the records between the consumer's position and its end offset (``ends``, else
    the end now); 0 at the end. A partition whose position cannot be told (revoked meanwhile) is
    left out."""
    tps = list(partitions)
    if not tps:
        return {}
    if ends is None:
        ends = await consumer.end_offsets(tps)
    out: dict[TopicPartition, int] = {}
    for tp in tps:
        try:
            position = await consumer.position(tp)
        except Exception:  # not assigned any more: its new owner counts it
            continue
        out[tp] = max(0, ends[tp] - position)
    return out


async def read_to_end(consumer: AIOKafkaConsumer, take: Take, *,
                      start: Mapping[TopicPartition, int] | Iterable[TopicPartition] | None = None,
                      ends: Mapping[TopicPartition, int] | None = None, timeout_s: float | None = None,
                      idle_polls: int | None = None, poll_ms: int = 500, max_records: int | None = None,
                      what: str = "the topics to their end") -> None:
    """Read up to the end offsets the partitions had when the read started, calling ``take`` for each
    record (a poll may return a few past the end too).

    ``start``: ``{partition: offset}`` to read from, or partitions to read from their beginning (the
    consumer is assigned exactly those); ``None``: the consumer's subscription, from where it is,
    once every subscribed topic has its partitions assigned. ``ends``: the end offsets to read to,
    when the caller has them. The read stops early, quietly, after ``idle_polls`` empty polls in a
    row (a partition whose last records are transaction markers); past ``timeout_s`` it raises
    :class:`ReadTimeout` naming ``what``. The consumer stays assigned and positioned after the read.
    """
    clock = asyncio.get_running_loop().time
    deadline = None if timeout_s is None else clock() + timeout_s
    pending: set[TopicPartition] | None = None
    if start is not None:
        pending = set(start)
        if not pending:
            return
        consumer.assign(list(pending))
        if isinstance(start, Mapping):
            for tp, offset in start.items():
                consumer.seek(tp, offset)
        else:
            await consumer.seek_to_beginning(*pending)
    to = dict(ends) if ends is not None else {}
    empty = 0
    while True:
        if pending is not None:
            if not to:
                to = dict(await consumer.end_offsets(sorted(pending)))
            pending = {tp for tp, left in (await behind(consumer, pending, to)).items() if left}
            if not pending:
                return
        if idle_polls is not None and empty >= idle_polls:
            return
        if deadline is not None and clock() > deadline:
            raise ReadTimeout(f"could not read {what} within {timeout_s:g} s")
        batches = await consumer.getmany(*(pending or ()), timeout_ms=poll_ms, max_records=max_records)
        empty = 0 if batches else empty + 1
        for tp, records in batches.items():
            for record in records:
                take(tp, record)
        if pending is None and _all_assigned(consumer):
            pending = set(consumer.assignment())


def _all_assigned(consumer: AIOKafkaConsumer) -> bool:
    """Whether every topic the consumer subscribes to has partitions assigned."""
    topics = consumer.subscription()
    return bool(topics) and {tp.topic for tp in consumer.assignment()} == set(topics)
