"""End to end, a visual task as a user runs it (``examples/vision.yaml`` shortened, a subprocess, the
real broker and store): the tiny VLM is created, the images go to the run's blob store, the tasks in
the record name them, every sample is accounted for; a text model with a visual task is refused in
one line before anything starts; a visual environment under history windows shows every window its
frames."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from blobs import BlobStore
from tests.e2e.faults import assert_accounted, sql

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
# make test-bench (CI time is spent): the short run took 32 s on a quiet machine, 100 s on 2 busy
# cores, the refusal 9-22 s; tests/launch/test_prepare.py checks the refusals in CI on the function
# the run calls

SHORT_VISION = [
    "train.steps=2", "train.warmup_sft_steps=2", "train.warmup_batch_size=8", "train.eval_every=2",
    "train.checkpoint_every=2", "data.heldout_size=8", "rollout.group_size=4", "train.batch_size=8",
    "train.micro_batch_size=8",
]
"""A short visual run: 2 steps of 2 groups of 4, a 2-step warm-up, 8 held-out images."""


def run(repo: Path, run_id: str, runs: Path, env: dict[str, str], sets: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli", "run", str(repo / "examples" / "vision.yaml"), "--run-id",
                           run_id, *[a for kv in [*sets, f"run.runs_dir={runs}"] for a in ("--set", kv)]],
                          capture_output=True, text=True, env=env, timeout=200, cwd=repo)


@pytest.mark.bench
def test_a_short_visual_run_accounts_for_every_sample(tmp_path: Path, bootstrap: str, repo_root: Path) -> None:
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)
    runs = tmp_path / "runs"
    run_id = f"e2e-vision-{uuid.uuid4().hex[:6]}"
    res = run(repo_root, run_id, runs, env, SHORT_VISION)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads((runs / run_id / "summary.json").read_text())
    assert summary["steps"] == 2
    assert_accounted(summary["samples"])
    assert summary["samples"]["trained"] > 0 and summary["samples"]["dead_letter"] == 0
    rows = sql("SELECT JSONExtract(payload, 'image_hashes', 'Array(String)') AS h FROM events "
               "WHERE kind = 'RolloutTask'", runs, run_id, env)
    assert len(rows) == summary["samples"]["issued"]
    store = BlobStore(runs / run_id / "blobs")
    hashes = {h for r in rows for h in r["h"]}
    assert all(len(r["h"]) == 1 for r in rows) and all(store.get(h) for h in hashes)  # every image, intact
    assert (runs / run_id / "final" / "preprocessor_config.json").is_file()


@pytest.mark.bench
def test_a_short_visual_lora_run_publishes_complete_vlms(tmp_path: Path, bootstrap: str, repo_root: Path) -> None:
    """LoRA on the language side (the example freezes the tower too): the engine loads every merged
    version it is sent, and the final model is a complete VLM directory."""
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)
    runs = tmp_path / "runs"
    run_id = f"e2e-vision-lora-{uuid.uuid4().hex[:6]}"
    res = run(repo_root, run_id, runs, env, [*SHORT_VISION, "train.lora_rank=4", "train.lr=1e-3"])
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads((runs / run_id / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["samples"]["dead_letter"] == 0
    assert_accounted(summary["samples"])
    assert summary["weights_versions"] == [0, 1, 2]
    assert (runs / run_id / "final" / "preprocessor_config.json").is_file()



@pytest.mark.bench
def test_a_visual_task_with_a_text_model_is_refused_in_one_line(tmp_path: Path, bootstrap: str,
                                                                 repo_root: Path) -> None:
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)
    runs = tmp_path / "runs"
    bad = run(repo_root, f"e2e-vision-text-{uuid.uuid4().hex[:6]}", runs, env,
              [*SHORT_VISION, "model.init.vision=false"])
    assert bad.returncode != 0
    line = [ln for ln in (bad.stdout + bad.stderr).splitlines() if ln.startswith("error:")]
    assert line and "data.domains[0] (shapes) shows images" in line[0], bad.stdout + bad.stderr
    assert "Traceback" not in bad.stderr
    assert {p.name for p in runs.glob("*/logs/*.log")} <= {"cli.log"}  # no service started


WINDOWED_LAKE = """\
run: {name: lake-windows, seed: 0}
model:
  init: {vision: true, hidden_size: 64, num_layers: 2, num_heads: 4, intermediate_size: 192,
         max_position_embeddings: 1024}
