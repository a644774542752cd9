"""Batch assembly (pure functions): group completion, the staleness filter, the group rules
(size and dynamic filter), selecting the next batch's groups, assembling it, and the tensors."""

from __future__ import annotations

from collections import OrderedDict

import msgspec
import pytest
import torch

from schemas.config import AlgorithmConfig
from schemas.events import Generation, RolloutTask, ScoredSample
from trainer.batch import (
    Rejection,
    TrainSample,
    assemble,
    collate,
    group_complete,
    group_reject_reason,
    samples_from_scored,
    select_groups,
    split_stale,
)


def scored(group: str, index: int, reward: float, version: int, size: int = 2) -> ScoredSample:
    task = RolloutTask(
        run_id="r",
        sample_id=f"{group}/{index}",
        group_id=group,
        index=index,
        group_size=size,
        prompt_id="p",
        domain="arith",
        prompt="1+1=",
    )
    gen = Generation(
        run_id="r",
        task=task,
        prompt_ids=[1, 5, 14, 5, 18],
        response_ids=[6, 2],
        response_text="2",
        logprobs=[-0.5, -0.1],
        loss_mask=[1, 1],
        finish_reason="stop",
        policy_version=version,
        policy_version_end=version,
    )
    return ScoredSample(run_id="r", generation=gen, reward=reward, policy_version=version)


def group(gid: str, rewards: list[float], version: int = 0, size: int | None = None) -> list[ScoredSample]:
    return [scored(gid, i, r, version, size or len(rewards)) for i, r in enumerate(rewards)]


def ids(samples: list[ScoredSample]) -> list[str]:
    return [s.generation.task.sample_id for s in samples]


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
    batch, rejected = assemble([fresh, mixed, lone], version=5, max_staleness=1)
    assert ids(batch) == ["f/0", "f/1", "f/2", "f/3", "m/1", "m/2", "m/3"]
    by_id = {r.sample.generation.task.sample_id: (r.status, r.reason) for r in rejected}
    assert by_id["m/0"] == ("dropped_stale", "stale: gap 2 > 1")
    assert by_id["l/0"][0] == "dropped_stale"
    assert by_id["l/3"][0] == "filtered" and by_id["l/3"][1].startswith("group too small: 1 member(s) left")
    assert all(isinstance(r, Rejection) for r in rejected)
    assert len(batch) + len(rejected) == 12  # every sample exactly once


def test_assemble_keeps_an_on_policy_batch_whole() -> None:
    batch, rejected = assemble([group("g", [1, 0, 1, 0], version=7)], version=7, max_staleness=0)
    assert len(batch) == 4 and rejected == []


def test_assemble_applies_the_dynamic_filter_and_names_dead_members() -> None:
    algo = AlgorithmConfig(dynamic_filter="all_equal")
    batch, rejected = assemble([group("a", [1, 1, 1, 1]), group("b", [1, 0, 0, 1])], version=0, max_staleness=0,
                               algo=algo)
    assert {s.generation.task.group_id for s in batch} == {"b"} and len(batch) == 4
    assert {(r.sample.generation.task.group_id, r.status) for r in rejected} == {("a", "filtered")}
    assert all("all 4 rewards equal" in r.reason for r in rejected)
    # a group that lost 3 of 4 members to dead letters is filtered, and the reason says why
    _, rejected = assemble([group("d", [1], size=4)], version=0, max_staleness=0, dead={"d": 3})
    assert [(r.status, r.reason) for r in rejected] == [
        ("filtered", "group too small: 1 member(s) left (3 dead-lettered), a group baseline needs 2")]


# --------------------------------------------------------------------------- tensors


def test_samples_from_scored_keeps_order_reward_and_group() -> None:
    batch = [scored("g", 0, 1.0, 0), scored("h", 0, 0.0, 0), scored("g", 1, 0.0, 3), scored("h", 1, 0.0, 0)]
    samples = samples_from_scored(batch)
    assert [(s.sample_id, s.group_id, s.reward) for s in samples] == [
        ("g/0", "g", 1.0), ("h/0", "h", 0.0), ("g/1", "g", 0.0), ("h/1", "h", 0.0)]
    assert samples[2].policy_version == 3 and not samples[0].truncated
    assert samples[0].response_ids == [6, 2]
    assert samples[0].old_logprobs == [-0.5, -0.1] and samples[0].loss_mask == [1, 1]
    assert samples_from_scored([]) == []
    long = msgspec.structs.replace(batch[0], generation=msgspec.structs.replace(batch[0].generation,
                                                                                finish_reason="length"))
    assert samples_from_scored([long])[0].truncated


def test_split_rows_cuts_episodes_into_their_segments_and_merge_rows_puts_them_back() -> None:
    import torch

    from trainer.batch import merge_rows, segment_layout, split_rows

    a = TrainSample([1, 5], [6, 7, 8, 9, 10], [-0.1, 0.0, 0.0, -0.4, -0.5], [1, 0, 0, 1, 1], 1.0, "a",
                    segment_starts=(1,))
    b = TrainSample([1, 4, 4], [3], [-0.3], [1], 0.0, "b")
    layout = segment_layout([a, b])
    assert layout == [(0, 0, 3), (0, 3, 7), (1, 0, 4)]
    batch = collate([a, b], pad_id=0)
    rows = split_rows(batch, layout)
    assert rows.input_ids.tolist() == [[1, 5, 6, 0], [7, 8, 9, 10], [1, 4, 4, 3]]
    assert rows.attention_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert rows.loss_mask.tolist() == [[0, 1, 0], [0, 1, 1], [0, 0, 1]]  # token 7 starts a prompt: no target
    assert rows.old_logprobs[1].tolist() == pytest.approx([0.0, -0.4, -0.5])
    assert rows.extras["rewards"].tolist() == [1.0, 1.0, 0.0] and rows.num_rows == 3
    assert rows.num_tokens == batch.num_tokens == 4
    back = merge_rows(rows.old_logprobs, layout, 2, batch.input_ids.shape[1])
    assert torch.equal(back * batch.loss_mask, batch.old_logprobs * batch.loss_mask)
    assert segment_layout([b]) is None
    with pytest.raises(ValueError, match="segment_starts"):
        segment_layout([TrainSample([1], [6, 7], [0.0, 0.0], [0, 1], 0.0, "c", segment_starts=(2,))])


def test_by_length_orders_rows_shortest_first_and_keeps_each_row_whole() -> None:
    samples = [TrainSample([1] * p, [5] * r, [-float(i)] * r, [1] * r, float(i), f"s{i}", group_id="g")
               for i, (p, r) in enumerate([(3, 4), (2, 1), (3, 4), (1, 2)])]
    batch = collate(samples, pad_id=0)
    batch = batch.replace(advantages=torch.arange(4.0), extras={**batch.extras, "tag": torch.arange(4.0) * 10})
    out = batch.by_length()
    assert out.attention_mask.sum(1).tolist() == [3, 3, 7, 7]
    order = [1, 3, 0, 2]  # stable: rows 0 and 2 (both 7 long) keep their order
    assert out.advantages.tolist() == [float(i) for i in order]
    assert out.extras["tag"].tolist() == [10.0 * i for i in order]
    assert torch.equal(out.input_ids, batch.input_ids[order]) and torch.equal(out.old_logprobs, batch.old_logprobs[order])
    assert out.rows(0, 2).input_ids.shape == (2, 3)  # the short micro-batch is trimmed to 3 columns
