"""End to end, judged domains as a user runs them (a subprocess per CLI call, the real broker and
store), on ``examples/judge.yaml`` shortened, with the session's tiny model as the judge:

* a ``kill -9`` of the judge worker while judge requests flow: the supervisor restarts it, the run
  completes, every sample is accounted for, and an independent ``read_committed`` reader of
  ``scored`` finds every sample at most once and every judged one with its judge's score;
* a judge that answers garbage (an untrained model asked for a number): every judged sample is
  scored with judge component 0 and the reason recorded, and the run completes its steps.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from runtime.bus import Consumer
from schemas import events as ev
from schemas.config import KafkaSettings
from schemas.topics import topic_name
from tests.e2e.faults import assert_accounted, sql
from tests.e2e.test_heal import finish, state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

SHORT_JUDGED = [
    "train.steps=3", "train.warmup_sft_steps=10", "train.warmup_batch_size=8", "train.eval_every=3",
    "train.checkpoint_every=1", "data.heldout_size=8", "rollout.group_size=4", "train.batch_size=16",
    "train.micro_batch_size=16", "rollout.max_new_tokens=24", "judge.device=cpu", "judge.max_batch=8",
]
"""3 steps of 4 groups of 4 samples; the judge on the CPU."""


def judged_sets(judge_dir: Path, *extra: str) -> list[str]:
    return [*SHORT_JUDGED, f"judge.models.quality.path={judge_dir}", "judge.models.quality.source=", *extra]


def start(repo_root: Path, run_id: str, runs: Path, env: dict[str, str], sets: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "cli", "run", str(repo_root / "examples" / "judge.yaml"),
                             "--run-id", run_id, *[a for kv in [*sets, f"run.runs_dir={runs}"] for a in ("--set", kv)]],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


async def read_committed(bootstrap: str, run_id: str, name: str, until_idle_s: float = 3.0) -> list[ev.Event]:
    """Every committed event of the run's topic ``name`` (an independent reader, no group)."""
    out: list[ev.Event] = []
    async with Consumer(KafkaSettings(), bootstrap, group_id=None, topics=[topic_name(run_id, name)]) as c:
        idle_since = time.monotonic()
        while time.monotonic() - idle_since < until_idle_s:
            recs = await c.getmany(timeout_ms=500)
            if recs:
                idle_since = time.monotonic()
            out += [r.event for r in recs if r.event is not None]
    return out


