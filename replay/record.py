"""The record of a run, read back: settings, decoding, order, step slices and the run's config.

Both replay modes (:mod:`replay.into`, :mod:`replay.rescore`) read the run's
``events`` table (every message the recorder stored, payload as msgspec JSON) and decode each
row back into its :mod:`schemas.events` Struct (:func:`decode_payload`).

**Order** (:func:`read_in_order`): Kafka only ever ordered messages within one partition, so
each partition is read in offset order (:func:`iter_partition`). Across partitions and topics
the streams are interleaved by the recorded event time ``ts`` (a k-way merge of the
partitions' heads; ties by topic registry order, partition, offset) — the order in which the
services created the events, which is the causal order up to clock resolution.

**Step slice** ``--from-step A --to-step B`` (:func:`step_slice`): the steps ``A..B`` (their
``TrainStep`` and ``EvalResult``), the weights they started from and produced
(``WeightsPublished`` with version ``v`` or ``v + 1`` for each step's version ``v``), and every
event of the samples the trainer decided on in those steps: trained in one of them, or dropped /
filtered while the trainer was at one of their versions. A sample's events are its
``RolloutTask``, ``Generation``, ``ScoredSample``, ``SampleOutcome``, dead letters naming it, and
the environment events of its episodes. Control events and undecodable records belong to no step
and are left out of a slice.

**The run's config** (:func:`recorded_config`, :func:`run_config`): the config the run recorded
in its ``RunStarted`` event, validated with today's schema, plus ``--set`` overrides.
"""

from __future__ import annotations

import base64
import copy
import functools
import heapq
import math
import types
import typing
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import yaml

import store as st
from schemas import events as ev
from schemas.config import KafkaSettings, RunConfig, parse_raw
from schemas.errors import one_line
from schemas.topics import TOPICS, check_run_id, topic_name

__all__ = [
    "PAGE_ROWS", "TOPIC_RANK", "Progress", "ReplayError", "ReplaySettings", "StepSlice", "StoredEvent",
    "check_settings", "decode_payload", "events_of", "iter_partition", "merge_in_order", "no_progress",
    "open_record", "parse_topics", "read_in_order", "record_dsn", "recorded_config", "recorded_partitions",
    "run_config", "run_config_file", "sample_id_of", "step_slice", "train_steps",
]

Progress = Callable[[str], None]
"""A callback that shows one line of progress."""

TOPIC_RANK = {name: i for i, name in enumerate(TOPICS)}
"""Registry order of the logical topics: breaks ties of event time when streams are merged."""
PAGE_ROWS = 2000
"""Rows fetched per query while streaming one partition of the record."""


class ReplayError(RuntimeError):
    """A replay problem, as one line for the user."""


def no_progress(_: str) -> None:
    """A :data:`Progress` callback that shows nothing."""


class ReplaySettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What to replay and where from (both modes)."""

    run_id: str
    """The recorded run."""
    runs_dir: str = "runs"
    """Directory of run folders (``<runs_dir>/<run_id>/store`` is the default record)."""
    store: str = ""
    """Store DSN of the record; empty = the run's embedded store (or its config's ``store.dsn``)."""
    from_step: int | None = None
    """First training step of the slice (``None`` = from the first)."""
    to_step: int | None = None
    """Last training step of the slice, inclusive (``None`` = to the last)."""
    overrides: list[str] = msgspec.field(default_factory=list)
    """``section.key=value`` overrides of the run's recorded config."""
    into: str = ""
    """``replay into``: the run whose topics receive the copy."""
    topics: list[str] = msgspec.field(default_factory=list)
    """``replay into``: logical topics to re-publish; empty = all."""
    kafka: KafkaSettings = msgspec.field(default_factory=KafkaSettings)
    """``replay into``: how to reach Kafka; the default = the recorded config's ``kafka`` section (after
    ``overrides``)."""
    bootstrap: str = ""
    """``replay into``: bootstrap address (``--bootstrap``); empty = the rest of
    :func:`runtime.probe.find_bootstrap`: ``$ROLLSTREAM_BOOTSTRAP``, ``kafka.bootstrap``, the local broker."""
    local_bootstrap: str = ""
    """``replay into``: the address of the broker running in the local stack's home, the last resort
    (the CLI gives it: :func:`infra.kafka.broker.local_bootstrap`; replay does not know the home)."""

    @property
    def sliced(self) -> bool:
        return self.from_step is not None or self.to_step is not None


