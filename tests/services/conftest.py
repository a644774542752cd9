"""Fixtures of the bus and runtime tests: Kafka settings for the test broker and a run's topics."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from schemas.config import KafkaSettings
from services.kafka.bus import TopicAdmin


@pytest.fixture
def kafka(bootstrap: str) -> KafkaSettings:
    return KafkaSettings(bootstrap=bootstrap, connect_timeout_s=10.0, request_timeout_s=15.0)


@pytest.fixture
async def topics(kafka: KafkaSettings, run_id: str) -> AsyncIterator[list[str]]:
    async with TopicAdmin(kafka) as admin:
        names = await admin.ensure_run_topics(run_id)
        yield names
        await admin.delete_run_topics(run_id)
