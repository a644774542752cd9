"""End to end, as a user runs it (a subprocess per CLI call, the real broker and store):

* (a run that heals from ``kill -9`` of a service, with ``rollstream status`` and the record's
  ``service_events`` showing the restart, is ``test_faults.py``);
* ``rollstream stop`` drains a run from another terminal: ``rollstream run`` then writes its
  summary and exits 0 with fewer steps than configured, and ``status`` calls the run stopped;
* ``run.max_wall_s`` drains a run the same way.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from runtime.bus import Consumer
from schemas import events as ev
from schemas.config import KafkaSettings
from schemas.topics import topic_name
from tests.e2e.faults import rollstream, sql, status
from tests.e2e.test_run import SHORT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def start_run(repo_root: Path, runs: Path, run_id: str, env: dict[str, str], *overrides: str) -> subprocess.Popen[str]:
    sets = [*SHORT, "train.warmup_sft_steps=30", f"run.runs_dir={runs}", *overrides]
    return subprocess.Popen([sys.executable, "-m", "cli", "run", str(repo_root / "examples" / "main.yaml"),
                             "--run-id", run_id, *[a for kv in sets for a in ("--set", kv)]],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


async def wait_for_step(bootstrap: str, run_id: str, step: int, proc: subprocess.Popen[str],
                        timeout_s: float = 150) -> None:
    """Until the run's ``metrics`` topic holds ``TrainStep`` number ``step`` (0-based)."""
    deadline = time.monotonic() + timeout_s
    async with Consumer(KafkaSettings(), bootstrap, group_id=None, topics=[topic_name(run_id, "metrics")],
                        metadata_max_age_ms=300) as c:
        while True:
            assert proc.poll() is None, f"the run ended early: {proc.communicate()}"
            assert time.monotonic() < deadline, f"no training step {step} within {timeout_s:g} s"
            if any(isinstance(r.event, ev.TrainStep) and r.event.step >= step for r in await c.getmany(timeout_ms=300)):
                return


def state(runs: Path, run_id: str) -> dict[str, Any]:
    return json.loads((runs / run_id / "supervisor.json").read_text())


def finish(proc: subprocess.Popen[str], timeout_s: float = 180) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"the run did not finish within {timeout_s:g} s:\n{out}\n{err}")
    assert proc.returncode == 0, out + err
    return out, err


def test_stop_drains_a_run_from_another_terminal(tmp_path: Path, bootstrap: str, repo_root: Path) -> None:
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)
    runs = tmp_path / "runs"
    run_id = f"e2e-stop-{uuid.uuid4().hex[:6]}"
    proc = start_run(repo_root, runs, run_id, env, "train.steps=20000")  # more than any machine does before the stop
    try:
        asyncio.run(wait_for_step(bootstrap, run_id, 1, proc))
        during = status(runs, run_id, env)
        assert during["phase"] == "running" and during["supervisor"]["alive"]
        assert {s["state"] for s in during["services"].values()} == {"running"}
        t0 = time.monotonic()
        stopped = rollstream("stop", run_id, "--runs-dir", str(runs), "--timeout", "170", env=env, timeout=200)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        # RunFinished says "stopped" (the feeder knows the drain was not the trainer's)
        assert re.search(rf"run {run_id} finished \((stopped|completed)\) \d+ s after the drain, at step \d+/20000",
                         stopped.stdout), stopped.stdout
        assert "summary:" in stopped.stdout
        assert time.monotonic() - t0 < 170
    finally:
        out, _ = finish(proc)
    assert "held-out accuracy" in out
    summary = json.loads((runs / run_id / "summary.json").read_text())
    assert 2 <= summary["steps"] < 20000 and summary["samples"]["unaccounted"] == 0
    after = status(runs, run_id, env)
    assert after["phase"] == "stopped" and after["draining"] == "stopped by user"
    assert not after["supervisor"]["alive"] and after["stall"] is None
    drains = sql(f"SELECT JSONExtractString(payload, 'reason') AS reason FROM events FINAL WHERE run_id = '{run_id}' "
                 "AND kind = 'Drain' ORDER BY ts", runs, run_id, env)
    assert drains[0]["reason"] == "stopped by user"


def test_the_wall_limit_drains_the_run_and_still_writes_its_summary(tmp_path: Path, bootstrap: str,
                                                                    repo_root: Path) -> None:
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)
    runs = tmp_path / "runs"
    run_id = f"e2e-wall-{uuid.uuid4().hex[:6]}"
    # far more steps than 30 s can hold on any machine (a fast one did 196 steps in 46 s), so the wall, not
    # the step count, is what ends the run
    proc = start_run(repo_root, runs, run_id, env, "train.steps=20000", "run.max_wall_s=30")
    out, err = finish(proc, timeout_s=400)
    assert "run.max_wall_s=30s reached: draining the run" in err, err
    assert "held-out accuracy" in out
    summary = json.loads((runs / run_id / "summary.json").read_text())
    assert summary["steps"] < 20000 and summary["samples"]["unaccounted"] == 0
    assert summary["eval"]["final"]["accuracy"] is not None
    after = status(runs, run_id, env)
    assert after["phase"] == "stopped" and after["draining"] == "run.max_wall_s=30s reached"
    drains = sql(f"SELECT JSONExtractString(payload, 'reason') AS reason FROM events FINAL WHERE run_id = '{run_id}' "
                 "AND kind = 'Drain' ORDER BY ts", runs, run_id, env)
    assert drains[0]["reason"] == "run.max_wall_s=30s reached"
