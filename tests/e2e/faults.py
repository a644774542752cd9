"""Harness of the fault and resume tests (and of ``bench/reliability.py``): start `rollstream run`
as a subprocess, watch the run's topics, kill a service (or the whole run) at a chosen moment,
run it again, and check the invariants of the record in SQL (``rollstream sql`` subprocesses).

* :class:`Watch` — a background consumer of the run's ``metrics``, ``control``, ``weights`` and
  ``tasks``: training steps (with the wall time each was seen), drains, ``RunFinished``...;
  :meth:`Watch.wait` blocks until a condition on it holds.
* :class:`RunProc` — one ``rollstream run`` process: :meth:`RunProc.service_pids` (``pgrep -f
  "cli service <name> --run <id> "``), :meth:`RunProc.kill_service`,
  :meth:`RunProc.kill_all` (SIGKILL of the supervisor and every service: the whole run dies),
  :meth:`RunProc.wait`.
* :func:`invariants` — one SQL query over the record: samples issued, samples with no terminal
  status (lost), with two terminal outcomes, trained twice, rows recorded twice, training steps.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schemas import events as ev
from schemas.config import KafkaSettings
from schemas.topics import topic_name

REPO = Path(__file__).resolve().parents[2]

SHORT = [
    "train.warmup_sft_steps=10", "data.heldout_size=16", "rollout.group_size=4", "train.batch_size=16",
    "train.micro_batch_size=16", "train.eval_every=2", "rollout.async_ratio=1",
]
"""A short run of the main example (steps and checkpoints are set per test)."""


def rollstream(*args: str, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=REPO)


def assert_accounted(samples: dict[str, int]) -> None:
    """``summary.json``'s ``samples``: every issued sample has exactly one terminal status."""
    assert samples["unaccounted"] == 0, samples
    assert samples["issued"] == (samples["trained"] + samples["dropped_stale"] + samples["filtered"]
                                 + samples["dead_letter"]), samples


