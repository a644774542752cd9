"""Topic administration for rollstream's per-run topics, and counting what they hold.

* :class:`TopicAdmin` — creates, describes, lists and deletes the topics of a run following
  :data:`schemas.topics.TOPICS` (start bounded by ``connect_timeout_s``, every request by the
  request timeout).
* :func:`message_count` / :func:`message_counts` — messages currently held by some topics
  (in all / per topic).

Importing this module has no side effects.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Self

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.structs import TopicPartition

from runtime.connection import (
    DEFAULT_MAX_MESSAGE_BYTES,
    TOPIC_MESSAGE_HEADROOM_BYTES,
    AsyncClient,
    BusError,
    kafka_kwargs,
    resolve_bootstrap,
    start_bounded,
)
from schemas.config import KafkaSettings
from schemas.topics import TOPICS, TopicSpec, check_run_id, parse_topic

__all__ = ["TopicAdmin", "TopicInfo", "message_count", "message_counts"]


@dataclass(frozen=True)
class TopicInfo:
    """What the broker says about one topic of a run."""

    name: str
    """Logical name (``tasks``...)."""
    topic: str
    """Kafka topic name."""
    partitions: int
    configs: dict[str, str] = field(default_factory=dict)
    """Topic-level configs that differ from the broker default (plus ``cleanup.policy``)."""


class TopicAdmin(AsyncClient):
    """Creates and inspects the per-run topics of :data:`schemas.topics.TOPICS`.

    ``replication_factor=None`` uses ``min(3, number of brokers)``. Topics get the registry's
    partitions and cleanup policy, ``max.message.bytes`` large enough for
    :data:`DEFAULT_MAX_MESSAGE_BYTES` messages, and ``min.insync.replicas=2`` with 3 replicas.
    """

    def __init__(
        self,
        settings: KafkaSettings,
        bootstrap: str | None = None,
        *,
        replication_factor: int | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.settings = settings
        self.bootstrap = resolve_bootstrap(settings, bootstrap)
        self.replication_factor = replication_factor
        self.max_message_bytes = max_message_bytes
        self._kwargs = kafka_kwargs(settings, self.bootstrap, client_suffix="admin")
        self._raw: AIOKafkaAdminClient | None = None
        self._stopped = False

    @property
    def raw(self) -> AIOKafkaAdminClient:
        if self._raw is None:
            raise BusError("admin not started: call `await admin.start()` first")
        return self._raw

    async def start(self) -> Self:
        """Connect (bounded by ``connect_timeout_s``). Idempotent."""
        if self._raw is not None:
            return self
        raw = AIOKafkaAdminClient(**self._kwargs)
        await start_bounded("admin", raw.start, raw.close, self.bootstrap, self.settings.connect_timeout_s, self._kwargs)
        self._raw = raw
        return self

    async def stop(self) -> None:
        """Close the admin client. Idempotent."""
        if self._raw is not None and not self._stopped:
            self._stopped = True
            await self._raw.close()

    def topic_configs(self, spec: TopicSpec, replication_factor: int = 1) -> dict[str, str]:
        """Configs a run topic is created with: the registry's plus ``max.message.bytes``; with 3
        or more replicas ``min.insync.replicas=2`` (a write is on two brokers before it is
        acknowledged, and one broker may be down)."""
        cfg = dict(spec.configs())
        cfg["max.message.bytes"] = str(self.max_message_bytes + TOPIC_MESSAGE_HEADROOM_BYTES)
        if replication_factor >= 3:
            cfg["min.insync.replicas"] = "2"
        return cfg

    async def _timeout(self, coro: Awaitable[Any], what: str) -> Any:
        t = self.settings.request_timeout_s + 5
        try:
            return await asyncio.wait_for(coro, timeout=t)
        except TimeoutError:
            raise BusError(f"Kafka at {self.bootstrap} did not answer {what} within {t:g} s") from None

    async def ensure_run_topics(self, run_id: str) -> list[str]:
        """Create every topic of the run (existing ones are fine); wait until all have leaders.

        Returns the Kafka topic names in registry order. An existing topic is left as is (its
        partition count is not changed; :meth:`describe` shows it).
        """
        check_run_id(run_id)
        rf = self.replication_factor
        if rf is None:
            rf = max(1, min(3, await self.broker_count()))
        new = [
            NewTopic(spec.topic(run_id), spec.partitions, rf, topic_configs=self.topic_configs(spec, rf))
            for spec in TOPICS.values()
        ]
        resp = await self._timeout(self.raw.create_topics(new), "create_topics")
        problems = []
        for t in resp.to_object()["topic_errors"]:
            code = t["error_code"]
            if code not in (0, 36):  # 36 = TOPIC_ALREADY_EXISTS
                problems.append(f"{t['topic']}: error {code} {t.get('error_message') or ''}".strip())
        if problems:
            raise BusError(f"creating topics of run {run_id} failed: " + "; ".join(problems))
        names = [n.name for n in new]
        await self._wait_leaders(names)
        return names

    async def broker_count(self) -> int:
        """How many brokers the cluster has, from a metadata request for no topic: the admin
        client's ``describe_cluster`` asks for every topic of the cluster (35 ms of CPU with 1,464
        topics on the dev broker, at every service's start) and drops them."""
        meta = await self._timeout(self.raw._get_cluster_metadata(topics=[]), "metadata")
        return len(meta.to_object().get("brokers") or [1])

    async def _poll(self, pending: Callable[[], Awaitable[list[str]]], failure: Callable[[list[str]], str]) -> None:
        """Ask ``pending()`` every 0.1 s until it returns no names; after ``request_timeout_s``
        raise :class:`BusError` with ``failure(names still pending)``."""
        deadline = time.monotonic() + self.settings.request_timeout_s
        while left := await pending():
            if time.monotonic() > deadline:
                raise BusError(failure(left))
            await asyncio.sleep(0.1)

    async def _wait_leaders(self, names: list[str]) -> None:
        async def leaderless() -> list[str]:
            topics = await self._timeout(self.raw.describe_topics(names), "describe_topics")
            return [
                t["topic"]
                for t in topics
                if t["error_code"] != 0
                or not t["partitions"]
                or any(p["leader"] < 0 for p in t["partitions"])
            ]

        await self._poll(
            leaderless, lambda missing: f"topics have no leader after {self.settings.request_timeout_s:g} s: {missing}"
        )

    async def run_topics(self, run_id: str) -> list[str]:
        """Kafka topics of ``run_id`` that exist now."""
        check_run_id(run_id)
        existing = set(await self._timeout(self.raw.list_topics(), "list_topics"))
        return [spec.topic(run_id) for spec in TOPICS.values() if spec.topic(run_id) in existing]

    async def describe(self, run_id: str) -> dict[str, TopicInfo]:
        """Logical name -> :class:`TopicInfo` for the run's existing topics."""
        names = await self.run_topics(run_id)
        if not names:
            return {}
        meta = await self._timeout(self.raw.describe_topics(names), "describe_topics")
        parts = {t["topic"]: len(t["partitions"]) for t in meta if t["error_code"] == 0}
        resources = [ConfigResource(ConfigResourceType.TOPIC, n) for n in names]
        responses = await self._timeout(self.raw.describe_configs(resources), "describe_configs")
        configs: dict[str, dict[str, str]] = {}
        for resp in responses:
            for res in resp.to_object()["resources"]:
                entries = {}
                for e in res["config_entries"]:
                    # config_source 1 = topic config; keep cleanup.policy always
                    if e.get("config_source") == 1 or e["config_names"] == "cleanup.policy":
                        entries[e["config_names"]] = e["config_value"]
                configs[res["resource_name"]] = entries
        out: dict[str, TopicInfo] = {}
        for n in names:
            parsed = parse_topic(n)
            assert parsed is not None
            out[parsed[1]] = TopicInfo(parsed[1], n, parts.get(n, 0), configs.get(n, {}))
        return out

    async def topic_config(self, topic: str) -> dict[str, str]:
        """Every config of one topic as the broker reports it (defaults included)."""
        responses = await self._timeout(
            self.raw.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)]), "describe_configs"
        )
        out: dict[str, str] = {}
        for resp in responses:
            for res in resp.to_object()["resources"]:
                if res["error_code"]:
                    raise BusError(
                        f"describe_configs {topic}: error {res['error_code']} {res['error_message']}"
                    )
                for e in res["config_entries"]:
                    out[e["config_names"]] = e["config_value"]
        return out

    async def list_runs(self) -> list[str]:
        """Run ids that have at least one topic, sorted."""
        topics = await self._timeout(self.raw.list_topics(), "list_topics")
        return sorted({p[0] for p in map(parse_topic, topics) if p is not None})

    async def delete_run_topics(self, run_id: str) -> list[str]:
        """Delete the run's existing topics and wait until the broker no longer lists them;
        returns the names deleted."""
        names = await self.run_topics(run_id)
        if not names:
            return []
        resp = await self._timeout(self.raw.delete_topics(names), "delete_topics")
        problems = [
            f"{t['topic']}: error {t['error_code']}"
            for t in resp.to_object()["topic_error_codes"]
            if t["error_code"] not in (0, 3)  # 3 = UNKNOWN_TOPIC_OR_PARTITION (already gone)
        ]
        if problems:
            raise BusError(f"deleting topics of run {run_id} failed: " + "; ".join(problems))
        # deletion is asynchronous on the broker: wait until metadata no longer lists them
        await self._poll(
            lambda: self.run_topics(run_id),
            lambda _: f"topics of run {run_id} still listed {self.settings.request_timeout_s:g} s after deletion",
        )
        return names


async def message_counts(
    kafka: KafkaSettings, bootstrap: str, partitions: dict[str, int], *, client_suffix: str = "count"
) -> dict[str, int]:
    """Kafka topic -> messages it holds now (end minus beginning offsets), for the topics of
    ``partitions`` (Kafka topic -> partition count)."""
    tps = [TopicPartition(t, p) for t, n in partitions.items() for p in range(n)]
    if not tps:
        return {t: 0 for t in partitions}
    consumer = AIOKafkaConsumer(**kafka_kwargs(kafka, bootstrap, client_suffix=client_suffix))
    await consumer.start()
    try:
        begin = await consumer.beginning_offsets(tps)
        end = await consumer.end_offsets(tps)
    finally:
        await consumer.stop()
    counts = dict.fromkeys(partitions, 0)
    for tp in tps:
        counts[tp.topic] += int(end[tp] - begin[tp])
    return counts


async def message_count(kafka: KafkaSettings, bootstrap: str, partitions: dict[str, int]) -> int:
    """Messages currently held by the topics of ``partitions`` (Kafka topic -> partition count)."""
    return sum((await message_counts(kafka, bootstrap, partitions)).values())
