"""Faults during a short `rollstream run` (real broker, real store), each case one run:

* ``kill -9`` of one service at a point chosen at random (seeded) in the middle of the run —
  feeder, rollout (mid-generation), reward (mid-transaction), trainer (after a checkpoint, with
  a step after it that the restarted trainer re-runs from the record), recorder (mid-batch): the
  supervisor restarts it and the run completes; ``rollstream status`` and the record's
  ``service_events`` show that one restart;
* the Kafka broker stopped for 20 s in the middle of the run (a broker of the test's own, never
  the shared one) and started again, or killed with ``kill -9`` and started again 10 s later:
  every service rides it out;
* a verifier that hangs or crashes on some samples: they are scored 0 with the reason, the run
  goes on;
* the store down for 8 s mid-run (its inserts fail as chDB's do when the disk refuses writes):
  training goes on, ``rollstream status`` shows the outage, the recorder catches up (``make
  test-bench``; CI has tests/services/test_recorder.py's outage tests on the real store).

After each, in SQL: every issued sample has exactly one terminal status, none is trained twice,
no row is recorded twice, the training steps are 0..N-1 exactly once. Poison records (bad bytes
and impossible values) are ``tests/e2e/test_poison.py``.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.faults import (
    REPO,
    SHORT,
    FaultResult,
    RunProc,
    Watch,
    check_invariants,
    invariants,
    recovery_after,
    sql,
    status,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

STEPS = 8  # long enough for a kill in the middle and the restart to happen well before the end
OVERRIDES = [*SHORT, f"train.steps={STEPS}", "train.checkpoint_every=4"]


# --------------------------------------------------------------------------- kill -9 of a service

KILL_AT = {
    # service -> steps done before the kill (then up to 0.3 s more, at random)
    "feeder": 2,
    "rollout": 2,
    "reward": 2,
    "trainer": 5,  # checkpoints of steps 4 and 8: step 4 (maybe 5, 6) is re-run from the record after the restart
    "recorder": 2,
}


def kill_service_run(runs: Path, bootstrap: str, service: str, seed: int = 0, *sets: str) -> FaultResult:
    """One run where ``service`` is SIGKILLed once mid-run; asserts it completes and the invariants.
    ``sets``: config overrides beyond :data:`OVERRIDES`."""
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)
    run_id = f"e2e-kill-{service}-{uuid.uuid4().hex[:6]}"
    t0 = time.time()
    with Watch(bootstrap, run_id) as watch:
        run = RunProc(runs, run_id, [*OVERRIDES, *sets], env)
        watch.wait(lambda s: s.done_steps >= KILL_AT[service], 300, f"{KILL_AT[service]} step(s)", run)
        time.sleep(random.Random(f"{seed}/{service}").uniform(0, 0.3))
        (victim,) = run.service_pids(service)
        killed_at = run.kill_service(service)
        assert watch.seen.finished is None and watch.seen.done_steps < STEPS, f"killed too late: {watch.seen}"
        if service == "recorder":
            # the run goes on without its recorder and may reach RunFinished before the restart,
            # which `rollstream run` does not wait for: hold the end (the feeder publishes
            # RunFinished) until the recorder is back
            run.pause_service("feeder")
            deadline = time.monotonic() + 60
            while "restarted recorder" not in run.output():
                assert time.monotonic() < deadline, run.output()
                time.sleep(0.2)
            run.resume_service("feeder")
        code = run.wait(360)
        recovery = recovery_after(watch, killed_at)
    assert code == 0, run.output()
    assert f"service {service} killed by SIGKILL (exit code -9); restarting in 1 s" in run.output(), run.output()
    assert f"restarted {service}" in run.output(), run.output()
    inv = invariants(runs, run_id, env)
    check_invariants(inv, STEPS)
    # `rollstream status` and the record's service_events show the one restart, of this service only
    after = status(runs, run_id, env)
    assert after["phase"] == "finished" and after["step"] == STEPS and after["policy_version"] == STEPS, after
    svc = after["services"][service]
    assert svc["restarts"] == 1 and svc["pid"] != victim and svc["state"] in ("stopped", "exited"), svc
    assert all(s["restarts"] == 0 for name, s in after["services"].items() if name != service), after
    rows = sql(f"SELECT service, kind, exit_code, restarts, previous_pid, pid FROM service_events FINAL "
               f"WHERE run_id = '{run_id}' AND kind != 'ServiceStarted'", runs, run_id, env)
    assert rows == [{"service": service, "kind": "ServiceRestarted", "exit_code": -9, "restarts": 1,
                     "previous_pid": victim, "pid": svc["pid"]}], rows
    started = sql(f"SELECT service FROM service_events FINAL WHERE run_id = '{run_id}' AND kind = 'ServiceStarted' "
                  "ORDER BY service", runs, run_id, env)
    assert [r["service"] for r in started] == ["feeder", "recorder", "reward", "rollout", "trainer"], started
    if service == "trainer":  # the restarted trainer re-ran the step(s) after its checkpoint from the record
        log = (runs / run_id / "logs" / "trainer.log").read_text()
        rerun = re.search(r"resumed from the checkpoint of step (\d+); (\d+) later step", log)
        assert rerun is not None and int(rerun[1]) > 0 and int(rerun[2]) > 0, log[-3000:]
    return FaultResult(inv, recovery, time.time() - t0)


# the feeder's and the recorder's kills are `make test-bench` (CI time): CI's 3-fault chaos soak
# (tests/e2e/test_cluster_faults.py) kills both at once; the reward service's too: CI's
# test_kill_9_of_an_at_least_once_reward_router kills a reward process mid-run
@pytest.mark.parametrize("service", [pytest.param(s, marks=pytest.mark.bench) if s in ("feeder", "recorder", "reward") else s
                                     for s in KILL_AT])
def test_kill_9_of_a_service_mid_run(tmp_path: Path, bootstrap: str, service: str) -> None:
    kill_service_run(tmp_path / "runs", bootstrap, service)


def test_kill_9_of_an_at_least_once_reward_router(tmp_path: Path, bootstrap: str) -> None:
    """Without transactions the restarted router scores again what its predecessor had sent but not
    committed: the copies carry the same event ids, and still no sample is lost, decided twice or
    trained twice (the invariants)."""
    res = kill_service_run(tmp_path / "runs", bootstrap, "reward", 0, "reward.delivery=at_least_once")
    assert res.invariants["trained"] > 0


# --------------------------------------------------------------------------- the broker away for 20 s


@pytest.fixture(scope="module")
def own_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """A Kafka broker of this test module only (its home, its bootstrap): stopped and started here."""
    from infra.kafka import broker as stack

    home = tmp_path_factory.mktemp("outage-kafka")
    stack.ensure_kafka_jars()
    proc, _ = stack.start_local_kafka(home)
    try:
        yield home, proc.bootstrap
    finally:
        stack.stop_local_kafka(home)


def kill_9_broker(home: Path) -> float:
    """SIGKILL the local broker of ``home`` (no clean shutdown: its logs are recovered at the next
    start) and wait until it is gone; the wall time of the kill."""
    from infra.kafka import broker as stack

    proc = stack.local_kafka(home)
    assert proc is not None, f"no broker runs in {home}"
    t = time.time()
    os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while stack.local_kafka(home) is not None:  # reaps it (a child of this process) and forgets it
        assert time.monotonic() < deadline, f"broker pid {proc.pid} still alive after SIGKILL"
        time.sleep(0.1)
    return t


def broker_outage_run(runs: Path, home: Path, bootstrap: str, outage_s: float = 20.0,
                      kill: bool = False) -> FaultResult:
    """One run on the broker of ``home`` with that broker stopped (SIGTERM, a clean shutdown; with
    ``kill``: SIGKILL) for ``outage_s`` mid-run, then started again on the same port."""
    from infra.kafka import broker as stack

    env = {k: v for k, v in os.environ.items() if k != "ROLLSTREAM_BOOTSTRAP"}
    run_id = f"e2e-{'kill9' if kill else 'outage'}-{uuid.uuid4().hex[:6]}"
    t0 = time.time()
    with Watch(bootstrap, run_id) as watch:
        run = RunProc(runs, run_id, OVERRIDES, env, bootstrap=bootstrap)
        watch.wait(lambda s: s.done_steps >= 1, 300, "1 step", run)
        if kill:
            kill_9_broker(home)
        else:
            stack.stop_local_kafka(home)
        time.sleep(outage_s)
        proc, _ = stack.start_local_kafka(home)
        up_at = time.time()
        assert proc.bootstrap == bootstrap, (proc.bootstrap, bootstrap)  # same port again
        code = run.wait(360)
        recovery = recovery_after(watch, up_at)  # from the broker back to the next step
    assert code == 0, run.output()
    assert "restarted" not in run.output(), run.restarts()  # no service died: they rode it out
    env["ROLLSTREAM_BOOTSTRAP"] = bootstrap
    inv = invariants(runs, run_id, env)
    check_invariants(inv, STEPS)
    return FaultResult(inv, recovery, time.time() - t0)


@pytest.mark.bench  # the kill -9 below covers an outage with a restart in CI; this graceful one is `make test-bench`
def test_broker_down_for_20_s_mid_run(tmp_path: Path, own_broker: tuple[Path, str]) -> None:
    home, bootstrap = own_broker
    broker_outage_run(tmp_path / "runs", home, bootstrap)


def test_kill_9_of_the_broker_mid_run(tmp_path: Path, own_broker: tuple[Path, str]) -> None:
    """No clean shutdown: the broker recovers its logs and the transactions left open (aborted at
    its restart or at their timeout), the services ride it out as a graceful stop."""
    home, bootstrap = own_broker
    res = broker_outage_run(tmp_path / "runs", home, bootstrap, outage_s=10.0, kill=True)
    assert res.recovery_s is not None and res.invariants["trained"] > 0, res
    print(f"kill -9 of the broker: recovery {res.recovery_s:.1f} s after its restart, wall {res.wall_s:.0f} s, "
          f"{res.invariants['issued']} samples issued, 0 lost")


# --------------------------------------------------------------------------- a verifier that hangs or crashes

FAULTY_VERIFIER = '''
import os
if os.environ.get("ROLLSTREAM_TEST_FAULTY_VERIFIER"):
    import time

    import envs
    from envs.registry import register_verifier

    @register_verifier("test-faulty")
    def faulty(response, reference, **kwargs):
        """final_number, except: hangs when the answer is 0 mod 7, raises when it is 1 mod 7."""
        n = int(reference)
        if n % 7 == 0:
            time.sleep(3600)  # hangs: only the time bound ends it
        if n % 7 == 1:
            raise RuntimeError("verifier crashed (test)")
        return envs.get_verifier("final_number")(response, reference)
'''


def faulty_verifier_run(runs: Path, bootstrap: str, plugin_dir: Path) -> FaultResult:
    """One run whose domain's verifier hangs on some answers and crashes on others (registered by
    a ``sitecustomize`` on ``PYTHONPATH``, so every process of the run knows it)."""
    plugin_dir.mkdir(parents=True, exist_ok=True)
    (plugin_dir / "sitecustomize.py").write_text(FAULTY_VERIFIER)
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap, ROLLSTREAM_TEST_FAULTY_VERIFIER="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(plugin_dir), os.environ.get("PYTHONPATH", "")) if p))
    run_id = f"e2e-verifier-{uuid.uuid4().hex[:6]}"
    t0 = time.time()
    run = RunProc(runs, run_id, [*OVERRIDES, "data.domains.0.verifier=test-faulty", "reward.timeout_s=1"], env)
    code = run.wait(360)
    assert code == 0, run.output()
    inv = invariants(runs, run_id, env)
    check_invariants(inv, STEPS)
    rows = sql(f"SELECT multiIf(details LIKE 'error: timeout%', 'timeout', details LIKE 'error: verifier raised%', "
               f"'raised', 'ok') AS what, count() AS n, max(reward) AS max_reward, max(reward_s) AS max_s "
               f"FROM sample_rewards FINAL WHERE run_id = '{run_id}' GROUP BY what", runs, run_id, env)
    by = {r["what"]: r for r in rows}
    assert by["timeout"]["n"] > 0 and by["raised"]["n"] > 0, rows
    assert by["timeout"]["max_reward"] == 0 and by["raised"]["max_reward"] == 0, rows
    assert by["timeout"]["max_s"] < 5, rows  # bounded by reward.timeout_s, not the verifier's 30 s
    summary = json.loads((runs / run_id / "summary.json").read_text())
    assert summary["steps"] == STEPS
    return FaultResult(inv, None, time.time() - t0)


def test_a_verifier_that_hangs_or_crashes(tmp_path: Path, bootstrap: str) -> None:
    faulty_verifier_run(tmp_path / "runs", bootstrap, tmp_path / "plugin")


# --------------------------------------------------------------------------- the store down


STORE_DOWN = '''
import os
import sys
flag = os.environ.get("ROLLSTREAM_TEST_STORE_DOWN_FILE")
if flag and "recorder" in sys.argv:
    from clickhouse_connect.driver.exceptions import DatabaseError

    from services import recorder

    real = recorder.Recorder.insert

    def insert(self, tables):
        """While the flag file exists: chDB's error when its disk refuses writes (chattr +i)."""
        if os.path.exists(flag):
            raise DatabaseError("Code: 1001. DB::Exception: std::__1::filesystem::filesystem_error: filesystem "
                                "error: in create_directories: Operation not permitted. (STD_EXCEPTION)",
                                code=1001, name="STD_EXCEPTION")
        return real(self, tables)

    recorder.Recorder.insert = insert
