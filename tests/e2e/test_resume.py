"""Resume from any point: a short `rollstream run` (real broker, real store) dies at once — every
process SIGKILLed — at the start (the RL start is checkpointed, no step yet), in the middle (a
step or more after its last checkpoint) or near the end (after the last step, before ``RunFinished``);
``rollstream status`` then exits 3 naming ``rollstream resume RUN``, which finishes the run. In SQL: every issued sample
has exactly one terminal status, none is trained twice, no row is recorded twice, and the
training steps are 0..N-1 exactly once (a step re-run after a resume from an older checkpoint is
re-run from its recorded batch, not published again)."""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from pathlib import Path

import pytest

from tests.e2e.faults import (
    SHORT,
    FaultResult,
    RunProc,
    Watch,
    check_invariants,
    invariants,
    recovery_after,
    rollstream,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 8
OVERRIDES = [*SHORT, f"train.steps={STEPS}", "train.checkpoint_every=4"]

CASES = {
    # during the warm-up: the initial eval is out, no checkpoint and no weights yet (the warm-up is
    # made long enough for the kill to land in it, see WARMUP_OVERRIDES)
    "warmup": (lambda s: "init" in s.evals and not s.versions, "the initial eval, no weights"),
    # no training step yet, but the RL start is checkpointed and its weights published
    "start": (lambda s: bool(s.versions) and s.done_steps == 0, "weights v0, no step"),
    # steps 0..4 done, the last checkpoint is of step 4 (the next is of step 8): step 4 (maybe 5,
    # 6) is re-run from the record
    "middle": (lambda s: s.done_steps >= 5, "5 steps"),
    # the last step done and the trainer's Drain out, but no RunFinished: the feeder, which
    # publishes it, is paused (SIGSTOP) as soon as the last step is seen, until the kill
    "end": (lambda s: "training complete" in s.drains, "the trainer's Drain"),
}


WARMUP_OVERRIDES = ["train.warmup_sft_steps=150"]


def resume_run(runs: Path, bootstrap: str, point: str) -> FaultResult:
    """Run, SIGKILL every process of the run at ``point``, resume it (``rollstream resume``); assert
    it completes with the invariants of the record."""
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)
    run_id = f"e2e-resume-{point}-{uuid.uuid4().hex[:6]}"
    cond, what = CASES[point]
    t0 = time.time()
    with Watch(bootstrap, run_id) as watch:
        overrides = OVERRIDES + (WARMUP_OVERRIDES if point == "warmup" else [])
        first = RunProc(runs, run_id, overrides, env)
        if point == "end":  # the final eval and checkpoint come before the Drain: time enough
            watch.wait(lambda s: s.done_steps >= STEPS, 300, f"{STEPS} steps", first)
            first.pause_service("feeder")
        watch.wait(cond, 300, what, first)
        killed_at = first.kill_all()
        finished_before = watch.seen.finished is not None
        if point == "warmup":
            assert not watch.seen.versions, "the warm-up ended before the kill: the case did not happen"
        # `rollstream status` says the run ended before it finished, names the command, exits 3
        asked = time.time()
        told = rollstream("status", run_id, "--runs-dir", str(runs), env=env, timeout=60)
        assert told.returncode == 3 and f"rollstream resume {run_id} --runs-dir {runs}" in told.stdout, told
        second = RunProc(runs, run_id, overrides, env, resume=True)
        code = second.wait(400)
        # the recovery counts from the kill as if resumed at once (the status call left out)
        recovery = recovery_after(watch, killed_at + (second.started - asked))
    assert code == 0, second.output()
    assert not finished_before, "the run finished before it was killed: the case did not happen"
    summary = json.loads((runs / run_id / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["samples"]["unaccounted"] == 0, summary
    assert summary["final_model"] == str(runs / run_id / "final"), summary
    inv = invariants(runs, run_id, env)
    check_invariants(inv, STEPS)
    log = (runs / run_id / "logs" / "trainer.log").read_text()
    if point == "middle":  # the second trainer re-ran what the first one did after its checkpoint
        rerun = re.search(r"resumed from the checkpoint of step (\d+); (\d+) later step", log)
        assert rerun is not None and int(rerun[1]) > 0 and int(rerun[2]) > 0, log[-3000:]
        assert f"({rerun[2]} step(s) re-run)" in log, log[-3000:]
    return FaultResult(inv, recovery, time.time() - t0)


# the warm-up case (a 150-step warm-up, about a minute) and the end case (resuming a run that had
# trained its last step; start and middle cover a resume in CI) are `make test-bench`, for CI time
@pytest.mark.parametrize("point", [pytest.param(p, marks=pytest.mark.bench) if p in ("warmup", "end") else p
                                   for p in CASES])
def test_resume_after_the_whole_run_died(tmp_path: Path, bootstrap: str, point: str) -> None:
    resume_run(tmp_path / "runs", bootstrap, point)