def status(runs: Path, run_id: str, env: dict[str, str]) -> dict[str, Any]:
    """``rollstream status RUN --format json``."""
    res = rollstream("status", run_id, "--runs-dir", str(runs), "--format", "json", env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    return dict(json.loads(res.stdout))


def sql(q: str, runs: Path, run_id: str, env: dict[str, str]) -> list[dict[str, Any]]:
    res = rollstream("sql", q, "--run", run_id, "--runs-dir", str(runs), "--format", "json", env=env)
    assert res.returncode == 0, res.stderr
    rows: list[dict[str, Any]] = json.loads(res.stdout)
    return rows


# --------------------------------------------------------------------------- watching the topics


@dataclass
class Seen:
    """What the watch has seen on the run's topics so far."""

    steps: dict[int, float] = field(default_factory=dict)
    """Training step -> when its (first) ``TrainStep`` was created (the event's ``ts``: a step
    published by a process that died afterwards is not counted as one after the fault)."""
    step_events: int = 0
    tasks: int = 0
    versions: list[int] = field(default_factory=list)
    drains: list[str] = field(default_factory=list)
    evals: list[str] = field(default_factory=list)
    """Splits of the ``EvalResult`` s seen (``init`` comes before the warm-up)."""
    finished: float | None = None
    """Wall time ``RunFinished`` was seen."""

    @property
    def done_steps(self) -> int:
        return len(self.steps)


class Watch:
    """Follows a run's topics in a background thread (see the module doc)."""

    def __init__(self, bootstrap: str, run_id: str) -> None:
        self.kafka = KafkaSettings(bootstrap=bootstrap)
        self.run_id = run_id
        self.seen = Seen()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._follow()), daemon=True, name="watch")

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    async def _follow(self) -> None:
        from runtime.bus import Consumer

        names = [topic_name(self.run_id, n) for n in ("metrics", "control", "weights", "tasks")]
        # the run's topics appear once `rollstream run` created them: refresh metadata often
        async with Consumer(self.kafka, group_id=None, topics=names, metadata_max_age_ms=300,
                            client_suffix="test-watch") as consumer:
            while not self._stop.is_set():
                try:
                    recs = await consumer.getmany(timeout_ms=200)
                except Exception:  # a broker outage (the outage test): try again
                    await asyncio.sleep(0.5)
                    continue
                now = time.time()
                with self._lock:
                    for rec in recs:
                        self._observe(rec.event, now)

    def _observe(self, event: Any, now: float) -> None:
        s = self.seen
        if isinstance(event, ev.TrainStep):
            s.step_events += 1
            s.steps.setdefault(event.step, event.ts)
        elif isinstance(event, ev.RolloutTask):
            s.tasks += 1
        elif isinstance(event, ev.WeightsPublished):
            s.versions.append(event.policy_version)
        elif isinstance(event, ev.Drain):
            s.drains.append(event.reason)
        elif isinstance(event, ev.EvalResult):
            s.evals.append(event.split)
        elif isinstance(event, ev.RunFinished):
            s.finished = s.finished or now

    def wait(self, cond: Callable[[Seen], bool], timeout: float, what: str, proc: RunProc | None = None) -> None:
        """Until ``cond(seen)`` holds; fails after ``timeout`` seconds (or when ``proc`` ended)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if cond(self.seen):
                    return
            if proc is not None and proc.proc.poll() is not None:
                raise AssertionError(f"the run ended (code {proc.proc.returncode}) before {what}:\n{proc.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"not seen within {timeout:g} s: {what} (seen: {self.seen})")
            time.sleep(0.1)

    def first_step_after(self, t: float) -> float | None:
        """Creation time of the first training step created after ``t``."""
        with self._lock:
            later = [ts for ts in self.seen.steps.values() if ts > t]
        return min(later) if later else None


# --------------------------------------------------------------------------- the run process


class RunProc:
    """One ``rollstream run`` of ``run_id`` (see the module doc)."""

    def __init__(self, runs: Path, run_id: str, overrides: list[str], env: dict[str, str],
                 bootstrap: str | None = None, config: Path | None = None, resume: bool = False) -> None:
        """``resume``: ``rollstream resume RUN`` (the run's own config) instead of ``rollstream run``."""
        self.runs, self.run_id, self.env = runs, run_id, env
        globals_ = ["--bootstrap", bootstrap] if bootstrap else []
        sets = [*overrides, f"run.runs_dir={runs}"]
        self.cmd = ([sys.executable, "-m", "cli", *globals_, "resume", run_id, "--runs-dir", str(runs)] if resume
                    else [sys.executable, "-m", "cli", *globals_, "run", str(config or REPO / "examples" / "main.yaml"),
                          "--run-id", run_id, *[a for kv in sets for a in ("--set", kv)]])
        runs.mkdir(parents=True, exist_ok=True)
        self.log = runs / f"{run_id}.run{int(time.time() * 1000) % 100000}.out"
        self._fh = open(self.log, "wb")
        self.proc = subprocess.Popen(self.cmd, env=env, cwd=REPO, stdout=self._fh, stderr=subprocess.STDOUT)
        self.started = time.time()

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def service_pids(self, name: str) -> list[int]:
        """Pids of the run's ``name`` service processes (``rollout`` covers every rollout worker)."""
        res = subprocess.run(["pgrep", "-f", f"cli service {name} --run {self.run_id} "],
                             capture_output=True, text=True)
        return [int(p) for p in res.stdout.split()]

    def kill_service(self, name: str) -> float:
        """SIGKILL the service (it must be running); the wall time of the kill."""
        pids = self.service_pids(name)
        assert pids, f"no {name} process of run {self.run_id}:\n{self.output()}"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        return time.time()

    def pause_service(self, name: str) -> None:
        """SIGSTOP the service: it holds still until killed (a moment made to last)."""
        pids = self.service_pids(name)
        assert pids, f"no {name} process of run {self.run_id}:\n{self.output()}"
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)

    def resume_service(self, name: str) -> None:
        """SIGCONT a paused service."""
        for pid in self.service_pids(name):
            os.kill(pid, signal.SIGCONT)

    def kill_all(self) -> float:
        """SIGKILL the supervisor and every service of the run: the whole run dies at once."""
        pids = [self.proc.pid]
        for name in ("recorder", "feeder", "reward", "rollout", "trainer"):
            pids += self.service_pids(name)
        t = time.time()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        deadline = time.monotonic() + 30
        while any(self.service_pids(n) for n in ("recorder", "feeder", "reward", "rollout", "trainer")):
            assert time.monotonic() < deadline, "services still alive after SIGKILL"
            time.sleep(0.2)
        return t

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise AssertionError(f"run {self.run_id} did not finish within {timeout:g} s:\n{self.output()}") from None
        finally:
            self._fh.close()

    def restarts(self) -> str:
        """The supervisor's lines about restarts (for messages)."""
        return "\n".join(ln for ln in self.output().splitlines() if "restart" in ln)