'''


def store_down_env(env: dict[str, str], plugin_dir: Path) -> tuple[dict[str, str], Path]:
    """``env`` with the store-down plugin (a ``sitecustomize`` the recorder process loads): the run's
    store fails every insert while the returned flag file exists."""
    plugin_dir.mkdir(parents=True, exist_ok=True)
    (plugin_dir / "sitecustomize.py").write_text(STORE_DOWN)
    flag = plugin_dir / "store-down"
    paths = [str(plugin_dir), str(REPO), *filter(None, [env.get("PYTHONPATH")])]
    return dict(env, ROLLSTREAM_TEST_STORE_DOWN_FILE=str(flag), PYTHONPATH=os.pathsep.join(paths)), flag


def store_outage_run(runs: Path, bootstrap: str, plugin_dir: Path, outage_s: float = 8.0) -> FaultResult:
    """One run whose store fails every insert for ``outage_s`` after step 2: training goes on,
    status shows the outage, the recorder catches up (no restart), the invariants hold. Its
    recovery: from the store back to the recorder's word that it stored the waiting batch."""
    env, flag = store_down_env(dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap), plugin_dir)
    run_id = f"e2e-store-down-{uuid.uuid4().hex[:6]}"
    t0 = time.time()
    with Watch(bootstrap, run_id) as watch:
        run = RunProc(runs, run_id, OVERRIDES, env)
        watch.wait(lambda s: s.done_steps >= 2, 300, "2 steps", run)
        flag.touch()
        down_at, steps_at_down = time.time(), watch.seen.done_steps
        deadline = time.monotonic() + 60
        while "unreachable" not in (seen := status(runs, run_id, env)).get("store", ""):
            assert time.monotonic() < deadline and run.proc.poll() is None, f"no outage in status: {seen}"
            time.sleep(0.5)
        time.sleep(max(0.0, down_at + outage_s - time.time()))
        trained_meanwhile = watch.seen.done_steps - steps_at_down
        flag.unlink()
        up_at = time.time()
        code = run.wait(360)
    assert code == 0, run.output()
    recovery = (runs / run_id / "recorder_store.json").stat().st_mtime - up_at  # its last write: "up"
    assert "restarted" not in run.output(), run.restarts()  # the recorder rode it out
    assert trained_meanwhile > 0 or watch.seen.finished is not None, watch.seen  # training went on
    inv = invariants(runs, run_id, env)
    check_invariants(inv, STEPS)
    after = status(runs, run_id, env)
    assert after["store"].startswith("store: up (caught up after 1 outage(s)"), after["store"]
    print(f"{after['store']}; {trained_meanwhile} step(s) trained during the outage")
    return FaultResult(inv, recovery, time.time() - t0)


@pytest.mark.bench  # a whole run: make test-bench (CI: tests/services/test_recorder.py's outage tests)
def test_the_store_down_for_8_s_mid_run(tmp_path: Path, bootstrap: str) -> None:
    res = store_outage_run(tmp_path / "runs", bootstrap, tmp_path / "plugin")
    assert res.recovery_s is not None and 0 <= res.recovery_s < 10, res  # the next retry, within the 5 s backoff cap
    print(f"store down 8 s: caught up {res.recovery_s:.1f} s after it was back, wall {res.wall_s:.0f} s, "
          f"{res.invariants['issued']} samples issued, 0 lost, 0 duplicate rows")
