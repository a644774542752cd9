"""End to end under ``rollstream run --launcher ray`` (a subprocess, as a user runs it; the real
broker and store; a local Ray instance the run starts and stops itself): the services run as Ray
actors placed by ``placement``, a killed service is restarted by a new actor, and the run's record
has the same shape and accounting as a local-launcher run (tests/e2e/test_run.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.e2e.faults import assert_accounted, sql
from tests.e2e.test_heal import finish, state, wait_for_step
from tests.e2e.test_run import SHORT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_ray_run_heals_and_records_like_a_local_run(tmp_path: Path, bootstrap: str, repo_root: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local Ray instance of its own
    env["ROLLSTREAM_BOOTSTRAP"] = bootstrap
    runs = tmp_path / "runs"
    run_id = f"e2e-ray-{uuid.uuid4().hex[:6]}"
    sets = [*SHORT, f"run.runs_dir={runs}", "placement.trainer.cpus=0.5", "placement.rollout.cpus=0.5"]
    proc = subprocess.Popen([sys.executable, "-m", "cli", "run", str(repo_root / "examples" / "main.yaml"),
                             "--launcher", "ray", "--run-id", run_id, *[a for kv in sets for a in ("--set", kv)]],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        asyncio.run(wait_for_step(bootstrap, run_id, 0, proc))
        before = state(runs, run_id)["services"]
        victim = before["rollout"]["pid"]
        os.kill(victim, signal.SIGKILL)  # the service process its actor runs
    finally:
        out, err = finish(proc)
    assert "ray: 5 service processes placed on a local Ray instance (CPU 1.75, strategy pack)" in err
    assert "service rollout killed by SIGKILL (exit code -9); restarting in 1 s" in err
    assert "held-out accuracy" in out
    after = state(runs, run_id)
    assert after["phase"] == "finished"
    assert after["services"]["rollout"]["restarts"] == 1 and after["services"]["rollout"]["pid"] != victim
    assert all(s["restarts"] == 0 for name, s in after["services"].items() if name != "rollout")
    assert sorted(after["services"]) == ["feeder", "recorder", "reward", "rollout", "trainer"]
    # every service logged to runs/<id>/logs/<label>.log, as under the local launcher
    logs = runs / run_id / "logs"
    assert all((logs / f"{label}.log").stat().st_size > 0 for label in after["services"])
    assert "--- rollstream run: restart 1 of rollout" in (logs / "rollout.log").read_text()

    # the accounting of tests/e2e/test_run.py
    summary = json.loads((runs / run_id / "summary.json").read_text())
    assert summary["steps"] == 4
    s = summary["samples"]
    assert s["issued"] > 0 and s["unaccounted"] == 0
    assert_accounted(s)
    where = f"WHERE run_id = '{run_id}'"
    tables = ("samples", "sample_generations", "sample_rewards", "train_steps", "evals", "weights")
    rec = sql(  # one CLI call: each one costs seconds
        f"SELECT (SELECT count() FROM samples {where} AND status NOT IN "
        "('trained', 'dropped_stale', 'filtered', 'dead_letter')) AS open, "
        f"(SELECT count() FROM (SELECT sample_id, count() AS n FROM sample_outcomes FINAL {where} "
        "AND status = 'trained' GROUP BY sample_id HAVING n > 1)) AS twice, "
        f"(SELECT groupArray(policy_version) FROM (SELECT policy_version FROM weights FINAL {where} "
        "ORDER BY policy_version)) AS versions, "
        f"(SELECT groupArray(step) FROM (SELECT step FROM train_steps FINAL {where} ORDER BY step)) AS steps, "
        f"(SELECT groupArray(policy_version) FROM (SELECT step, policy_version FROM train_steps FINAL {where} "
        "ORDER BY step)) AS step_versions, "
        + ", ".join(f"(SELECT count() FROM {t} {where}) AS {t}" for t in tables), runs, run_id, env)[0]
    assert rec["open"] == 0 and rec["twice"] == 0  # every sample has one terminal status, none trained twice
    assert rec["versions"] == list(range(5))  # weight versions go up by one per step
    assert rec["steps"] == rec["step_versions"] == list(range(4))
    # the same tables hold the run as under the local launcher
    assert all(rec[t] > 0 for t in tables), rec
    events = sql(f"SELECT service, kind, exit_code, previous_pid FROM service_events FINAL WHERE run_id = '{run_id}' "
                 "ORDER BY kind, service", runs, run_id, env)
    assert [(e["kind"], e["service"]) for e in events] == [
        ("ServiceRestarted", "rollout"), *[("ServiceStarted", x) for x in ("feeder", "recorder", "reward", "rollout",
                                                                          "trainer")]]
    assert events[0]["exit_code"] == -9 and events[0]["previous_pid"] == victim
    # no service process of the run is left running
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert f"--run {run_id}" not in ps
