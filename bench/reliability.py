"""The reliability table of ``docs/reliability.md``: every fault and bad input tried, measured.

Runs each scenario of ``tests/e2e/test_faults.py``, ``tests/e2e/test_resume.py`` and
``tests/e2e/test_poison.py`` (the same harness, ``tests/e2e/faults.py``: ``rollstream run`` as a
subprocess, the real broker, the embedded store) ``--runs`` times, queries each run's record in
SQL and prints one markdown table: fault, runs, samples issued, samples lost (no terminal status),
samples trained twice, rows recorded twice, recovery time (from the fault to the next training
step; to ``RunFinished`` when no step was left) and wall time. A run that fails its checks is a
row with the error. The bad-input row runs ``tests/test_bad_input.py`` (the CLI corpus of
``tests/data/bad_input``) and counts its cases.

    ROLLSTREAM_BOOTSTRAP=host:port .venv/bin/python bench/reliability.py [--runs 1] [--only NAME ...]
                                                                        [--runs-dir DIR] [--json OUT]

``$ROLLSTREAM_BOOTSTRAP`` (else the local broker of ``rollstream stack up``: ``common.find_broker``)
is the broker of the runs (never stopped); the broker-outage and broker-kill scenarios
start, stop (or SIGKILL) and restart a broker of their own in a temporary home, and the
``cluster-*`` scenarios (``tests/e2e/test_cluster_faults.py``) a 3-broker cluster of their own. The exit status is 1 when a
scenario failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.faults import (  # noqa: E402
    SHORT,
    FaultResult,
    RunProc,
    Watch,
    check_invariants,
    invariants,
)
from tests.e2e.test_cluster_faults import FAULTS as CLUSTER_FAULTS  # noqa: E402
from tests.e2e.test_cluster_faults import cluster_fault_run  # noqa: E402
from tests.e2e.test_faults import (  # noqa: E402
    broker_outage_run,
    faulty_verifier_run,
    kill_service_run,
    store_outage_run,
)
from tests.e2e.test_resume import resume_run  # noqa: E402

POISON_STEPS = 4


def poison_run(runs: Path, bootstrap: str) -> FaultResult:
    """``tests/e2e/test_poison.py``'s scenario (its helpers): undecodable and impossible records
    on ``tasks``, ``generations`` and ``scored`` naming real samples, mid-run."""
    from schemas.config import KafkaSettings
    from tests.e2e.test_poison import inject, issued_tasks

    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)
    run_id = f"bench-poison-{uuid.uuid4().hex[:6]}"
    t0 = time.time()
    kafka = KafkaSettings(bootstrap=bootstrap)
    with Watch(bootstrap, run_id):
        run = RunProc(runs, run_id, [*SHORT, f"train.steps={POISON_STEPS}", "train.checkpoint_every=2"], env)
        tasks = asyncio.run(issued_tasks(kafka, run_id, groups=8))
        injected = asyncio.run(inject(kafka, run_id, tasks))
        code = run.wait(360)
    assert code == 0, run.output()
    inv = invariants(runs, run_id, env)
    check_invariants(inv, POISON_STEPS)
    inv["poison"] = len(injected)
    return FaultResult(inv, None, time.time() - t0)


def bad_input_row() -> dict[str, Any]:
    """``tests/test_bad_input.py`` (every case answered with one line, nothing started)."""
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_bad_input.py"],
                          cwd=ROOT, capture_output=True, text=True)
    passed = re.search(r"(\d+) passed", proc.stdout)
    failed = re.search(r"(\d+) failed", proc.stdout)
    return {"fault": "bad config / CLI input (`tests/data/bad_input`, one run per case)",
            "runs": int(passed[1] if passed else 0) + int(failed[1] if failed else 0),
            "refused": int(passed[1]) if passed else 0, "failed": int(failed[1]) if failed else 0,
            "wall_s": time.time() - t0, "ok": proc.returncode == 0}


def scenarios(bootstrap: str, outage_home: Callable[[], tuple[Path, str]],
              cluster_home: Callable[[], Path]) -> dict[str, tuple[str, Callable[..., FaultResult]]]:
    """name -> (table label, run(runs_dir, index) -> FaultResult)."""
    out: dict[str, tuple[str, Callable[..., FaultResult]]] = {}
    labels = {"feeder": "`kill -9` feeder", "rollout": "`kill -9` rollout (mid-generation)",
              "reward": "`kill -9` reward (mid-transaction)", "trainer": "`kill -9` trainer (after a checkpoint)",
              "recorder": "`kill -9` recorder (mid-batch)"}
    for service, label in labels.items():
        out[f"kill-{service}"] = (label, lambda runs, i, s=service: kill_service_run(runs, bootstrap, s, seed=i))
    for point, label in (("start", "whole run killed at the start (step-0 checkpoint), rerun"),
                         ("middle", "whole run killed mid-run (a step after its checkpoint), rerun"),
                         ("end", "whole run killed after the last step, before `RunFinished`, rerun")):
        out[f"resume-{point}"] = (label, lambda runs, i, p=point: resume_run(runs, bootstrap, p))

    def outage(runs: Path, i: int) -> FaultResult:
        home, own = outage_home()
        return broker_outage_run(runs, home, own)

    def broker_kill(runs: Path, i: int) -> FaultResult:
        home, own = outage_home()
        return broker_outage_run(runs, home, own, outage_s=10.0, kill=True)

    out["outage"] = ("Kafka broker stopped for 20 s mid-run", outage)
    out["broker-kill"] = ("`kill -9` of the Kafka broker mid-run, started again 10 s later", broker_kill)
    for name, (label, fault) in CLUSTER_FAULTS.items():
        out[f"cluster-{name}"] = (f"3-broker cluster: {label}",
                                  lambda runs, i, n=name, f=fault: cluster_fault_run(runs, cluster_home(), f, n))
    out["verifier"] = ("verifier hangs (`sleep`) or raises on 2/7 of the answers",
                       lambda runs, i: faulty_verifier_run(runs, bootstrap, runs.parent / f"plugin{i}"))
    out["store-down"] = ("the store down for 8 s mid-run (every insert fails as chDB's do on a refused write)",
                         lambda runs, i: store_outage_run(runs, bootstrap, runs.parent / f"store-plugin{i}"))
    out["poison"] = ("poison records (7 undecodable / impossible events mid-run)",
                     lambda runs, i: poison_run(runs, bootstrap))
    return out


def fmt_s(values: list[float]) -> str:
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.median(values):.1f} (max {max(values):.1f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1, help="Runs per scenario.")
    ap.add_argument("--only", nargs="*", default=[], help="Scenario names (kill-feeder, resume-middle, outage, ...).")
    ap.add_argument("--runs-dir", type=Path, default=None, help="Where the runs go (default: a temporary folder).")
    ap.add_argument("--json", type=Path, default=None, help="Also write the raw results here.")
    ap.add_argument("--no-bad-input", action="store_true", help="Skip the bad-input row.")
    args = ap.parse_args()
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # the watches' clients: retries are expected
    from common import find_broker  # bench/common.py

    from runtime.probe import NO_BROKER

    bootstrap = find_broker()
    if not bootstrap:
        print(f"error: {NO_BROKER}", file=sys.stderr)
        return 1
    base = args.runs_dir or Path(tempfile.mkdtemp(prefix="rs-reliability-"))
    state: dict[str, Any] = {}

    def outage_home() -> tuple[Path, str]:
        from infra.kafka import broker as stack

        if "home" not in state:
            home = base / "outage-kafka"
            stack.ensure_kafka_jars()
            proc, _ = stack.start_local_kafka(home)
            state["home"], state["bootstrap"] = home, proc.bootstrap
        return state["home"], state["bootstrap"]

    def cluster_home() -> Path:
        from infra.kafka import cluster as kc

        if "cluster" not in state:
            state["cluster"] = base / "cluster-kafka"
            kc.start_cluster(state["cluster"], 3)
        return Path(state["cluster"])

    table = scenarios(bootstrap, outage_home, cluster_home)
    names = args.only or list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        print(f"error: unknown scenario(s) {unknown}; one of {list(table)}", file=sys.stderr)
        return 1
    rows: list[dict[str, Any]] = []
    try:
        for name in names:
            label, fn = table[name]
            results: list[FaultResult] = []
            errors: list[str] = []
            for i in range(args.runs):
                print(f"{name} run {i + 1}/{args.runs}...", file=sys.stderr, flush=True)
                try:
                    results.append(fn(base / name / f"r{i}" / "runs", i))
                except Exception as e:  # one line in the table, the traceback on stderr
                    traceback.print_exc()
                    errors.append(str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__)
            rows.append({
                "name": name, "fault": label, "runs": args.runs, "failed_runs": len(errors), "errors": errors,
                "issued": sum(r.invariants["issued"] for r in results),
                "lost": sum(r.invariants["lost"] for r in results),
                "trained_twice": sum(r.invariants["trained_twice"] for r in results),
                "two_outcomes": sum(r.invariants["two_outcomes"] for r in results),
                "duplicate_rows": sum(r.invariants["duplicate_rows"] for r in results),
                "recovery_s": [r.recovery_s for r in results if r.recovery_s is not None],
                "wall_s": [r.wall_s for r in results],
            })
    finally:
        if "home" in state:
            from infra.kafka import broker as stack

            stack.stop_local_kafka(state["home"])
        if "cluster" in state:
            from infra.kafka.cluster import stop_cluster

            stop_cluster(state["cluster"])
    bad = None if args.no_bad_input or args.only else bad_input_row()

    print("| fault | runs | samples issued | samples lost | trained twice | duplicate rows | "
          "recovery time (s) | wall (s) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        runs = f"{r['runs'] - r['failed_runs']}/{r['runs']}" if r["failed_runs"] else str(r["runs"])
        print(f"| {r['fault']} | {runs} | {r['issued']} | {r['lost']} | {r['trained_twice']} | "
              f"{r['duplicate_rows']} | {fmt_s(r['recovery_s'])} | {fmt_s(r['wall_s'])} |")
        for err in r["errors"]:
            print(f"|   ↳ failed: {err} | | | | | | | |")
    if bad is not None:
        print(f"| {bad['fault']} | {bad['runs']} | — | — | — | — | refused in one line: {bad['refused']}/"
              f"{bad['runs']} | {bad['wall_s']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "bad_input": bad}, indent=2))
    failed = any(r["failed_runs"] or r["lost"] or r["trained_twice"] or r["two_outcomes"] or r["duplicate_rows"]
                 for r in rows) or (bad is not None and not bad["ok"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
