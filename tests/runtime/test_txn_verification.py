"""The transactional producer and the broker's transaction verification (KIP-890), on the real
broker: consume-transform-produce transactions as the reward router runs them never come back
with ``NOT_ENOUGH_REPLICAS``.

Kafka (3.6+) verifies with the transaction coordinator that a partition is in the transaction
before it appends a transactional produce or offset commit, and keeps one pending verification
per transactional id: when the offset commit's verification arrived while a produce request's
was pending, the produce request failed with ``NETWORK_EXCEPTION``, which a produce request of
version < 12 (aiokafka's) gets as ``NOT_ENOUGH_REPLICAS`` (error 19) and retries after a backoff —
179 such retries in one main-example run. ``Producer.send_offsets_to_transaction`` flushes the
transaction's messages first. Without that, this test sees 80-200 such retries in its 400
transactions (4 producers at once); with it, none.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from runtime.bus import Producer, TopicPartition
from schemas.config import KafkaSettings
from schemas.topics import topic_name

pytestmark = pytest.mark.timeout(120)

INSTANCES = 4
TRANSACTIONS = 100


async def test_transactions_do_not_race_the_brokers_verification(
    kafka: KafkaSettings, run_id: str, topics: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aiokafka")
    out = topic_name(run_id, "scored")  # 4 partitions, as the reward router writes them
    consumed = topic_name(run_id, "generations")

    async def instance(k: int) -> None:
        # no linger: a produce request leaves at once and its verification overlaps the offset commit's
        async with Producer(kafka, transactional_id=f"txn-{run_id}-{k}", linger_ms=0) as p:
            for i in range(TRANSACTIONS):
                async with p.transaction():
                    futs = [await p.send_raw(out, b"scored", f"g{i}", partition=part) for part in range(4)]
                    await p.send_offsets_to_transaction({TopicPartition(consumed, k): i + 1}, f"txn-{run_id}-{k}")
                assert all(f.done() and not f.exception() for f in futs)

    # several instances at once (reward routers of concurrent runs share the broker's verification queue)
    await asyncio.gather(*(instance(k) for k in range(INSTANCES)))
    retried = [r.getMessage() for r in caplog.records if "NotEnoughReplicas" in r.getMessage()]
    assert not retried, f"{len(retried)} produce retries, e.g. {retried[0]}"