data:
  domains:
    - {name: lake, source: frozenlake_pixels, kwargs: {size: 4, cell_px: 28, frames: every, instructions: false}}
  heldout_size: 4
rollout: {group_size: 4, max_new_tokens: 8, max_turns: 4, history_turns: 0, max_context_tokens: 512, max_batch: 16}
train: {steps: 2, batch_size: 8, micro_batch_size: 8, eval_every: 2, checkpoint_every: 2, warmup_sft_steps: 2,
        warmup_batch_size: 4, freeze_vision: true}
env: {workers: 1}
"""
"""``frozenlake_pixels`` (a frame every observation) under history windows: 2 steps of 2 groups of 4."""


@pytest.mark.bench
def test_a_windowed_visual_run_shows_each_window_its_frames(tmp_path: Path, bootstrap: str, repo_root: Path) -> None:
    """``rollout.history_turns`` with a visual environment through the real services: every episode
    names one image list per turn (``segment_image_hashes``; a later window shows the first frame and
    the current one), every frame is in the blob store, the trainer's logprobs of every window agree
    with the engine's (the ratio), and ``replay step`` recomputes a step from the recorded digests."""
    from tests.e2e.faults import rollstream

    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)
    runs = tmp_path / "runs"
    run_id = f"e2e-vision-windows-{uuid.uuid4().hex[:6]}"
    cfg = tmp_path / "lake.yaml"
    cfg.write_text(WINDOWED_LAKE)
    res = subprocess.run([sys.executable, "-m", "cli", "run", str(cfg), "--run-id", run_id, "--set",
                          f"run.runs_dir={runs}"], capture_output=True, text=True, env=env, timeout=220, cwd=repo_root)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads((runs / run_id / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["samples"]["dead_letter"] == 0 and summary["samples"]["trained"] > 0
    assert_accounted(summary["samples"])
    gens = sql("SELECT JSONExtractUInt(payload, 'num_turns') AS turns, "
               "JSONExtract(payload, 'segment_image_hashes', 'Array(Array(String))') AS segs, "
               "JSONExtract(payload, 'image_hashes', 'Array(String)') AS flat FROM events "
               "WHERE kind = 'Generation'", runs, run_id, env)
    assert len(gens) >= summary["samples"]["trained"]
    store = BlobStore(runs / run_id / "blobs")
    for g in gens:
        assert len(g["segs"]) == g["turns"] and [len(s) for s in g["segs"]] == [1] + [2] * (g["turns"] - 1), g
        assert [h for s in g["segs"] for h in s] == g["flat"] and all(store.has(h) for h in g["flat"])
        assert all(s[0] == g["segs"][0][0] for s in g["segs"])  # every window shows the first frame
    steps = sql("SELECT metrics['actor/ratio_min'] AS lo, metrics['actor/ratio_max'] AS hi FROM train_steps",
                runs, run_id, env)
    assert len(steps) == 2 and all(abs(s["lo"] - 1) < 1e-4 and abs(s["hi"] - 1) < 1e-4 for s in steps), steps
    rep = rollstream("replay", "step", run_id, "0", "--format", "json", "--runs-dir", str(runs), env=env, timeout=300)
    assert rep.returncode == 0, rep.stderr
    out = json.loads(rep.stdout)
    assert out["step"] == 0 and out["max_abs_diff"] <= 1e-5, out["metrics"]
