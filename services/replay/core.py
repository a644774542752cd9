"""``rollstream replay``: re-publish a recorded run, or re-score it under a changed config.

Both modes read the run's ``events`` table (every message the recorder stored, payload as
msgspec JSON) and decode each row back into its :mod:`schemas.events` Struct.

**``--into NEW_RUN``** (:func:`replay_into`) re-publishes the record (or a slice of it) into
``NEW_RUN``'s topics, created with :meth:`TopicAdmin.ensure_run_topics`:

* every event keeps its ``event_id``, ``ts``, payload, key and partition; only ``run_id`` is
  rewritten to ``NEW_RUN`` (in nested events too: a ``Generation``'s ``task``, a
  ``ScoredSample``'s ``generation``). Undecodable records go out as their original bytes.
* *original order*: Kafka only ever ordered messages within one partition, so that order is
  kept exactly (each partition is read in offset order and sent to the same partition number
  by an idempotent producer). Across partitions and topics the streams are interleaved by the
  recorded event time ``ts`` (a k-way merge of the partitions' heads; ties by topic registry
  order, partition, offset) — the order in which the services created the events, which is the
  causal order up to clock resolution. The Kafka record timestamps of the copies are the
  replay's own time (old timestamps would fall outside the topics' retention at once).
* ``NEW_RUN``'s topics must not hold messages yet, and ``runs/NEW_RUN/config.yaml`` is written
  (the source run's config plus ``--set`` overrides, ``model.path`` pointing at the source run's
  model, an embedded store of its own) so ``rollstream service NAME --run NEW_RUN`` can consume
  the replayed traffic.

**``--rescore``** (:func:`rescore`) runs the reward verifiers again over the recorded
generations with the run's recorded config plus ``--set`` overrides (scoring exactly as the
reward router does, :func:`services.reward_router.score`), and recomputes each recorded training
batch's per-sample advantages with the old and the new config
(:func:`trainer.algorithm.sample_advantages`); it reports per domain how rewards and advantages
would change. Nothing is published.

**Step slice** ``--from-step A --to-step B`` (:func:`step_slice`): the steps ``A..B`` (their
``TrainStep`` and ``EvalResult``), the weights they started from and produced
(``WeightsPublished`` with version ``v`` or ``v + 1`` for each step's version ``v``), and every
event of the samples the trainer decided on in those steps: trained in one of them, or dropped /
filtered while the trainer was at one of their versions. A sample's events are its
``RolloutTask``, ``Generation``, ``ScoredSample``, ``SampleOutcome``, dead letters naming it, and
the environment events of its episodes. Control events and undecodable records belong to no step
and are left out of a slice.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import functools
import heapq
import math
import types
import typing
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import yaml

from schemas import events as ev
from schemas.config import KafkaSettings, RunConfig, parse_raw, to_dict
from schemas.topics import TOPICS, check_run_id, topic_name
from services import store as st

Progress = Callable[[str], None]
TOPIC_RANK = {name: i for i, name in enumerate(TOPICS)}
PAGE_ROWS = 2000
"""Rows fetched per query while streaming one partition of the record."""
ADV_TOL = 1e-6
"""An advantage moved when ``|new - old|`` exceeds this."""


class ReplayError(RuntimeError):
    """A replay problem, as one line for the user."""


def _quiet(_: str) -> None:
    pass


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
    """``--into``: the run whose topics receive the copy."""
    topics: list[str] = msgspec.field(default_factory=list)
    """``--into``: logical topics to re-publish; empty = all."""
    kafka: KafkaSettings = msgspec.field(default_factory=KafkaSettings)
    """``--into``: how to reach Kafka; the default = the recorded config's ``kafka`` section (after
    ``overrides``)."""
    bootstrap: str = ""
    """``--into``: bootstrap address (empty = ``kafka.bootstrap`` / ``$ROLLSTREAM_BOOTSTRAP``)."""

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
            raise ReplayError(f"cannot replay run {s.run_id} into itself; name a new run with --into")


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

    @property
    def order_key(self) -> tuple[int, int, int, int]:
        """Merge key across partitions: ``(ts, topic rank, partition, offset)``."""
        return (self.ts_us, TOPIC_RANK.get(self.name, len(TOPIC_RANK)), self.partition, self.offset)


def _run_config_file(runs_dir: Path, run_id: str) -> Path:
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
    cfg_path = _run_config_file(runs_dir, s.run_id)
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
    recorder (:func:`services.store.connect_reader`), so replay works during a run too."""
    client = st.connect_reader(record_dsn(s))
    try:
        n = client.query("SELECT count() FROM events WHERE run_id = {r:String}",
                         parameters={"r": s.run_id}).result_rows[0][0]
    except Exception as e:
        raise ReplayError(f"cannot read the record of run {s.run_id}: {_first_line(e)}") from None
    if not n:
        raise ReplayError(f"run {s.run_id} has no recorded events")
    return client


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


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
    """The recorded messages of one partition in offset order, decoded, fetched a page at a time."""
    topic = topic_name(run_id, name)
    next_offset = 0
    while True:
        rows = client.query(
            "SELECT offset, toUnixTimestamp64Micro(ts), key, kind, payload FROM events FINAL "
            "WHERE topic = {t:String} AND partition = {p:UInt32} AND offset >= {o:UInt64} "
            "ORDER BY offset LIMIT {n:UInt32}",
            parameters={"t": topic, "p": partition, "o": next_offset, "n": page_rows}).result_rows
        for offset, ts_us, key, kind, payload in rows:
            try:
                event, raw = decode_payload(name, str(kind), str(payload))
            except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as e:
                raise ReplayError(f"cannot decode the recorded message {topic}[{partition}]@{offset}: "
                                  f"{_first_line(e)}") from None
            yield StoredEvent(name, partition, int(offset), int(ts_us), str(key), str(kind), event, raw)
        if len(rows) < page_rows:
            return
        next_offset = int(rows[-1][0]) + 1


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


