"""The chaos soak of issue 38: one long run of the main example on a 3-broker cluster, a random
fault every so often, then the invariants on the record.

A 3-broker cluster of its own (``rollstream stack up --brokers 3`` in a temporary home, stopped at
the end) and one ``rollstream run`` of ``examples/main.yaml`` (the short settings of the fault
tests, as many steps as the soak lasts: it is stopped with ``rollstream stop`` at the end). Every
``--interval-s`` (drawn between 0.5 and 1.5 times it, seeded) a fault drawn from ``--pool``:
``kill -9`` of a service (``tests/e2e/faults.py``: feeder, rollout, reward, trainer, recorder) or
a broker fault of ``tests/e2e/test_cluster_faults.py``'s ``FAULTS``; with ``--pair-p`` two at
once (two services, or a broker fault with a service killed during it). The next fault waits for
recovery: every killed service restarted and a training step created after the fault. At the
end the run is drained, and the record's invariants are checked in SQL: nothing lost, no sample
trained twice or decided twice, no row recorded twice, the steps 0..N-1 once each.

The ``whole`` fault (all 3 brokers killed at once) is out of the default pool: it has an open
exactly-once defect (docs/reliability.md); ``--pool`` names it to run it anyway. So is
``store-down``: the run's store fails every insert for :data:`STORE_DOWN_S` (the plugin of
``tests/e2e/test_faults.py``'s store-down test, loaded by the recorder), and its recovery is the
recorder caught up (``recorder_store.json`` says the store is up again).

    .venv/bin/python bench/chaos.py [--minutes 60 | --faults N] [--interval-s 45] [--seed 0]
                                    [--pool trainer,leader,...] [--pair-p 0.2] [--runs-dir DIR] [--json OUT]

Prints one line per fault, then the summary: faults injected and survived, samples, lost,
trained twice, duplicate rows, the longest recovery and the wall time. Exit status 1 when a
fault was not survived or an invariant fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from store.outage import OUTAGE_FILE, StoreOutage  # noqa: E402
from tests.e2e.faults import SHORT, RunProc, Watch, check_invariants, invariants  # noqa: E402
from tests.e2e.test_cluster_faults import FAULTS as CLUSTER_FAULTS  # noqa: E402
from tests.e2e.test_faults import store_down_env  # noqa: E402

SERVICES = ("feeder", "rollout", "reward", "trainer", "recorder")
"""The services a fault may ``kill -9`` (the supervisor restarts them)."""
BROKER_FAULTS = tuple(n for n in CLUSTER_FAULTS if n != "whole")
"""The broker faults of the default pool: ``whole`` is out (an open exactly-once defect)."""
DEFAULT_POOL = (*SERVICES, *BROKER_FAULTS)
STORE_DOWN_S = 20.0
"""How long the ``store-down`` fault keeps the run's store failing, seconds."""
SOAK_SETTINGS = [
    *SHORT, "train.steps=1000000", "train.checkpoint_every=10", "train.eval_every=50",
    "run.max_restarts=1000", "run.restart_backoff_max_s=8",
]
"""The run of the soak: the fault tests' short main example, without an end of its own (it is
drained when the soak is over), checkpoints every 10 steps, any number of restarts (each
service is killed many times; the backoff stays short so a recovery does not wait out 30 s)."""


@dataclass
class Strike:
    """One fault (or two at once) and its recovery."""

    faults: list[str]
    at: float
    """Wall time the recovery counts from (the kill; for a broker fault, its end as ``FAULTS`` says)."""
    recovery_s: float | None = None
    error: str | None = None


@dataclass
class Soak:
    """What a soak did and found."""

    strikes: list[Strike] = field(default_factory=list)
    invariants: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    error: str | None = None

    @property
    def injected(self) -> int:
        return sum(len(s.faults) for s in self.strikes)

    @property
    def survived(self) -> int:
        return sum(len(s.faults) for s in self.strikes if s.error is None and s.recovery_s is not None)

    @property
    def longest_recovery_s(self) -> float:
        return max((s.recovery_s for s in self.strikes if s.recovery_s is not None), default=0.0)

    @property
    def ok(self) -> bool:
        inv = self.invariants
        return (self.error is None and self.survived == self.injected and bool(inv) and inv["lost"] == 0
                and inv["trained_twice"] == 0 and inv["two_outcomes"] == 0 and inv["duplicate_rows"] == 0)


