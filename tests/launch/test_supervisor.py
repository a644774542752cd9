"""The supervisor of `rollstream run`: it refuses a run id whose topics already hold an earlier
run's events (the two runs would mix) unless the run directory has a checkpoint to resume from;
it heals services that exit unexpectedly (backoff, a bound, lifecycle events) and keeps
`runs/<id>/supervisor.json` current; `rollstream status` names a stall from what it sees."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from runtime.bus import Producer
from schemas import events as ev
from schemas.config import KafkaSettings
from schemas.topics import topic_name


async def test_run_id_reuse_is_refused(kafka: KafkaSettings, topics: list[str], run_id: str, tmp_path: Path,
                                       repo_root: Path) -> None:
    async with Producer(kafka) as producer:
        await producer.send_and_wait(topic_name(run_id, "control"), ev.RunFinished(run_id=run_id, status="completed"))
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=kafka.bootstrap)
    res = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "cli", "run", str(repo_root / "examples" / "main.yaml"),
                          "--run-id", run_id, "--set", f"run.runs_dir={tmp_path}"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 1
    assert f"run id {run_id} already has 1 messages" in res.stderr and "pick another --run-id" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / run_id / "model").exists()  # refused before anything was created


def test_services_get_the_bootstrap_and_the_store_in_their_environment(tmp_path: Path, monkeypatch: Any) -> None:
    import io

    from rich.console import Console

    from launch import supervisor
    from schemas.config import parse_config

    started: list[tuple[list[str], dict[str, str]]] = []

    class FakePopen:
        pid = 0

        def __init__(self, cmd: list[str], **kw: Any) -> None:
            started.append((cmd, kw["env"]))

    monkeypatch.setattr(supervisor.subprocess, "Popen", FakePopen)
    for overrides, dsn in [([], f"chdb://{tmp_path.resolve() / 'r1' / 'store'}"),
                           (["store.dsn=http://clickhouse:8123"], "http://clickhouse:8123")]:
        started.clear()
        cfg = parse_config("", [f"run.runs_dir={tmp_path}", *overrides])
        supervisor.Supervisor(cfg, "r1", "kafka:9092", Console(file=io.StringIO())).start_children()
        assert [cmd[4] for cmd, _ in started] == ["recorder", "feeder", "reward", "rollout", "trainer"]
        for cmd, env in started:
            assert env["ROLLSTREAM_BOOTSTRAP"] == "kafka:9092" and env["ROLLSTREAM_STORE"] == dsn
            assert cmd[-2:] == ["--runs-dir", str(tmp_path)]


# --------------------------------------------------------------------------- healing (pure)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def slot(label: str, tmp_path: Path) -> Any:
    from launch.healing import ServiceSlot

    return ServiceSlot(label, tmp_path / f"{label}.log", state="running", pid=100)


def test_backoff_doubles_up_to_its_cap() -> None:
    from launch.healing import Healer

    h = Healer(backoff_s=1.0, backoff_max_s=10.0)
    assert [h.backoff(n) for n in range(6)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert Healer(backoff_s=0.0).backoff(3) == 0.0
    assert Healer(backoff_s=2.0, backoff_max_s=1e9).backoff(1000) > 0  # no overflow


def test_a_crash_is_restarted_after_its_backoff_until_the_bound(tmp_path: Path) -> None:
    from launch.healing import Healer

    clock = Clock()
    h = Healer(max_restarts=2, backoff_s=1.0, backoff_max_s=30.0, clock=clock)
    s = slot("rollout", tmp_path)
    assert h.on_exit(s, -9, "", run_finished=False) == "restart"
    assert s.state == "restarting" and s.backoff_s == 1.0 and s.reason == "killed by SIGKILL (exit code -9)"
    assert not h.due(s)
    clock.t += 1.0
    assert h.due(s)
    s.restarts, s.state = 1, "running"  # what the supervisor does when it restarts it
    assert h.on_exit(s, 1, "ERROR boom", run_finished=False) == "restart" and s.backoff_s == 2.0
    s.restarts, s.state = 2, "running"
    assert h.on_exit(s, 1, "ERROR boom", run_finished=False) == "fail"
    assert s.state == "failed" and not h.due(s)
    line = h.failure_line(s)
    assert line.startswith("service rollout exited with code 1 after 2 restarts (run.max_restarts=2): ERROR boom")
    assert str(s.log_path) in line and "\n" not in line


def test_max_restarts_zero_fails_at_the_first_unexpected_exit(tmp_path: Path) -> None:
    from launch.healing import Healer

    s = slot("reward", tmp_path)
    assert Healer(max_restarts=0).on_exit(s, -15, "", run_finished=False) == "fail"
    assert "killed by SIGTERM (exit code -15) after 0 restarts" in Healer(max_restarts=0).failure_line(s)


def test_exit_zero_is_expected_only_from_finishing_services_at_the_end(tmp_path: Path) -> None:
    from launch.healing import Healer

    clock = Clock()
    h = Healer(max_restarts=3, finish_grace_s=10.0, clock=clock)
    # rollout and reward run until told to stop: exit 0 while the run goes is unexpected
    assert h.on_exit(slot("rollout", tmp_path), 0, "", run_finished=False) == "restart"
    assert h.on_exit(slot("reward", tmp_path), 0, "", run_finished=False) == "restart"
    # anyone may exit once the run finished
    assert h.on_exit(slot("rollout", tmp_path), -9, "", run_finished=True) == "expected"
    # feeder / trainer / recorder exit 0 by design at the end: held until RunFinished shows up ...
    t = slot("trainer", tmp_path)
    assert h.on_exit(t, 0, "", run_finished=False) == "hold" and t.state == "exited"
    assert h.recheck(t, run_finished=False) is None
    assert h.recheck(t, run_finished=True) == "expected"
    # ... or restarted when it does not within the grace period
    f = slot("feeder", tmp_path)
    h.on_exit(f, 0, "", run_finished=False)
    clock.t += 10.0
    assert h.recheck(f, run_finished=False) == "restart" and f.state == "restarting"
    assert "exited with code 0 although the run had not finished" in f.reason
    # a non-zero exit of a finishing service is unexpected at once
    assert h.on_exit(slot("trainer", tmp_path), 1, "", run_finished=False) == "restart"


def test_last_error_line_skips_restart_marks_and_timestamps(tmp_path: Path) -> None:
    from launch.healing import RESTART_MARK, last_error_line, last_log_line

    log = tmp_path / "x.log"
    assert last_error_line(log) == "" and last_log_line(log) == ""
    log.write_text("2026-01-02 03:04:05,678 4242 INFO rollstream.x: started\n"
                   "2026-01-02 03:04:06,000 4242 ERROR rollstream.x: engine error: CUDA out of memory\n"
                   "2026-01-02 03:04:07,000 4242 INFO rollstream.x: still going\n"
                   f"{RESTART_MARK} restart 1 of x (pid 4242 exited with code 1; waited 1 s) ---\n")
    assert last_error_line(log) == "ERROR rollstream.x: engine error: CUDA out of memory"
    assert last_log_line(log) == "ERROR rollstream.x: engine error: CUDA out of memory"
    log.write_text("2026-01-02 03:04:05,678 4242 INFO rollstream.x: started\n")
    assert last_error_line(log) == "" and last_log_line(log) == "INFO rollstream.x: started"
    # why the latest process ended: never an error of an earlier one (it died before logging any)
    log.write_text("2026-01-02 03:04:06,000 4242 ERROR rollstream.x: unexpected ImportError: no name\n"
                   f"{RESTART_MARK} restart 1 of x (pid 4242 exited with code 1; waited 1 s) ---\n")
    assert last_error_line(log, last_process_only=True) == ""
    with open(log, "a") as fh:
        fh.write("2026-01-02 03:04:08,000 4343 ERROR rollstream.x: engine error: out of memory\n")
    assert last_error_line(log, last_process_only=True) == "ERROR rollstream.x: engine error: out of memory"


# --------------------------------------------------------------------------- the state file


def test_state_file_is_written_atomically_and_read_back(tmp_path: Path) -> None:
    from launch.state import STATE_FILE, pid_alive, read_state, write_state

    assert read_state(tmp_path) is None
    write_state(tmp_path / "r", {"phase": "running", "services": {"rollout": {"restarts": 1}}})
    assert read_state(tmp_path / "r") == {"version": 1, "phase": "running", "services": {"rollout": {"restarts": 1}}}
    assert [p.name for p in (tmp_path / "r").iterdir()] == [STATE_FILE]  # no temporary file left
    (tmp_path / "r" / STATE_FILE).write_text("{not json")
    assert read_state(tmp_path / "r") is None
    assert pid_alive(os.getpid()) and not pid_alive(0) and not pid_alive(None)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert not pid_alive(dead.pid)


class FakeProc:
    """A service process the test ends by setting ``code``."""

    next_pid = 500

    def __init__(self, cmd: list[str], **kw: Any) -> None:
        FakeProc.next_pid += 1
        self.pid, self.cmd, self.code = FakeProc.next_pid, cmd, None

    def poll(self) -> int | None:
        return self.code

    @property
    def returncode(self) -> int | None:
        return self.code


def test_supervisor_restarts_records_and_gives_up(tmp_path: Path, monkeypatch: Any) -> None:
    import io

    from rich.console import Console

    from launch import supervisor
    from launch.state import read_state
    from schemas.config import parse_config

    monkeypatch.setattr(supervisor.subprocess, "Popen", FakeProc)
    cfg = parse_config("", [f"run.runs_dir={tmp_path}", "run.max_restarts=1", "run.restart_backoff_s=0"])
    sup = supervisor.Supervisor(cfg, "r1", "kafka:9092", Console(file=io.StringIO()))
    sup.start_children()
    assert [type(e).__name__ for e in sup.pending] == ["ServiceStarted"] * 5
    state = read_state(tmp_path / "r1")
    assert state is not None and state["phase"] == "running" and state["supervisor_pid"] == os.getpid()
    assert {k: v["state"] for k, v in state["services"].items()} == dict.fromkeys(
        ["recorder", "feeder", "reward", "rollout", "trainer"], "running")
    sup.pending.clear()
    first = sup.procs["rollout"]
    first.code = -9  # type: ignore[attr-defined]
    (tmp_path / "r1" / "logs" / "rollout.log").write_text("ERROR rollstream.rollout: boom\n")
    sup.check_children()  # noticed, restarted at once (backoff 0)
    second = sup.procs["rollout"]
    assert second is not first and sup.failure is None
    (restarted,) = sup.pending
    assert isinstance(restarted, ev.ServiceRestarted)
    assert (restarted.service, restarted.exit_code, restarted.restarts, restarted.previous_pid, restarted.pid) == (
        "rollout", -9, 1, first.pid, second.pid)
    assert restarted.reason == "killed by SIGKILL (exit code -9): ERROR rollstream.rollout: boom"
    rollout = read_state(tmp_path / "r1")["services"]["rollout"]  # type: ignore[index]
    assert (rollout["state"], rollout["restarts"], rollout["last_exit_code"], rollout["pid"]) == (
        "running", 1, -9, second.pid)
    assert "restart 1 of rollout" in (tmp_path / "r1" / "logs" / "rollout.log").read_text()
    sup.pending.clear()
    second.code = 2  # type: ignore[attr-defined]
    sup.check_children()  # past run.max_restarts=1
    # the second process logged nothing: the first one's error is not given as its reason, only as
    # where the log ends
    assert sup.failure is not None and sup.failure.startswith(
        "service rollout exited with code 2 after 1 restart (run.max_restarts=1); its log ends: "
        "ERROR rollstream.rollout: boom")
    (failed,) = sup.pending
    assert isinstance(failed, ev.ServiceFailed) and (failed.service, failed.exit_code) == ("rollout", 2)
    assert read_state(tmp_path / "r1")["services"]["rollout"]["state"] == "failed"  # type: ignore[index]


def test_the_end_of_the_run_is_not_a_crash(tmp_path: Path, monkeypatch: Any) -> None:
    import io

    from rich.console import Console

    from launch import supervisor
    from schemas.config import parse_config

    monkeypatch.setattr(supervisor.subprocess, "Popen", FakeProc)
    cfg = parse_config("", [f"run.runs_dir={tmp_path}", "run.restart_backoff_s=0"])
    sup = supervisor.Supervisor(cfg, "r2", "kafka:9092", Console(file=io.StringIO()))
    sup.start_children()
    sup.pending.clear()
    sup.procs["feeder"].code = 0  # type: ignore[attr-defined]  # it published RunFinished and left
    sup.check_children()
    assert not sup.pending and [s.state for s in sup.slots if s.label == "feeder"] == ["exited"]
    sup.progress.observe(ev.RunFinished(run_id="r2", status="completed"))
    sup.check_children()
    assert not sup.pending and sup.failure is None


# --------------------------------------------------------------------------- naming a stall


def test_stall_text_says_what_it_sees() -> None:
    from launch.status import stall_text

    base: dict[str, Any] = {"stall_after_s": 120.0, "any_weights": True, "tasks_issued": 96,
                            "lags": {"rollout": 0, "reward": 0, "trainer": 0}, "services": {}}
    assert stall_text(idle_s=60.0, feeder_idle_s=60.0, **base) is None
    assert stall_text(idle_s=312.0, feeder_idle_s=300.0, **base) == (
        "no training step for 312 s; rollout lag 0, reward lag 0, scored lag 0; "
        "feeder has issued nothing for 300 s (96 tasks in all)")
    text = stall_text(idle_s=130.0, feeder_idle_s=1.0, draining="stopped by user", drain_age_s=20.0,
                      **{**base, "lags": {"rollout": 60, "reward": None, "trainer": 3},
                         "services": {"rollout": {"state": "restarting", "restarts": 2},
                                      "reward": {"state": "running"}}})
    assert text == ("no training step for 130 s; rollout lag 60, reward lag ?, scored lag 3; "
                    "rollout restarting (2 restarts); draining (stopped by user) for 20 s")
    assert stall_text(idle_s=130.0, feeder_idle_s=1.0, servers_down={"http://h:8000": "connection refused"},
                      **base) == ("no training step for 130 s; rollout lag 0, reward lag 0, scored lag 0; "
                                  "generation server http://h:8000 not answering (connection refused; "
                                  "rollout.server_urls)")
    assert stall_text(idle_s=200.0, feeder_idle_s=None, **{**base, "any_weights": False}) is None  # warm-up
    assert "no weights published 600 s after the start" in str(
        stall_text(idle_s=600.0, feeder_idle_s=None, **{**base, "any_weights": False}))


def test_the_lag_of_a_finished_run_is_said_to_be_normal() -> None:
    """A finished run's trainer leaves the samples scored after its last step unread: the status
    table says so instead of showing a bare number that reads as an alarm; a running run's stays bare."""
    import io

    from rich.console import Console

    from launch.status import render

    def table(phase: str) -> str:
        buf = io.StringIO()
        render({"run_id": "r", "phase": phase, "supervisor": {"pid": 1, "alive": phase == "running"},
                "finished": None, "error": "", "resume": None, "step": 200, "steps": 200, "policy_version": 200,
                "last_progress_s_ago": 5.0, "feeder": {"tasks_issued": None}, "draining": "",
                "kafka": {"error": ""}, "stall": None,
                "services": {"trainer": {"state": "exited", "pid": 2, "lag": {"scored": 281}}}},
               Console(file=buf, width=200))
        return buf.getvalue()

    assert "scored 281 (left at the end: normal)" in table("finished")
    assert "scored 281 (since its checkpoint)" in table("running")


