"""Do the advantage estimators and losses learn? The main example task, once per example, side by side.

For each row (default: grpo, gae, rloo, reinforce, dr_grpo, and GRPO with the rollout corrections
rejection and icepop; ``all``: every estimator, loss and correction with an examples/algos file,
in that order) this runs
``rollstream run examples/algos/<name>.yaml`` as a subprocess — the real thing: local Kafka
broker, every service in its own process, the embedded store — with the same seed and the same
overrides (``--steps`` RL steps; everything else as in the example), one after the other, and
prints one table: held-out greedy accuracy at the RL start (after the supervised warm-up, the
same for every estimator since the seed is shared) and at the end, the gain in points, and wall
time. An estimator "learns" when it gains at least ``--min-gain`` points; the exit status is 1
when one does not.

``--from-model DIR`` starts every row from that model with no supervised warm-up: e.g. the
``checkpoints/step_000000/model`` of an earlier run of any examples/algos file (they share the
model, data and warm-up sections and the seed, so that model is what each row's own warm-up would
produce). It saves the warm-up's minutes per row; the start accuracy is then that model's.

    .venv/bin/python bench/algos.py [--steps 60] [--estimators grpo,gae,...|newer|all] [--runs-dir DIR]
                                    [--from-model DIR] [--eval-every N] [--set KEY=VALUE ...] [--json OUT]

Wall times are comparable only within one invocation (same machine, same moment).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ["grpo", "gae", "rloo", "reinforce", "dr_grpo"]
CORRECTIONS = ["rejection", "icepop"]  # GRPO with a rollout correction (off_policy_correction), one row each


def run_one(name: str, steps: int, runs_dir: Path, extra: list[str], tag: str, eval_every: int = 0) -> dict[str, Any]:
    run_id = f"bench-{name.replace('_', '-')}-{tag}"
    sets = [f"train.steps={steps}", f"run.runs_dir={runs_dir}", f"train.eval_every={eval_every or max(steps // 3, 1)}",
            f"train.checkpoint_every={steps}", *extra]
    cmd = [sys.executable, "-m", "cli", "run", str(ROOT / "examples" / "algos" / f"{name}.yaml"),
           "--run-id", run_id, *[a for kv in sets for a in ("--set", kv)]]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        return {"estimator": name, "kind": kind_of(name), "error": tail[0], "wall_s": wall}
    summary = json.loads((runs_dir / run_id / "summary.json").read_text())
    start = summary["eval"]["start"]["accuracy"]
    final = summary["eval"]["final"]["accuracy"]
    return {"estimator": name, "kind": kind_of(name), "run_id": run_id, "start": start, "final": final,
            "gain_points": 100 * (final - start), "wall_s": wall, "steps": summary["steps"],
            "curve": summary["eval"]["curve"], "samples": summary["samples"]}


NEWER = ["gpg", "opo", "pass_at_k", "remax", "sapo", "gmpo", "clip_cov", "kl_cov"]
"""Rows of the newer estimators and losses (examples/algos/<name>.yaml each)."""
GROUPS = {"default": DEFAULT, "newer": NEWER}
"""Names ``--estimators`` accepts for a list of rows (``all``: every examples/algos file)."""
KINDS = ("estimator", "loss", "correction")
"""What a row varies, in the order ``all`` lists them (:func:`kind_of`)."""


def kind_of(name: str) -> str:
    """Whether examples/algos/<name>.yaml shows an estimator, a loss or a rollout correction (the
    config value it is named after)."""
    from typing import get_args, get_type_hints

    from schemas.config import AlgorithmConfig

    hints = get_type_hints(AlgorithmConfig)
    if name in get_args(hints["adv_estimator"]):
        return "estimator"
    return "loss" if name in get_args(hints["pg_variant"]) else "correction"


def expand(spec: str) -> list[str]:
    """The rows ``--estimators`` names: comma-separated example names or :data:`GROUPS` names
    (``all``: every examples/algos file, estimators first, then losses, then corrections)."""
    names: list[str] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if part == "all":
            every = sorted(p.stem for p in (ROOT / "examples" / "algos").glob("*.yaml"))
            names += sorted(every, key=lambda n: KINDS.index(kind_of(n)))
        else:
            names += GROUPS.get(part, [part])
    return list(dict.fromkeys(names))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="RL steps per estimator (default 60)")
    ap.add_argument("--estimators", default=",".join(DEFAULT + CORRECTIONS),
                    help="comma-separated examples/algos names")
    ap.add_argument("--runs-dir", default="", help="where the runs go (default: a temporary directory)")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="extra config override for every run")
    ap.add_argument("--min-gain", type=float, default=20.0, help="points an estimator must gain (default 20)")
    ap.add_argument("--json", default="", help="also write the results as JSON here")
    ap.add_argument("--from-model", default="", help="start every row from this model, no warm-up (module doc)")
    ap.add_argument("--eval-every", type=int, default=0,
                    help="held-out evaluation every N RL steps (default: steps / 3; start and end always)")
    args = ap.parse_args()
    names = expand(args.estimators)
    missing = [n for n in names if not (ROOT / "examples" / "algos" / f"{n}.yaml").exists()]
    if missing:
        print(f"error: no examples/algos/{missing[0]}.yaml", file=sys.stderr)
        return 2
    if args.from_model and not (Path(args.from_model) / "config.json").is_file():
        print(f"error: --from-model {args.from_model} is not a model directory (no config.json)", file=sys.stderr)
        return 2
    if args.from_model:
        args.sets = [f"model.path={Path(args.from_model).resolve()}", "train.warmup_sft_steps=0", *args.sets]
    runs_dir = Path(args.runs_dir or tempfile.mkdtemp(prefix="rollstream-bench-algos-"))
    tag = time.strftime("%H%M%S")
    results = []
    for name in names:
        print(f"running {name} ({args.steps} RL steps)...", flush=True)
        res = run_one(name, args.steps, runs_dir, args.sets, tag, args.eval_every)
        results.append(res)
        if "error" in res:
            print(f"  {name}: FAILED: {res['error']}", flush=True)
        else:
            print(f"  {name}: {100 * res['start']:.1f}% -> {100 * res['final']:.1f}% "
                  f"({res['gain_points']:+.1f} points) in {res['wall_s']:.0f}s", flush=True)
    print()
    print(f"| example | kind | held-out accuracy at RL start | after {args.steps} RL steps | gain (points) | wall (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    ok = True
    for r in results:
        if "error" in r:
            ok = False
            print(f"| {r['estimator']} | {r['kind']} | failed: {r['error']} | | | {r['wall_s']:.0f} |")
            continue
        learns = r["gain_points"] >= args.min_gain
        ok &= learns
        print(f"| {r['estimator']} | {r['kind']} | {100 * r['start']:.1f}% | {100 * r['final']:.1f}% | "
              f"{r['gain_points']:+.1f}{'' if learns else ' (< ' + format(args.min_gain, 'g') + ')'} | {r['wall_s']:.0f} |")
    print(f"\nruns: {runs_dir}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