def draw(rng: random.Random, pool: list[str], pair_p: float) -> list[str]:
    """One fault of ``pool``, or with probability ``pair_p`` two: two services, or a broker fault and
    a service (never two broker faults: they could take the same broker, or two of three, down)."""
    first = rng.choice(pool)
    if rng.random() >= pair_p:
        return [first]
    services = [n for n in pool if n in SERVICES and n != first]
    return [first, rng.choice(services)] if services else [first]


def restarts(run: RunProc, service: str) -> int:
    """How often the supervisor said it restarted ``service`` (a rollout worker counts as rollout)."""
    return sum(ln.lstrip().startswith(f"restarted {service}") for ln in run.log.read_text(errors="replace").splitlines())


def store_down(flag: Path) -> Callable[[Path, str, str], float]:
    """The ``store-down`` fault: the run's store fails every insert for :data:`STORE_DOWN_S`; returns
    the wall time it is back."""
    def fault(home: Path, bootstrap: str, run_id: str) -> float:
        flag.touch()
        try:
            time.sleep(STORE_DOWN_S)
        finally:
            flag.unlink()
        return time.time()
    return fault


def store_caught_up(run: RunProc, after: float, timeout_s: float) -> float | None:
    """When the recorder said the store is up again (``recorder_store.json`` written after ``after``)."""
    path = run.runs / run.run_id / OUTAGE_FILE
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and run.proc.poll() is None:
        try:
            if path.stat().st_mtime > after and msgspec.json.decode(path.read_bytes(), type=StoreOutage).down_since is None:
                return path.stat().st_mtime
        except (OSError, msgspec.DecodeError):
            pass
        time.sleep(0.2)
    return None


def strike(run: RunProc, watch: Watch, home: Path, bootstrap: str, faults: list[str], rng: random.Random,
           timeout_s: float, say: Callable[[str], None] = print, store_flag: Path | None = None) -> Strike:
    """Inject ``faults`` at once (a broker fault in a thread, the service kills during it) and wait
    for the recovery: each killed service restarted, then a training step created after the fault.
    A broker the fault's restart gave up on (not answering within 120 s) is started once more,
    with 300 s, and the recovery counts from then."""
    from infra.kafka import cluster as kc
    from infra.kafka.home import StackError
    broker = [n for n in faults if n not in SERVICES]
    services = [n for n in faults if n in SERVICES]
    before: dict[str, int] = {}
    killed: dict[str, int] = {}
    times: list[float] = []
    errors: list[BaseException] = []
    thread = None
    if broker:
        if broker[0] == "store-down":
            assert store_flag is not None, "store-down needs the soak's store plugin"
            fault = store_down(store_flag)
        else:
            fault = CLUSTER_FAULTS[broker[0]][1]

        def go() -> None:
            try:
                times.append(fault(home, bootstrap, run.run_id))
            except StackError as e:  # a broker not back within 120 s on a loaded machine: start it again
                say(f"         {broker[0]}: {str(e).splitlines()[0][:160]}; starting the stopped brokers again")
                try:
                    kc.start_cluster(home, 3, timeout_s=300)
                    times.append(time.time())
                except BaseException as again:  # reported as the strike's error
                    errors.append(again)
            except BaseException as e:  # reported as the strike's error
                errors.append(e)

        thread = threading.Thread(target=go, name=f"fault-{broker[0]}", daemon=True)
        thread.start()
        time.sleep(rng.uniform(0.5, 3.0))  # a service killed while the brokers are at fault
    for s in services:
        deadline = time.monotonic() + 60
        while not run.service_pids(s) and time.monotonic() < deadline:  # being restarted already
            time.sleep(0.2)
        before[s], killed[s] = restarts(run, s), len(run.service_pids(s))
        times.append(run.kill_service(s))
    if thread is not None:
        thread.join(timeout=timeout_s)
        if thread.is_alive():
            return Strike(faults, min(times, default=time.time()), None, f"{broker[0]} did not end within {timeout_s:g} s")
    if errors:
        return Strike(faults, time.time(), None, f"{broker[0]}: {type(errors[0]).__name__}: {errors[0]}")
    at = max(times)
    deadline = time.monotonic() + timeout_s
    back = at
    while any(restarts(run, s) < before[s] + killed[s] for s in services):
        if run.proc.poll() is not None or time.monotonic() > deadline:
            return Strike(faults, at, None, f"{services} not restarted within {timeout_s:g} s")
        time.sleep(0.2)
        back = time.time()
    if "store-down" in faults:  # training never waited for the store: its recovery is the recorder caught up
        up = store_caught_up(run, at, deadline - time.monotonic() + 1)
        if up is None:
            return Strike(faults, at, None, f"the recorder did not catch up within {timeout_s:g} s")
        back = max(back, up)
    try:
        watch.wait(lambda seen: any(ts > at for ts in seen.steps.values()), deadline - time.monotonic() + 1,
                   "a training step after the fault", run)
    except AssertionError as e:
        return Strike(faults, at, None, str(e).splitlines()[0][:300])
    step = watch.first_step_after(at)
    return Strike(faults, at, max(back, step or at) - at)


