"""Pure mapping from recorded Kafka messages to rows of the store's tables.

``events`` gets every message (the raw record: payload as JSON); the typed tables
(``sample_tasks``, ``sample_generations``, ``sample_rewards``, ``sample_outcomes``,
``train_steps``, ``evals``, ``weights``, ``dlq``, ``env_events``, ``service_events``) get one row
per fact they describe (a ``JudgeRequest`` only goes to ``events``: the judged sample reaches
``sample_rewards`` as the judge's ``ScoredSample``). ``recorder_lag`` rows come from the recorder
itself (:func:`lag_row`).
Column lists here match ``infra/clickhouse/*.sql``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import msgspec

from schemas import events as ev

COLUMNS: dict[str, list[str]] = {
    "events": ["topic", "partition", "offset", "run_id", "name", "kind", "key", "event_id", "ts",
               "policy_version", "payload", "record_index"],
    "sample_tasks": ["run_id", "sample_id", "group_id", "prompt_id", "domain", "issued_version", "issued_ts"],
    "sample_generations": ["run_id", "sample_id", "policy_version", "policy_version_end", "response_len",
                           "finish_reason", "worker_id", "queued_s", "gen_s", "env_s", "generated_ts", "num_turns",
                           "episode_id", "env_finish", "env_error", "success", "step_rewards", "turn_versions",
                           "state_hashes"],
    "sample_rewards": ["run_id", "sample_id", "reward", "rewards", "verifier", "details", "reward_s", "scored_ts",
                       "judge", "judge_s", "judge_error"],
    "sample_outcomes": ["run_id", "sample_id", "group_id", "status", "reason", "policy_version",
                        "trained_version", "step", "decided_ts"],
    "train_steps": ["run_id", "step", "policy_version", "ts", "metrics", "staleness_hist", "num_samples"],
    "evals": ["run_id", "step", "policy_version", "split", "ts", "metrics"],
    "weights": ["run_id", "policy_version", "step", "uri", "format", "checksum", "num_bytes", "ts"],
    "dlq": ["run_id", "source_topic", "partition", "offset", "sample_id", "service", "stage", "error", "ts",
            "group_id", "record_index"],
    "env_events": ["run_id", "episode_id", "sample_id", "kind", "step", "env", "policy_version", "text", "reward",
                   "terminated", "truncated", "error", "event_id", "ts", "env_s", "failed"],
    "recorder_lag": ["run_id", "group_id", "ts", "lag_records", "partitions", "recorded_total", "skipped_total"],
    "service_events": ["run_id", "service", "kind", "pid", "previous_pid", "exit_code", "restarts", "reason",
                       "backoff_s", "event_id", "ts"],
}
TEXT_MAX_CHARS = 2000
"""Free text (verifier details, env actions and observations) is cut to this many characters."""

_json = msgspec.json.Encoder()


def dt(ts: float) -> int:
    """Unix seconds -> microseconds since the epoch: the ticks of a ``DateTime64(6)`` column, which
    clickhouse-connect writes as they are (a ``datetime`` per row cost the recorder 5% of its CPU)."""
    return round(ts * 1_000_000)


def event_row(topic: str, partition: int, offset: int, run_id: str, name: str, key: bytes | None,
              event: ev.Event | None, raw: bytes | None, ts: float, index: int = 0) -> list[Any]:
    """The ``events`` row of one event (an undecodable one is kept with kind ``undecodable``);
    ``index``: which event of its Kafka record it is."""
    if event is None:
        payload = _json.encode({"undecodable_msgpack_b64": raw or b""}).decode()
        return [topic, partition, offset, run_id, name, "undecodable", _key(key), "", dt(ts), -1, payload, index]
    version = getattr(event, "policy_version", -1)
    return [topic, partition, offset, run_id, name, type(event).__name__, _key(key), event.event_id,
            dt(event.ts), int(version), _json.encode(event).decode(), index]


def typed_rows(event: ev.Event) -> dict[str, list[list[Any]]]:
    """Rows for the typed tables that ``event`` contributes to (may be empty)."""
    out: dict[str, list[list[Any]]] = defaultdict(list)
    typed = typed_row(event)
    if typed is not None:
        out[typed[0]].append(typed[1])
    return out


def typed_row(event: ev.Event) -> tuple[str, list[Any]] | None:
    """The typed table ``event`` contributes a row to and the row, ``None`` when none (every event
    makes at most one typed row): the recorder's per-event call, a lookup by the event's type."""
    make = _TYPED.get(type(event))
    return None if make is None else make(event)


def _task(e: ev.RolloutTask) -> tuple[str, list[Any]]:
    return "sample_tasks", [e.run_id, e.sample_id, e.group_id, e.prompt_id, e.domain, e.policy_version, dt(e.ts)]


def _generation(e: ev.Generation) -> tuple[str, list[Any]]:
    return "sample_generations", [
        e.run_id, e.task.sample_id, e.policy_version, e.policy_version_end, len(e.response_ids), e.finish_reason,
        e.worker_id, e.queued_s, e.gen_s, e.env_s, dt(e.ts), e.num_turns, e.episode_id, e.env_finish,
        e.env_error[:TEXT_MAX_CHARS], int(e.success), [float(x) for x in e.step_rewards],
        [int(v) for v in e.turn_versions], list(e.state_hashes)]


def _scored(e: ev.ScoredSample) -> tuple[str, list[Any]]:
    return "sample_rewards", [e.run_id, e.generation.task.sample_id, e.reward, dict(e.rewards), e.verifier,
                              e.details[:TEXT_MAX_CHARS], e.reward_s, dt(e.ts), e.judge, float(e.judge_s),
                              e.judge_error[:TEXT_MAX_CHARS]]


def _outcome(e: ev.SampleOutcome) -> tuple[str, list[Any]]:
    return "sample_outcomes", [e.run_id, e.sample_id, e.group_id, e.status, e.reason, e.policy_version,
                               e.trained_version, e.step, dt(e.ts)]


def _train_step(e: ev.TrainStep) -> tuple[str, list[Any]]:
    return "train_steps", [e.run_id, e.step, e.policy_version, dt(e.ts), dict(e.metrics),
                           {int(k): int(v) for k, v in e.staleness_hist.items()}, len(e.sample_ids)]


def _eval(e: ev.EvalResult) -> tuple[str, list[Any]]:
    return "evals", [e.run_id, e.step, e.policy_version, e.split, dt(e.ts), dict(e.metrics)]


def _weights(e: ev.WeightsPublished) -> tuple[str, list[Any]]:
    return "weights", [e.run_id, e.policy_version, e.step, e.uri, e.format, e.checksum, e.num_bytes, dt(e.ts)]


def _env_reset(e: ev.EnvReset) -> tuple[str, list[Any]]:
    return "env_events", [e.run_id, e.episode_id, e.sample_id, "EnvReset", 0, e.env.name, -1, "", 0.0, 0, 0, "",
                          e.event_id, dt(e.ts), 0.0, 0]


def _env_step(e: ev.EnvStep) -> tuple[str, list[Any]]:
    return "env_events", [e.run_id, e.episode_id, "", "EnvStep", e.step, "", e.policy_version,
                          e.action[:TEXT_MAX_CHARS], 0.0, 0, 0, "", e.event_id, dt(e.ts), 0.0, 0]


def _env_observation(e: ev.EnvObservation) -> tuple[str, list[Any]]:
    return "env_events", [e.run_id, e.episode_id, "", "EnvObservation", e.step, "", -1,
                          e.observation[:TEXT_MAX_CHARS], e.reward, int(e.terminated), int(e.truncated), e.error,
                          e.event_id, dt(e.ts), float(e.env_s), int(e.failed)]


def _dead_letter(e: ev.DeadLetter) -> tuple[str, list[Any]]:
    return "dlq", [e.run_id, e.source_topic, e.partition, e.offset, e.sample_id, e.service, e.stage, e.error,
                   dt(e.ts), e.group_id, e.index]


def _started(e: ev.ServiceStarted) -> tuple[str, list[Any]]:
    return "service_events", [e.run_id, e.service, "ServiceStarted", e.pid, 0, 0, 0, "", 0.0, e.event_id, dt(e.ts)]


def _restarted(e: ev.ServiceRestarted) -> tuple[str, list[Any]]:
    return "service_events", [e.run_id, e.service, "ServiceRestarted", e.pid, e.previous_pid, e.exit_code,
                              e.restarts, e.reason[:TEXT_MAX_CHARS], e.backoff_s, e.event_id, dt(e.ts)]


def _failed(e: ev.ServiceFailed) -> tuple[str, list[Any]]:
    return "service_events", [e.run_id, e.service, "ServiceFailed", e.pid, 0, e.exit_code, e.restarts,
                              e.reason[:TEXT_MAX_CHARS], 0.0, e.event_id, dt(e.ts)]


_TYPED: dict[type, Callable[[Any], tuple[str, list[Any]]]] = {
    ev.RolloutTask: _task, ev.Generation: _generation, ev.ScoredSample: _scored, ev.SampleOutcome: _outcome,
    ev.TrainStep: _train_step, ev.EvalResult: _eval, ev.WeightsPublished: _weights, ev.EnvReset: _env_reset,
    ev.EnvStep: _env_step, ev.EnvObservation: _env_observation, ev.DeadLetter: _dead_letter,
    ev.ServiceStarted: _started, ev.ServiceRestarted: _restarted, ev.ServiceFailed: _failed,
}
"""The typed row maker of each event type (types not here make none: ``JudgeRequest``, control events)."""


def lag_row(run_id: str, group_id: str, ts: float, lag_records: int, partitions: int, recorded_total: int,
            skipped_total: int) -> list[Any]:
    """The ``recorder_lag`` row of one lag measurement."""
    return [run_id, group_id, dt(ts), lag_records, partitions, recorded_total, skipped_total]


def _key(key: bytes | None) -> str:
    return key.decode("utf-8", "replace") if key else ""