def _events_of(client: Any, run_id: str, name: str) -> Iterator[Any]:
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
    for e in _events_of(client, run_id, "metrics"):
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
    episodes = {e.episode_id for e in _events_of(client, run_id, "env.requests")
                if isinstance(e, ev.EnvReset) and e.sample_id in samples}
    return StepSlice(a, b, set(chosen), versions, samples, episodes)


# --------------------------------------------------------------------------- the run's config


def recorded_config(client: Any, run_id: str, runs_dir: Path) -> dict[str, Any]:
    """The run's config as a raw mapping: from its ``RunStarted`` event (what the run used), else
    ``<runs_dir>/<run_id>/config.yaml``."""
    import json

    for e in _events_of(client, run_id, "control"):
        if isinstance(e, ev.RunStarted):
            raw = json.loads(e.config_json)
            if isinstance(raw, dict):
                return raw
    path = _run_config_file(runs_dir, run_id)
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


def with_run_id(event: Any, run_id: str) -> Any:
    """``event`` with ``run_id`` replaced, in the event and in every event nested in it."""
    changes: dict[str, Any] = {"run_id": run_id}
    for f in event.__struct_fields__:
        value = getattr(event, f)
        if isinstance(value, ev.Event):
            changes[f] = with_run_id(value, run_id)
    return msgspec.structs.replace(event, **changes)


# --------------------------------------------------------------------------- --into


