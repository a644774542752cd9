"""The feeder's in-flight bound, version gate and deterministic groups (state machine, no Kafka),
and the feeder on the runtime against the real broker (restart, dead letters, end of run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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


def test_outstanding_counts_each_sample_once_whatever_the_order_of_events() -> None:
    # a restarted feeder reads tasks and metrics back in any interleaving; duplicates happen too
    f = feeder(1.0)
    tasks = [t for k in range(2) for t in f.group_tasks(k)]
    outcome = ev.SampleOutcome(run_id="r", sample_id=tasks[0].sample_id, group_id=tasks[0].group_id, status="trained")
    letter = ev.DeadLetter(run_id="r", source_topic="x", partition=0, offset=0, key=None, value=None, error="e",
                           sample_id=tasks[1].sample_id)
    for e in [outcome, outcome, *tasks, tasks[0], letter, letter, outcome]:
        f.observe(e)
    assert f.outstanding == len(tasks) - 2 == len(f.issued) - len(f.done & set(f.issued))
    f.observe(ev.DeadLetter(run_id="r", source_topic="x", partition=0, offset=0, key=None, value=None, error="e",
                            sample_id="g999999/0"))  # names a sample never issued: nothing changes
    assert f.outstanding == len(tasks) - 2


def test_remax_groups_carry_one_greedy_baseline_task_past_the_others() -> None:
    cfg = parse_config("rollout: {group_size: 4, group_size_redundancy: 1, async_ratio: 1.0}\n"
                       "train: {batch_size: 8}\nalgorithm: {adv_estimator: remax}")
    f = Feeder(FeederSettings(run_id="r", config=cfg))
    group = f.group_tasks(3)
    assert [t.index for t in group] == [0, 1, 2, 3, 4, 5] and f.group_width == 6
    assert {t.baseline_index for t in group} == {5}  # every task names it: the trainer waits for it
    assert [t.is_baseline for t in group] == [False] * 5 + [True]
    assert len({(t.prompt, t.reference) for t in group}) == 1  # the same prompt
    # the in-flight bound counts the baseline, so two batches of samples still fit
    assert cfg.max_inflight == 8 * 2 * 6 // 4 and len(issue_all(f)) == 24
    assert all(t.baseline_index == -1 for t in feeder(1.0).group_tasks(0))


async def test_a_failed_send_issues_nothing_and_the_next_tick_sends_the_same_groups() -> None:
    from aiokafka.errors import KafkaConnectionError

    class FlakyRunner:
        def __init__(self) -> None:
            self.calls: list[list[str]] = []
            self.stop = None

        async def send(self, topic: str, *events: ev.Event, key: object = None) -> list[object]:
            self.calls.append([e.sample_id for e in events if isinstance(e, ev.RolloutTask)])
            if len(self.calls) == 1:
                raise KafkaConnectionError("broker away")
            return []

    f = feeder(1.0)
    f._caught_up = True
    runner = FlakyRunner()
    try:
        await f.on_tick(runner)  # type: ignore[arg-type]
    except KafkaConnectionError:
        pass
    assert f.outstanding == 0 and f.issued_now == 0 and f.next_index == 0  # nothing counts as issued
    await f.on_tick(runner)  # type: ignore[arg-type]
    assert len(runner.calls) == 2 and runner.calls[0] == runner.calls[1]  # one send per tick, the same tasks
    assert len(runner.calls[1]) == 16 == f.outstanding == f.issued_now and f.next_index == 4


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


# --------------------------------------------------------------------------- on the runtime, real broker


async def test_feeder_follows_the_run_and_rebuilds_its_state_on_restart(bootstrap: str, run_id: str) -> None:
    """The feeder on the runtime (no group, from the beginning, commits nothing): it issues up to
    the bound, a dead letter naming a sample frees its slot like an outcome, a restarted feeder
    rebuilds its state from the topics (issues nothing twice), and after Drain it publishes
    RunFinished once every sample has an outcome or a dead letter, then exits."""
    import asyncio
    import time

    from runtime.bus import Consumer
    from runtime.runner import publish
    from schemas.config import KafkaSettings
    from schemas.topics import topic_name

    kafka = KafkaSettings(bootstrap=bootstrap)
    cfg = parse_config(f"rollout: {{group_size: 2, async_ratio: 0}}\ntrain: {{batch_size: 4, steps: 3}}\n"
                       f"kafka: {{bootstrap: '{bootstrap}'}}")
    settings = FeederSettings(run_id=run_id, config=cfg, poll_timeout_s=0.1, catch_up_timeout_s=10)
    seen: list[ev.Event] = []

    async def read_until(cond: object, timeout_s: float = 20) -> None:
        async with Consumer(kafka, group_id=None, topics=[topic_name(run_id, n) for n in ("tasks", "control")],
                            metadata_max_age_ms=300) as c:
            deadline = time.monotonic() + timeout_s
            seen.clear()
            while not cond():  # type: ignore[operator]
                assert time.monotonic() < deadline, [type(e).__name__ for e in seen]
                seen.extend(r.event for r in await c.getmany(timeout_ms=200) if r.event is not None)

    def tasks() -> list[ev.RolloutTask]:
        return [e for e in seen if isinstance(e, ev.RolloutTask)]

    stop = asyncio.Event()
    first = asyncio.create_task(Feeder(settings).run(stop))
    await read_until(lambda: len(tasks()) >= 4)
    batch = tasks()
    assert sorted(t.sample_id for t in batch) == ["g000000/0", "g000000/1", "g000001/0", "g000001/1"]
    assert any(isinstance(e, ev.RunStarted) for e in seen)
    # three samples trained at step 0, the fourth dead-lettered; then weights v1
    outcomes = [ev.SampleOutcome(run_id=run_id, sample_id=t.sample_id, group_id=t.group_id, status="trained", step=0)
                for t in batch[:3]]
    await publish(kafka, None, "metrics", outcomes)
    await publish(kafka, None, "dlq", [ev.DeadLetter(run_id=run_id, source_topic=topic_name(run_id, "generations"),
                                                     partition=0, offset=0, key=None, value=None, error="bad",
                                                     sample_id=batch[3].sample_id, group_id=batch[3].group_id)])
    await publish(kafka, None, "weights", [ev.WeightsPublished(run_id=run_id, policy_version=1, step=1, uri="/w/1")])
    await read_until(lambda: len(tasks()) >= 8)
    stop.set()
    assert await asyncio.wait_for(first, 15) == 8

    # a restarted feeder reads the run back: 4 outstanding, nothing issued again
    stop = asyncio.Event()
    feeder = Feeder(settings)
    second = asyncio.create_task(feeder.run(stop))
    deadline = time.monotonic() + 20
    while len(feeder.issued) < 8 or not feeder._caught_up:
        assert time.monotonic() < deadline and not second.done()
        await asyncio.sleep(0.1)
    assert feeder.outstanding == 4 and feeder.version == 1 and feeder.steps_seen == 1
    await publish(kafka, None, "control", [ev.Drain(run_id=run_id)])
    newer = [t for t in tasks() if t.sample_id not in {b.sample_id for b in batch}]
    await publish(kafka, None, "metrics", [
        ev.SampleOutcome(run_id=run_id, sample_id=t.sample_id, group_id=t.group_id, status="trained", step=1)
        for t in newer])
    assert await asyncio.wait_for(second, 20) == 0  # exits by itself after RunFinished
    await read_until(lambda: any(isinstance(e, ev.RunFinished) for e in seen))


def test_a_group_cut_short_by_a_killed_feeder_is_completed_and_numbering_goes_on() -> None:
    a = feeder(1.0)
    g0 = a.next_group()
    for t in g0:
        a.observe(t)
    g1 = a.next_group()
    restarted = feeder(1.0)  # sees g0 and the first two tasks of g1 on the topic
    for t in [*g0, *g1[:2]]:
        restarted.observe(t)
    missing = restarted.short_groups()
    assert [(t.sample_id, t.prompt) for t in missing] == [(t.sample_id, t.prompt) for t in g1[2:]]
    for t in missing:
        restarted.observe(t)
    assert restarted.short_groups() == [] and restarted.next_group()[0].group_id == "g000002"


def test_a_drain_the_trainer_did_not_publish_ends_the_run_as_stopped() -> None:
    f = feeder(1.0)
    issue_all(f)
    f.observe(ev.Drain(run_id="r", reason="stopped by user", origin="user"))
    assert not f.can_issue() and f.stopped_by == "stopped by user"
    g = feeder(1.0)
    g.observe(ev.Drain(run_id="r", reason="training complete", origin="trainer"))
    g.observe(ev.Drain(run_id="r", reason="stopped by user", origin="user"))  # after the end of training: still completed
    assert g.draining and g.stopped_by == ""
    w = feeder(1.0)  # the wall limit's: stopped too; where it came from is the field, not the words
    w.observe(ev.Drain(run_id="r", reason="trainer stopped the clock", origin="supervisor"))
    assert w.stopped_by == "trainer stopped the clock"


def test_multi_turn_tasks_carry_their_environment() -> None:
    import json

    cfg = parse_config("data: {domains: [{name: lake, source: frozenlake, kwargs: {size: 3}}]}\n"
                       "rollout: {group_size: 2}\ntrain: {batch_size: 4}")
    group = Feeder(FeederSettings(run_id="r", config=cfg)).next_group()
    ref = json.loads(group[0].reference)
    assert [t.env for t in group] == [ev.EnvSpec(name="frozenlake", kwargs=ref["kwargs"])] * 2
    assert ref["kwargs"]["size"] == 3 and isinstance(ref["seed"], int)
    plain = feeder(1.0).next_group()
    assert all(t.env is None for t in plain)


def test_a_file_rows_system_prompt_travels_with_its_tasks(tmp_path: Path) -> None:
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1), "sys": "Be brief." if i % 2 else None} for i in range(40)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = parse_config(json.dumps({"data": {"domains": [{"name": "d", "source": "jsonl", "kwargs": {
        "path": str(path), "system_key": "sys"}}]}, "model": {"init": {"chat_template": True}},
        "rollout": {"group_size": 2}, "train": {"batch_size": 4}}))
    f = Feeder(FeederSettings(run_id="r", config=cfg))
    groups = [f.group_tasks(k) for k in range(12)]
    for group in groups:
        row = rows[int(group[0].prompt.split("+")[0])]
        assert [t.system_prompt for t in group] == [row["sys"] or ""] * 2
    assert {g[0].system_prompt for g in groups} == {"", "Be brief."}


def test_redundant_groups_issue_n_plus_r_tasks_within_a_grown_bound() -> None:
    cfg = parse_config("rollout: {group_size: 4, group_size_redundancy: 2, async_ratio: 0}\ntrain: {batch_size: 8}")
    f = Feeder(FeederSettings(run_id="r", config=cfg))
    group = f.next_group()
    assert [t.index for t in group] == list(range(6)) and {(t.group_size, t.redundancy) for t in group} == {(4, 2)}
    assert cfg.max_inflight == 12  # 8 x 6/4: two whole redundant groups
    assert len(issue_all(f)) == 12


def test_a_visual_tasks_images_go_to_the_blob_store_and_the_tasks_carry_their_digests(tmp_path: Path) -> None:
    from blobs import BlobStore, sha256_hex

    cfg = parse_config("data: {domains: [{name: see, source: shapes}]}\nrollout: {group_size: 3}\n"
                       "train: {batch_size: 6}")
    f = Feeder(FeederSettings(run_id="r", config=cfg, blob_dir=str(tmp_path / "blobs")))
    group = f.next_group()
    problem = f.sources[0].problem(int(group[0].prompt_id.split(":")[1]))
    assert [t.image_hashes for t in group] == [[sha256_hex(problem.images[0])]] * 3
    assert BlobStore(tmp_path / "blobs").get(group[0].image_hashes[0]) == problem.images[0]
    again = f.group_tasks(0)  # a restarted feeder re-derives the group: the same blob, written once
    assert [t.image_hashes for t in again] == [t.image_hashes for t in group]
    with pytest.raises(RuntimeError, match="no blob store"):
        Feeder(FeederSettings(run_id="r", config=cfg)).next_group()
