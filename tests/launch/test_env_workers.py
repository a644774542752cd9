"""The supervisor starts environment workers for multi-turn domains only: ``env.workers`` processes
labelled ``env`` (one) or ``env0``, ``env1``... (several), started before the rollout workers,
healed like the other services, and stopped (SIGTERM) at the end of the run after the rollout
workers; a single-turn run has no env process. ``rollstream status`` lists and orders them."""

from __future__ import annotations

import io
import signal
from pathlib import Path
from typing import Any, ClassVar

import pytest
from rich.console import Console

from schemas import events as ev
from schemas.config import RunConfig, parse_config

FL = "data.domains=[{name: fl, source: frozenlake}]"
"""A multi-turn domain: frozenlake is a task source and an environment."""


class FakeProc:
    """A service process: it ends when the test sets ``code`` or when it gets a signal (each signal
    is recorded in :attr:`signalled`, in order)."""

    next_pid = 700
    signalled: ClassVar[list[tuple[str, int]]] = []

    def __init__(self, cmd: list[str], **kw: Any) -> None:
        FakeProc.next_pid += 1
        self.pid, self.cmd = FakeProc.next_pid, cmd
        self.code: int | None = None
        self.log = Path(kw["stdout"].name).stem  # the label: the process logs to logs/<label>.log

    def poll(self) -> int | None:
        return self.code

    @property
    def returncode(self) -> int | None:
        return self.code

    def send_signal(self, sig: int) -> None:
        FakeProc.signalled.append((self.log, sig))
        self.code = -sig

    def wait(self, timeout: float | None = None) -> int | None:
        return self.code

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@pytest.fixture
def fake_procs(monkeypatch: pytest.MonkeyPatch) -> type[FakeProc]:
    from launch import supervisor

    FakeProc.signalled = []
    monkeypatch.setattr(supervisor.subprocess, "Popen", FakeProc)
    return FakeProc


def config(tmp_path: Path, *overrides: str) -> RunConfig:
    return parse_config("", [f"run.runs_dir={tmp_path}", "run.restart_backoff_s=0", *overrides])


def supervisor_of(cfg: RunConfig, run_id: str = "r1") -> Any:
    from launch import supervisor

    return supervisor.Supervisor(cfg, run_id, "kafka:9092", Console(file=io.StringIO()))


# --------------------------------------------------------------------------- planning


@pytest.mark.parametrize(("overrides", "labels"), [
    ([FL, "env.workers=2", "rollout.workers=2"],
     ["recorder", "feeder", "reward", "env0", "env1", "rollout0", "rollout1", "trainer"]),
    ([FL], ["recorder", "feeder", "reward", "env", "rollout", "trainer"]),
    # one multi-turn domain among single-turn ones is enough
    (["data.domains=[{name: a, source: arith}, {name: fl, source: frozenlake, ratio: 0.5}]", "env.workers=3"],
     ["recorder", "feeder", "reward", "env0", "env1", "env2", "rollout", "trainer"]),
    # single-turn: no env process, whatever env.workers says
    (["env.workers=3", "rollout.workers=2"], ["recorder", "feeder", "reward", "rollout0", "rollout1", "trainer"]),
    ([], ["recorder", "feeder", "reward", "rollout", "trainer"]),
    # no live record: no recorder (rollstream record builds the record later)
    (["store.record_live=false"], ["feeder", "reward", "rollout", "trainer"]),
])
def test_env_workers_are_planned_for_multi_turn_domains_only(tmp_path: Path, overrides: list[str],
                                                              labels: list[str]) -> None:
    assert supervisor_of(config(tmp_path, *overrides)).labels() == labels


def test_every_label_is_a_service_of_the_table(tmp_path: Path) -> None:
    from launch.healing import service_of
    from schemas.services import SERVICES

    labels = supervisor_of(config(tmp_path, FL, "env.workers=2", "rollout.workers=2")).labels()
    # every service but the judge workers (no domain has a judge here: test_judge_workers.py)
    assert {service_of(label) for label in labels} == set(SERVICES) - {"judge"}


def test_env_workers_start_before_rollout_with_the_service_command(tmp_path: Path, fake_procs: type[FakeProc]) -> None:
    from launch.state import read_state

    sup = supervisor_of(config(tmp_path, FL, "env.workers=2"))
    sup.start_children()
    started = [(label, proc.cmd) for label, proc in sup.procs.items()]
    assert [label for label, _ in started] == ["recorder", "feeder", "reward", "env0", "env1", "rollout", "trainer"]
    for label, cmd in started:
        service = "env" if label.startswith("env") else label
        assert cmd[3:] == ["service", service, "--run", "r1", "--runs-dir", str(tmp_path)], cmd
    events = [(e.service, e.pid) for e in sup.pending if isinstance(e, ev.ServiceStarted)]
    assert events == [(label, sup.procs[label].pid) for label, _ in started]
    state = read_state(tmp_path / "r1")
    assert state is not None
    assert {k: v["state"] for k, v in state["services"].items() if k.startswith("env")} == {
        "env0": "running", "env1": "running"}
    assert state["services"]["env1"]["log"] == str(tmp_path / "r1" / "logs" / "env1.log")


def test_single_turn_runs_start_no_env_process(tmp_path: Path, fake_procs: type[FakeProc]) -> None:
    sup = supervisor_of(config(tmp_path, "env.workers=2"))
    sup.start_children()
    assert [proc.cmd[4] for proc in sup.procs.values()] == ["recorder", "feeder", "reward", "rollout", "trainer"]
    assert not (tmp_path / "r1" / "logs" / "env.log").exists()


# --------------------------------------------------------------------------- healing