def new_run_config(raw: dict[str, Any], s: ReplaySettings) -> tuple[dict[str, Any], str]:
    """The config of the new run and a note (empty, or why it was kept unvalidated).

    The source run's recorded config with ``run.runs_dir`` = ``s.runs_dir``, ``model.path`` = the
    source run's model directory (when the source created its own), no embedded ``store.dsn``
    (an embedded store holds one run: the copy gets its own), then ``s.overrides``. A recorded
    config that no longer validates (written by an older version) is kept as recorded when there
    are no overrides, so the replay itself still works; with overrides it is an error.
    """
    raw = copy.deepcopy(raw)
    runs_dir = Path(s.runs_dir).resolve()
    sections = {k: raw.setdefault(k, {}) for k in ("run", "model", "store")}
    if not all(isinstance(v, dict) for v in sections.values()):
        raise ReplayError(f"the recorded config of run {s.run_id} is malformed (run/model/store are not sections)")
    sections["run"]["runs_dir"] = str(runs_dir)
    model_dir = runs_dir / s.run_id / "model"
    if not sections["model"].get("path") and (model_dir / "config.json").exists():
        sections["model"]["path"] = str(model_dir)
    if str(sections["store"].get("dsn") or "").startswith("chdb:"):
        sections["store"]["dsn"] = ""
    try:
        return to_dict(run_config(raw, s.overrides, s.run_id)), ""
    except ReplayError as e:
        if s.overrides:
            raise
        return raw, f"{e}; written as recorded"


def _kafka_of(cfg: dict[str, Any]) -> KafkaSettings:
    """The ``kafka`` section of a raw config, or the defaults when it does not validate."""
    try:
        return msgspec.convert(cfg.get("kafka") or {}, KafkaSettings, strict=False)
    except msgspec.ValidationError:
        return KafkaSettings()


@dataclass
class IntoSummary:
    """What :func:`replay_into` published."""

    run_id: str
    into: str
    steps: tuple[int, int] | None
    """The step range replayed (``None`` = the whole record)."""
    published: dict[str, int]
    """Logical topic -> events published, for every topic asked for."""
    read: int
    """Recorded messages read (published plus those outside the slice)."""
    config_path: str
    """The new run's ``config.yaml``."""
    config_note: str = ""
    """Non-empty when the recorded config did not validate and was written as recorded."""

    @property
    def total(self) -> int:
        return sum(self.published.values())

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "into": self.into,
                "steps": list(self.steps) if self.steps else None, "topics": self.published,
                "total": self.total, "read": self.read, "config": self.config_path,
                "config_note": self.config_note}


async def replay_into(s: ReplaySettings, progress: Progress = _quiet) -> IntoSummary:
    """Re-publish the record of ``s.run_id`` (or its step slice) into ``s.into``'s topics.

    See the module doc for the order, the rewriting and the slice. Raises :class:`ReplayError`
    when the target run's topics already hold messages or a send fails.
    """
    from aiokafka.errors import KafkaError

    from services.kafka.bus import Producer, TopicAdmin, message_count, one_line, resolve_bootstrap

    check_settings(s)
    if not s.into:
        raise ReplayError("replay_into needs a target run (--into)")
    names = list(dict.fromkeys(s.topics)) or list(TOPICS)
    client = open_record(s)
    progress(f"reading the record of {s.run_id}...")
    cfg, note = new_run_config(recorded_config(client, s.run_id, Path(s.runs_dir)), s)
    parts = recorded_partitions(client, s.run_id, names)
    sl = step_slice(client, s.run_id, s.from_step, s.to_step) if s.sliced else None
    total = sum(sum(p.values()) for p in parts.values())

    kafka = s.kafka if s.kafka != KafkaSettings() else _kafka_of(cfg)
    bootstrap = resolve_bootstrap(kafka, s.bootstrap or None)
    async with TopicAdmin(kafka, bootstrap) as admin:
        existing = {i.topic: i.partitions for i in (await admin.describe(s.into)).values()}
        if existing and (held := await message_count(kafka, bootstrap, existing)):
            raise ReplayError(f"run {s.into} already has {held} messages on its topics; replay into a new run id")
        await admin.ensure_run_topics(s.into)
        infos = await admin.describe(s.into)
    for name, ps in parts.items():
        if ps and max(ps) >= infos[name].partitions:
            raise ReplayError(f"topic {infos[name].topic} has {infos[name].partitions} partitions; the record "
                              f"of {s.run_id} uses partition {max(ps)}")
    config_path = Path(s.runs_dir).resolve() / s.into / "config.yaml"
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))

    published: Counter[str] = Counter({n: 0 for n in names})
    read = 0
    pending: list[asyncio.Future[Any]] = []
    async with Producer(kafka, bootstrap, client_suffix="replay") as producer:
        try:
            for rec in read_in_order(client, s.run_id, parts):
                read += 1
                if sl is not None and (rec.event is None or not sl.contains(rec.event)):
                    continue
                value = producer.encode(with_run_id(rec.event, s.into)) if rec.event is not None else rec.raw
                pending.append(await producer.send_raw(topic_name(s.into, rec.name), value, rec.key or None,
                                                       partition=rec.partition))
                published[rec.name] += 1
                if len(pending) >= 500:
                    await asyncio.gather(*pending)
                    pending.clear()
                    progress(f"replaying {s.run_id} -> {s.into}: read {read}/{total}, "
                             f"published {sum(published.values())}")
            await asyncio.gather(*pending)
        except KafkaError as e:  # a send the broker refused (size, authorization, ...)
            raise ReplayError(f"publishing into run {s.into} failed: {one_line(e)}") from None
    return IntoSummary(s.run_id, s.into, (sl.first, sl.last) if sl else None, dict(published), read,
                       str(config_path), note)


