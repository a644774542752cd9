"""``rollstream replay into RUN NEW_RUN``: re-publish a recorded run (or its step slice) into new topics.

:func:`replay_into` re-publishes the record of a run (or a slice of it, see
:func:`replay.record.step_slice`) into ``NEW_RUN``'s topics, created with
:meth:`TopicAdmin.ensure_run_topics`:

* every event keeps its ``event_id``, ``ts``, payload, key and partition; only ``run_id`` is
  rewritten to ``NEW_RUN`` (in nested events too: a ``Generation``'s ``task``, a
  ``ScoredSample``'s ``generation``). Undecodable records go out as their original bytes.
* *original order*: each partition is read in offset order and sent to the same partition number
  by an idempotent producer, so every partition's order is kept exactly; across partitions and
  topics the events go out in recorded event time (:func:`replay.record.read_in_order`).
  The Kafka record timestamps of the copies are the replay's own time (old timestamps would fall
  outside the topics' retention at once).
* ``NEW_RUN``'s topics must not hold messages yet, and ``runs/NEW_RUN/config.yaml`` is written
  (the source run's config plus ``--set`` overrides, ``model.path`` pointing at the source run's
  model, an embedded store of its own) so ``rollstream service NAME --run NEW_RUN`` can consume
  the replayed traffic.
"""

from __future__ import annotations

import asyncio
import copy
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import yaml

from blobs import blob_dir_of, share_blobs
from replay.record import (
    Progress,
    ReplayError,
    ReplaySettings,
    check_settings,
    no_progress,
    open_record,
    read_in_order,
    recorded_config,
    recorded_partitions,
    run_config,
    step_slice,
)
from schemas import events as ev
from schemas.config import KafkaSettings, to_dict
from schemas.topics import TOPICS, topic_name

__all__ = ["IntoSummary", "into_table", "new_run_config", "replay_into", "with_run_id"]


def with_run_id(event: Any, run_id: str) -> Any:
    """``event`` with ``run_id`` replaced, in the event and in every event nested in it."""
    changes: dict[str, Any] = {"run_id": run_id}
    for f in event.__struct_fields__:
        value = getattr(event, f)
        if isinstance(value, ev.Event):
            changes[f] = with_run_id(value, run_id)
    return msgspec.structs.replace(event, **changes)


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
    bootstrap: str = ""
    """The Kafka the copy went to (:func:`runtime.probe.find_bootstrap`)."""
    blobs: int = 0
    """Blobs (a visual run's images) the new run's blob store got from the source run's."""

    @property
    def total(self) -> int:
        return sum(self.published.values())

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "into": self.into,
                "steps": list(self.steps) if self.steps else None, "topics": self.published,
                "total": self.total, "read": self.read, "config": self.config_path,
                "config_note": self.config_note, "kafka": self.bootstrap, "blobs": self.blobs}


async def replay_into(s: ReplaySettings, progress: Progress = no_progress) -> IntoSummary:
    """Re-publish the record of ``s.run_id`` (or its step slice) into ``s.into``'s topics.

    See the module doc for the order, the rewriting and the slice. Raises :class:`ReplayError`
    when the target run's topics already hold messages or a send fails.
    """
    from aiokafka.errors import KafkaError

    from runtime.bus import Producer, TopicAdmin, message_count
    from runtime.probe import NO_BROKER, find_bootstrap
    from schemas.errors import one_line

    check_settings(s)
    if not s.into:
        raise ReplayError("replay_into needs a target run (NEW_RUN)")
    names = list(dict.fromkeys(s.topics)) or list(TOPICS)
    client = open_record(s)
    progress(f"reading the record of {s.run_id}...")
    cfg, note = new_run_config(recorded_config(client, s.run_id, Path(s.runs_dir)), s)
    parts = recorded_partitions(client, s.run_id, names)
    sl = step_slice(client, s.run_id, s.from_step, s.to_step) if s.sliced else None
    total = sum(sum(p.values()) for p in parts.values())

    kafka = s.kafka if s.kafka != KafkaSettings() else _kafka_of(cfg)
    bootstrap = find_bootstrap(s.bootstrap, kafka.bootstrap, s.local_bootstrap)
    if bootstrap is None:
        raise ReplayError(NO_BROKER)
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
    runs_dir = Path(s.runs_dir).resolve()  # the events name images by digest: the new run reads them here
    blobs = share_blobs(blob_dir_of(runs_dir / s.run_id), blob_dir_of(runs_dir / s.into))

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
                       str(config_path), note, bootstrap, blobs)


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
    if summary.blobs:
        t.caption = f"{summary.blobs} blob(s) (images) shared into runs/{summary.into}/blobs"
    return t