def test_phase_of_a_run() -> None:
    from launch.runinfo import RunInfo
    from launch.status import phase_of

    info = RunInfo(started=ev.RunStarted(run_id="r", config_json="{}"))
    assert phase_of(None, False, None) == "starting"
    assert phase_of({"phase": "running"}, True, info) == "running"
    assert phase_of({"phase": "running"}, False, info) == "abandoned"  # the supervisor died
    info.drains.append(ev.Drain(run_id="r", reason="training complete", origin="trainer"))
    assert phase_of({"phase": "running"}, True, info) == "draining"
    info.finished = ev.RunFinished(run_id="r", status="completed")
    assert phase_of({"phase": "finishing"}, False, info) == "finished"
    assert phase_of(None, False, info) == "finished"
    info.drains.append(ev.Drain(run_id="r", reason="stopped by user", origin="user"))
    assert phase_of(None, False, info) == "stopped"
    assert phase_of({"phase": "failed"}, False, RunInfo()) == "failed"


def test_runs_recorded_before_drain_origin_read_as_they_did() -> None:
    """A Drain recorded before ``Drain.origin`` decodes as the trainer's; the run's ``RunFinished``
    (the feeder of that run told a stop from the end of training by the reason) decides."""
    import msgspec

    from launch.runinfo import RunInfo
    from launch.status import phase_of
    from schemas.topics import TOPICS

    control = msgspec.msgpack.Decoder(TOPICS["control"].event_type)
    for reason, status, phase in [("training complete", "completed", "finished"), ("stopped by user", "stopped", "stopped"),
                                  ("run.max_wall_s=30s reached", "stopped", "stopped")]:
        old = control.decode(msgspec.msgpack.encode({"kind": "Drain", "run_id": "r", "reason": reason}))
        info = RunInfo(started=ev.RunStarted(run_id="r", config_json="{}"), drains=[old],
                       finished=ev.RunFinished(run_id="r", status=status))
        assert phase_of(None, False, info) == phase, reason


def test_lifecycle_events_become_service_events_rows() -> None:
    from store.rows import COLUMNS, typed_rows

    e = ev.ServiceRestarted(run_id="r", service="rollout", pid=7, exit_code=-9, restarts=1, reason="killed",
                            backoff_s=2.0, previous_pid=6)
    (row,) = typed_rows(e)["service_events"]
    assert dict(zip(COLUMNS["service_events"], row, strict=True)) | {"ts": None} == {
        "run_id": "r", "service": "rollout", "kind": "ServiceRestarted", "pid": 7, "previous_pid": 6, "exit_code": -9,
        "restarts": 1, "reason": "killed", "backoff_s": 2.0, "event_id": e.event_id, "ts": None}
    for other in (ev.ServiceStarted(run_id="r", service="feeder", pid=1),
                  ev.ServiceFailed(run_id="r", service="trainer", pid=2, exit_code=1, restarts=3)):
        (row,) = typed_rows(other)["service_events"]
        assert len(row) == len(COLUMNS["service_events"]) and row[2] == type(other).__name__
