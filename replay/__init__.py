"""``rollstream replay``: the record of a run, played back.

* ``replay into`` re-publishes a slice of the record into a new run's topics;
* ``replay rescore`` re-runs the reward router's scoring over the recorded generations;
* ``replay step`` recomputes one training step from its checkpoint (:mod:`replay.step`).

Both re-publishing and re-scoring read the record through :mod:`replay.record`
(decoding, order, step slices, the run's config); :mod:`replay.into` and
:mod:`replay.rescore` hold the two modes.
"""

from replay.into import IntoSummary, into_table, replay_into, with_run_id
from replay.record import (
    ReplayError,
    ReplaySettings,
    StepSlice,
    StoredEvent,
    check_settings,
    decode_payload,
    merge_in_order,
    parse_topics,
)
from replay.rescore import rescore, rescore_lines

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