# --------------------------------------------------------------------------- --rescore


@dataclass
class _Rescored:
    scored: ev.ScoredSample
    new: ev.ScoredSample
    step: int = -1
    adv_old: float | None = None
    adv_new: float | None = None

    @property
    def reward_changed(self) -> bool:
        return not _same(self.scored.reward, self.new.reward)


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _advantages(cfg: RunConfig, rewards: list[float], groups: list[str]) -> list[float]:
    """Per-sample advantages of one batch under ``cfg.algorithm`` (the trainer's estimator)."""
    import torch

    from trainer.algorithm import sample_advantages

    index = {g: i for i, g in enumerate(dict.fromkeys(groups))}
    adv = sample_advantages(cfg.algorithm, torch.tensor(rewards, dtype=torch.float),
                            torch.tensor([index[g] for g in groups]))
    return [float(a) for a in adv]


def _domain_stats(items: list[_Rescored], groups: dict[Any, list[_Rescored]]) -> dict[str, Any]:
    """Report numbers of ``items`` (rescored samples) and ``groups`` (trained (step, group) -> members)."""
    n = len(items)
    trained = [r for r in items if r.adv_old is not None]
    deltas = [abs((r.adv_new or 0.0) - (r.adv_old or 0.0)) for r in trained]
    return {
        "samples": n,
        "reward_mean_old": sum(r.scored.reward for r in items) / n if n else None,
        "reward_mean_new": sum(r.new.reward for r in items) / n if n else None,
        "rewards_changed": sum(r.reward_changed for r in items),
        "trained_samples": len(trained),
        "groups": len(groups),
        "groups_adv_changed": sum(
            any(abs((r.adv_new or 0.0) - (r.adv_old or 0.0)) > ADV_TOL for r in members)
            for members in groups.values()),
        "max_abs_delta_adv": max(deltas, default=0.0),
    }


def _example(r: _Rescored) -> dict[str, Any]:
    task = r.scored.generation.task
    return {
        "sample_id": task.sample_id, "domain": task.domain, "step": r.step,
        "verifier_old": r.scored.verifier, "verifier_new": r.new.verifier,
        "reward_old": r.scored.reward, "reward_new": r.new.reward,
        "adv_old": r.adv_old, "adv_new": r.adv_new,
        "response": r.scored.generation.response_text[:120], "reference": task.reference[:80],
        "details_new": r.new.details[:160],
    }


