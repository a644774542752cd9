"""Examples under examples/algos run a few steps through the real broker and the real store (one
`rollstream run` subprocess each), and their own metrics reach the record: one per distinct service
path (``BUS``: the default, a critic, a filtering estimator, a step-level one), and ReMax, whose
greedy baseline is a task, a generation and an outcome of its own. Every example also
takes an in-process step of its own config in tests/trainer/test_algorithm.py, which is what CI
time allows for all of them."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

from tests.e2e.faults import assert_accounted, invariants, rollstream, sql

pytestmark = pytest.mark.slow

TINY = ["train.steps=2", "train.warmup_sft_steps=5", "train.eval_every=0", "train.checkpoint_every=1",
        "data.heldout_size=8", "rollout.group_size=4", "train.batch_size=16", "train.micro_batch_size=8"]
EXAMPLES = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "examples" / "algos").glob("*.yaml"))
# a metric only this example's step produces
OWN_METRIC = {"gae": "loss/value", "raft": "raft/kept_frac", "gpg": "gpg/alpha", "sapo": "loss/sapo_gate_mean",
              "clip_cov": "loss/cov_selected", "kl_cov": "loss/cov_kl", "rejection": "offpolicy/rejected_seqs",
              "icepop": "offpolicy/rejected_tokens", "remax": "remax/baseline_mean"}
EXTRA = {"pass_at_k": ["algorithm.pass_k=2"]}  # pass_k < rollout.group_size (4 here)
REFUSED: set[str] = set()  # config values refused as not supported yet: no example
CORRECTIONS = {"rejection", "icepop"}  # algorithm.off_policy_correction values with an example of their own


def test_there_is_one_example_per_estimator() -> None:
    from typing import get_args, get_type_hints

    from schemas.config import AlgorithmConfig

    hints = get_type_hints(AlgorithmConfig)
    estimators = set(get_args(hints["adv_estimator"]))
    losses = set(get_args(hints["pg_variant"]))
    assert CORRECTIONS <= set(get_args(hints["off_policy_correction"]))
    assert (estimators - REFUSED) | CORRECTIONS <= set(EXAMPLES) <= estimators | losses | CORRECTIONS


BUS = ["gae", "gigpo", "grpo", "raft"]


def test_the_bus_subset_are_examples() -> None:
    assert set(BUS) <= set(EXAMPLES)


@pytest.mark.parametrize("name", BUS)
def test_example_runs_through_the_bus(tmp_path: Path, bootstrap: str, repo_root: Path, name: str) -> None:
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)
    runs = tmp_path / "runs"
    run_id = f"algo-{name.replace('_', '-')}-{uuid.uuid4().hex[:6]}"
    res = rollstream("run", str(repo_root / "examples" / "algos" / f"{name}.yaml"), "--run-id", run_id,
                     *[a for kv in [*TINY, *EXTRA.get(name, []), f"run.runs_dir={runs}"] for a in ("--set", kv)],
                     env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads((runs / run_id / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["samples"]["unaccounted"] == 0
    algo = summary["config"]["algorithm"]
    assert name in (algo["adv_estimator"], algo["pg_variant"], algo["off_policy_correction"])
    rows = sql(f"SELECT step, metrics FROM train_steps FINAL WHERE run_id = '{run_id}' ORDER BY step", runs, run_id, env)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert "loss/policy" in r["metrics"] and "rollout/advantage_abs_mean" in r["metrics"]
        if name in OWN_METRIC:
            assert OWN_METRIC[name] in r["metrics"]
    # the reference model exists only when a KL term is on (none of these examples turns one on)
    assert not (runs / run_id / "reference").exists()
    assert (runs / run_id / "checkpoints" / "step_000000").is_dir()


def test_remax_trains_against_a_greedy_baseline_that_is_never_trained(tmp_path: Path, bootstrap: str,
                                                                      repo_root: Path) -> None:
    """examples/algos/remax.yaml, two steps: every group has one more task (index group_size,
    greedy), generated and scored; it ends ``filtered`` as its group's baseline, never ``trained``,
    and the accounting stays exact (each issued sample one terminal outcome)."""
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)
    runs = tmp_path / "runs"
    run_id = f"algo-remax-{uuid.uuid4().hex[:6]}"
    res = rollstream("run", str(repo_root / "examples" / "algos" / "remax.yaml"), "--run-id", run_id,
                     *[a for kv in [*TINY, f"run.runs_dir={runs}"] for a in ("--set", kv)], env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads((runs / run_id / "summary.json").read_text())
    assert summary["steps"] == 2
    assert_accounted(summary["samples"])
    inv = invariants(runs, run_id, env)
    assert inv["lost"] == 0 and inv["two_outcomes"] == 0 and inv["trained_twice"] == 0
    rows = sql(f"""SELECT JSONExtractString(payload, 'sample_id') AS sid, JSONExtractString(payload, 'status') AS status,
                          JSONExtractString(payload, 'reason') AS reason
                   FROM events WHERE run_id = '{run_id}' AND kind = 'SampleOutcome' ORDER BY sid""", runs, run_id, env)
    baseline = [r for r in rows if r["sid"].endswith("/4")]  # group_size 4: the baseline is index 4
    trained_groups = {r["sid"].split("/")[0] for r in rows if r["status"] == "trained"}
    assert trained_groups and not any(r["status"] == "trained" for r in baseline)
    assert {r["sid"].split("/")[0] for r in baseline if r["reason"].startswith("remax baseline")} >= trained_groups
    greedy = sql(f"""SELECT JSONExtractInt(payload, 'generation', 'task', 'baseline_index') AS b, count() AS n
                     FROM events WHERE run_id = '{run_id}' AND kind = 'ScoredSample' GROUP BY b""", runs, run_id, env)
    assert [r["b"] for r in greedy] == [4]  # every task of the run names its group's baseline
    steps = sql(f"SELECT metrics FROM train_steps FINAL WHERE run_id = '{run_id}' ORDER BY step", runs, run_id, env)
    assert len(steps) == 2 and all("remax/baseline_mean" in r["metrics"] for r in steps)
