"""The feeder's in-flight bound, version gate and deterministic groups (state machine, no Kafka)."""

from __future__ import annotations

from schemas import events as ev
from schemas.config import parse_config
from services.feeder import Feeder, FeederSettings


def feeder(async_ratio: float) -> Feeder:
    cfg = parse_config(f"rollout: {{group_size: 4, async_ratio: {async_ratio}}}\ntrain: {{batch_size: 8}}")
    return Feeder(FeederSettings(run_id="r", config=cfg))


def issue_all(f: Feeder) -> list[ev.RolloutTask]:
    out = []
    while f.can_issue():
        group = f.next_group()
        for t in group:
            f.observe(t)
        out += group
    return out


def finish(f: Feeder, tasks: list[ev.RolloutTask], step: int) -> None:
    for t in tasks:
        f.observe(ev.SampleOutcome(run_id="r", sample_id=t.sample_id, group_id=t.group_id, status="trained", step=step))


def test_inflight_bound_is_batch_times_one_plus_async_ratio() -> None:
    f = feeder(1.0)
    first = issue_all(f)
    assert len(first) == 16 == f.cfg.max_inflight
    assert f.outstanding == 16
    assert len({t.group_id for t in first}) == 4 and all(t.group_size == 4 for t in first)
    # a dead letter naming a sample frees its slot too, but a group needs 4 free slots
    f.observe(ev.DeadLetter(run_id="r", source_topic="x", partition=0, offset=0, key=None, value=None, error="e",
                            sample_id=first[0].sample_id))
    assert f.outstanding == 15 and not f.can_issue()


def test_new_groups_wait_for_the_weights_of_seen_steps() -> None:
    f = feeder(0.0)
    batch = issue_all(f)
    assert len(batch) == 8 and all(t.policy_version == 0 for t in batch)
    finish(f, batch, step=0)  # trained at step 0: version 1 must be published before more tasks
    assert f.outstanding == 0 and not f.can_issue()
    f.observe(ev.WeightsPublished(run_id="r", policy_version=1, step=1, uri="/w/1"))
    nxt = issue_all(f)
    assert len(nxt) == 8 and all(t.policy_version == 1 for t in nxt)


def test_groups_are_deterministic_and_drain_stops_issuing() -> None:
    a, b = feeder(1.0), feeder(1.0)
    ta, tb = issue_all(a), issue_all(b)
    assert [(t.sample_id, t.prompt) for t in ta] == [(t.sample_id, t.prompt) for t in tb]
    finish(a, ta, step=0)
    a.observe(ev.WeightsPublished(run_id="r", policy_version=1, step=1, uri="/w/1"))
    a.observe(ev.Drain(run_id="r"))
    assert not a.can_issue()
