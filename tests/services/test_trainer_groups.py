"""The trainer's groups: the pure rules (completion, staleness, the group rules, selection,
assembly) and :class:`Groups`, which keeps the undecided samples in the state and makes every
decision about them (dead letters complete groups, nothing is decided twice)."""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from schemas.config import AlgorithmConfig
from schemas.events import ScoredSample
from services.trainer.groups import (
    BASELINE_REASON,
    Groups,
    Rejection,
    assemble,
    baseline_ids,
    group_complete,
    group_reject_reason,
    select_groups,
    split_stale,
)
from services.trainer.state import TrainerState
from tests.trainer.test_batch import group, ids, scored


def member(gid: str, index: int, size: int = 4, reward: float = 1.0) -> ScoredSample:
    return scored(gid, index, reward, 0, size)


def groups(algo: AlgorithmConfig | None = None) -> Groups:
    return Groups(TrainerState(), algo or AlgorithmConfig(), "r")


# --------------------------------------------------------------------------- group completion


def test_a_group_is_complete_when_every_member_arrived_or_was_dead_lettered() -> None:
    g = group("g", [1, 0, 1, 0])
    assert group_complete(g, dead=())
    assert not group_complete(g[:3], dead=())
    assert group_complete(g[:3], dead={"g/3"})
    assert group_complete(g[:1], dead={"g/1", "g/2", "g/3"})
    assert not group_complete(g[:2], dead={"g/1"})  # a dead letter for an arrived member adds nothing
    assert not group_complete([], dead={"g/0", "g/1"})  # the size is unknown without a member ...
    assert group_complete([], dead={"g/0", "g/1"}, group_size=2)  # ... unless given


# --------------------------------------------------------------------------- staleness


def test_split_stale_keeps_within_max_staleness() -> None:
    batch = [scored("g", 0, 1.0, 5), scored("g", 1, 0.0, 3), scored("h", 0, 1.0, 2)]
    fresh, stale = split_stale(batch, version=5, max_staleness=2)
    assert ids(fresh) == ["g/0", "g/1"]
    assert [(ids([r.sample]), r.status, r.reason) for r in stale] == [(["h/0"], "dropped_stale", "stale: gap 3 > 2")]
    assert split_stale(batch, version=5, max_staleness=0)[0] == [batch[0]]  # on-policy: only the current version


# --------------------------------------------------------------------------- group rules


def test_group_reject_reason_needs_two_members_and_applies_the_dynamic_filter() -> None:
    assert group_reject_reason(group("g", [1, 0]), None) is None
    small = group_reject_reason(group("g", [1]), None, dead=3)
    assert small is not None and "group too small: 1 member(s) left (3 dead-lettered)" in small
    assert group_reject_reason([], None) is not None
    all_equal = AlgorithmConfig(dynamic_filter="all_equal")
    why = group_reject_reason(group("g", [1, 1, 1]), all_equal)
    assert why is not None and "all 3 rewards equal" in why
    assert group_reject_reason(group("g", [1, 0, 1]), all_equal) is None
    assert group_reject_reason(group("g", [1, 1, 1]), AlgorithmConfig()) is None  # filter off


# --------------------------------------------------------------------------- selection


def test_select_groups_takes_complete_groups_in_arrival_order() -> None:
    groups: OrderedDict[str, list[ScoredSample]] = OrderedDict()
    groups["a"] = group("a", [1, 0, 1, 0])[:3]  # incomplete (3 of 4)
    groups["b"] = group("b", [1, 0, 1, 0])
    assert select_groups(groups, complete={"b"}, batch_size=8) is None  # only 4 complete samples
    groups["c"] = group("c", [1, 0, 1, 0])
    assert select_groups(groups, complete={"b", "c"}, batch_size=8) == ["b", "c"]
    groups["a"].append(scored("a", 3, 0, 0, 4))
    assert select_groups(groups, complete={"a", "b", "c"}, batch_size=8) == ["a", "b"]
    assert select_groups(groups, complete={"a", "b", "c"}, batch_size=4) == ["a"]
    # a group that completed with a dead-lettered member counts its 3 arrived members
    groups["d"] = group("d", [1, 0, 1, 0])[:3]
    assert select_groups(OrderedDict(d=groups["d"], b=groups["b"]), complete={"d", "b"}, batch_size=6) == ["d", "b"]


# --------------------------------------------------------------------------- assembly


def test_assemble_drops_stale_samples_and_filters_small_groups_with_reasons() -> None:
    fresh = group("f", [1, 0, 1, 0], version=5)
    mixed = [scored("m", 0, 1, 3, 4), scored("m", 1, 0, 4, 4), scored("m", 2, 1, 5, 4), scored("m", 3, 0, 5, 4)]
    lone = [scored("l", 0, 1, 1, 4), scored("l", 1, 0, 1, 4), scored("l", 2, 1, 1, 4), scored("l", 3, 0, 5, 4)]
    batch, rejected, _ = assemble([fresh, mixed, lone], version=5, max_staleness=1)
    assert ids(batch) == ["f/0", "f/1", "f/2", "f/3", "m/1", "m/2", "m/3"]
    by_id = {r.sample.generation.task.sample_id: (r.status, r.reason) for r in rejected}
    assert by_id["m/0"] == ("dropped_stale", "stale: gap 2 > 1")
    assert by_id["l/0"][0] == "dropped_stale"
    assert by_id["l/3"][0] == "filtered" and by_id["l/3"][1].startswith("group too small: 1 member(s) left")
    assert all(isinstance(r, Rejection) for r in rejected)
    assert len(batch) + len(rejected) == 12  # every sample exactly once


