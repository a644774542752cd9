"""The supervisor starts judge workers for domains with a judge only: ``judge.workers`` processes
labelled ``judge`` (one) or ``judge0``, ``judge1``... (several), started after the reward router
and before the env and rollout workers, each told its label in ``ROLLSTREAM_SERVICE_LABEL`` (its
Kafka transactional id is made of it, so a restart keeps it), healed like the other services and
stopped (SIGTERM) at the end of the run after reward and rollout; a run without a judged domain has
no judge process. ``rollstream status`` lists and orders them. ``rollstream service judge`` takes its
label, device and dtype from there; the judge models are checked before anything starts
(:func:`launch.prepare.check_judge_model`) and converted from ``source`` when the run is
prepared (:func:`launch.prepare.prepare_judges`). The last test runs ``rollstream service
judge`` against the real broker."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import pytest
from rich.console import Console

from schemas import events as ev
from schemas.config import JudgeModelConfig, KafkaSettings, RunConfig, parse_config
from tests.conftest import TINY_SPEC

JUDGES = "judge.models={q: {path: /models/q}, rm: {kind: reward_model, path: /models/rm}}"
"""Two judges (their paths are not looked at: planning does not read the models)."""
JUDGED = "data.domains=[{name: a, source: arith, judge: q}]"
FL = "data.domains=[{name: fl, source: frozenlake}]"
MIXED = ("data.domains=[{name: a, source: arith, judge: rm}, {name: b, source: arith, ratio: 0.5},"
         " {name: fl, source: frozenlake, ratio: 0.5}]")
"""A judged domain, a plain one and a multi-turn one."""


class FakeProc:
    """A service process: it ends when the test sets ``code`` or when it gets a signal (each signal
    is recorded in :attr:`signalled`, in order). It keeps the environment it was started with."""

    next_pid = 900
    signalled: ClassVar[list[tuple[str, int]]] = []

    def __init__(self, cmd: list[str], **kw: Any) -> None:
        FakeProc.next_pid += 1
        self.pid, self.cmd, self.env = FakeProc.next_pid, cmd, dict(kw["env"])
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


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollout.model_init import init_tiny_model

    return init_tiny_model(tmp_path_factory.mktemp("judge-lm") / "m", TINY_SPEC, seed=0)


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollout.model_init import init_tiny_reward_model

    return init_tiny_reward_model(tmp_path_factory.mktemp("judge-rm") / "m", TINY_SPEC, seed=0)


# --------------------------------------------------------------------------- planning


@pytest.mark.parametrize(("overrides", "labels"), [
    ([JUDGES, JUDGED], ["recorder", "feeder", "reward", "judge", "rollout", "trainer"]),
    ([JUDGES, JUDGED, "judge.workers=2", "rollout.workers=2"],
     ["recorder", "feeder", "reward", "judge0", "judge1", "rollout0", "rollout1", "trainer"]),
    # judge workers after reward, before the env workers and the rollout workers
    ([JUDGES, MIXED, "judge.workers=3", "env.workers=2"],
     ["recorder", "feeder", "reward", "judge0", "judge1", "judge2", "env0", "env1", "rollout", "trainer"]),
    # judges defined but no domain names one: no judge process, whatever judge.workers says
    ([JUDGES, "judge.workers=2"], ["recorder", "feeder", "reward", "rollout", "trainer"]),
    ([JUDGES, FL, "judge.workers=2"], ["recorder", "feeder", "reward", "env", "rollout", "trainer"]),
    (["judge.workers=4"], ["recorder", "feeder", "reward", "rollout", "trainer"]),
])
def test_judge_workers_are_planned_for_judged_domains_only(tmp_path: Path, overrides: list[str],
                                                           labels: list[str]) -> None:
    assert supervisor_of(config(tmp_path, *overrides)).labels() == labels


def test_every_service_of_the_cli_is_planned_for_a_run_that_needs_them_all(tmp_path: Path) -> None:
    from launch.healing import service_of
    from schemas.services import SERVICES

    labels = supervisor_of(config(tmp_path, JUDGES, MIXED, "judge.workers=2", "env.workers=2")).labels()
    assert {service_of(label) for label in labels} == set(SERVICES)
    assert "judge" in SERVICES


def test_judge_workers_start_with_their_label_in_their_environment(tmp_path: Path, fake_procs: type[FakeProc],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from launch.state import read_state
    from launch.supervisor import LABEL_ENV

    monkeypatch.setenv(LABEL_ENV, "inherited")  # the supervisor's own environment must not leak through
    sup = supervisor_of(config(tmp_path, JUDGES, JUDGED, "judge.workers=2"))
    sup.start_children()
    started = list(sup.procs.items())
    assert [label for label, _ in started] == ["recorder", "feeder", "reward", "judge0", "judge1", "rollout", "trainer"]
    for label, proc in started:
        service = "judge" if label.startswith("judge") else label
        assert proc.cmd[3:] == ["service", service, "--run", "r1", "--runs-dir", str(tmp_path)], proc.cmd
        assert proc.env[LABEL_ENV] == label  # every process knows its label
        assert proc.env["ROLLSTREAM_BOOTSTRAP"] == "kafka:9092" and proc.env["ROLLSTREAM_STORE"]
    assert sup._env.get(LABEL_ENV) == "inherited"  # set per process, not in the shared environment
    events = [(e.service, e.pid) for e in sup.pending if isinstance(e, ev.ServiceStarted)]
    assert events == [(label, proc.pid) for label, proc in started]
    state = read_state(tmp_path / "r1")
    assert state is not None
    assert {k: v["state"] for k, v in state["services"].items() if k.startswith("judge")} == {
        "judge0": "running", "judge1": "running"}
    assert state["services"]["judge1"]["log"] == str(tmp_path / "r1" / "logs" / "judge1.log")


def test_runs_without_a_judge_start_no_judge_process(tmp_path: Path, fake_procs: type[FakeProc]) -> None:
    sup = supervisor_of(config(tmp_path, JUDGES, "judge.workers=2"))
    sup.start_children()
    assert [proc.cmd[4] for proc in sup.procs.values()] == ["recorder", "feeder", "reward", "rollout", "trainer"]
    assert not list((tmp_path / "r1" / "logs").glob("judge*.log"))


# --------------------------------------------------------------------------- healing


def test_a_restarted_judge_worker_keeps_its_label(tmp_path: Path, fake_procs: type[FakeProc]) -> None:
    from launch.supervisor import LABEL_ENV

    sup = supervisor_of(config(tmp_path, JUDGES, JUDGED, "judge.workers=2", "run.max_restarts=1"))
    sup.start_children()
    sup.pending.clear()
    first = sup.procs["judge1"]
    first.code = 0  # even exit 0: a judge worker runs until it is told to stop
    (tmp_path / "r1" / "logs" / "judge1.log").write_text("ERROR rollstream.judge: boom\n")
    sup.check_children()
    second = sup.procs["judge1"]
    assert second is not first and second.cmd == first.cmd and sup.failure is None
    assert second.env[LABEL_ENV] == "judge1"  # the same transactional id: it fences the one it replaces
    assert sup.procs["judge0"].env[LABEL_ENV] == "judge0"
    (restarted,) = sup.pending
    assert isinstance(restarted, ev.ServiceRestarted)
    assert (restarted.service, restarted.exit_code, restarted.restarts, restarted.previous_pid) == (
        "judge1", 0, 1, first.pid)
    sup.pending.clear()
    second.code = 1
    sup.check_children()  # past run.max_restarts=1
    assert sup.failure is not None and sup.failure.startswith("service judge1 exited with code 1 after 1 restart")
    (failed,) = sup.pending
    assert isinstance(failed, ev.ServiceFailed) and failed.service == "judge1"


# --------------------------------------------------------------------------- the end of the run


@pytest.mark.parametrize("judged", [True, False])
async def test_judge_workers_are_stopped_after_reward_and_rollout_at_the_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_procs: type[FakeProc], judged: bool) -> None:
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
    domains = MIXED if judged else FL
    cfg = config(tmp_path, JUDGES, domains, "judge.workers=2", "env.workers=2")
    assert await supervisor.run_supervised(cfg, "r3", "kafka:9092", Console(file=io.StringIO())) == {"run_id": "r3"}
    seen = [label for label, _ in FakeProc.signalled]
    assert all(sig == signal.SIGTERM for label, sig in FakeProc.signalled if label != "wait for the recorder")
    assert sorted(seen[:2]) == ["reward", "rollout"]  # reward (which sends them work) and rollout first
    # then the judge and env workers, before the recorder is waited for (it records their last output)
    assert sorted(seen[2:-1]) == ["env0", "env1", *(["judge0", "judge1"] if judged else [])]
    assert seen[-1] == "wait for the recorder"
    state = read_state(tmp_path / "r3")
    assert state is not None and state["phase"] == "finished"
    assert {k: v["state"] for k, v in state["services"].items() if k.startswith("judge")} == (
        {"judge0": "stopped", "judge1": "stopped"} if judged else {})


# --------------------------------------------------------------------------- rollstream status


def test_status_orders_judge_workers_after_reward_and_names_their_lag() -> None:
    from launch.status import lag_services, stall_text, start_rank

    assert start_rank("reward") < start_rank("judge") < start_rank("env") < start_rank("rollout")
    assert lag_services(["recorder", "feeder", "reward", "judge0", "judge1", "rollout", "trainer"]) == [
        "rollout", "reward", "judge", "trainer"]
    assert lag_services(["recorder", "feeder", "reward", "judge", "env", "rollout", "trainer"]) == [
        "rollout", "env", "reward", "judge", "trainer"]
    assert "judge" not in lag_services(["recorder", "feeder", "reward", "rollout", "trainer"])
    base: dict[str, Any] = {"idle_s": 300.0, "stall_after_s": 120.0, "any_weights": True, "tasks_issued": 8,
                            "feeder_idle_s": 1.0}
    assert stall_text(lags={"rollout": 0, "reward": 0, "judge": 40, "trainer": 0},
                      services={"judge1": {"state": "restarting", "restarts": 2}}, **base) == (
        "no training step for 300 s; rollout lag 0, reward lag 0, judge lag 40, scored lag 0; "
        "judge1 restarting (2 restarts)")


async def test_status_lists_judge_workers_in_start_order(tmp_path: Path) -> None:
    from launch.state import write_state
    from launch.status import gather

    labels = ["trainer", "rollout", "env", "judge1", "judge0", "reward", "feeder", "recorder"]
    write_state(tmp_path / "r4", {"run_id": "r4", "supervisor_pid": os.getpid(), "phase": "running",
                                  "services": {label: {"state": "running", "pid": 0, "restarts": 0} for label in labels}})
    report = await gather("r4", tmp_path / "r4", bootstrap=None, kafka=KafkaSettings(), steps=4, stall_after_s=120.0)
    assert list(report["services"]) == ["recorder", "feeder", "reward", "judge0", "judge1", "env", "rollout", "trainer"]


# --------------------------------------------------------------------------- rollstream service judge


@pytest.mark.parametrize(("label", "want"), [("judge1", "judge1"), ("", "judge"), (None, "judge")])
async def test_service_judge_takes_its_label_device_and_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              label: str | None, want: str) -> None:
    from cli.run import _run_service
    from launch.supervisor import LABEL_ENV
    from services import judge_worker

    got: list[judge_worker.JudgeSettings] = []

    async def run(settings: judge_worker.JudgeSettings, stop: object = None) -> None:
        got.append(settings)

    monkeypatch.setattr(judge_worker, "run", run)
    if label is None:
        monkeypatch.delenv(LABEL_ENV, raising=False)
    else:
        monkeypatch.setenv(LABEL_ENV, label)
    cfg = config(tmp_path, JUDGES, JUDGED, "judge.device=cpu")
    await _run_service("judge", cfg, "r5", tmp_path / "r5", str(tmp_path / "m"))
    (s,) = got
    assert (s.run_id, s.label, s.device, s.dtype) == ("r5", want, "cpu", "float32")
    assert s.config is cfg


async def test_service_judge_refuses_a_missing_device_only_when_it_has_judges(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from cli.run import _run_service
    from schemas.config import ConfigError
    from services import judge_worker

    got: list[judge_worker.JudgeSettings] = []

    async def run(settings: judge_worker.JudgeSettings, stop: object = None) -> None:
        got.append(settings)

    monkeypatch.setattr(judge_worker, "run", run)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"judge\.device='cuda:0' but this machine has no CUDA device"):
        await _run_service("judge", config(tmp_path, JUDGES, JUDGED, "judge.device=cuda:0"), "r6", tmp_path, "m")
    # a run without a judged domain: the worker loads nothing, it idles on CPU
    await _run_service("judge", config(tmp_path, JUDGES, "judge.device=cuda:0"), "r6", tmp_path, "m")
    assert [(s.device, s.dtype) for s in got] == [("cpu", "float32")]


def test_service_help_names_the_judge_workers() -> None:
    import typer.main

    from cli import app

    service = typer.main.get_command(app).commands["service"]  # type: ignore[attr-defined]
    (name,) = [p for p in service.params if p.name == "name"]
    assert "judge: a judge worker for domains with a judge" in name.help
    assert "judge only when a domain has a judge" in (service.help or "")


# --------------------------------------------------------------------------- the judge models on disk


def judge(path: Path | str, **kw: Any) -> JudgeModelConfig:
    return JudgeModelConfig(path=str(path), **kw)


def test_judge_models_that_can_judge_pass(tiny_lm: Path, tiny_rm: Path) -> None:
    from launch.prepare import check_judge_model

    check_judge_model("q", judge(tiny_lm))
    check_judge_model("q", judge(tiny_lm, score="logprobs", min_score=1, max_score=9))
    check_judge_model("q", judge(tiny_lm, score="choice", choices={"yes": 1.0, "no": 0.0}, chat_template=False))
    check_judge_model("rm", judge(tiny_rm, kind="reward_model"))


@pytest.mark.parametrize(("which", "kw", "says"), [
    ("none", {}, ["judge.models.q.path=", "does not exist", "judge.models.q.source"]),
    ("file", {}, ["judge.models.q.path=", "is a file"]),
    ("empty", {}, ["judge.models.q.path=", "no config.json"]),
    ("lm", {"score": "logprobs", "min_score": 0, "max_score": 10}, [
        "judge.models.q: min_score=0..max_score=10 with score: logprobs: score label 10 is 2 tokens", "1..5"]),
    ("lm", {"chat_template": True}, ["judge.models.q.chat_template=true", "no chat template"]),
    ("lm", {"kind": "reward_model"}, ["judge.models.q:", "LlamaForCausalLM", "not a sequence-classification",
                                      "--reward-model"]),
    ("rm", {}, ["judge.models.q:", "LlamaForSequenceClassification", "kind: reward_model"]),
    ("rm2", {"kind": "reward_model"}, ["judge.models.q: reward model", "has 2 outputs", "num_labels=1"]),
    ("broken", {}, ["judge.models.q.path=", "config.json cannot be read"]),
    ("notok", {}, ["judge.models.q:", "holds no tokenizer"]),
    ("badtok", {"chat_template": True}, ["judge.models.q: the tokenizer of", "cannot be loaded (JSONDecodeError)"]),
    ("full", {"source": "smollm2-135m-instruct"}, ["judge.models.q.path=", "holds no model",
                                                   "judge.models.q.source='smollm2-135m-instruct'"]),
])
def test_judge_models_that_cannot_judge_are_refused_in_one_line(
        tmp_path: Path, tiny_lm: Path, tiny_rm: Path, which: str, kw: dict[str, Any], says: list[str]) -> None:
    import shutil

    from launch.prepare import check_judge_model

    path = {"none": tmp_path / "nope", "file": tmp_path / "f", "empty": tmp_path, "lm": tiny_lm, "rm": tiny_rm,
            "full": tmp_path}.get(which, tmp_path / which)
    if which == "file":
        path.write_text("x")
    elif which == "full":
        (tmp_path / "stray.txt").write_text("x")
    elif which in ("rm2", "broken", "notok", "badtok"):
        shutil.copytree(tiny_rm if which == "rm2" else tiny_lm, path)
        if which == "rm2":  # a classifier with two outputs
            c = json.loads((path / "config.json").read_text())
            c["id2label"], c["label2id"] = {"0": "BAD", "1": "GOOD"}, {"BAD": 0, "GOOD": 1}
            (path / "config.json").write_text(json.dumps(c))
        elif which == "broken":
            (path / "config.json").write_text("{not json")
        elif which == "badtok":
            (path / "tokenizer.json").write_text("{not json")
        else:
            for f in path.glob("*token*"):
                f.unlink()
    with pytest.raises(ValueError) as e:
        check_judge_model("q", judge(path, **kw))
    line = str(e.value)
    assert "\n" not in line and ";" in line  # what is wrong; what to do
    for word in says:
        assert word in line, line


def test_a_judge_to_convert_passes_the_check_while_its_path_is_empty(tmp_path: Path) -> None:
    from launch.prepare import check_judge_model

    check_judge_model("q", judge(tmp_path / "later", source="smollm2-135m-instruct"))
    check_judge_model("q", judge(tmp_path, source="smollm2-135m-instruct"))  # an empty folder


def test_the_cli_checks_only_the_judges_a_domain_names(tmp_path: Path, tiny_lm: Path) -> None:
    from cli.run import check_judges
    from schemas.config import ConfigError

    models = f"judge.models={{q: {{path: '{tiny_lm}'}}, broken: {{path: '{tmp_path / 'nope'}'}}}}"
    check_judges(config(tmp_path, models, JUDGED))  # `broken` is named by no domain
    with pytest.raises(ConfigError, match=r"^config: judge\.models\.broken\.path=.* does not exist;"):
        check_judges(config(tmp_path, models, "data.domains=[{name: a, source: arith, judge: broken}]"))


def test_prepare_converts_a_judge_source_once_then_checks_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             tiny_lm: Path) -> None:
    import shutil

    from launch import models
    from launch.prepare import RunError, prepare_judges

    calls: list[tuple[str, str]] = []

    def ensure_model(name: str, out_dir: str | Path, progress: Any = None) -> Path:  # no package install here
        calls.append((name, str(out_dir)))
        if not (Path(out_dir) / "config.json").is_file():
            shutil.copytree(tiny_lm, out_dir)
        return Path(out_dir)

    monkeypatch.setattr(models, "ensure_model", ensure_model)
    into, unused = tmp_path / "judges" / "q", tmp_path / "judges" / "unused"
    cfg = config(tmp_path, f"judge.models={{q: {{path: '{into}', source: smollm2-135m-instruct}}, "
                           f"u: {{path: '{unused}', source: smollm2-135m-instruct}}}}", JUDGED)
    assert prepare_judges(cfg) == [into]
    assert calls == [("smollm2-135m-instruct", str(into))]  # only the judges a domain names
    assert (into / "config.json").is_file() and not unused.exists()
    # the converted model is checked like any judge: here its labels are two tokens
    bad = config(tmp_path, f"judge.models={{q: {{path: '{into}', source: smollm2-135m-instruct, score: logprobs, "
                           "min_score: 1, max_score: 10}}", JUDGED)
    with pytest.raises(RunError, match=r"^judge\.models\.q: min_score=1\.\.max_score=10 .*2 tokens"):
        prepare_judges(bad)
    assert prepare_judges(config(tmp_path, f"judge.models={{q: {{path: '{into}'}}}}")) == []  # no judged domain


# --------------------------------------------------------------------------- against the real broker


async def test_prepare_run_names_the_judges_it_prepared(bootstrap: str, tmp_path: Path, tiny_rm: Path) -> None:
    """`rollstream run --prepare-only` of a judged run: topics (judge.requests among them), config,
    model, and one line naming each judge and its directory."""
    from launch.prepare import prepare_run
    from runtime.bus import TopicAdmin

    rid = f"prepj-{uuid.uuid4().hex[:8]}"
    cfg = config(tmp_path, f"kafka.bootstrap={bootstrap}", f"judge.models={{rm: {{kind: reward_model, path: '{tiny_rm}'}}}}",
                 "data.domains=[{name: a, source: arith, judge: rm}]", "model.init.hidden_size=32",
                 "model.init.num_layers=1", "model.init.num_heads=2", "model.init.intermediate_size=64")
    console = Console(file=io.StringIO(), width=300)
    try:
        await prepare_run(cfg, rid, bootstrap, console)
        async with TopicAdmin(cfg.kafka, bootstrap) as admin:
            topics = await admin.describe(rid)
        assert "judge.requests" in topics, topics
        shown = console.file.getvalue()  # type: ignore[attr-defined]
        assert f"judges: rm ({tiny_rm})" in shown, shown
        assert (tmp_path / rid / "config.yaml").is_file()
    finally:
        async with TopicAdmin(cfg.kafka, bootstrap) as admin:
            await admin.delete_run_topics(rid)


def test_cli_service_judge_judges_with_its_label_and_stops_on_sigterm(bootstrap: str, tmp_path: Path,
                                                                       tiny_rm: Path) -> None:
    """`rollstream service judge --run ID` (ROLLSTREAM_SERVICE_LABEL=judge1) with a prepared run
    folder and a tiny reward model: a judge request becomes a committed ``scored`` sample with its
    ``judge`` component; SIGTERM ends it with exit 0 and its label in its last log line."""
    from launch.supervisor import LABEL_ENV
    from runtime.bus import Consumer, Producer, TopicAdmin
    from schemas.topics import topic_name
    from tests.schemas.examples import example_events

    rid = f"judge-{uuid.uuid4().hex[:8]}"
    runs = tmp_path / "runs"
    (runs / rid).mkdir(parents=True)
    (runs / rid / "config.yaml").write_text(
        f"judge: {{device: cpu, max_batch: 4, models: {{rm: {{kind: reward_model, path: '{tiny_rm}'}}}}}}\n"
        "data: {heldout_size: 4, domains: [{name: arith, source: arith, judge: rm, rewards: {judge: 0.5, correct: 0.5}}]}\n")
    kafka = KafkaSettings(bootstrap=bootstrap, connect_timeout_s=10.0, request_timeout_s=15.0)
    (request,) = [e for e in example_events() if isinstance(e, ev.JudgeRequest)]
    gen = msgspec.structs.replace(request.scored.generation, run_id=rid, episode_id="", step_rewards=[],  # one turn
                                  turn_versions=[], state_hashes=[], num_turns=1, env_s=0.0, env_finish="",
                                  success=False)
    request = msgspec.structs.replace(request, run_id=rid, judge="rm",
                                      scored=msgspec.structs.replace(request.scored, run_id=rid, generation=gen))

    async def drive() -> ev.ScoredSample:
        async with TopicAdmin(kafka) as admin:
            await admin.ensure_run_topics(rid)
        async with Producer(kafka) as producer, Consumer(
                kafka, group_id=None, topics=[topic_name(rid, "scored")], auto_offset_reset="earliest") as consumer:
            await producer.send_and_wait(topic_name(rid, "judge.requests"), request, key=gen.task.sample_id)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                for rec in await consumer.getmany(timeout_ms=1000):
                    if isinstance(rec.event, ev.ScoredSample):
                        return rec.event
            raise AssertionError("no scored sample within 120 s")

    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap, ROLLSTREAM_HOME=str(tmp_path / "home"),
               **{LABEL_ENV: "judge1"})
    log = tmp_path / "judge.log"
    with log.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "service", "judge", "--run", rid,
                                 "--runs-dir", str(runs)], env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        scored = asyncio.run(drive())
        assert scored.judge == "rm" and not scored.judge_error, scored
        assert 0.0 < scored.rewards["judge"] < 1.0  # a sigmoid of the tiny reward model's output
        assert scored.reward == pytest.approx(0.5 * scored.rewards["judge"] + 0.5 * scored.rewards["correct"])
        assert scored.generation.task.sample_id == gen.task.sample_id
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-2000:]
        assert "judge worker judge1: 1 judged" in log.read_text(), log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

        async def cleanup() -> None:
            async with TopicAdmin(kafka) as admin:
                await admin.delete_run_topics(rid)

        asyncio.run(cleanup())