def rescore(s: ReplaySettings, progress: Progress = _quiet, examples: int = 5) -> dict[str, Any]:
    """Re-score the run's recorded generations with its config plus ``s.overrides``.

    Every recorded ``ScoredSample`` (of the step slice, if one is given) is scored again by
    :func:`services.reward_router.score` with the new config; every recorded ``TrainStep`` batch (its
    ``sample_ids``, in batch order, as the trainer assembled it) gets its per-sample advantages
    computed from the old and from the new rewards, each with its config's ``algorithm``. The
    batch composition is held as recorded (a changed reward does not re-run the staleness or
    dynamic filters). Returns the report as JSON-able data: ``total`` and ``domains`` (per task
    domain: samples, mean reward old/new, rewards changed, trained samples, groups, groups
    whose advantages changed, max |Δadvantage|) and up to ``examples`` changed samples.
    """
    from envs.registry import VERIFIERS
    from services.reward_router import score, verifier_table

    check_settings(s)
    client = open_record(s)
    progress(f"reading the record of {s.run_id}...")
    raw = recorded_config(client, s.run_id, Path(s.runs_dir))
    old_cfg = run_config(raw, [], s.run_id)
    new_cfg = run_config(raw, s.overrides, s.run_id)
    table = verifier_table(new_cfg)
    for domain, (verifier, _) in table.items():
        if verifier not in VERIFIERS:
            raise ReplayError(f"domain {domain!r}: unknown verifier {verifier!r}; registered: "
                              f"{', '.join(sorted(VERIFIERS))}")
    sl = step_slice(client, s.run_id, s.from_step, s.to_step) if s.sliced else None
    steps = train_steps(client, s.run_id)
    if sl is not None:
        steps = {k: v for k, v in steps.items() if k in sl.steps}

    items: dict[str, _Rescored] = {}
    recorded = [e for e in _events_of(client, s.run_id, "scored")
                if isinstance(e, ev.ScoredSample) and (sl is None or sl.contains(e))]
    for i, smp in enumerate(recorded):
        sid = smp.generation.task.sample_id
        if sid not in items:
            items[sid] = _Rescored(smp, score(smp.generation, table, new_cfg.reward))
        if i % 200 == 0:
            progress(f"rescoring {s.run_id}: {i}/{len(recorded)} samples")

    groups: dict[str, dict[Any, list[_Rescored]]] = defaultdict(dict)
    missing = 0
    for step in sorted(steps):
        batch = [items[sid] for sid in steps[step].sample_ids if sid in items]
        missing += len(steps[step].sample_ids) - len(batch)
        if not batch:
            continue
        gids = [r.scored.generation.task.group_id for r in batch]
        old = _advantages(old_cfg, [r.scored.reward for r in batch], gids)
        new = _advantages(new_cfg, [r.new.reward for r in batch], gids)
        for r, g, a_old, a_new in zip(batch, gids, old, new, strict=True):
            r.step, r.adv_old, r.adv_new = step, a_old, a_new
            groups[r.scored.generation.task.domain].setdefault((step, g), []).append(r)

    by_domain: dict[str, list[_Rescored]] = defaultdict(list)
    for r in items.values():
        by_domain[r.scored.generation.task.domain].append(r)
    all_groups: dict[Any, list[_Rescored]] = {(d, k): v for d, gs in groups.items() for k, v in gs.items()}
    def shift(r: _Rescored) -> float:
        return abs((r.adv_new or 0.0) - (r.adv_old or 0.0))

    # examples: changed rewards first, those that moved an advantage most at the top; then
    # samples whose advantage moved without a reward change (an algorithm override, a group mate)
    changed = sorted((r for r in items.values() if r.reward_changed), key=lambda r: -shift(r))
    moved = sorted((r for r in items.values() if not r.reward_changed and shift(r) > ADV_TOL),
                   key=lambda r: -shift(r))
    return {
        "run_id": s.run_id,
        "overrides": list(s.overrides),
        "steps": [sl.first, sl.last] if sl else None,
        "adv_estimator": {"old": old_cfg.algorithm.adv_estimator, "new": new_cfg.algorithm.adv_estimator},
        "verifiers": {d: v for d, (v, _) in table.items()},
        "train_steps": len(steps),
        "trained_samples_missing": missing,
        "total": _domain_stats(list(items.values()), all_groups),
        "domains": {d: _domain_stats(rs, groups.get(d, {})) for d, rs in sorted(by_domain.items())},
        "examples": [_example(r) for r in (changed + moved)[:examples]],
    }


