"""Group assembly and the staleness filter of the trainer service (pure functions)."""

from __future__ import annotations

from collections import OrderedDict

from schemas import events as ev
from services.trainer_service import assemble, ready_groups


def scored(group: str, index: int, version: int, size: int = 4, reward: float = 1.0) -> ev.ScoredSample:
    task = ev.RolloutTask(run_id="r", sample_id=f"{group}/{index}", group_id=group, index=index, group_size=size,
                          prompt_id="p", domain="arith", prompt="1+1=", reference="2")
    gen = ev.Generation(run_id="r", task=task, prompt_ids=[1], response_ids=[2], response_text="2", logprobs=[-0.1],
                        loss_mask=[1], finish_reason="stop", policy_version=version, policy_version_end=version)
    return ev.ScoredSample(run_id="r", generation=gen, reward=reward, policy_version=version)


def test_only_complete_groups_in_arrival_order() -> None:
    groups: OrderedDict[str, list[ev.ScoredSample]] = OrderedDict()
    groups["a"] = [scored("a", i, 0) for i in range(3)]  # incomplete (3 of 4)
    groups["b"] = [scored("b", i, 0) for i in range(4)]
    assert ready_groups(groups, batch_size=8) is None  # only 4 complete samples
    groups["c"] = [scored("c", i, 0) for i in range(4)]
    assert ready_groups(groups, batch_size=8) == ["b", "c"]
    groups["a"].append(scored("a", 3, 0))
    assert ready_groups(groups, batch_size=8) == ["a", "b"]
    assert ready_groups(groups, batch_size=4) == ["a"]


def test_staleness_filter_drops_and_records_reasons() -> None:
    fresh = [scored("f", i, 5) for i in range(4)]
    mixed = [scored("m", 0, 3), scored("m", 1, 4), scored("m", 2, 5), scored("m", 3, 5)]
    lone = [scored("l", 0, 1), scored("l", 1, 1), scored("l", 2, 1), scored("l", 3, 5)]
    batch, rejected = assemble([fresh, mixed, lone], version=5, max_staleness=1)
    assert [s.generation.task.sample_id for s in batch] == ["f/0", "f/1", "f/2", "f/3", "m/1", "m/2", "m/3"]
    by_id = {s.generation.task.sample_id: (status, reason) for s, status, reason in rejected}
    assert by_id["m/0"] == ("dropped_stale", "stale: gap 2 > 1")
    assert by_id["l/0"][0] == "dropped_stale"
    assert by_id["l/3"] == ("filtered", "group too small after the staleness filter")
    # every sample is either in the batch or rejected, exactly once
    assert len(batch) + len(rejected) == 12


def test_on_policy_batch_keeps_everything() -> None:
    groups = [[scored("g", i, 7) for i in range(4)]]
    batch, rejected = assemble(groups, version=7, max_staleness=0)
    assert len(batch) == 4 and rejected == []