def test_assemble_keeps_an_on_policy_batch_whole() -> None:
    batch, rejected, baselines = assemble([group("g", [1, 0, 1, 0], version=7)], version=7, max_staleness=0)
    assert len(batch) == 4 and rejected == [] and baselines == []


def test_assemble_applies_the_dynamic_filter_and_names_dead_members() -> None:
    algo = AlgorithmConfig(dynamic_filter="all_equal")
    batch, rejected, _ = assemble([group("a", [1, 1, 1, 1]), group("b", [1, 0, 0, 1])], version=0, max_staleness=0,
                               algo=algo)
    assert {s.generation.task.group_id for s in batch} == {"b"} and len(batch) == 4
    assert {(r.sample.generation.task.group_id, r.status) for r in rejected} == {("a", "filtered")}
    assert all("all 4 rewards equal" in r.reason for r in rejected)
    # a group that lost 3 of 4 members to dead letters is filtered, and the reason says why
    _, rejected, _ = assemble([group("d", [1], size=4)], version=0, max_staleness=0, dead={"d": 3})
    assert [(r.status, r.reason) for r in rejected] == [
        ("filtered", "group too small: 1 member(s) left (3 dead-lettered), a group baseline needs 2")]


# --------------------------------------------------------------------------- the groups of the state


def test_dead_letters_complete_groups_and_end_their_samples_once() -> None:
    buf = groups()
    for i in range(3):
        assert buf.add(member("a", i))
    assert not buf.complete("a")
    assert buf.dead_letter("a/3", "a")  # before the sample arrived
    assert buf.complete("a") and buf.dead_count("a") == 1
    assert not buf.add(member("a", 3))  # the real sample after its dead letter: ignored
    assert not buf.dead_letter("a/3")  # a second dead letter changes nothing
    # a dead letter for a buffered sample takes it out; the group name comes from the sample id
    assert buf.add(member("b", 0)) and buf.add(member("b", 1))
    assert buf.dead_letter("b/1")
    assert ids(buf.state.groups["b"]) == ["b/0"] and buf.state.dead["b"] == {"b/1"}
    # a dead letter naming no sample, or a decided one, is not counted
    buf.state.decided.add("c/0")
    assert not buf.dead_letter("") and not buf.dead_letter("c/0")
    assert buf.complete_ids() == {"a"}
    assert [len(g) for g in buf.take(["a"])] == [3] and "a" not in buf.state.dead
    assert len(buf) == 1


def test_every_decision_is_one_outcome_and_marks_the_sample_decided() -> None:
    buf = groups(AlgorithmConfig(dynamic_filter="all_equal"))
    buf.state.version = 3
    for i in range(4):
        buf.add(scored("same", i, 1.0, 3, 4))  # complete, all rewards equal: filtered at once
        buf.add(scored("mixed", i, float(i % 2), 2 if i else 1, 4))  # complete, kept; mixed/0 is stale later
    buf.add(member("open", 0))
    filtered = buf.filter_complete()
    assert [(o.sample_id, o.status) for o in filtered] == [(f"same/{i}", "filtered") for i in range(4)]
    assert all("all 4 rewards equal" in o.reason and o.trained_version == 3 for o in filtered)
    assert buf.filter_complete() == [] and buf.kept == {"mixed"}  # a kept group is not checked again
    assert buf.next_batch(8) is None and buf.next_batch(4) == ["mixed"]
    batch, baselines, rejected = buf.assemble(["mixed"], max_staleness=1)
    assert ids(batch) == ["mixed/1", "mixed/2", "mixed/3"] and baselines == []
    assert [(o.sample_id, o.status, o.reason, o.policy_version) for o in rejected] == [
        ("mixed/0", "dropped_stale", "stale: gap 2 > 1", 1)]
    assert "mixed" not in buf.state.groups and "mixed" not in buf.kept
    closed = buf.close_all("run finished")
    assert [(o.sample_id, o.status, o.reason) for o in closed] == [("open/0", "filtered", "run finished")]
    assert buf.state.decided >= {f"same/{i}" for i in range(4)} | {"mixed/0", "open/0"}
    assert not buf.add(member("open", 0)) and not buf.state.groups  # decided: a redelivery is ignored