def rescore_lines(report: dict[str, Any]) -> list[str]:
    """The report of :func:`rescore` as plain text lines: a table per domain, then examples."""

    def num(v: Any, fmt: str = ".4f") -> str:
        return "-" if v is None else format(v, fmt) if isinstance(v, float) else str(v)

    head = f"rescore of {report['run_id']}"
    if report["steps"]:
        head += f" (steps {report['steps'][0]}..{report['steps'][1]})"
    head += f" with {' '.join(report['overrides'])}" if report["overrides"] else " with the recorded config"
    verifiers = ", ".join(f"{d}={v}" for d, v in report["verifiers"].items())
    est = report["adv_estimator"]
    lines = [head, f"verifiers: {verifiers}; advantages: {est['old']}"
             + (f" -> {est['new']}" if est["new"] != est["old"] else "")
             + f"; {report['train_steps']} training steps", ""]
    cols = ("domain", "samples", "reward old", "reward new", "changed", "trained", "groups", "groups Δadv",
            "max |Δadv|")
    rows = [[d, str(x["samples"]), num(x["reward_mean_old"]), num(x["reward_mean_new"]), str(x["rewards_changed"]),
             str(x["trained_samples"]), str(x["groups"]), str(x["groups_adv_changed"]), num(x["max_abs_delta_adv"])]
            for d, x in [*report["domains"].items(), ("all", report["total"])]]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cols, widths, strict=True))))
    for r in rows:
        lines.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths, strict=True))))
    if report["trained_samples_missing"]:
        lines.append(f"note: {report['trained_samples_missing']} trained samples have no recorded score")
    if report["examples"]:
        lines += ["", "examples:"]
        for x in report["examples"]:
            verifier = x["verifier_old"] if x["verifier_old"] == x["verifier_new"] else \
                f"{x['verifier_old']} -> {x['verifier_new']}"
            lines.append(f"  {x['sample_id']}  step {x['step']}  {verifier}  reward {num(x['reward_old'], 'g')} -> "
                         f"{num(x['reward_new'], 'g')}  advantage {num(x['adv_old'], '.3f')} -> "
                         f"{num(x['adv_new'], '.3f')}")
            lines.append(f"    response {x['response']!r}  reference {x['reference']!r}  new: {x['details_new']}")
    return lines


def into_table(summary: IntoSummary) -> Any:
    """The summary of :func:`replay_into` as a rich table (events per topic)."""
    from rich.table import Table

    rng = f" (steps {summary.steps[0]}..{summary.steps[1]})" if summary.steps else ""
    t = Table(title=f"replayed {summary.run_id}{rng} into {summary.into}")
    t.add_column("topic")
    t.add_column("events", justify="right")
    for name, n in summary.published.items():
        t.add_row(topic_name(summary.into, name), str(n))
    t.add_row("total", str(summary.total))
    return t


__all__ = [
    "IntoSummary", "ReplayError", "ReplaySettings", "StepSlice", "StoredEvent", "check_settings",
    "decode_payload", "into_table", "merge_in_order", "parse_topics", "read_in_order", "recorded_config",
    "replay_into", "rescore", "rescore_lines", "step_slice", "with_run_id",
]
