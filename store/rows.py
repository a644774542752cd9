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
    r = event.run_id
    if isinstance(event, ev.RolloutTask):
        out["sample_tasks"].append([r, event.sample_id, event.group_id, event.prompt_id, event.domain,
                                    event.policy_version, dt(event.ts)])
    elif isinstance(event, ev.Generation):
        out["sample_generations"].append([
            r, event.task.sample_id, event.policy_version, event.policy_version_end, len(event.response_ids),
            event.finish_reason, event.worker_id, event.queued_s, event.gen_s, event.env_s, dt(event.ts),
            event.num_turns, event.episode_id, event.env_finish, event.env_error[:TEXT_MAX_CHARS], int(event.success),
            [float(x) for x in event.step_rewards], [int(v) for v in event.turn_versions], list(event.state_hashes)])
    elif isinstance(event, ev.ScoredSample):
        out["sample_rewards"].append([r, event.generation.task.sample_id, event.reward, dict(event.rewards),
                                      event.verifier, event.details[:TEXT_MAX_CHARS], event.reward_s, dt(event.ts),
                                      event.judge, float(event.judge_s), event.judge_error[:TEXT_MAX_CHARS]])
    elif isinstance(event, ev.SampleOutcome):
        out["sample_outcomes"].append([r, event.sample_id, event.group_id, event.status, event.reason,
                                       event.policy_version, event.trained_version, event.step, dt(event.ts)])
    elif isinstance(event, ev.TrainStep):
        out["train_steps"].append([r, event.step, event.policy_version, dt(event.ts), dict(event.metrics),
                                   {int(k): int(v) for k, v in event.staleness_hist.items()},
                                   len(event.sample_ids)])
    elif isinstance(event, ev.EvalResult):
        out["evals"].append([r, event.step, event.policy_version, event.split, dt(event.ts), dict(event.metrics)])
    elif isinstance(event, ev.WeightsPublished):
        out["weights"].append([r, event.policy_version, event.step, event.uri, event.format, event.checksum,
                               event.num_bytes, dt(event.ts)])
    elif isinstance(event, ev.EnvReset):
        out["env_events"].append([r, event.episode_id, event.sample_id, "EnvReset", 0, event.env.name, -1, "",
                                  0.0, 0, 0, "", event.event_id, dt(event.ts), 0.0, 0])
    elif isinstance(event, ev.EnvStep):
        out["env_events"].append([r, event.episode_id, "", "EnvStep", event.step, "", event.policy_version,
                                  event.action[:TEXT_MAX_CHARS], 0.0, 0, 0, "", event.event_id, dt(event.ts), 0.0, 0])
    elif isinstance(event, ev.EnvObservation):
        out["env_events"].append([r, event.episode_id, "", "EnvObservation", event.step, "", -1,
                                  event.observation[:TEXT_MAX_CHARS], event.reward, int(event.terminated),
                                  int(event.truncated), event.error, event.event_id, dt(event.ts), float(event.env_s),
                                  int(event.failed)])
    elif isinstance(event, ev.DeadLetter):
        out["dlq"].append([r, event.source_topic, event.partition, event.offset, event.sample_id, event.service,
                           event.stage, event.error, dt(event.ts), event.group_id, event.index])
    elif isinstance(event, ev.ServiceStarted):
        out["service_events"].append([r, event.service, "ServiceStarted", event.pid, 0, 0, 0, "", 0.0,
                                      event.event_id, dt(event.ts)])
    elif isinstance(event, ev.ServiceRestarted):
        out["service_events"].append([r, event.service, "ServiceRestarted", event.pid, event.previous_pid,
                                      event.exit_code, event.restarts, event.reason[:TEXT_MAX_CHARS],
                                      event.backoff_s, event.event_id, dt(event.ts)])
    elif isinstance(event, ev.ServiceFailed):
        out["service_events"].append([r, event.service, "ServiceFailed", event.pid, 0, event.exit_code,
                                      event.restarts, event.reason[:TEXT_MAX_CHARS], 0.0, event.event_id,
                                      dt(event.ts)])
    return out


def lag_row(run_id: str, group_id: str, ts: float, lag_records: int, partitions: int, recorded_total: int,
            skipped_total: int) -> list[Any]:
    """The ``recorder_lag`` row of one lag measurement."""
    return [run_id, group_id, dt(ts), lag_records, partitions, recorded_total, skipped_total]


def _key(key: bytes | None) -> str:
    return key.decode("utf-8", "replace") if key else ""
