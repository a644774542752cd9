"""End to end: a short ``rollstream run`` with ``train.strategy=fsdp2 train.ranks=2`` (2 CPU trainer
processes) through the real broker and store, in one run: a trainer rank SIGKILLed after the
first step fails the trainer with that rank's error (no hang); the supervisor restarts it and the
run finishes with every step exactly once; then ``replay step`` (which restores an fsdp2
checkpoint in 2 fresh processes) recomputes a step as recorded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.e2e.faults import RunProc, Watch, check_invariants, invariants, rollstream, sql

pytestmark = pytest.mark.slow

STEPS = 4
SHORT = [
    f"train.steps={STEPS}", "train.warmup_sft_steps=4", "train.eval_every=0", "train.checkpoint_every=2",
    "data.heldout_size=8", "rollout.group_size=4", "train.batch_size=16", "train.micro_batch_size=8",
    "train.strategy=fsdp2", "train.ranks=2", "train.dist_timeout_s=120",
    "algorithm.entropy_loss_coef=0.01",  # a gradient at every step even when all rewards are equal
]



def test_fsdp2_run_heals_a_killed_rank_completes_and_replays(tmp_path: Path, bootstrap: str) -> None:
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)
    runs = tmp_path / "runs"
    run_id = f"e2e-fsdp2-{uuid.uuid4().hex[:6]}"  # unique: a long-lived broker keeps old runs
    with Watch(bootstrap, run_id) as watch:
        run = RunProc(runs, run_id, SHORT, env)
        watch.wait(lambda s: s.done_steps >= 1, 300, "1 step", run)
        workers = subprocess.run(["pgrep", "-f", f"trainer.rank_worker --model-dir {runs / run_id}/"],
                                 capture_output=True, text=True).stdout.split()
        assert len(workers) == 1, (workers, run.output())
        os.kill(int(workers[0]), signal.SIGKILL)
        killed_at = time.time()
        assert watch.seen.done_steps < STEPS, "killed too late"
        code = run.wait(400)
        assert watch.first_step_after(killed_at) is not None  # training went on after the restart
    assert code == 0, run.output()
    # the rank's death fails the trainer with that rank's error (no hang); the supervisor restarts it
    assert "restarted trainer" in run.output(), run.output()
    log = (runs / run_id / "logs" / "trainer.log").read_text()
    assert "trainer rank 1 exited with code -9" in log, log[-3000:]
    check_invariants(invariants(runs, run_id, env), STEPS)

    summary = json.loads((runs / run_id / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert summary["samples"]["unaccounted"] == 0
    steps = sql(f"SELECT step, policy_version, metrics['actor/grad_norm'] AS g, metrics['train/samples'] AS n "
                f"FROM train_steps FINAL WHERE run_id = '{run_id}' ORDER BY step", runs, run_id, env)
    assert [(r["step"], r["policy_version"]) for r in steps] == [(i, i) for i in range(STEPS)]
    # a step after the restart may be short: samples generated meanwhile past the staleness bound are dropped
    assert all(r["g"] > 0 and 0 < r["n"] <= 16 for r in steps), steps
    assert sum(r["n"] for r in steps) == summary["samples"]["trained"], (steps, summary)
    versions = sql(f"SELECT DISTINCT policy_version FROM weights FINAL WHERE run_id = '{run_id}' "
                   "ORDER BY policy_version", runs, run_id, env)
    assert [v["policy_version"] for v in versions] == list(range(STEPS + 1))
    ckpts = sorted(p.name for p in (runs / run_id / "checkpoints").iterdir())
    assert "step_000002" in ckpts

    # the trainer's rank processes are gone with the run
    left = subprocess.run(["pgrep", "-f", f"trainer.rank_worker.*{runs}"], capture_output=True, text=True)
    assert left.stdout.strip() == ""

    # replay step 2 from the fsdp2 checkpoint of step 2 (made by the restarted trainer): the
    # recorded numbers come back
    rep = rollstream("replay", "step", run_id, "2", "--format", "json", "--runs-dir", str(runs), env=env, timeout=300)
    assert rep.returncode == 0, rep.stderr
    out = json.loads(rep.stdout)
    assert out["step"] == 2 and out["from_checkpoint"] == 2
    assert out["max_abs_diff"] <= 1e-5, [m for m in out["metrics"] if m["abs_diff"] and m["abs_diff"] > 1e-5]