async def wait_for_judge_requests(bootstrap: str, run_id: str, proc: subprocess.Popen[str], n: int,
                                  timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    seen = 0
    async with Consumer(KafkaSettings(), bootstrap, group_id=None, topics=[topic_name(run_id, "judge.requests")],
                        metadata_max_age_ms=300) as c:
        while seen < n:
            assert proc.poll() is None, f"the run ended early: {proc.communicate()}"
            assert time.monotonic() < deadline, f"fewer than {n} judge requests within {timeout_s:g} s ({seen})"
            seen += sum(isinstance(r.event, ev.JudgeRequest) for r in await c.getmany(timeout_ms=300))


def accounted(runs: Path, run_id: str) -> dict[str, int]:
    summary = json.loads((runs / run_id / "summary.json").read_text())
    assert summary["steps"] == 3
    s: dict[str, int] = summary["samples"]
    assert s["unaccounted"] == 0 and s["trained"] > 0
    assert_accounted(s)
    return s


@pytest.mark.bench  # CI time: CI's service kills (tests/e2e/test_faults.py) cover a kill -9 mid-run
def test_a_killed_judge_worker_loses_and_doubles_no_sample(tmp_path: Path, bootstrap: str, repo_root: Path,
                                                           model_dir: Path) -> None:
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)
    runs = tmp_path / "runs"
    run_id = f"e2e-judge-{uuid.uuid4().hex[:6]}"
    proc = start(repo_root, run_id, runs, env, judged_sets(model_dir, "judge.models.quality.min_label_mass=0"))
    try:
        asyncio.run(wait_for_judge_requests(bootstrap, run_id, proc, n=6))
        victim = state(runs, run_id)["services"]["judge"]["pid"]
        os.kill(victim, signal.SIGKILL)
    finally:
        _, err = finish(proc, timeout_s=360)
    assert "service judge killed by SIGKILL (exit code -9); restarting in 1 s" in err and "restarted judge" in err
    s = accounted(runs, run_id)

    rows = sql(f"SELECT service, kind, exit_code FROM service_events FINAL WHERE run_id = '{run_id}' "
               "AND kind != 'ServiceStarted'", runs, run_id, env)
    assert rows == [{"service": "judge", "kind": "ServiceRestarted", "exit_code": -9}]

    # an independent reader: each sample scored at most once; every judged one carries the judge's score
    scored = [e for e in asyncio.run(read_committed(bootstrap, run_id, "scored")) if isinstance(e, ev.ScoredSample)]
    per_sample = Counter(e.generation.task.sample_id for e in scored)
    assert scored and max(per_sample.values()) == 1, per_sample.most_common(3)
    writing = [e for e in scored if e.generation.task.domain == "writing"]
    arith = [e for e in scored if e.generation.task.domain == "arith"]
    assert writing and arith
    for e in writing:
        assert e.judge == "quality" and e.judge_error == "" and e.judge_s > 0
        assert 0.0 <= e.rewards["judge"] <= 1.0
        assert e.reward == pytest.approx(e.rewards["correct"] + 0.5 * e.rewards["judge"])
    assert all(e.judge == "" and "judge" not in e.rewards for e in arith)
    # every committed judge request was judged: none lost in the kill
    requests = {e.scored.generation.task.sample_id for e in asyncio.run(read_committed(bootstrap, run_id, "judge.requests"))
                if isinstance(e, ev.JudgeRequest)}
    assert requests == {e.generation.task.sample_id for e in writing}

    # the record has per-domain rewards and per-sample judge latency
    by_domain = sql(f"SELECT t.domain AS domain, count() AS n, countIf(r.judge = 'quality') AS judged, "
                    f"min(r.judge_s) AS min_judge_s FROM sample_rewards AS r FINAL "
                    f"JOIN (SELECT sample_id, domain FROM sample_tasks FINAL WHERE run_id = '{run_id}') AS t "
                    f"ON t.sample_id = r.sample_id WHERE r.run_id = '{run_id}' GROUP BY domain ORDER BY domain",
                    runs, run_id, env)
    assert [(r["domain"], r["n"] == r["judged"]) for r in by_domain] == [("arith", False), ("writing", True)]
    assert by_domain[1]["min_judge_s"] > 0 and by_domain[0]["judged"] == 0
    print(f"judge kill -9: samples {s}, {len(writing)} judged, {len(arith)} verified")


def test_a_garbage_judge_scores_zero_with_the_reason_and_the_run_goes_on(tmp_path: Path, bootstrap: str,
                                                                        repo_root: Path, model_dir: Path) -> None:
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)
    runs = tmp_path / "runs"
    run_id = f"e2e-badjudge-{uuid.uuid4().hex[:6]}"
    # an untrained model asked to write a number 1..5 answers garbage; the writing domain is judged alone
    sets = judged_sets(model_dir, "judge.models.quality.score=number", "judge.models.quality.max_new_tokens=4",
                       "judge.models.quality.answer_prefix=", "data.domains.1.rewards={judge: 1.0}")
    proc = start(repo_root, run_id, runs, env, sets)
    finish(proc, timeout_s=360)
    accounted(runs, run_id)
    rows = sql(f"SELECT r.reward AS reward, r.judge_error AS why, r.rewards['judge'] AS judge "
               f"FROM sample_rewards AS r FINAL WHERE r.run_id = '{run_id}' AND r.judge = 'quality'", runs, run_id, env)
    assert rows
    unscored = [r for r in rows if r["why"]]
    # an untrained char model may, rarely, start with a digit 1..5: those are scored; all others are 0 with a reason
    assert len(unscored) >= 0.8 * len(rows), rows[:5]
    for r in unscored:
        assert r["reward"] == 0.0 and r["judge"] == 0.0
        assert r["why"].startswith(("no integer in the judge's answer", "judge answered")), r
