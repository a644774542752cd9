"""`replay step RUN N` on a short recorded run (real broker, real store): the recomputed loss
and gradient norm match the recorded ones to 1e-6 on CPU, from a checkpoint at the step and from
an earlier one (steps in between re-run from the record)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

RUN = f"replay-step-{uuid.uuid4().hex[:6]}"  # unique: a long-lived broker keeps old runs
SHORT = ["train.steps=4", "train.warmup_sft_steps=40", "train.eval_every=0", "train.checkpoint_every=2",
         "data.heldout_size=8", "rollout.group_size=4", "train.batch_size=16", "train.micro_batch_size=6",
         # an entropy bonus and a KL loss give every step a gradient even when all rewards are equal
         "algorithm.entropy_loss_coef=0.01", "algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.1"]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory, bootstrap: str, repo_root: Path) -> Path:
    runs = tmp_path_factory.mktemp("replay") / "runs"
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)
    res = subprocess.run([sys.executable, "-m", "cli", "run", str(repo_root / "examples" / "main.yaml"),
                          "--run-id", RUN, *[a for kv in [*SHORT, f"run.runs_dir={runs}"] for a in ("--set", kv)]],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    return runs


def replay_step_json(recorded: Path, step: int) -> dict[str, Any]:
    """``rollstream replay step RUN N --format json`` in a subprocess: chDB lets a process open one
    embedded store, and the test process may have opened another one already."""
    res = subprocess.run([sys.executable, "-m", "cli", "replay", "step", RUN, str(step), "--format", "json",
                          "--runs-dir", str(recorded)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out: dict[str, Any] = json.loads(res.stdout)
    return out


@pytest.mark.parametrize("step, from_checkpoint", [(2, 2), (3, 2), (1, 0)])
def test_recomputed_step_matches_the_record(recorded: Path, step: int, from_checkpoint: int) -> None:
    r = replay_step_json(recorded, step)
    assert r["step"] == step and r["from_checkpoint"] == from_checkpoint
    rows = {m["metric"]: m for m in r["metrics"]}
    for key in ("loss/policy", "actor/grad_norm", "actor/kl", "actor/entropy", "loss/total"):
        assert key in rows and rows[key]["recorded"] is not None and rows[key]["replayed"] is not None, key
    assert rows["actor/grad_norm"]["replayed"] > 0
    assert r["max_abs_diff"] <= 1e-6, [m for m in r["metrics"] if m["abs_diff"] is not None and m["abs_diff"] > 1e-6]


def test_cli_train_step_prints_recorded_beside_replayed(recorded: Path, bootstrap: str) -> None:
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cli", "replay", "step", RUN, *args, "--runs-dir",
                               str(recorded)], capture_output=True, text=True, env=env, timeout=300)

    res = cli("3", "--format", "json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["step"] == 3 and out["from_checkpoint"] == 2 and out["max_abs_diff"] <= 1e-6
    assert {"loss/policy", "actor/grad_norm"} <= {m["metric"] for m in out["metrics"]}
    table = cli("3")
    assert table.returncode == 0 and "actor/grad_norm" in table.stdout and "max |difference|" in table.stdout
    for args, code, msg in [(["9"], 1, "no recorded training step 9 (last step: 3)"),
                            (["1", "--set", "train.lr=1"], 2, "No such option: --set")]:
        bad = cli(*args)
        assert bad.returncode == code and msg in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr


@pytest.mark.bench
def test_a_visual_step_recomputes_with_its_images(visual_run: Any, tmp_path: Path) -> None:
    """A visual run's step 1, re-run from the checkpoint of step 0, with the images loaded by digest
    from the run's blob store: the record to 1e-6; without the blob store, one line naming the image."""
    def replay(runs: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cli", "replay", "step", visual_run.run_id, "1", "--format",
                               "json", "--runs-dir", str(runs)], capture_output=True, text=True, timeout=300,
                              env=visual_run.env)

    res = replay(visual_run.runs)
    assert res.returncode == 0, res.stderr
    r = json.loads(res.stdout)
    assert r["step"] == 1 and r["from_checkpoint"] == 0
    rows = {m["metric"]: m for m in r["metrics"]}
    assert rows["actor/grad_norm"]["replayed"] > 0 and rows["actor/entropy"]["replayed"] > 0
    assert r["max_abs_diff"] <= 1e-6, [m for m in r["metrics"] if m["abs_diff"] is not None and m["abs_diff"] > 1e-6]

    blobs = visual_run.runs / visual_run.run_id / "blobs"
    blobs.rename(tmp_path / "blobs")  # the run without its blob store (given back below: the run is shared)
    try:
        bad = replay(visual_run.runs)
    finally:
        (tmp_path / "blobs").rename(blobs)
    lines = [ln for ln in bad.stderr.splitlines() if ln.strip()]
    assert bad.returncode == 1 and len(lines) == 1 and "Traceback" not in bad.stderr, bad.stderr
    assert "is missing from the run's blob store" in lines[0] and lines[0].startswith("error: sample ")
