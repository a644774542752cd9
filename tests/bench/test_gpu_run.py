"""bench/gpu_run.py end to end on the CPU (``--device cpu --smoke``: the tiny model, 2 steps): its
own broker, the main example through Kafka against learn_offline, the shape row, results.json and
the runs' archives within the limits, and a record built from an archive with no broker
(``rollstream record --from-log``), as the CPU machine builds it after a GPU run. Minutes: ``bench``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.bench
def test_the_gpu_script_runs_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_") or k == "ROLLSTREAM_CACHE"}
    res = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_run.py"), "--out", str(out), "--device", "cpu",
                          "--smoke"], capture_output=True, text=True, env=env, cwd=REPO, timeout=1200)
    assert res.returncode == 0, res.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all((out / f).stat().st_size <= 16 * 2**20 for f in files)
    results = json.loads((out / "results.json").read_text())
    main = results["main_example"]
    assert main["steps"] == 2 and main["pipeline"]["s_per_step"] > 0 and main["learn_offline"]["s_per_step"] > 0
    assert [s for s, _ in main["pipeline"]["heldout_curve"]] == [0, 1, 2]
    assert [s for s, _ in main["learn_offline"]["heldout_curve"]] == [0, 1, 2]
    (row,) = results["shapes"]
    assert row["model"] == "tiny" and row["steps"] == 2 and row["generations"] > 0
    assert row["pipeline"]["gen_tok_s"] > 0 and row["engine_alone_gen_tok_s"] > 0
    assert row["pipeline"]["train_tok_s"] > 0 and row["strategy_alone_train_tok_s"] > 0
    assert len(row["pipeline"]["handoff_s"]) == 2  # versions 1 and 2 reached the rollout worker
    assert results["archives"] == files[:-1] and files[-1] == "results.json"
    run = main["pipeline"]["run_id"]
    rec = subprocess.run([sys.executable, "-m", "cli", "record", run, "--from-log", str(out / f"{run}.tar.xz"),
                          "--runs-dir", str(tmp_path / "runs"), "--format", "json"], capture_output=True, text=True,
                         env=env | {"PYTHONPATH": str(REPO)}, cwd=REPO, timeout=300)
    assert rec.returncode == 0, rec.stderr
    done = json.loads(rec.stdout)
    assert done["finished"] and done["tables"]["train_steps"] == 2 and done["tables"]["evals"] >= 3