@dataclass
class FaultResult:
    """What one fault run measured (``bench/reliability.py`` prints these)."""

    invariants: dict[str, int]
    recovery_s: float | None
    """From the fault to the next training step seen on the topics (to ``RunFinished`` when no
    step was left), seconds; ``None`` where it does not apply."""
    wall_s: float


def recovery_after(watch: Watch, t: float) -> float | None:
    """Seconds from ``t`` to the next training step (or ``RunFinished``) the watch saw."""
    nxt = watch.first_step_after(t)
    if nxt is None:
        nxt = watch.seen.finished if watch.seen.finished and watch.seen.finished > t else None
    return None if nxt is None else nxt - t


# --------------------------------------------------------------------------- the record


INVARIANTS = """
WITH
  outcomes AS (SELECT JSONExtractString(payload, 'sample_id') AS sid, JSONExtractString(payload, 'status') AS status
               FROM events WHERE run_id = '{r}' AND kind = 'SampleOutcome'),
  issued AS (SELECT DISTINCT JSONExtractString(payload, 'sample_id') AS sid
             FROM events WHERE run_id = '{r}' AND kind = 'RolloutTask'),
  dead AS (SELECT DISTINCT sample_id AS sid FROM dlq FINAL WHERE run_id = '{r}' AND sample_id != ''),
  steps AS (SELECT JSONExtractInt(payload, 'step') AS step, ts FROM events WHERE run_id = '{r}' AND kind = 'TrainStep')
SELECT
  (SELECT count() FROM issued) AS issued,
  (SELECT count() FROM issued WHERE sid NOT IN (SELECT sid FROM outcomes) AND sid NOT IN (SELECT sid FROM dead)) AS lost,
  (SELECT count() FROM (SELECT sid FROM outcomes GROUP BY sid HAVING count() > 1)) AS two_outcomes,
  (SELECT count() FROM (SELECT sid FROM outcomes WHERE status = 'trained' GROUP BY sid HAVING count() > 1))
    AS trained_twice,
  (SELECT countIf(status = 'trained') FROM outcomes) AS trained,
  (SELECT count() FROM (SELECT topic, partition, offset, record_index FROM events WHERE run_id = '{r}'
                        GROUP BY topic, partition, offset, record_index HAVING count() > 1)) AS duplicate_rows,
  (SELECT count() FROM steps) AS step_rows,
  (SELECT uniqExact(step) FROM steps) AS steps_distinct,
  (SELECT min(step) FROM steps) AS min_step,
  (SELECT max(step) FROM steps) AS max_step,
  (SELECT count() FROM train_steps FINAL WHERE run_id = '{r}') AS train_steps_rows,
  (SELECT count() FROM (SELECT step FROM train_steps WHERE run_id = '{r}' GROUP BY step
                        HAVING uniqExact(ts, policy_version, num_samples) > 1)) AS steps_with_two_versions,
  (SELECT count() FROM events WHERE run_id = '{r}' AND kind = 'RunFinished') AS run_finished,
  (SELECT count() FROM events WHERE run_id = '{r}' AND record_index > 0) AS batched_rows
"""


def invariants(runs: Path, run_id: str, env: dict[str, str]) -> dict[str, int]:
    """The counters of :data:`INVARIANTS` for ``run_id`` (one ``rollstream sql`` call)."""
    rows = sql(INVARIANTS.format(r=run_id), runs, run_id, env)
    return {k: int(v) for k, v in rows[0].items()}


def check_invariants(inv: dict[str, int], steps: int) -> None:
    """Assert the reliability invariants of a finished run of ``steps`` steps."""
    assert inv["issued"] > 0, inv
    assert inv["lost"] == 0, f"issued samples with no terminal status: {inv}"
    assert inv["two_outcomes"] == 0, f"samples with two terminal outcomes: {inv}"
    assert inv["trained_twice"] == 0, f"samples trained twice: {inv}"
    assert inv["duplicate_rows"] == 0, f"rows recorded twice: {inv}"
    assert (inv["step_rows"], inv["steps_distinct"], inv["min_step"], inv["max_step"]) == (steps, steps, 0, steps - 1), \
        f"training steps are not 0..{steps - 1} once each: {inv}"
    # the typed table: one row per step (an identical copy a recorder killed between its inserts
    # left behind collapses under FINAL, as every query of the record reads it), never two versions
    assert inv["train_steps_rows"] == steps and inv["steps_with_two_versions"] == 0, inv
    assert inv["run_finished"] == 1, inv
    assert inv["batched_rows"] > 0, f"no batched record in the run (kafka.samples_per_record): {inv}"
