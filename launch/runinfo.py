"""What the broker says about a run, for ``rollstream status`` and a stalled ``rollstream run``.

:func:`probe_run` reads, with short-lived clients and without joining any group:

* per service with a consumer group (:data:`schemas.services.SERVICES`: its ``group_id`` and
  ``lag_topics``): its consumer lag, end offsets minus the group's committed offsets (a partition
  the group never committed counts from its beginning);
* the feeder's output: how many tasks it issued (its groups are numbered in order, so the newest
  task of each ``tasks`` partition tells: highest group number + 1, times the tasks per group) and
  when the newest was issued;
* the trainer's progress: the newest ``WeightsPublished`` (``weights`` is compacted: its last
  message) and the newest ``TrainStep`` (a bounded look back over ``metrics``);
* the run's ``control`` history: ``RunStarted``, every ``Drain``, ``RunFinished``, and the
  supervisor's ``ServiceRestarted`` / ``ServiceFailed``.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from runtime.bus import TopicAdmin, kafka_kwargs
from runtime.connection import start_bounded
from runtime.reading import read_to_end
from schemas import events as ev
from schemas.config import KafkaSettings
from schemas.services import SERVICES, ServiceSpec
from schemas.topics import TOPICS, count_events, decode_all, topic_name

EXACT_LAG_MAX = 200
"""A lag up to this many offsets per partition is counted event by event (records are read: a
batched record carries up to ``kafka.samples_per_record`` events, transaction markers take offsets
and carry none); a larger one is the offset difference (records, a lower bound on events)."""
METRICS_LOOK_BACK = 2000
"""How many of the newest ``metrics`` messages are searched for the newest ``TrainStep``."""


def grouped() -> list[ServiceSpec]:
    """The services whose group's lag tells how far behind they are (the feeder has no group: it
    re-reads the run on every start)."""
    return [spec for spec in SERVICES.values() if spec.grouped]


@dataclass
class RunInfo:
    """What :func:`probe_run` found (times are unix seconds)."""

    messages: dict[str, int] = field(default_factory=dict)
    """Logical topic -> messages on it (end offsets summed)."""
    lags: dict[str, dict[str, int]] = field(default_factory=dict)
    """Service -> logical topic -> lag of its group (only groups that committed something)."""
    tasks_issued: int = 0
    last_task_ts: float | None = None
    newest_group: tuple[int, int] | None = None
    """The highest group number seen on ``tasks`` and its tasks per group (``group_size`` +
    ``redundancy``, + 1 for ReMax's baseline task)."""
    weights: ev.WeightsPublished | None = None
    train_step: ev.TrainStep | None = None
    started: ev.RunStarted | None = None
    drains: list[ev.Drain] = field(default_factory=list)
    finished: ev.RunFinished | None = None
    restarts: Counter[str] = field(default_factory=Counter)
    """Service label -> ``ServiceRestarted`` events seen."""
    failed: list[ev.ServiceFailed] = field(default_factory=list)

    def lag(self, service: str) -> int | None:
        """The group's total lag, ``None`` when the group committed nothing yet."""
        per = self.lags.get(service)
        return None if per is None else sum(per.values())

    @property
    def last_progress_ts(self) -> float | None:
        """Unix time of the newest weights version or training step."""
        times = [e.ts for e in (self.weights, self.train_step) if e is not None]
        return max(times) if times else None

    def as_dict(self) -> dict[str, Any]:
        w, t = self.weights, self.train_step
        return {
            "messages": self.messages,
            "lags": self.lags,
            "tasks_issued": self.tasks_issued,
            "last_task_ts": self.last_task_ts,
            "policy_version": w.policy_version if w else None,
            "weights_step": w.step if w else None,
            "weights_ts": w.ts if w else None,
            "train_step": t.step if t else None,
            "train_step_ts": t.ts if t else None,
            "reward_mean": t.metrics.get("rollout/reward_mean") if t else None,
            "run_started_ts": self.started.ts if self.started else None,
            "drains": [{"reason": d.reason, "ts": d.ts} for d in self.drains],
            "finished": ({"status": self.finished.status, "ts": self.finished.ts, "error": self.finished.error}
                         if self.finished else None),
            "restarts": dict(self.restarts),
            "failed": [{"service": f.service, "exit_code": f.exit_code, "reason": f.reason} for f in self.failed],
        }


async def probe_run(kafka: KafkaSettings, bootstrap: str, run_id: str, *, timeout_s: float = 20.0) -> RunInfo | None:
    """What the broker holds about ``run_id`` (``None``: the run has no topics). Bounded by
    ``timeout_s``; an unreachable broker is a :class:`~runtime.bus.BusError`."""
    return await asyncio.wait_for(_probe(kafka, bootstrap, run_id), timeout=timeout_s)


async def _probe(kafka: KafkaSettings, bootstrap: str, run_id: str) -> RunInfo | None:
    info = RunInfo()
    async with TopicAdmin(kafka, bootstrap) as admin:
        described = await admin.describe(run_id)
        if not described:
            return None
        committed: dict[str, dict[TopicPartition, int]] = {}
        for spec in grouped():
            offsets = await admin.raw.list_consumer_group_offsets(spec.group_id(run_id))
            committed[spec.name] = {tp: om.offset for tp, om in offsets.items() if om.offset >= 0}
    tps = [TopicPartition(t.topic, p) for t in described.values() for p in range(t.partitions)]
    consumer = AIOKafkaConsumer(**kafka_kwargs(kafka, bootstrap, client_suffix="status"),
                                enable_auto_commit=False, isolation_level="read_committed")
    await start_bounded("consumer", consumer.start, consumer.stop, bootstrap, kafka.connect_timeout_s)
    try:
        begins = await consumer.beginning_offsets(tps)
        ends = await consumer.end_offsets(tps)
        name_of = {t.topic: name for name, t in described.items()}
        for tp in tps:
            info.messages[name_of[tp.topic]] = info.messages.get(name_of[tp.topic], 0) + ends[tp]
        # a small gap may be only transaction markers (``scored`` is written in transactions):
        # read such gaps and count the records really there
        starts = {tp: min(done.get(tp, begins[tp]) for done in committed.values() if done)
                  for tp in tps if any(committed.values())}
        small = {tp: off for tp, off in starts.items() if 0 < ends[tp] - off <= EXACT_LAG_MAX}
        present = await _record_offsets(consumer, small, ends)
        for spec in grouped():
            done = committed[spec.name]
            if not done:
                continue
            per: dict[str, int] = {}
            for tp in tps:
                name = name_of[tp.topic]
                if name in spec.lag_topics:
                    start = done.get(tp, begins[tp])
                    gap = (sum(n for o, n in present[tp] if o >= start) if tp in present
                           else max(0, ends[tp] - start))
                    per[name] = per.get(name, 0) + gap
            info.lags[spec.name] = per
        await _read_tail(consumer, info, run_id, begins, ends)
        if info.newest_group is not None:
            k, width = info.newest_group
            info.tasks_issued = (k + 1) * width
        else:  # no task of the feeder's naming: count records
            info.tasks_issued = info.messages.get("tasks", 0)
    finally:
        await consumer.stop()
    return info


async def _read_tail(consumer: AIOKafkaConsumer, info: RunInfo, run_id: str,
                     begins: dict[TopicPartition, int], ends: dict[TopicPartition, int]) -> None:
    """The newest task of each ``tasks`` partition, the last ``weights`` message, the newest
    ``metrics`` (for a ``TrainStep``) and the whole ``control`` topic."""
    wanted: dict[TopicPartition, int] = {}
    for tp in begins:
        name = tp.topic.rsplit(".", 1)[-1]
        back = {"tasks": 1, "weights": 1, "metrics": METRICS_LOOK_BACK}.get(name)
        if name == "control":
            wanted[tp] = begins[tp]
        elif back is not None:
            wanted[tp] = max(begins[tp], ends[tp] - back)
    wanted = {tp: off for tp, off in wanted.items() if off < ends[tp]}
    decoders = {name: msgspec.msgpack.Decoder(spec.event_type) for name, spec in TOPICS.items()}

    def take(tp: TopicPartition, m: Any) -> None:
        try:
            events = decode_all(decoders[tp.topic.rsplit(".", 1)[-1]], m.value) if m.value is not None else []
        except (msgspec.DecodeError, msgspec.ValidationError):
            events = []
        for event in events:  # every event of a batched record
            if event.run_id == run_id:
                _take(info, event)

    await read_to_end(consumer, take, start=wanted, ends=ends, idle_polls=2)


async def _record_offsets(consumer: AIOKafkaConsumer, starts: dict[TopicPartition, int],
                          ends: dict[TopicPartition, int]) -> dict[TopicPartition, list[tuple[int, int]]]:
    """``(offset, events)`` of the committed records between ``starts[tp]`` and the end of each
    partition (gives up quietly after two empty polls in a row)."""
    found: dict[TopicPartition, list[tuple[int, int]]] = {tp: [] for tp in starts}
    await read_to_end(consumer, lambda tp, m: found[tp].append((m.offset, count_events(m.value))),
                      start=starts, ends=ends, idle_polls=2)
    return found


def _take(info: RunInfo, event: Any) -> None:
    if isinstance(event, ev.RolloutTask):
        info.last_task_ts = max(info.last_task_ts or 0.0, event.ts)
        k = ev.group_number(event.group_id)
        if k is not None and (info.newest_group is None or k > info.newest_group[0]):
            info.newest_group = (k, event.group_size + event.redundancy + int(event.baseline_index >= 0))
    elif isinstance(event, ev.WeightsPublished):
        if info.weights is None or event.ts >= info.weights.ts:
            info.weights = event
    elif isinstance(event, ev.TrainStep):
        if info.train_step is None or event.ts >= info.train_step.ts:
            info.train_step = event
    elif isinstance(event, ev.RunStarted):
        info.started = info.started or event
    elif isinstance(event, ev.Drain):
        info.drains.append(event)
    elif isinstance(event, ev.RunFinished):
        info.finished = event
    elif isinstance(event, ev.ServiceRestarted):
        info.restarts[event.service] += 1
    elif isinstance(event, ev.ServiceFailed):
        info.failed.append(event)


def control_topic(run_id: str) -> str:
    return topic_name(run_id, "control")
