"""The topic registry: every topic of a run, its key, event union, partitions and policy.

Topic names are per run: ``rs.<run_id>.<name>``; the recorder subscribes to ``^rs\\..*``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import msgspec

from schemas import events as ev

TOPIC_PREFIX = "rs"
RUN_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,120}$")
ALL_RUNS_PATTERN = r"^rs\..*"


@dataclass(frozen=True)
class TopicSpec:
    """One logical topic of a run."""

    name: str
    """Logical name, e.g. ``tasks``; the Kafka topic is ``rs.<run_id>.<name>``."""
    key: str
    """Which field of the event is the message key (documentation and producers' choice)."""
    event_type: Any
    """The union of event types this topic carries (what its decoder decodes)."""
    partitions: int
    """Partition count at creation."""
    cleanup: Literal["delete", "compact"] = "delete"
    """Kafka ``cleanup.policy``."""
    retention_ms: int = 7 * 24 * 3600 * 1000
    """Kafka ``retention.ms`` for ``delete`` topics (ignored for compacted ones)."""
    doc: str = ""

    def topic(self, run_id: str) -> str:
        return topic_name(run_id, self.name)

    def configs(self) -> dict[str, str]:
        """Kafka topic configs used at creation."""
        if self.cleanup == "compact":
            return {"cleanup.policy": "compact", "min.compaction.lag.ms": "0"}
        return {"cleanup.policy": "delete", "retention.ms": str(self.retention_ms)}


TOPICS: dict[str, TopicSpec] = {
    spec.name: spec
    for spec in (
        TopicSpec("tasks", "sample_id", ev.TaskEvent, 4, doc="feeder -> rollout"),
        TopicSpec("env.requests", "episode_id", ev.EnvRequestEvent, 4, doc="rollout agent loop -> env workers"),
        TopicSpec("env.responses", "episode_id", ev.EnvResponseEvent, 4, doc="env workers -> rollout agent loop"),
        TopicSpec("generations", "sample_id", ev.GenerationEvent, 4, doc="rollout -> reward router"),
        TopicSpec("scored", "group_id", ev.ScoredEvent, 4, doc="reward router, judge -> trainer"),
        TopicSpec("judge.requests", "sample_id", ev.JudgeEvent, 4, doc="reward router -> judge workers"),
        TopicSpec("weights", "latest", ev.WeightsEvent, 1, cleanup="compact", doc="trainer -> rollout, feeder"),
        TopicSpec("metrics", "step", ev.MetricsEvent, 1, doc="trainer -> recorder"),
        TopicSpec("control", "run_id", ev.ControlEvent, 1, doc="CLI -> all"),
        TopicSpec("dlq", "original key", ev.DlqEvent, 1, doc="any consumer -> recorder"),
    )
}


BATCHED_TOPICS = frozenset({"tasks", "generations", "scored", "metrics"})
"""The hot topics whose Kafka records may carry several events (``kafka.samples_per_record``)."""

_ARRAY_MARKERS = frozenset({*range(0x90, 0xA0), 0xDC, 0xDD})
_RAW_LIST = msgspec.msgpack.Decoder(list[msgspec.Raw])


def pack_values(values: Sequence[bytes]) -> bytes:
    """The value of a batched Kafka record: a msgpack array whose elements are the single-event
    encodings ``values`` (concatenated as they are, nothing is encoded again)."""
    n = len(values)
    head = bytes((0x90 | n,)) if n < 16 else (b"\xdc" + n.to_bytes(2, "big") if n < 65536
                                               else b"\xdd" + n.to_bytes(4, "big"))
    return head + b"".join(values)


def split_value(value: bytes | None) -> list[bytes] | None:
    """The single-event encodings a batched record's ``value`` carries (:func:`pack_values`), in
    order; ``None`` when it holds one event (a msgpack map: every record written before batching).
    ``msgspec.DecodeError`` when the array is damaged."""
    if not value or value[0] not in _ARRAY_MARKERS:
        return None
    return [bytes(r) for r in _RAW_LIST.decode(value)]


def count_events(value: bytes | None) -> int:
    """How many events a record's ``value`` carries, from the batched array's header alone (1 for a
    single event, 0 for a tombstone)."""
    if not value:
        return 0
    head = value[0]
    if 0x90 <= head < 0xA0:
        return head & 0x0F
    if head == 0xDC:
        return int.from_bytes(value[1:3], "big")
    if head == 0xDD:
        return int.from_bytes(value[1:5], "big")
    return 1


def decode_all(decoder: msgspec.msgpack.Decoder[Any], value: bytes) -> list[Any]:
    """Every event of a record's ``value``: one for a single event, each element of a batched one.
    The decoder's errors propagate."""
    parts = split_value(value)
    return [decoder.decode(value)] if parts is None else [decoder.decode(p) for p in parts]


class BadRunId(ValueError):
    pass


def check_run_id(run_id: str) -> str:
    """Return ``run_id`` if it is a legal run id, else raise ``BadRunId`` naming the rule."""
    if not RUN_ID_RE.match(run_id):
        raise BadRunId(f"run id {run_id!r} is invalid: use 1-120 characters of A-Z a-z 0-9 _ -")
    return run_id


@lru_cache(maxsize=1024)
def topic_name(run_id: str, name: str) -> str:
    """Kafka topic for logical ``name`` of ``run_id`` (``rs.<run_id>.<name>``)."""
    if name not in TOPICS:
        raise KeyError(f"unknown topic {name!r}; known: {', '.join(TOPICS)}")
    return f"{TOPIC_PREFIX}.{check_run_id(run_id)}.{name}"


@lru_cache(maxsize=1024)
def parse_topic(topic: str) -> tuple[str, str] | None:
    """``rs.<run_id>.<name>`` -> ``(run_id, name)``; ``None`` for topics that are not ours.
    Cached: every consumed event and every output asks it of one of a few topic names."""
    if not topic.startswith(TOPIC_PREFIX + "."):
        return None
    rest = topic[len(TOPIC_PREFIX) + 1 :]
    run_id, _, name = rest.partition(".")
    if name not in TOPICS or not RUN_ID_RE.match(run_id):
        return None
    return run_id, name


def spec_for_topic(topic: str) -> TopicSpec | None:
    parsed = parse_topic(topic)
    return TOPICS[parsed[1]] if parsed else None
