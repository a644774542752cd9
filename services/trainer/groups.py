"""The trainer's groups: its undecided samples by group, and every decision about them.

* A ``ScoredSample`` joins its group (:meth:`Groups.add`) unless it is decided or there already;
  a ``DeadLetter`` ends a member (:meth:`Groups.dead_letter`: it counts as a dead member and gets
  no outcome from the trainer, its dead letter is its terminal record).
* A group is complete when every member arrived or was dead-lettered (:func:`group_complete`; a
  redundant group once ``group_size`` arrived, and its surplus is cancelled: :meth:`Groups.cancel_surplus`).
* A complete group that cannot be trained is filtered at once (:func:`group_reject_reason`: fewer
  than 2 members, or ``algorithm.dynamic_filter``; :meth:`Groups.filter_complete`); the others wait
  until complete groups hold a batch (:func:`select_groups`, arrival order), then
  :meth:`Groups.assemble` drops stale samples (:func:`split_stale`) and applies the group rules again.
* ReMax (``task.baseline_index >= 0``): the group's greedy baseline is a member that is never
  trained. The group is complete once it arrived or was dead-lettered too (:func:`group_complete`);
  it needs one sample besides it, and a group whose baseline was dead-lettered is filtered;
  :meth:`Groups.assemble` returns it beside the batch (its reward is the group's baseline) and
  decides it ``filtered`` (``remax baseline: ...``) when its group is trained.
* Every decision is a ``SampleOutcome`` made here (:meth:`Groups.outcome`), which records the
  sample as decided: no sample gets two terminal statuses.

The samples, dead members and decided ids live in the :class:`~services.trainer.state.TrainerState`
a :class:`Groups` is given, so a checkpoint keeps them; only the cache of groups the dynamic filter
already kept is not saved (after a restore they are checked again, with the same outcome).
"""

from __future__ import annotations

from collections.abc import Collection, Container, Iterable, Mapping, Sequence
from typing import NamedTuple

from runtime.deadletter import group_of
from schemas import events as ev
from schemas.config import AlgorithmConfig
from services.trainer.state import TrainerState
from trainer.algorithm import group_filter_reason

__all__ = ["BASELINE_REASON", "MIN_GROUP_MEMBERS", "Groups", "Rejection", "assemble", "baseline_ids",
           "group_complete", "group_reject_reason", "select_groups", "split_baseline", "split_stale"]

MIN_GROUP_MEMBERS = 2
"""Fewest members a group needs to be trained (a group baseline needs two; with ReMax's greedy
baseline one sample besides it is enough)."""
BASELINE_REASON = "remax baseline: the group's greedy response, its reward the baseline of the group's samples"
"""The ``filtered`` reason of a ReMax baseline whose group was trained."""


def split_baseline(members: Sequence[ev.ScoredSample]) -> tuple[list[ev.ScoredSample], ev.ScoredSample | None]:
    """``(samples, baseline)``: the members to train and the group's ReMax baseline (``None``: not here)."""
    samples = [m for m in members if not m.generation.task.is_baseline]
    baseline = next((m for m in members if m.generation.task.is_baseline), None)
    return samples, baseline


def baseline_ids(sample_ids: Iterable[str], baseline_index: int) -> list[str]:
    """The ReMax baseline ids of the groups of ``sample_ids`` (first-seen order; none when
    ``baseline_index < 0``): what a re-run of a recorded step needs besides its batch."""
    if baseline_index < 0:
        return []
    return [ev.sample_id_of(g, baseline_index) for g in dict.fromkeys(group_of(s) for s in sample_ids)]


class Rejection(NamedTuple):
    """A sample left out of a batch, with its terminal status and the reason."""

    sample: ev.ScoredSample
    status: ev.SampleStatus
    reason: str