def check_settings(s: ReplaySettings) -> None:
    """Raise :class:`ReplayError` for settings that cannot work (before touching any store)."""
    check_run_id(s.run_id)
    for flag, value in (("--from-step", s.from_step), ("--to-step", s.to_step)):
        if value is not None and value < 0:
            raise ReplayError(f"{flag} {value}: steps start at 0")
    if s.from_step is not None and s.to_step is not None and s.from_step > s.to_step:
        raise ReplayError(f"--from-step {s.from_step} is after --to-step {s.to_step}")
    unknown = [t for t in s.topics if t not in TOPICS]
    if unknown:
        raise ReplayError(f"unknown topic {unknown[0]!r} in --topics; known: {', '.join(TOPICS)}")
    if s.into:
        check_run_id(s.into)
        if s.into == s.run_id:
            raise ReplayError(f"cannot replay run {s.run_id} into itself; name a new run as NEW_RUN")


def parse_topics(text: str) -> list[str]:
    """``"tasks, generations"`` -> ``["tasks", "generations"]`` (names are checked by :func:`check_settings`)."""
    return [t.strip() for t in text.split(",") if t.strip()]


# --------------------------------------------------------------------------- reading the record


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """One recorded message, decoded back into its event."""

    name: str
    """Logical topic (``tasks``, ...)."""
    partition: int
    offset: int
    ts_us: int
    """The event's ``ts`` as recorded, microseconds."""
    key: str
    """The message key as recorded (UTF-8); empty = no key."""
    kind: str
    """Event type name, or ``undecodable``."""
    event: Any
    """The decoded event; ``None`` for an undecodable record."""
    raw: bytes | None = None
    """An undecodable record's original bytes."""
    index: int = 0
    """Which event of its Kafka record it is (a batched record holds several)."""

    @property
    def order_key(self) -> tuple[int, int, int, int, int]:
        """Merge key across partitions: ``(ts, topic rank, partition, offset, index)``."""
        return (self.ts_us, TOPIC_RANK.get(self.name, len(TOPIC_RANK)), self.partition, self.offset, self.index)


def run_config_file(runs_dir: Path, run_id: str) -> Path:
    """``<runs_dir>/<run_id>/config.yaml``."""
    return runs_dir / run_id / "config.yaml"


def record_dsn(s: ReplaySettings) -> str:
    """The record's DSN: ``--store``, else the run config's ``store.dsn``, else the run's embedded
    store. Raises :class:`ReplayError` for an unknown run or one without a store."""
    if s.store:
        st.check_dsn(s.store)
        return s.store
    runs_dir = Path(s.runs_dir)
    run_dir = runs_dir / s.run_id
    if not run_dir.is_dir():
        raise ReplayError(f"unknown run {s.run_id!r}: no directory {run_dir}")
    cfg_path = run_config_file(runs_dir, s.run_id)
    if cfg_path.exists():
        raw = yaml.safe_load(cfg_path.read_text()) or {}
        dsn = ((raw.get("store") or {}).get("dsn") or "") if isinstance(raw, dict) else ""
        if dsn:
            return str(dsn)
    dsn = st.default_dsn(runs_dir, s.run_id)
    if not Path(st.chdb_path(dsn)).is_dir():
        raise ReplayError(f"run {s.run_id} has no store at {st.chdb_path(dsn)}")
    return dsn


def open_record(s: ReplaySettings) -> Any:
    """A read-only client on the run's record (:class:`ReplayError` if it recorded nothing).

    While the run is going its recorder holds the embedded store; the client then asks the
    recorder (:func:`store.connect_reader`), so replay works during a run too."""
    client = st.connect_reader(record_dsn(s))
    try:
        n = client.query("SELECT count() FROM events WHERE run_id = {r:String}",
                         parameters={"r": s.run_id}).result_rows[0][0]
    except Exception as e:
        raise ReplayError(f"cannot read the record of run {s.run_id}: {one_line(e, 300, typed=False)}") from None
    if not n:
        raise ReplayError(f"run {s.run_id} has no recorded events")
    return client


def recorded_partitions(client: Any, run_id: str, names: Iterable[str]) -> dict[str, dict[int, int]]:
    """Logical topic -> partition -> number of recorded messages, for ``names`` that have any."""
    topics = [topic_name(run_id, n) for n in names]
    rows = client.query(
        "SELECT name, partition, count() FROM events FINAL WHERE topic IN {t:Array(String)} "
        "GROUP BY name, partition ORDER BY name, partition", parameters={"t": topics}).result_rows
    out: dict[str, dict[int, int]] = defaultdict(dict)
    for name, partition, n in rows:
        out[str(name)][int(partition)] = int(n)
    return dict(out)


_DECODERS = {name: msgspec.json.Decoder(spec.event_type) for name, spec in TOPICS.items()}


