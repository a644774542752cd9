"""The trainer's state: one msgspec Struct, saved and loaded whole by a checkpoint.

:class:`TrainerState` is everything of the stream a restarted trainer needs: the step and policy
version, the consumer positions, the undecided samples by group, the decided sample ids, the
dead-lettered members of open groups and the samples of recorded steps waiting to be re-run. The
service reads and changes it in place (:mod:`services.trainer.groups` owns the group fields) and a
checkpoint writes it as ``stream_state.msgpack`` (:mod:`services.trainer.checkpoint`).

Evolution as for events: a new field gets a default and goes last; a field never changes type.
Checkpoints written before this Struct (``StreamState``) keep the undecided samples as one list,
``buffer``; it is read into ``groups`` on load (``tests/services/fixtures``).
"""

from __future__ import annotations

import msgspec

from schemas import events as ev

__all__ = ["TrainerState", "position_key"]


def position_key(topic: str, partition: int) -> str:
    """The key of a partition in :attr:`TrainerState.positions`: ``topic:partition``."""
    return f"{topic}:{partition}"


class TrainerState(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a checkpoint keeps of the stream (see the module doc)."""

    step: int = 0
    """Training steps done (the strategy's optimizer steps): a checkpoint is of the state before step ``step``."""
    version: int = 0
    """The policy version being trained (the weights of ``version`` are the latest published)."""
    positions: dict[str, int] = {}
    """``topic:partition`` -> next offset to read: what ``groups``, ``decided`` and ``pool`` cover."""
    buffer: list[ev.ScoredSample] = []
    """Checkpoints before ``groups``: the undecided samples, groups in arrival order. Moved into
    ``groups`` when decoded, so always empty here (and not written)."""
    decided: set[str] = set()
    """Sample ids with a terminal status (dead-lettered ones included): a later copy is ignored."""
    dead: dict[str, set[str]] = {}
    """Open group id -> its dead-lettered members."""
    groups: dict[str, list[ev.ScoredSample]] = {}
    """Group id -> its undecided scored members in arrival order; groups in arrival order."""
    pool: dict[str, ev.ScoredSample] = {}
    """After a resume: sample id -> a sample of a step on the record, to be re-run from its batch."""

    def __post_init__(self) -> None:
        for s in self.buffer:
            self.groups.setdefault(s.generation.task.group_id, []).append(s)
        self.buffer = []