def group_complete(members: Sequence[ev.ScoredSample], dead: Collection[str], group_size: int | None = None) -> bool:
    """True when every one of the group's ``group_size`` members has arrived (``members``) or been
    dead-lettered (``dead``: sample ids). A redundant group (``task.redundancy = r``) is complete once
    ``group_size`` members arrived, or all ``group_size + r`` arrived or were dead-lettered.
    ``group_size`` defaults to the members' task's; without members it must be given. A ReMax group
    is complete only once its baseline arrived or was dead-lettered too (it counts towards neither)."""
    task = members[0].generation.task if members else None
    redundancy = task.redundancy if task else 0
    if group_size is None:
        if task is None:
            return False
        group_size = task.group_size
    arrived = {m.generation.task.sample_id for m in members}
    dead = set(dead)
    if task is not None and task.baseline_index >= 0:
        baseline = ev.sample_id_of(task.group_id, task.baseline_index)
        if baseline not in arrived and baseline not in dead:
            return False
        arrived.discard(baseline)
        dead.discard(baseline)
    return len(arrived) >= group_size or len(arrived | dead) >= group_size + redundancy


def group_reject_reason(members: Sequence[ev.ScoredSample], algo: AlgorithmConfig | None, dead: int = 0) -> str | None:
    """Why a complete group cannot be trained, or ``None`` to keep it: fewer than
    :data:`MIN_GROUP_MEMBERS` members left (no group baseline), else ``algorithm.dynamic_filter``
    (:func:`trainer.algorithm.group_filter_reason`). ``dead`` (members dead-lettered) only goes
    into the reason. A ReMax group (``task.baseline_index >= 0``; ``members`` may hold its baseline)
    needs its baseline and one sample besides it."""
    samples, baseline = split_baseline(members)
    remax = bool(members) and members[0].generation.task.baseline_index >= 0
    if remax and baseline is None:
        return "remax: the group's greedy baseline was lost (dead-lettered or stale), no baseline to train against"
    need = 1 if remax else MIN_GROUP_MEMBERS
    if len(samples) < need:
        lost = f" ({dead} dead-lettered)" if dead else ""
        return f"group too small: {len(samples)} member(s) left{lost}, a group baseline needs {need}"
    if algo is None:
        return None
    return group_filter_reason(algo, [s.reward for s in samples])


def split_stale(members: Sequence[ev.ScoredSample], version: int,
                max_staleness: int) -> tuple[list[ev.ScoredSample], list[Rejection]]:
    """``(fresh, stale)`` by the staleness rule of docs/architecture.md: a sample generated with
    ``policy_version`` is ``dropped_stale`` at trainer ``version`` when
    ``version - policy_version > max_staleness``."""
    fresh: list[ev.ScoredSample] = []
    stale: list[Rejection] = []
    for s in members:
        if s.generation.task.is_baseline:  # ReMax's baseline is never trained: no staleness rule
            fresh.append(s)
            continue
        gap = version - s.generation.policy_version
        if gap > max_staleness:
            stale.append(Rejection(s, "dropped_stale", f"stale: gap {gap} > {max_staleness}"))
        else:
            fresh.append(s)
    return fresh, stale


def select_groups(groups: Mapping[str, Sequence[ev.ScoredSample]], complete: Container[str],
                  batch_size: int) -> list[str] | None:
    """The first groups of ``groups`` (its order is arrival order) that are in ``complete`` and
    together hold at least ``batch_size`` samples, or ``None`` while there are not enough."""
    chosen: list[str] = []
    count = 0
    for gid, members in groups.items():
        if gid in complete and members:
            chosen.append(gid)
            count += len(split_baseline(members)[0])
            if count >= batch_size:
                return chosen
    return None


def assemble(groups: Sequence[Sequence[ev.ScoredSample]], version: int, max_staleness: int,
             algo: AlgorithmConfig | None = None, dead: Mapping[str, int] | None = None,
             ) -> tuple[list[ev.ScoredSample], list[Rejection], list[ev.ScoredSample]]:
    """``(batch, rejected, baselines)`` from complete groups: per group, :func:`split_stale`, then
    :func:`group_reject_reason` on the fresh members (a rejected group's fresh members are
    ``filtered`` with the reason). ``dead``: group id -> members dead-lettered (for the reason).
    ``baselines``: the ReMax baselines of the groups in ``batch`` (not trained; their rewards are
    the baselines). Every input sample is in exactly one of the three; the batch keeps the order."""
    batch: list[ev.ScoredSample] = []
    rejected: list[Rejection] = []
    baselines: list[ev.ScoredSample] = []
    for members in groups:
        fresh, stale = split_stale(members, version, max_staleness)
        rejected += stale
        gid = members[0].generation.task.group_id if members else ""
        reason = group_reject_reason(fresh, algo, (dead or {}).get(gid, 0))
        if reason is None:
            samples, baseline = split_baseline(fresh)
            batch += samples
            baselines += [baseline] if baseline is not None else []
        else:
            rejected += [Rejection(s, "filtered", reason) for s in fresh]
    return batch, rejected, baselines


