"""The trainer's buffer of undecided samples, by group, in arrival order.

What a group needs to complete is decided by :func:`trainer.batch.group_complete` (every member
arrived or dead-lettered); this module only keeps the state those pure functions read:

* ``groups``: group id -> its scored members not decided yet, groups in arrival order (the
  order :func:`trainer.batch.select_groups` takes them in);
* ``dead``: group id -> its members that were dead-lettered (they count towards completion and
  get no outcome from the trainer: their ``DeadLetter`` is their terminal record);
* ``decided``: every sample id with a terminal status already (trained, dropped, filtered or
  dead-lettered): a later copy of it (a redelivery, or the real sample after a dead letter
  naming it) is ignored, so no sample gets two terminal statuses;
* ``kept``: complete groups the dynamic filter already kept (not checked again).
"""

from __future__ import annotations

from collections import OrderedDict

from runtime.deadletter import group_of
from schemas import events as ev
from trainer.batch import group_complete

__all__ = ["GroupBuffer"]


class GroupBuffer:
    """Undecided scored samples by group (see the module doc)."""

    def __init__(self) -> None:
        self.groups: OrderedDict[str, list[ev.ScoredSample]] = OrderedDict()
        self.dead: dict[str, set[str]] = {}
        self.decided: set[str] = set()
        self.kept: set[str] = set()

    def __len__(self) -> int:
        """Buffered samples."""
        return sum(len(g) for g in self.groups.values())

    def add(self, sample: ev.ScoredSample) -> bool:
        """Buffer ``sample``; False when it is already decided or buffered (a duplicate)."""
        sid, gid = sample.generation.task.sample_id, sample.generation.task.group_id
        if sid in self.decided:
            return False
        group = self.groups.setdefault(gid, [])
        if any(s.generation.task.sample_id == sid for s in group):
            return False
        group.append(sample)
        return True

    def dead_letter(self, sample_id: str, group_id: str = "") -> bool:
        """A dead letter named ``sample_id``: it ends here (leaves the buffer if it was in it and
        counts as a dead member of its group). False when it was decided already (an earlier
        outcome or dead letter stands) or no sample is named."""
        if not sample_id or sample_id in self.decided:
            return False
        self.decided.add(sample_id)
        gid = group_id or group_of(sample_id)
        members = self.groups.get(gid)
        if members is not None:
            members[:] = [s for s in members if s.generation.task.sample_id != sample_id]
            if not members:
                del self.groups[gid]
                self.kept.discard(gid)
        if gid:
            self.dead.setdefault(gid, set()).add(sample_id)
        return True

    def complete(self, group_id: str) -> bool:
        """Whether every member of the buffered group arrived or was dead-lettered."""
        return group_complete(self.groups.get(group_id, []), self.dead.get(group_id, ()))

    def complete_ids(self) -> set[str]:
        """Ids of the buffered groups that are complete."""
        return {gid for gid in self.groups if self.complete(gid)}

    def dead_count(self, group_id: str) -> int:
        return len(self.dead.get(group_id, ()))

    def take(self, group_ids: list[str]) -> list[list[ev.ScoredSample]]:
        """Remove these groups (in this order) from the buffer; their members, to be decided."""
        out = []
        for gid in group_ids:
            out.append(self.groups.pop(gid, []))
            self.dead.pop(gid, None)
            self.kept.discard(gid)
        return out

    def remove(self, sample_ids: set[str]) -> list[ev.ScoredSample]:
        """Take these samples out of the buffer (not decided by that); groups left empty go, with
        their dead-lettered members. Returns the samples removed (arrival order)."""
        out: list[ev.ScoredSample] = []
        for gid in list(self.groups):
            members = self.groups[gid]
            out += [s for s in members if s.generation.task.sample_id in sample_ids]
            members[:] = [s for s in members if s.generation.task.sample_id not in sample_ids]
            if not members:
                del self.groups[gid]
                self.dead.pop(gid, None)
                self.kept.discard(gid)
        return out

    def take_all(self) -> list[ev.ScoredSample]:
        """Every buffered sample (arrival order of groups); the buffer is left empty."""
        out = [s for g in self.groups.values() for s in g]
        self.groups.clear()
        self.kept.clear()
        return out

    def decide(self, sample_id: str) -> None:
        """``sample_id`` got its terminal outcome."""
        self.decided.add(sample_id)

    def restore(self, buffer: list[ev.ScoredSample], decided: list[str], dead: dict[str, list[str]]) -> None:
        """The state a checkpoint saved (see :meth:`snapshot`)."""
        self.groups.clear()
        self.kept.clear()
        self.decided = set(decided)
        self.dead = {g: set(ids) for g, ids in dead.items()}
        for s in buffer:
            self.groups.setdefault(s.generation.task.group_id, []).append(s)

    def snapshot(self) -> tuple[list[ev.ScoredSample], list[str], dict[str, list[str]]]:
        """``(buffer, decided, dead)`` for a checkpoint."""
        return ([s for g in self.groups.values() for s in g], sorted(self.decided),
                {g: sorted(ids) for g, ids in self.dead.items()})