def test_a_crashed_env_worker_is_restarted_like_the_others(tmp_path: Path, fake_procs: type[FakeProc]) -> None:
    sup = supervisor_of(config(tmp_path, FL, "env.workers=2", "run.max_restarts=1"))
    sup.start_children()
    sup.pending.clear()
    first = sup.procs["env1"]
    first.code = 0  # even exit 0: an env worker runs until it is told to stop
    (tmp_path / "r1" / "logs" / "env1.log").write_text("ERROR rollstream.env: boom\n")
    sup.check_children()
    second = sup.procs["env1"]
    assert second is not first and second.cmd == first.cmd and sup.failure is None
    (restarted,) = sup.pending
    assert isinstance(restarted, ev.ServiceRestarted)
    assert (restarted.service, restarted.exit_code, restarted.restarts, restarted.previous_pid) == (
        "env1", 0, 1, first.pid)
    assert "restart 1 of env1" in (tmp_path / "r1" / "logs" / "env1.log").read_text()
    sup.pending.clear()
    second.code = -9
    sup.check_children()  # past run.max_restarts=1
    assert sup.failure is not None and sup.failure.startswith("service env1 killed by SIGKILL (exit code -9) after 1 restart")
    (failed,) = sup.pending
    assert isinstance(failed, ev.ServiceFailed) and failed.service == "env1"


# --------------------------------------------------------------------------- the end of the run


@pytest.mark.parametrize("multi", [True, False])
async def test_env_workers_are_stopped_after_rollout_at_the_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                fake_procs: type[FakeProc], multi: bool) -> None:
    from launch import supervisor
    from launch.state import read_state

    async def prepare_run(*args: Any, **kw: Any) -> None:
        return None

    async def follow(self: Any, stop: Any) -> None:  # the run finishes: the finishing services exit 0
        self.progress.observe(ev.RunFinished(run_id=self.run_id, status="completed"))
        for label in ("feeder", "trainer", "recorder"):
            self.procs[label].code = 0

    wait_recorder = supervisor.Supervisor.wait_recorder

    def waited(self: Any, timeout_s: float = 120.0) -> None:  # marks when the supervisor waits for the recorder
        FakeProc.signalled.append(("wait for the recorder", 0))
        wait_recorder(self, timeout_s)

    monkeypatch.setattr(supervisor, "prepare_run", prepare_run)
    monkeypatch.setattr(supervisor.Supervisor, "follow", follow)
    monkeypatch.setattr(supervisor.Supervisor, "wait_recorder", waited)
    monkeypatch.setattr(supervisor, "summarize", lambda cfg, run_id, *_: {"run_id": run_id})
    cfg = config(tmp_path, *([FL, "env.workers=2"] if multi else ["env.workers=2"]), "rollout.workers=2")
    summary = await supervisor.run_supervised(cfg, "r3", "kafka:9092", Console(file=io.StringIO()))
    assert summary == {"run_id": "r3"}
    seen = [label for label, _ in FakeProc.signalled]
    assert all(sig == signal.SIGTERM for label, sig in FakeProc.signalled if label != "wait for the recorder")
    assert sorted(seen[:3]) == ["reward", "rollout0", "rollout1"]  # rollout and reward first
    # then the env workers, before the recorder is waited for (it records their last answers)
    assert seen[3:] == [*(["env0", "env1"] if multi else []), "wait for the recorder"]
    state = read_state(tmp_path / "r3")
    assert state is not None and state["phase"] == "finished"
    assert {k: v["state"] for k, v in state["services"].items()} == {
        "recorder": "exited", "feeder": "exited", "reward": "stopped",
        **({"env0": "stopped", "env1": "stopped"} if multi else {}),
        "rollout0": "stopped", "rollout1": "stopped", "trainer": "exited"}


# --------------------------------------------------------------------------- rollstream status


def test_status_orders_env_workers_before_rollout_and_names_their_lag() -> None:
    from launch.status import lag_services, stall_text, start_rank

    assert start_rank("reward") < start_rank("env") < start_rank("rollout")
    assert lag_services(["recorder", "feeder", "reward", "env0", "env1", "rollout", "trainer"]) == [
        "rollout", "env", "reward", "trainer"]
    assert lag_services(["recorder", "feeder", "reward", "rollout0", "trainer"]) == ["rollout", "reward", "trainer"]
    base: dict[str, Any] = {"idle_s": 300.0, "stall_after_s": 120.0, "any_weights": True, "tasks_issued": 8,
                            "feeder_idle_s": 1.0}
    assert stall_text(lags={"rollout": 3, "env": 12, "reward": 0, "trainer": 0},
                      services={"env0": {"state": "restarting", "restarts": 1}}, **base) == (
        "no training step for 300 s; rollout lag 3, env lag 12, reward lag 0, scored lag 0; env0 restarting (1 restarts)")
    assert stall_text(lags={"rollout": 3, "reward": 0, "trainer": 0}, services={}, **base) == (
        "no training step for 300 s; rollout lag 3, reward lag 0, scored lag 0")


async def test_status_lists_env_workers_in_start_order(tmp_path: Path) -> None:
    import os

    from launch.state import write_state
    from launch.status import gather
    from schemas.config import KafkaSettings

    labels = ["trainer", "rollout", "env1", "env0", "reward", "feeder", "recorder"]
    write_state(tmp_path / "r4", {"run_id": "r4", "supervisor_pid": os.getpid(), "phase": "running",
                                  "services": {label: {"state": "running", "pid": 0, "restarts": 0} for label in labels}})
    report = await gather("r4", tmp_path / "r4", bootstrap=None, kafka=KafkaSettings(), steps=4, stall_after_s=120.0)
    assert list(report["services"]) == ["recorder", "feeder", "reward", "env0", "env1", "rollout", "trainer"]