def decode_payload(name: str, kind: str, payload: str) -> tuple[Any, bytes | None]:
    """``(event, None)`` for a recorded payload, or ``(None, original bytes)`` for a record the
    recorder could not decode. Non-finite floats, which the JSON record holds as ``null``, come
    back as NaN."""
    if kind == "undecodable":
        b64 = msgspec.json.decode(payload).get("undecodable_msgpack_b64") or ""
        return None, base64.b64decode(b64)
    tp = TOPICS[name].event_type
    try:
        return _DECODERS[name].decode(payload), None
    except msgspec.ValidationError:
        obj = _null_to_nan(msgspec.json.decode(payload), tp)
        return msgspec.convert(obj, tp, strict=False), None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _union_args(tp: Any) -> tuple[Any, ...]:
    origin = typing.get_origin(tp)
    return typing.get_args(tp) if origin in (typing.Union, types.UnionType) else (tp,)


def _null_to_nan(obj: Any, tp: Any) -> Any:
    """Put NaN back where a ``float`` was encoded as JSON ``null`` (walking ``tp``'s Structs,
    dicts and lists); a ``null`` where the type allows ``None`` stays ``None``."""
    options = _union_args(tp)
    if obj is None:
        return math.nan if float in options and type(None) not in options else None
    if isinstance(obj, dict):
        structs = [o for o in options if isinstance(o, type) and issubclass(o, msgspec.Struct)]
        tagged = [o for o in structs if o.__struct_config__.tag == obj.get("kind")]
        if structs:
            hints = _hints((tagged or structs)[0])
            return {k: _null_to_nan(v, hints[k]) if k in hints else v for k, v in obj.items()}
        args = next((typing.get_args(o) for o in options if typing.get_origin(o) is dict), ())
        return {k: _null_to_nan(v, args[1]) if args else v for k, v in obj.items()}
    if isinstance(obj, list):
        args = next((typing.get_args(o) for o in options if typing.get_origin(o) is list), ())
        return [_null_to_nan(v, args[0]) if args else v for v in obj]
    return obj


def iter_partition(client: Any, run_id: str, name: str, partition: int,
                   page_rows: int = PAGE_ROWS) -> Iterator[StoredEvent]:
    """The recorded events of one partition in offset order (a batched record's in its order),
    decoded, fetched a page at a time."""
    topic = topic_name(run_id, name)
    next_offset, next_index = 0, 0
    while True:
        rows = client.query(
            "SELECT offset, toUnixTimestamp64Micro(ts), key, kind, payload, record_index FROM events FINAL "
            "WHERE topic = {t:String} AND partition = {p:UInt32} "
            "AND (offset > {o:UInt64} OR (offset = {o:UInt64} AND record_index >= {i:UInt32})) "
            "ORDER BY offset, record_index LIMIT {n:UInt32}",
            parameters={"t": topic, "p": partition, "o": next_offset, "i": next_index, "n": page_rows}).result_rows
        for offset, ts_us, key, kind, payload, index in rows:
            try:
                event, raw = decode_payload(name, str(kind), str(payload))
            except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as e:
                raise ReplayError(f"cannot decode the recorded message {topic}[{partition}]@{offset}: "
                                  f"{one_line(e, 300, typed=False)}") from None
            yield StoredEvent(name, partition, int(offset), int(ts_us), str(key), str(kind), event, raw, int(index))
        if len(rows) < page_rows:
            return
        next_offset, next_index = int(rows[-1][0]), int(rows[-1][5]) + 1


def merge_in_order(streams: Iterable[Iterable[StoredEvent]]) -> Iterator[StoredEvent]:
    """Interleave per-partition streams into one: each stream's own order is kept exactly; the
    next event is the stream head with the smallest :attr:`StoredEvent.order_key` (event time)."""
    return heapq.merge(*streams, key=lambda e: e.order_key)


def read_in_order(client: Any, run_id: str, parts: dict[str, dict[int, int]]) -> Iterator[StoredEvent]:
    """Every recorded message of ``parts`` (topic -> partitions) in replay order."""
    return merge_in_order(iter_partition(client, run_id, name, p) for name, ps in parts.items() for p in ps)


# --------------------------------------------------------------------------- the step slice


@dataclass
class StepSlice:
    """The events of training steps ``first..last`` (see the module doc)."""

    first: int
    last: int
    steps: set[int]
    """Recorded steps in the range."""
    versions: set[int]
    """Policy versions those steps trained."""
    samples: set[str]
    """Samples trained in those steps or rejected while the trainer was at one of their versions."""
    episodes: set[str]
    """Environment episodes of those samples."""

    @property
    def weight_versions(self) -> set[int]:
        """Versions the steps started from and the versions they produced."""
        return self.versions | {v + 1 for v in self.versions}

    def contains(self, e: Any) -> bool:
        """Whether event ``e`` belongs to the slice."""
        if isinstance(e, ev.TrainStep | ev.EvalResult):
            return e.step in self.steps
        if isinstance(e, ev.WeightsPublished):
            return e.policy_version in self.weight_versions
        if isinstance(e, ev.EnvStep | ev.EnvObservation):
            return e.episode_id in self.episodes
        sid = sample_id_of(e)
        return bool(sid) and sid in self.samples