def test_a_redundant_group_keeps_its_first_finishers_and_cancels_the_rest() -> None:
    def red(index: int) -> ScoredSample:
        s = member("a", index)
        task = msgspec.structs.replace(s.generation.task, redundancy=2)
        return msgspec.structs.replace(s, generation=msgspec.structs.replace(s.generation, task=task))

    buf = groups()
    assert not group_complete([red(i) for i in (5, 0, 3)], set())
    assert group_complete([red(i) for i in (0, 1)], {"a/2", "a/3", "a/4", "a/5"})
    buf.dead_letter("a/2")
    for i in (5, 0, 3):
        assert buf.add(red(i)) and buf.cancel_surplus("a") == []
    buf.add(red(1))
    cancelled = buf.cancel_surplus("a")
    assert [o.sample_id for o in cancelled] == ["a/4"]  # a/2 is dead, the others arrived first
    assert all(o.status == "filtered" and o.reason.startswith("cancelled: 4 of the group's 6") for o in cancelled)
    assert ids(buf.state.groups["a"]) == ["a/5", "a/0", "a/3", "a/1"] and buf.complete("a")
    assert not buf.add(red(4))  # the cancelled one arriving late


# --------------------------------------------------------------------------- ReMax's greedy baseline


def remax(gid: str, index: int, reward: float, size: int = 2, version: int = 0) -> ScoredSample:
    """A member of a ReMax group of ``size`` samples; index ``size`` is its greedy baseline."""
    s = scored(gid, index, reward, version, size)
    task = msgspec.structs.replace(s.generation.task, baseline_index=size)
    return msgspec.structs.replace(s, generation=msgspec.structs.replace(s.generation, task=task))


def test_a_remax_group_waits_for_its_baseline_which_counts_towards_nothing() -> None:
    a, b, greedy = remax("g", 0, 1.0), remax("g", 1, 0.0), remax("g", 2, 1.0)
    assert greedy.generation.task.is_baseline and not a.generation.task.is_baseline
    assert not group_complete([a, b], dead=())  # both samples, no baseline yet
    assert not group_complete([a, greedy], dead=())  # the baseline is not a sample
    assert group_complete([a, b, greedy], dead=())
    assert group_complete([a, b], dead={"g/2"})  # baseline dead-lettered: complete, and then filtered
    assert group_complete([a, greedy], dead={"g/1"})
    assert select_groups(OrderedDict(g=[a, b, greedy]), {"g"}, 3) is None  # 2 samples to train, not 3
    assert baseline_ids(["g/0", "h/1", "g/1"], 2) == ["g/2", "h/2"] and baseline_ids(["g/0"], -1) == []


def test_assemble_hands_out_the_baseline_beside_the_batch_and_filters_groups_without_one() -> None:
    kept = [remax("k", 0, 1.0, version=0), remax("k", 1, 0.0, version=3), remax("k", 2, 0.5, version=0)]
    lost = [remax("l", 0, 1.0, version=3), remax("l", 1, 0.0, version=3)]
    lone = [remax("o", 1, 1.0, version=3), remax("o", 2, 0.0, version=0)]  # one sample left: enough
    batch, rejected, baselines = assemble([kept, lost, lone], version=3, max_staleness=1)
    assert ids(batch) == ["k/1", "o/1"] and ids(baselines) == ["k/2", "o/2"]  # a stale baseline is no matter
    by_id = {r.sample.generation.task.sample_id: (r.status, r.reason) for r in rejected}
    assert by_id["k/0"] == ("dropped_stale", "stale: gap 3 > 1")
    assert by_id["l/0"][0] == by_id["l/1"][0] == "filtered" and "greedy baseline was lost" in by_id["l/0"][1]
    assert len(batch) + len(rejected) + len(baselines) == 7  # every sample exactly once


def test_the_baseline_of_a_trained_group_is_decided_filtered_once() -> None:
    buf = groups()
    for s in (remax("g", 0, 1.0), remax("g", 1, 0.0), remax("g", 2, 1.0)):
        assert buf.add(s)
    assert buf.filter_complete() == [] and buf.next_batch(2) == ["g"]
    batch, baselines, outcomes = buf.assemble(["g"], max_staleness=0)
    assert ids(batch) == ["g/0", "g/1"] and ids(baselines) == ["g/2"]
    assert [(o.sample_id, o.status, o.reason) for o in outcomes] == [("g/2", "filtered", BASELINE_REASON)]
    assert "g/2" in buf.state.decided and not buf.add(remax("g", 2, 1.0))  # a redelivery is ignored


def test_a_redundant_remax_group_never_cancels_its_baseline() -> None:
    buf = groups()
    members = []
    for i in (0, 3, 1):  # 2 samples + 1 redundant (indices 0..2), the baseline is index 3
        s = remax("r", i, float(i), size=2)
        task = msgspec.structs.replace(s.generation.task, redundancy=1, baseline_index=3)
        members.append(msgspec.structs.replace(s, generation=msgspec.structs.replace(s.generation, task=task)))
    for s in members:
        buf.add(s)
        cancelled = buf.cancel_surplus("r")
    assert [(o.sample_id, o.status) for o in cancelled] == [("r/2", "filtered")]
    assert ids(buf.state.groups["r"]) == ["r/0", "r/1", "r/3"] and buf.complete("r")
