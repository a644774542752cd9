"""``rollstream replay``: the record of a run, played back.

* ``replay into`` re-publishes a slice of the record into a new run's topics;
* ``replay rescore`` re-runs the reward router's scoring over the recorded generations;
* ``replay step`` recomputes one training step from its checkpoint (:mod:`services.replay.step`).
"""

from services.replay.core import (
    IntoSummary,
    ReplayError,
    ReplaySettings,
    StepSlice,
    StoredEvent,
    check_settings,
    decode_payload,
    into_table,
    merge_in_order,
    parse_topics,
    replay_into,
    rescore,
    rescore_lines,
    with_run_id,
)

__all__ = [
    "IntoSummary",
    "ReplayError",
    "ReplaySettings",
    "StepSlice",
    "StoredEvent",
    "check_settings",
    "decode_payload",
    "into_table",
    "merge_in_order",
    "parse_topics",
    "replay_into",
    "rescore",
    "rescore_lines",
    "with_run_id",
]