def sample_id_of(e: Any) -> str:
    """The sample an event is about ("" if none)."""
    if isinstance(e, ev.RolloutTask | ev.SampleOutcome | ev.EnvReset | ev.DeadLetter):
        return e.sample_id
    if isinstance(e, ev.Generation):
        return e.task.sample_id
    if isinstance(e, ev.ScoredSample):
        return e.generation.task.sample_id
    return ""


def events_of(client: Any, run_id: str, name: str) -> Iterator[Any]:
    """The decoded events recorded on logical topic ``name``, in replay order."""
    parts = recorded_partitions(client, run_id, [name]).get(name, {})
    for rec in read_in_order(client, run_id, {name: parts}):
        if rec.event is not None:
            yield rec.event


def train_steps(client: Any, run_id: str) -> dict[int, ev.TrainStep]:
    """step -> its recorded ``TrainStep`` (the first one recorded for the step)."""
    return _steps_and_outcomes(client, run_id)[0]


def _steps_and_outcomes(client: Any, run_id: str) -> tuple[dict[int, ev.TrainStep], list[ev.SampleOutcome]]:
    steps: dict[int, ev.TrainStep] = {}
    outcomes: list[ev.SampleOutcome] = []
    for e in events_of(client, run_id, "metrics"):
        if isinstance(e, ev.TrainStep):
            steps.setdefault(e.step, e)
        elif isinstance(e, ev.SampleOutcome):
            outcomes.append(e)
    return steps, outcomes


def step_slice(client: Any, run_id: str, first: int | None, last: int | None) -> StepSlice:
    """The slice of steps ``first..last`` (``None`` = open end) of the recorded run.

    Raises :class:`ReplayError` when the run recorded no step or the range holds none.
    """
    steps, outcomes = _steps_and_outcomes(client, run_id)
    if not steps:
        raise ReplayError(f"run {run_id} recorded no training steps; a step range needs some")
    lo, hi = min(steps), max(steps)
    a = lo if first is None else first
    b = hi if last is None else last
    chosen = {k: v for k, v in steps.items() if a <= k <= b}
    if not chosen:
        want = f"in {first}..{last}" if first is not None and last is not None else \
            f">= {first}" if first is not None else f"<= {last}"
        raise ReplayError(f"run {run_id} recorded steps {lo}..{hi}, none {want}")
    versions = {t.policy_version for t in chosen.values()}
    samples = {sid for t in chosen.values() for sid in t.sample_ids}
    for e in outcomes:
        if (e.status == "trained" and e.step in chosen) or (e.status != "trained" and e.trained_version in versions):
            samples.add(e.sample_id)
    episodes = {e.episode_id for e in events_of(client, run_id, "env.requests")
                if isinstance(e, ev.EnvReset) and e.sample_id in samples}
    return StepSlice(a, b, set(chosen), versions, samples, episodes)


# --------------------------------------------------------------------------- the run's config


def recorded_config(client: Any, run_id: str, runs_dir: Path) -> dict[str, Any]:
    """The run's config as a raw mapping: from its ``RunStarted`` event (what the run used), else
    ``<runs_dir>/<run_id>/config.yaml``."""
    import json

    for e in events_of(client, run_id, "control"):
        if isinstance(e, ev.RunStarted):
            raw = json.loads(e.config_json)
            if isinstance(raw, dict):
                return raw
    path = run_config_file(runs_dir, run_id)
    if path.exists():
        raw = yaml.safe_load(path.read_text())
        if isinstance(raw, dict):
            return raw
    raise ReplayError(f"run {run_id} has no recorded config (no RunStarted event and no {path})")


def run_config(raw: dict[str, Any], overrides: list[str], run_id: str) -> RunConfig:
    """Validate the recorded config, then the recorded config plus ``overrides``, with the current
    schema (a bad override raises :class:`schemas.config.ConfigError` naming the key)."""
    from schemas.config import ConfigError

    try:
        cfg = parse_raw(copy.deepcopy(raw))
    except ConfigError as e:
        raise ReplayError(f"the recorded config of run {run_id} does not validate: {e}") from None
    return typing.cast(RunConfig, parse_raw(copy.deepcopy(raw), overrides) if overrides else cfg)
