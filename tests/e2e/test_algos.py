"""Every example under examples/algos runs a few steps through the real broker and the real store
(one `rollstream run` subprocess each), and its estimator's own metrics reach the record."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

from tests.e2e.faults import rollstream, sql

pytestmark = pytest.mark.slow

TINY = ["train.steps=2", "train.warmup_sft_steps=5", "train.eval_every=0", "train.checkpoint_every=1",
        "data.heldout_size=8", "rollout.group_size=4", "train.batch_size=16", "train.micro_batch_size=8"]
EXAMPLES = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "examples" / "algos").glob("*.yaml"))
# a metric only this estimator's step produces
OWN_METRIC = {"gae": "loss/value", "raft": "raft/kept_frac", "rejection": "offpolicy/rejected_seqs",
              "icepop": "offpolicy/rejected_tokens"}
CORRECTIONS = {"rejection", "icepop"}  # algorithm.off_policy_correction values with an example of their own


def test_there_is_one_example_per_estimator() -> None:
    from typing import get_args, get_type_hints

    from schemas.config import AlgorithmConfig

    hints = get_type_hints(AlgorithmConfig)
    estimators = set(get_args(hints["adv_estimator"]))
    assert CORRECTIONS <= set(get_args(hints["off_policy_correction"]))
    assert set(EXAMPLES) == estimators | CORRECTIONS


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs_through_the_bus(tmp_path: Path, bootstrap: str, repo_root: Path, name: str) -> None:
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)
    runs = tmp_path / "runs"
    run_id = f"algo-{name.replace('_', '-')}-{uuid.uuid4().hex[:6]}"
    res = rollstream("run", str(repo_root / "examples" / "algos" / f"{name}.yaml"), "--run-id", run_id,
                     *[a for kv in [*TINY, f"run.runs_dir={runs}"] for a in ("--set", kv)], env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads((runs / run_id / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["samples"]["unaccounted"] == 0
    key = "off_policy_correction" if name in CORRECTIONS else "adv_estimator"
    assert summary["config"]["algorithm"][key] == name
    rows = sql(f"SELECT step, metrics FROM train_steps FINAL WHERE run_id = '{run_id}' ORDER BY step", runs, run_id, env)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert "loss/policy" in r["metrics"] and "rollout/advantage_abs_mean" in r["metrics"]
        if name in OWN_METRIC:
            assert OWN_METRIC[name] in r["metrics"]
    # the reference model exists only when a KL term is on (none of these examples turns one on)
    assert not (runs / run_id / "reference").exists()
    assert (runs / run_id / "checkpoints" / "step_000000").is_dir()
