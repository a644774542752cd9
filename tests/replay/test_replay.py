"""``rollstream replay``: unit tests of the pure parts, then a short real run (real broker, real
chDB) replayed with the CLI in subprocesses, as a user runs it.

The original run's topics stay on the broker, so what ``replay into`` re-published is checked
against them directly (not against the store replay read from), and the ``replay rescore`` numbers
against a computation from the original ``scored`` / ``metrics`` topics in this test.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest

from replay import (
    ReplayError,
    ReplaySettings,
    StepSlice,
    StoredEvent,
    check_settings,
    decode_payload,
    merge_in_order,
    parse_topics,
    with_run_id,
)
from runtime.bus import Consumer, Record, TopicAdmin, TopicPartition
from runtime.reading import read_to_end
from runtime.records import key_for
from schemas import events as ev
from schemas.config import KafkaSettings
from schemas.topics import TOPICS, spec_for_topic, split_value, topic_name

# --------------------------------------------------------------------------- unit tests (no I/O)


def _stored(name: str, partition: int, offset: int, ts_us: int) -> StoredEvent:
    return StoredEvent(name, partition, offset, ts_us, "", "Drain", None)


def test_merge_keeps_each_partition_in_offset_order_and_interleaves_by_time() -> None:
    a = [_stored("tasks", 0, 0, 10), _stored("tasks", 0, 1, 30), _stored("tasks", 0, 2, 20)]  # ts not monotonic
    b = [_stored("generations", 1, 0, 15), _stored("generations", 1, 1, 25)]
    c = [_stored("metrics", 0, 0, 10)]
    merged = list(merge_in_order([a, b, c]))
    assert [(e.name, e.offset) for e in merged] == [
        ("tasks", 0), ("metrics", 0), ("generations", 0), ("generations", 1), ("tasks", 1), ("tasks", 2)]
    for stream in (a, b, c):  # every partition's own order survives, whatever its timestamps
        assert [e for e in merged if e in stream] == stream


def _generation(run_id: str, sample_id: str = "g1/0") -> ev.Generation:
    task = ev.RolloutTask(run_id=run_id, sample_id=sample_id, group_id="g1", index=0, group_size=2,
                          prompt_id="p", domain="arith", prompt="1+1=", reference="2")
    return ev.Generation(run_id=run_id, task=task, prompt_ids=[1], response_ids=[2], response_text="2",
                         logprobs=[-0.1], loss_mask=[1], finish_reason="stop", policy_version=0,
                         policy_version_end=0)


def test_with_run_id_rewrites_nested_events_and_keeps_the_rest() -> None:
    scored = ev.ScoredSample(run_id="a", generation=_generation("a"), reward=1.0)
    out = with_run_id(scored, "b")
    assert (out.run_id, out.generation.run_id, out.generation.task.run_id) == ("b", "b", "b")
    assert out.event_id == scored.event_id and out.ts == scored.ts
    assert msgspec.structs.replace(out, run_id="a", generation=scored.generation) == scored


def test_decode_payload_round_trips_nan_and_undecodable_records() -> None:
    step = ev.TrainStep(run_id="r", step=3, policy_version=3, metrics={"loss/policy": math.nan, "x": 1.0},
                        staleness_hist={0: 4, 1: 2})
    payload = msgspec.json.encode(step).decode()
    assert '"loss/policy":null' in payload  # what the recorder's JSON holds for NaN
    back, raw = decode_payload("metrics", "TrainStep", payload)
    assert raw is None and isinstance(back, ev.TrainStep)
    assert math.isnan(back.metrics["loss/policy"]) and back.metrics["x"] == 1.0
    assert back.staleness_hist == {0: 4, 1: 2} and back.event_id == step.event_id
    dead = ev.DeadLetter(run_id="r", source_topic="rs.r.generations", partition=1, offset=7, key=b"k",
                         value=b"\x00\xff", error="bad")
    assert decode_payload("dlq", "DeadLetter", msgspec.json.encode(dead).decode()) == (dead, None)
    undecodable = msgspec.json.encode({"undecodable_msgpack_b64": b"\x01\x02garbage"}).decode()
    assert decode_payload("generations", "undecodable", undecodable) == (None, b"\x01\x02garbage")


def test_step_slice_membership() -> None:
    sl = StepSlice(first=1, last=2, steps={1, 2}, versions={1, 2}, samples={"g1/0"}, episodes={"e1"})
    gen = _generation("r")
    assert sl.contains(gen) and sl.contains(ev.ScoredSample(run_id="r", generation=gen, reward=0.0))
    assert not sl.contains(_generation("r", "g9/0"))
    assert sl.contains(ev.TrainStep(run_id="r", step=2, policy_version=2, metrics={}))
    assert not sl.contains(ev.TrainStep(run_id="r", step=3, policy_version=3, metrics={}))
    weights = [ev.WeightsPublished(run_id="r", policy_version=v, step=v, uri="u") for v in range(5)]
    assert [sl.contains(w) for w in weights] == [False, True, True, True, False]  # started from 1, 2; made 3
    assert sl.contains(ev.EnvObservation(run_id="r", episode_id="e1", step=0, observation=""))
    assert not sl.contains(ev.RunFinished(run_id="r", status="completed"))
    assert sl.contains(ev.SampleOutcome(run_id="r", sample_id="g1/0", group_id="g1", status="trained"))


@pytest.mark.parametrize(("changes", "message"), [
    ({"from_step": 3, "to_step": 1}, "--from-step 3 is after --to-step 1"),
    ({"from_step": -1}, "--from-step -1: steps start at 0"),
    ({"topics": ["tasks", "nope"]}, "unknown topic 'nope' in --topics"),
    ({"into": "r1"}, "cannot replay run r1 into itself"),
])
def test_check_settings_rejects_bad_input(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ReplayError, match=message):
        check_settings(ReplaySettings(run_id="r1", **changes))
    assert parse_topics(" tasks, generations ,") == ["tasks", "generations"]


# --------------------------------------------------------------------------- a recorded run

SHORT = [
    "train.steps=4", "train.warmup_sft_steps=40", "train.eval_every=2", "train.checkpoint_every=2",
    "data.heldout_size=16", "rollout.group_size=4", "train.batch_size=16", "train.micro_batch_size=16",
    # bare-number answers (no scratchpad), so the `format` verifier disagrees with `final_number`
    "data.domains.0.kwargs.demo_scratchpad=0", "rollout.max_new_tokens=6",
]


def rollstream(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def one_error_line(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    return lines[0]


@dataclass(frozen=True)
class Recorded:
    run_id: str
    runs: Path
    env: dict[str, str]
    bootstrap: str

    def replay(self, mode: str, *args: str) -> subprocess.CompletedProcess[str]:
        """``rollstream replay MODE RUN ARGS...`` on the recorded run."""
        return rollstream("replay", mode, self.run_id, *args, "--runs-dir", str(self.runs), env=self.env)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory, bootstrap: str) -> Iterator[Recorded]:
    """One short real run (about 20 s), recorded in its own embedded store; its topics and those
    of the runs replayed from it are deleted afterwards."""
    repo = Path(__file__).resolve().parents[2]
    runs = tmp_path_factory.mktemp("replay") / "runs"
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)
    run_id = f"rp-{uuid.uuid4().hex[:8]}"
    res = rollstream("run", str(repo / "examples" / "main.yaml"), "--run-id", run_id,
                     *[a for kv in [*SHORT, f"run.runs_dir={runs}"] for a in ("--set", kv)], env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    yield Recorded(run_id, runs, env, bootstrap)

    async def cleanup() -> None:
        async with TopicAdmin(KafkaSettings(), bootstrap) as admin:
            for run in [r for r in await admin.list_runs() if r.startswith(run_id)]:
                await admin.delete_run_topics(run)

    asyncio.run(cleanup())


async def _consume(bootstrap: str, topics: list[str], timeout_s: float = 60) -> list[Record]:
    """Every committed message of ``topics`` now on the broker."""
    out: list[Record] = []
    async with Consumer(KafkaSettings(), bootstrap, group_id=None, topics=topics, client_suffix="test-replay") as c:

        def take(tp: TopicPartition, m: Any) -> None:
            parts = split_value(m.value)  # a batched record: one Record per event, keyed by its own key
            for i, value in enumerate([m.value] if parts is None else parts):
                event, error = c.decode(tp.topic, value)
                spec = spec_for_topic(tp.topic)
                key = m.key if parts is None or event is None or spec is None else key_for(spec, event)
                out.append(Record(topic=tp.topic, partition=tp.partition, offset=m.offset, key=key, value_bytes=value,
                                  event=event, error=error, ts=m.timestamp / 1000.0, index=i,
                                  in_record=1 if parts is None else len(parts)))

        await read_to_end(c.raw, take, timeout_s=timeout_s, poll_ms=300, what=f"{topics} to their end")
    return out


def consume(r: Recorded, run_id: str, names: list[str] | None = None) -> list[Record]:
    return asyncio.run(_consume(r.bootstrap, [topic_name(run_id, n) for n in names or list(TOPICS)]))


def by_partition(records: list[Record]) -> dict[tuple[str, int], list[Record]]:
    out: dict[tuple[str, int], list[Record]] = defaultdict(list)
    for rec in records:
        out[(rec.topic.split(".", 2)[2], rec.partition)].append(rec)
    return dict(out)


def _without_run_id(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _without_run_id(v) for k, v in obj.items() if k != "run_id"}
    if isinstance(obj, list):
        return [_without_run_id(v) for v in obj]
    return obj


def _run_ids(obj: Any) -> set[str]:
    if isinstance(obj, dict):
        return {v for k, v in obj.items() if k == "run_id"} | {i for v in obj.values() for i in _run_ids(v)}
    if isinstance(obj, list):
        return {i for v in obj for i in _run_ids(v)}
    return set()


def assert_same_messages(original: list[Record], copy: list[Record], into: str) -> None:
    """Per partition: the same events (ids, kinds, keys, payloads but run_id) in the same order."""
    assert [r.error for r in copy if r.error] == []
    a, b = by_partition(original), by_partition(copy)
    assert a.keys() == b.keys()
    for tp in a:
        assert [(r.event_id, type(r.event).__name__, r.key) for r in b[tp]] == \
            [(r.event_id, type(r.event).__name__, r.key) for r in a[tp]], tp
        for x, y in zip(a[tp], b[tp], strict=True):
            assert _without_run_id(msgspec.to_builtins(y.event)) == _without_run_id(msgspec.to_builtins(x.event))
            assert _run_ids(msgspec.to_builtins(y.event)) == {into}


def sample_of(e: Any) -> str:
    if isinstance(e, ev.Generation):
        return e.task.sample_id
    if isinstance(e, ev.ScoredSample):
        return e.generation.task.sample_id
    return str(getattr(e, "sample_id", ""))


@pytest.mark.slow
def test_into_republishes_the_whole_record_in_order(recorded: Recorded) -> None:
    into = f"{recorded.run_id}-copy"
    res = recorded.replay("into", into, "--format", "json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    original, copy = consume(recorded, recorded.run_id), consume(recorded, into)
    assert_same_messages(original, copy, into)
    counts = {n: sum(1 for r in original if r.topic == topic_name(recorded.run_id, n)) for n in TOPICS}
    assert summary["topics"] == counts and summary["total"] == len(copy) > 0
    assert summary["steps"] is None

    # across topics the copy was sent in the original causal order (Kafka timestamps of the copy):
    # a sample's task -> generation -> score -> outcome, and weights v before a generation made with v
    sent = {(type(r.event).__name__, sample_of(r.event)): r.ts for r in copy}
    for (kind, sid), ts in sent.items():
        if kind == "Generation":
            chain = [sent.get(("RolloutTask", sid)), ts, sent.get(("ScoredSample", sid)), sent.get(("SampleOutcome", sid))]
            present = [t for t in chain if t is not None]
            assert present == sorted(present), sid
    weights_ts = {r.event.policy_version: r.ts for r in copy if isinstance(r.event, ev.WeightsPublished)}
    for r in copy:
        if isinstance(r.event, ev.Generation):
            assert weights_ts[r.event.policy_version] <= r.ts

    # the new run can be served: its config names the source run's model
    import yaml

    cfg = yaml.safe_load((recorded.runs / into / "config.yaml").read_text())
    assert cfg["model"]["path"] == str((recorded.runs / recorded.run_id / "model").resolve())
    assert cfg["run"]["runs_dir"] == str(recorded.runs.resolve())

    again = recorded.replay("into", into)
    assert f"run {into} already has {len(copy)} messages" in one_error_line(again)


@pytest.mark.slow
def test_into_a_step_slice_republishes_exactly_that_slice(recorded: Recorded) -> None:
    into = f"{recorded.run_id}-s12"
    names = ["tasks", "generations", "scored", "weights", "metrics"]
    res = recorded.replay("into", into, "--from-step", "1", "--to-step", "2", "--topics", ",".join(names),
                          "--format", "json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["steps"] == [1, 2] and set(summary["topics"]) == set(names)

    # the slice, computed here from the original topics
    original = [r for r in consume(recorded, recorded.run_id) if r.topic.split(".", 2)[2] in names]
    steps = {r.event.step: r.event for r in original if isinstance(r.event, ev.TrainStep)}
    versions = {steps[1].policy_version, steps[2].policy_version}
    samples = set(steps[1].sample_ids) | set(steps[2].sample_ids)
    for r in original:
        o = r.event
        if isinstance(o, ev.SampleOutcome) and o.status != "trained" and o.trained_version in versions:
            samples.add(o.sample_id)

    def wanted(e: Any) -> bool:
        if isinstance(e, ev.TrainStep | ev.EvalResult):
            return e.step in (1, 2)
        if isinstance(e, ev.WeightsPublished):
            return e.policy_version in versions | {v + 1 for v in versions}
        return sample_of(e) in samples

    expected = [r for r in original if wanted(r.event)]
    copy = consume(recorded, into)
    assert_same_messages(expected, copy, into)
    assert len(samples) >= 32 and len([r for r in copy if isinstance(r.event, ev.TrainStep)]) == 2
    assert summary["total"] == len(copy)
    assert consume(recorded, into, ["control", "dlq"]) == []  # not asked for


def _expected_rescore(r: Recorded, verifier: str | None) -> dict[str, Any]:
    """The rescore numbers, computed here from the original topics (GRPO: group mean and std)."""
    from envs.verifiers import format_check
    from trainer.advantages import grpo_advantages_reference

    records = consume(r, r.run_id, ["scored", "metrics"])
    scored = {sample_of(x.event): x.event for x in records if isinstance(x.event, ev.ScoredSample)}
    new = {sid: (format_check(s.generation.response_text).reward if verifier == "format" else s.reward)
           for sid, s in scored.items()}
    groups, groups_changed, trained, max_delta = 0, 0, 0, 0.0
    for step in (x.event for x in records if isinstance(x.event, ev.TrainStep)):
        trained += len(step.sample_ids)
        gids = [scored[s].generation.task.group_id for s in step.sample_ids]
        old_adv = grpo_advantages_reference([scored[s].reward for s in step.sample_ids], gids)
        new_adv = grpo_advantages_reference([new[s] for s in step.sample_ids], gids)
        deltas: dict[str, float] = defaultdict(float)
        for g, a, b in zip(gids, old_adv, new_adv, strict=True):
            deltas[g] = max(deltas[g], abs(a - b))
        groups += len(deltas)
        groups_changed += sum(d > 1e-4 for d in deltas.values())
        max_delta = max([max_delta, *deltas.values()])
    return {
        "samples": len(scored),
        "reward_mean_old": sum(s.reward for s in scored.values()) / len(scored),
        "reward_mean_new": sum(new.values()) / len(new),
        "rewards_changed": sum(new[sid] != s.reward for sid, s in scored.items()),
        "trained_samples": trained,
        "groups": groups,
        "groups_adv_changed": groups_changed,
        "max_abs_delta_adv": max_delta,
    }


def _check(report: dict[str, Any], want: dict[str, Any], domain: str = "arith") -> None:
    got = report["total"]
    for k, v in want.items():
        assert got[k] == pytest.approx(v, abs=1e-3), k
    assert report["domains"][domain] == got  # one domain


@pytest.mark.slow
def test_rescore_with_the_recorded_config_changes_nothing(recorded: Recorded) -> None:
    res = recorded.replay("rescore", "--format", "json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    want = _expected_rescore(recorded, None)
    _check(report, want)
    assert report["total"]["rewards_changed"] == report["total"]["groups_adv_changed"] == 0
    assert report["total"]["max_abs_delta_adv"] == 0.0 and report["examples"] == []
    assert report["train_steps"] == 4 and report["total"]["trained_samples"] >= 4 * 16 - 16
    assert report["verifiers"] == {"arith": "final_number"}


@pytest.mark.slow
def test_rescore_with_another_verifier_reports_consistent_changes(recorded: Recorded) -> None:
    res = recorded.replay("rescore", "--set", "data.domains.0.verifier=format", "--format", "json",
                          "--examples", "3")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    want = _expected_rescore(recorded, "format")
    _check(report, want)
    assert report["total"]["rewards_changed"] > 0
    assert report["verifiers"] == {"arith": "format"}
    assert 0 < len(report["examples"]) <= 3
    for x in report["examples"]:
        assert (x["verifier_old"], x["verifier_new"]) == ("final_number", "format")
        assert x["reward_new"] == (1.0 if x["response"].strip().lstrip("-").isdigit() else 0.0)

    table = recorded.replay("rescore", "--set", "data.domains.0.verifier=format")
    assert table.returncode == 0, table.stderr
    assert "data.domains.0.verifier=format" in table.stdout and "examples:" in table.stdout
    arith = next(ln.split() for ln in table.stdout.splitlines() if ln.startswith("arith "))
    assert int(arith[4]) == report["total"]["rewards_changed"]


def test_rescore_with_a_judge_judges_every_recorded_generation(recorded: Recorded, model_dir: Path) -> None:
    judge = ["--set", f"judge.models.j.path={model_dir}", "--set", "judge.models.j.score=logprobs",
             "--set", "judge.models.j.min_label_mass=0", "--set", "judge.device=cpu", "--set", "data.domains.0.judge=j"]
    res = recorded.replay("rescore", *judge, "--set", "data.domains.0.rewards.correct=1",
                          "--set", "data.domains.0.rewards.judge=0.5", "--format", "json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    arith = report["domains"]["arith"]
    assert report["judges"] == {"arith": "j"} and arith["judge_mean_old"] is None
    assert 0.0 < arith["judge_mean_new"] < 1.0 and arith["judge_unscored_new"] == 0
    # reward = correct + 0.5 * judge: every sample's reward moved by its judge score, none is lost
    assert arith["rewards_changed"] == arith["samples"] > 0
    assert arith["reward_mean_new"] == pytest.approx(arith["reward_mean_old"] + 0.5 * arith["judge_mean_new"], abs=1e-6)
    strict = recorded.replay("rescore", *judge[:4], "--set", "judge.models.j.min_label_mass=0.999",
                             *judge[6:], "--format", "json")
    assert strict.returncode == 0, strict.stderr
    x = json.loads(strict.stdout)["domains"]["arith"]
    assert x["judge_unscored_new"] == x["samples"] and x["reward_mean_new"] == 0.0
    text = recorded.replay("rescore", *judge)
    assert text.returncode == 0 and "could not score" in text.stdout and "judges: arith=j" in text.stdout


@pytest.mark.slow
def test_replay_errors_on_a_recorded_run_are_one_line(recorded: Recorded) -> None:
    assert "none >= 99" in one_error_line(recorded.replay("into", "x1", "--from-step", "99"))
    assert "unknown key 'reward.nope'" in one_error_line(recorded.replay("rescore", "--set", "reward.nope=1"))
    bad_verifier = recorded.replay("rescore", "--set", "data.domains.0.verifier=nope")
    assert "unknown verifier 'nope'" in one_error_line(bad_verifier)
    usage = recorded.replay("rescore", "--topics", "tasks")  # --topics belongs to `replay into`
    assert usage.returncode == 2 and "No such option: --topics" in usage.stderr


def test_replay_input_errors_are_one_line(tmp_path: Path) -> None:
    env = dict(os.environ)
    runs = str(tmp_path)
    assert "unknown run 'nope'" in one_error_line(rollstream("replay", "into", "nope", "x", "--runs-dir", runs, env=env))
    assert "unknown topic 'bogus'" in one_error_line(
        rollstream("replay", "into", "r1", "x", "--topics", "tasks,bogus", "--runs-dir", runs, env=env))
    assert "--from-step 5 is after --to-step 2" in one_error_line(
        rollstream("replay", "rescore", "r1", "--from-step", "5", "--to-step", "2", "--runs-dir", runs, env=env))
    assert "run id" in one_error_line(rollstream("replay", "into", "r1", "bad id!", env=env))
    assert "cannot replay run r1 into itself" in one_error_line(rollstream("replay", "into", "r1", "r1", env=env))


@pytest.mark.bench
def test_rescore_of_a_visual_run(visual_run: Any, bootstrap: str) -> None:
    """A visual run's recorded answers re-scored: with the recorded config nothing changes, with the
    format verifier every number is what the record's answers give here."""
    vis = Recorded(visual_run.run_id, visual_run.runs, visual_run.env, bootstrap)
    summary = json.loads((vis.runs / vis.run_id / "summary.json").read_text())
    same = vis.replay("rescore", "--format", "json")
    assert same.returncode == 0, same.stderr
    report = json.loads(same.stdout)
    _check(report, _expected_rescore(vis, None), "colour")
    assert report["verifiers"] == {"colour": "exact"} and report["train_steps"] == 2
    assert report["total"]["trained_samples"] == summary["samples"]["trained"]
    assert report["total"]["rewards_changed"] == 0 and report["examples"] == []
    other = vis.replay("rescore", "--set", "data.domains.0.verifier=format", "--format", "json")
    assert other.returncode == 0, other.stderr
    _check(json.loads(other.stdout), _expected_rescore(vis, "format"), "colour")


@pytest.mark.bench
def test_into_of_a_visual_run_gives_the_new_run_its_images(visual_run: Any, bootstrap: str) -> None:
    from blobs import BlobStore, blob_dir_of

    vis = Recorded(visual_run.run_id, visual_run.runs, visual_run.env, bootstrap)
    into = f"{vis.run_id}-into"
    res = vis.replay("into", into, "--format", "json")
    assert res.returncode == 0, res.stderr
    src = sorted(p.relative_to(blob_dir_of(vis.runs / vis.run_id)) for p in blob_dir_of(vis.runs / vis.run_id).rglob("*")
                 if p.is_file())
    assert json.loads(res.stdout)["blobs"] == len(src) > 0
    copy = BlobStore(blob_dir_of(vis.runs / into))
    tasks = [r.event for r in consume(vis, into) if isinstance(r.event, ev.RolloutTask)]
    assert tasks and all(copy.has(d) for t in tasks for d in t.image_hashes)
