"""Dead letters: which sample and group a failed record was about, and the ``DeadLetter`` itself.

A dead letter names the sample (and its group) whenever the record does, so the sample can end
as ``dead_letter`` and its group complete without it (docs/architecture.md, "Events and topics"). Only the
topics that carry one sample's data name it: ``tasks`` (``RolloutTask``), ``generations``
(``Generation.task``) and ``scored`` (``ScoredSample.generation.task``). In order of trust:

1. the decoded event, when decoding worked (the handler rejected or failed on it);
2. a schemaless msgpack decode of the raw bytes (a payload of the wrong shape — a missing or
   mistyped field, an unknown tag — usually still holds the ids);
3. the record key: ``tasks`` and ``generations`` are keyed by sample id, ``scored`` by group id
   (:data:`schemas.topics.TOPICS`).

A sample id ``<group_id>/<index>`` (``RolloutTask.sample_id``) names its group too.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from runtime.bus import Record
from schemas import events as ev
from schemas.topics import parse_topic

__all__ = ["SAMPLE_TOPICS", "dead_letter_for", "group_of", "subject_ids"]

SAMPLE_TOPICS = ("tasks", "generations", "scored", "judge.requests")
"""Logical topics whose every record is about one sample."""

_ID_MAX_CHARS = 200


def group_of(sample_id: str) -> str:
    """The group named by a ``<group_id>/<index>`` sample id (empty when it has no ``/``)."""
    group, sep, index = sample_id.rpartition("/")
    return group if sep and group and index.isdigit() else ""


def _ids_of_event(event: Any) -> tuple[str, str]:
    task = None
    if isinstance(event, ev.RolloutTask):
        task = event
    elif isinstance(event, ev.Generation):
        task = event.task
    elif isinstance(event, ev.ScoredSample):
        task = event.generation.task
    elif isinstance(event, ev.JudgeRequest):
        task = event.scored.generation.task
    return (task.sample_id, task.group_id) if task is not None else ("", "")


def _ids_of_raw(raw: bytes | None) -> tuple[str, str]:
    """Ids from a schemaless decode: at the top, under ``task``, or ``generation.task``."""
    if not raw:
        return "", ""
    try:
        obj = msgspec.msgpack.decode(raw)
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError):  # hostile nesting too
        return "", ""
    for path in ((), ("task",), ("generation", "task"), ("scored", "generation", "task")):
        node: Any = obj
        for step in path:
            node = node.get(step) if isinstance(node, dict) else None
        if isinstance(node, dict):
            sid, gid = node.get("sample_id"), node.get("group_id")
            sid = sid if isinstance(sid, str) else ""
            gid = gid if isinstance(gid, str) else ""
            if sid or gid:
                return sid[:_ID_MAX_CHARS], gid[:_ID_MAX_CHARS]
    return "", ""


def _ids_of_key(name: str, key: bytes | None) -> tuple[str, str]:
    if not key:
        return "", ""
    text = key.decode("utf-8", "replace")[:_ID_MAX_CHARS]
    if name in ("tasks", "generations", "judge.requests"):
        return text, ""
    if name == "scored":
        return "", text
    return "", ""


def subject_ids(topic: str, key: bytes | None, event: Any, raw: bytes | None) -> tuple[str, str]:
    """``(sample_id, group_id)`` a record of ``topic`` names, best effort (see the module doc);
    empty strings when it names none or is not on a sample topic."""
    parsed = parse_topic(topic)
    if parsed is None or parsed[1] not in SAMPLE_TOPICS:
        return "", ""
    sid, gid = _ids_of_event(event) if event is not None else _ids_of_raw(raw)
    if not sid and not gid:
        sid, gid = _ids_of_key(parsed[1], key)
    return sid, gid or group_of(sid)


def dead_letter_for(
    rec: Record, *, run_id: str, event_id: str, service: str, stage: Literal["decode", "handle"], error: str
) -> ev.DeadLetter:
    """The ``DeadLetter`` of ``rec`` (raw bytes and key kept, sample and group named when the
    record names them)."""
    sample_id, group_id = subject_ids(rec.topic, rec.key, rec.event, rec.value_bytes)
    return ev.DeadLetter(
        run_id=run_id,
        event_id=event_id,
        source_topic=rec.topic,
        partition=rec.partition,
        offset=rec.offset,
        key=rec.key,
        value=rec.value_bytes,
        error=error,
        service=service,
        stage=stage,
        sample_id=sample_id,
        group_id=group_id,
        index=rec.index,
    )