def soak(runs: Path, home: Path, *, minutes: float | None, faults: int | None, interval_s: float, pool: list[str],
         pair_p: float, seed: int, first_after_steps: int = 2, recovery_timeout_s: float = 420,
         say: Callable[[str], None] = print, settings: list[str] | None = None) -> Soak:
    """The soak on the running cluster of ``home`` (see the module doc): faults until ``minutes`` are
    over or ``faults`` were injected (a pair counts two), then the drain and the invariants."""
    from infra.kafka.cluster import local_cluster

    cluster = local_cluster(home)
    assert cluster is not None and len(cluster.running) == 3, cluster
    bootstrap = cluster.bootstrap
    env = {k: v for k, v in os.environ.items() if k != "ROLLSTREAM_BOOTSTRAP"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    store_flag = None
    if "store-down" in pool:
        env, store_flag = store_down_env(env, runs.parent / "store-plugin")
    run_id = f"chaos-{seed}-{uuid.uuid4().hex[:6]}"
    rng = random.Random(seed)
    out = Soak()
    t0 = time.time()
    limit = minutes * 60 if minutes is not None else None
    sets = [*(settings or SOAK_SETTINGS), f"run.max_wall_s={max(3600.0, 3 * (limit or 0) + 1800):g}"]
    with Watch(bootstrap, run_id) as watch:
        run = RunProc(runs, run_id, sets, env, bootstrap=bootstrap)
        try:
            watch.wait(lambda s: s.done_steps >= first_after_steps, 600, f"{first_after_steps} steps", run)
            say(f"run {run_id}: {watch.seen.done_steps} steps, the faults begin")
            while (faults is None or out.injected < faults) and (limit is None or time.time() - t0 < limit):
                time.sleep(rng.uniform(0.5, 1.5) * interval_s)
                if limit is not None and time.time() - t0 >= limit:
                    break
                if run.proc.poll() is not None:
                    out.error = f"the run ended (code {run.proc.returncode}) during the soak"
                    break
                names = draw(rng, pool, pair_p)
                if faults is not None:
                    names = names[: faults - out.injected]
                s = strike(run, watch, home, bootstrap, names, rng, recovery_timeout_s, say, store_flag)
                out.strikes.append(s)
                rec = "—" if s.recovery_s is None else f"{s.recovery_s:.1f} s"
                say(f"{time.time() - t0:7.0f} s  fault {out.injected:3d}: {' + '.join(names):28s} recovery {rec}  "
                    f"steps {watch.seen.done_steps}" + (f"  FAILED: {s.error}" if s.error else ""))
                if s.error:
                    out.error = f"fault {' + '.join(names)} not survived: {s.error}"
                    break
        finally:
            stop = subprocess.run([sys.executable, "-m", "cli", "--bootstrap", bootstrap, "stop", run_id,
                                   "--runs-dir", str(runs), "--timeout", "300", "--reason", "chaos soak over"],
                                  capture_output=True, text=True, env=env, cwd=ROOT, timeout=400)
            code = run.wait(300 if stop.returncode == 0 else 5)
    if code != 0 and out.error is None:
        out.error = f"rollstream run exited {code}: {run.output()[-1500:]}"
    env["ROLLSTREAM_BOOTSTRAP"] = bootstrap
    out.invariants = invariants(runs, run_id, env)
    try:
        check_invariants(out.invariants, out.invariants["steps_distinct"])
    except AssertionError as e:
        out.error = out.error or f"invariants: {e}"
    out.wall_s = time.time() - t0
    return out


def summary(res: Soak) -> str:
    inv = res.invariants
    rows = [("faults injected", res.injected), ("faults survived", res.survived),
            ("samples", inv.get("issued", "—")), ("trained", inv.get("trained", "—")),
            ("training steps", inv.get("steps_distinct", "—")), ("lost", inv.get("lost", "—")),
            ("trained twice", inv.get("trained_twice", "—")), ("decided twice", inv.get("two_outcomes", "—")),
            ("duplicate rows", inv.get("duplicate_rows", "—")),
            ("longest recovery (s)", f"{res.longest_recovery_s:.1f}"), ("wall (s)", f"{res.wall_s:.0f}")]
    lines = [f"{k:22s} {v}" for k, v in rows]
    lines.append("result                 " + ("ok" if res.ok else f"FAILED: {res.error or 'an invariant'}"))
    return "\n".join(lines)


def parse_pool(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = [*SERVICES, *CLUSTER_FAULTS, "store-down"]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown fault(s) {bad or text!r}; choose among {','.join(known)}")
    return names


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=None, help="How long the faults go on (default 60 unless --faults).")
    ap.add_argument("--faults", type=int, default=None, help="Stop after this many faults instead.")
    ap.add_argument("--interval-s", type=float, default=45.0,
                    help="Mean wait from one recovery to the next fault, seconds (each drawn 0.5-1.5x).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool", type=parse_pool, default=list(DEFAULT_POOL),
                    help=f"Comma-separated faults to draw from (default {','.join(DEFAULT_POOL)}; also: whole, store-down).")
    ap.add_argument("--pair-p", type=float, default=0.2, help="Probability that a fault comes with a second one.")
    ap.add_argument("--runs-dir", type=Path, default=None, help="Where the run and the cluster go (default: a temporary folder).")
    ap.add_argument("--keep", action="store_true", help="Keep the temporary folder (the run's record) at the end.")
    ap.add_argument("--json", type=Path, default=None, help="Also write the result here.")
    args = ap.parse_args()
    if args.minutes is None and args.faults is None:
        args.minutes = 60.0
    if (args.minutes is not None and args.minutes <= 0) or (args.faults is not None and args.faults <= 0) \
            or args.interval_s < 0 or not 0 <= args.pair_p <= 1:
        print("error: --minutes and --faults must be > 0, --interval-s >= 0 and --pair-p in [0, 1]", file=sys.stderr)
        return 1
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # the watch's client: retries are expected
    from infra.kafka import cluster as kc

    base = args.runs_dir or Path(tempfile.mkdtemp(prefix="rs-chaos-"))
    home = base / "cluster-kafka"
    if "whole" in args.pool:
        print("note: `whole` (all 3 brokers killed at once) has an open exactly-once defect", file=sys.stderr)
    print(f"pool {','.join(args.pool)}; seed {args.seed}; in {base}", file=sys.stderr, flush=True)
    kc.start_cluster(home, 3)
    try:
        res = soak(base / "runs", home, minutes=args.minutes, faults=args.faults, interval_s=args.interval_s,
                   pool=args.pool, pair_p=args.pair_p, seed=args.seed,
                   say=lambda line: print(line, file=sys.stderr, flush=True))
    finally:
        kc.stop_cluster(home)
    print(summary(res))
    if args.json:
        args.json.write_text(json.dumps({**asdict(res), "injected": res.injected, "survived": res.survived,
                                         "longest_recovery_s": res.longest_recovery_s, "ok": res.ok,
                                         "pool": args.pool, "seed": args.seed, "minutes": args.minutes}, indent=2))
    if args.runs_dir is None and not args.keep and res.ok:
        shutil.rmtree(base, ignore_errors=True)
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