def _sid(s: ev.ScoredSample) -> str:
    return s.generation.task.sample_id


class Groups:
    """The undecided samples of ``state`` by group, and the decisions about them (see the module doc)."""

    def __init__(self, state: TrainerState, algo: AlgorithmConfig, run_id: str) -> None:
        self.state = state
        self.algo = algo
        self.run_id = run_id
        self.kept: set[str] = set()
        """Complete groups the dynamic filter already kept (not checked again)."""

    def __len__(self) -> int:
        """Buffered samples."""
        return sum(len(g) for g in self.state.groups.values())

    # ----------------------------------------------------------------- arrivals

    def add(self, sample: ev.ScoredSample) -> bool:
        """Buffer ``sample``; False when it is already decided or buffered (a duplicate)."""
        sid, gid = _sid(sample), sample.generation.task.group_id
        if sid in self.state.decided:
            return False
        group = self.state.groups.setdefault(gid, [])
        if any(_sid(s) == sid for s in group):
            return False
        group.append(sample)
        return True

    def dead_letter(self, sample_id: str, group_id: str = "") -> bool:
        """A dead letter named ``sample_id``: it ends here (leaves the buffer if it was in it and
        counts as a dead member of its group). False when it was decided already (an earlier
        outcome or dead letter stands) or no sample is named."""
        st = self.state
        if not sample_id or sample_id in st.decided:
            return False
        st.decided.add(sample_id)
        gid = group_id or group_of(sample_id)
        members = st.groups.get(gid)
        if members is not None:
            members[:] = [s for s in members if _sid(s) != sample_id]
            if not members:
                del st.groups[gid]
                self.kept.discard(gid)
        if gid:
            st.dead.setdefault(gid, set()).add(sample_id)
        return True

    def cancel_surplus(self, group_id: str) -> list[ev.SampleOutcome]:
        """``rollout.group_size_redundancy``: once ``group_size`` members of a redundant group
        arrived, keep those (arrival order) and cancel the rest: a surplus member already here, and
        every member not arrived, dead-lettered or decided yet, is ``filtered`` with a ``cancelled:``
        reason (the feeder frees their slots; a late arrival is then a decided sample, ignored)."""
        members = self.state.groups.get(group_id)
        if not members:
            return []
        task = members[0].generation.task
        samples, baseline = split_baseline(members)  # a ReMax baseline is never surplus
        if not task.redundancy or len(samples) < task.group_size:
            return []
        reason = (f"cancelled: {task.group_size} of the group's {task.group_size + task.redundancy} samples finished "
                  f"first (rollout.group_size_redundancy={task.redundancy})")
        surplus = samples[task.group_size:]
        members[:] = samples[: task.group_size] + ([baseline] if baseline is not None else [])
        out = [self.outcome(s, "filtered", reason) for s in surplus]
        kept = {_sid(s) for s in members} | self.state.dead.get(group_id, set())
        for index in range(task.group_size + task.redundancy):
            sid = ev.sample_id_of(group_id, index)
            if sid in kept or sid in self.state.decided:
                continue
            self.state.decided.add(sid)
            out.append(ev.SampleOutcome(run_id=self.run_id, sample_id=sid, group_id=group_id, status="filtered",
                                        reason=reason, trained_version=self.state.version))
        return out

    # ----------------------------------------------------------------- completeness

    def complete(self, group_id: str) -> bool:
        """Whether every member of the buffered group arrived or was dead-lettered."""
        return group_complete(self.state.groups.get(group_id, []), self.state.dead.get(group_id, ()))

    def complete_ids(self) -> set[str]:
        """Ids of the buffered groups that are complete."""
        return {gid for gid in self.state.groups if self.complete(gid)}

    def dead_count(self, group_id: str) -> int:
        return len(self.state.dead.get(group_id, ()))

    def filter_complete(self) -> list[ev.SampleOutcome]:
        """Reject the complete groups that cannot be trained as soon as they complete (fewer than 2
        members, or ``algorithm.dynamic_filter``): ``filtered``, out of the buffer, so only kept
        groups count towards the next batch (the feeder issues replacements)."""
        algo = self.algo if self.algo.dynamic_filter != "none" else None
        out: list[ev.SampleOutcome] = []
        for gid in [g for g in self.state.groups if g not in self.kept and self.complete(g)]:
            reason = group_reject_reason(self.state.groups[gid], algo, self.dead_count(gid))
            if reason is None:
                self.kept.add(gid)
                continue
            for members in self.take([gid]):
                out += [self.outcome(s, "filtered", reason) for s in members]
        return out

    # ----------------------------------------------------------------- batches

    def next_batch(self, batch_size: int) -> list[str] | None:
        """The complete groups of the next batch (arrival order), or ``None`` while too few."""
        return select_groups(self.state.groups, self.complete_ids(), batch_size)

    def assemble(self, group_ids: list[str], max_staleness: int,
                 ) -> tuple[list[ev.ScoredSample], list[ev.ScoredSample], list[ev.SampleOutcome]]:
        """Take these groups out: the batch to train and its groups' ReMax baselines
        (:func:`assemble`), and the outcomes of the samples left out (stale ones ``dropped_stale``,
        members of a group left too small ``filtered``) and of those baselines (``filtered``,
        :data:`BASELINE_REASON`: they are decided here, their job is done with the step)."""
        dead = {gid: self.dead_count(gid) for gid in group_ids}
        batch, rejected, baselines = assemble(self.take(group_ids), self.state.version, max_staleness, self.algo,
                                              dead=dead)
        outcomes = [self.outcome(r.sample, r.status, r.reason) for r in rejected]
        return batch, baselines, outcomes + [self.outcome(b, "filtered", BASELINE_REASON) for b in baselines]

    def take(self, group_ids: list[str]) -> list[list[ev.ScoredSample]]:
        """Remove these groups (in this order) from the buffer; their members, to be decided."""
        out = []
        for gid in group_ids:
            out.append(self.state.groups.pop(gid, []))
            self.state.dead.pop(gid, None)
            self.kept.discard(gid)
        return out

    def remove(self, sample_ids: set[str]) -> list[ev.ScoredSample]:
        """Take these samples out of the buffer (not decided by that); groups left empty go, with
        their dead-lettered members. Returns the samples removed (arrival order)."""
        st = self.state
        out: list[ev.ScoredSample] = []
        for gid in list(st.groups):
            members = st.groups[gid]
            out += [s for s in members if _sid(s) in sample_ids]
            members[:] = [s for s in members if _sid(s) not in sample_ids]
            if not members:
                del st.groups[gid]
                st.dead.pop(gid, None)
                self.kept.discard(gid)
        return out

    def close_all(self, reason: str) -> list[ev.SampleOutcome]:
        """Every buffered sample ``filtered`` with ``reason`` (the end of the run); the buffer is left empty."""
        leftovers = [s for g in self.state.groups.values() for s in g]
        self.state.groups.clear()
        self.kept.clear()
        return [self.outcome(s, "filtered", reason) for s in leftovers]

    # ----------------------------------------------------------------- outcomes

    def outcome(self, s: ev.ScoredSample, status: ev.SampleStatus, reason: str = "",
                step: int = -1) -> ev.SampleOutcome:
        """The terminal outcome of ``s`` at the current version; ``s`` is decided from now on."""
        self.state.decided.add(_sid(s))
        return ev.SampleOutcome(
            run_id=self.run_id, sample_id=_sid(s), group_id=s.generation.task.group_id, status=status, reason=reason,
            policy_version=s.generation.policy_version, trained_version=self.state.version, step=step,
        )
