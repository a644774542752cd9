"""Experiment trackers fed by the recorder: TensorBoard files read back with TensorBoard's own
reader hold every train step and eval under the record's metric names, once per step; a
missing package is refused in one line before anything starts; a failing tracker is disabled
and recording goes on; and the real recorder over the real broker writes ``runs/<id>/tb``."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import msgspec
import pytest

from schemas import events as ev
from schemas.config import ConfigError, KafkaSettings, RunConfig, TrackingConfig
from services.recorder import Recorder, RecorderSettings
from store import tracking
from store.tracking import TensorBoardTracker, TrackerFeed, WandbTracker, check_trackers, make_trackers

REPO = Path(__file__).resolve().parents[2]


def config(**tracking_kw: Any) -> RunConfig:
    return msgspec.structs.replace(RunConfig(), tracking=TrackingConfig(**tracking_kw))


def scalars(logdir: Path) -> dict[str, list[tuple[int, float, float]]]:
    """tag -> [(step, value, wall_time)] of every event file in ``logdir``, as TensorBoard reads it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(s.step, s.value, s.wall_time) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def events(run_id: str) -> list[ev.Event]:
    return [
        ev.EvalResult(run_id=run_id, ts=1000.0, step=0, policy_version=0, split="init",
                      metrics={"eval/accuracy": 0.125, "eval/arith/accuracy": 0.25}),
        ev.EvalResult(run_id=run_id, ts=1001.0, step=0, policy_version=0, split="heldout",
                      metrics={"eval/accuracy": 0.375, "eval/arith/accuracy": 0.5, "eval/response_len": 7.0}),
        ev.TrainStep(run_id=run_id, ts=1010.0, step=1, policy_version=0,
                     metrics={"loss/policy": 0.5, "rollout/reward_mean": 0.25, "perf/step_s": 1.5}),
        ev.RolloutTask(run_id=run_id, sample_id="g/0", group_id="g", index=0, group_size=1, prompt_id="p",
                       domain="arith", prompt="1+1="),
        # the same step again (a re-published event): the first one stays
        ev.TrainStep(run_id=run_id, ts=1011.0, step=1, policy_version=0,
                     metrics={"loss/policy": 99.0, "rollout/reward_mean": 99.0, "perf/step_s": 99.0}),
        ev.TrainStep(run_id="another-run", ts=1012.0, step=2, policy_version=1, metrics={"loss/policy": 42.0}),
        ev.TrainStep(run_id=run_id, ts=1020.0, step=2, policy_version=1,
                     metrics={"loss/policy": 0.25, "rollout/reward_mean": 0.75, "perf/step_s": 1.25}),
        ev.EvalResult(run_id=run_id, ts=1021.0, step=2, policy_version=2, split="heldout",
                      metrics={"eval/accuracy": 0.625, "eval/arith/accuracy": 0.75, "eval/response_len": 6.0}),
    ]


EXPECTED = {
    "loss/policy": [(1, 0.5), (2, 0.25)],
    "rollout/reward_mean": [(1, 0.25), (2, 0.75)],
    "perf/step_s": [(1, 1.5), (2, 1.25)],
    "eval/accuracy": [(0, 0.375), (2, 0.625)],
    "eval/arith/accuracy": [(0, 0.5), (2, 0.75)],
    "eval/response_len": [(0, 7.0), (2, 6.0)],
    "init/eval/accuracy": [(0, 0.125)],
    "init/eval/arith/accuracy": [(0, 0.25)],
}


def steps_values(got: dict[str, list[tuple[int, float, float]]]) -> dict[str, list[tuple[int, float]]]:
    return {tag: sorted((s, v) for s, v, _ in pts) for tag, pts in got.items()}


# --------------------------------------------------------------------------- feeding, unit


def test_tensorboard_gets_every_step_once_under_the_record_names(tmp_path: Path) -> None:
    run_dir = tmp_path / "r1"
    trackers = make_trackers(config(tensorboard=True), run_dir)
    assert [t.name for t in trackers] == ["tensorboard"]
    feed = TrackerFeed("r1", trackers)
    evs = events("r1")
    assert feed.feed(evs[:4]) == 3  # two evals, one train step (the task is not a metric)
    # before close: what was fed is already on disk (a running job can be watched)
    assert steps_values(scalars(run_dir / "tb"))["loss/policy"] == [(1, 0.5)]
    assert feed.feed(evs[4:]) == 2 and feed.feed(evs) == 0  # duplicates and another run's step are skipped
    feed.close()

    got = scalars(run_dir / "tb")
    assert steps_values(got) == EXPECTED
    assert got["loss/policy"][0][2] == 1010.0  # wall time = when the trainer measured it


def test_tracked_names_are_those_of_the_record() -> None:
    step = ev.TrainStep(run_id="r", step=3, policy_version=2, metrics={"loss/policy": 0.5, "actor/approx_kl": 0.1})
    assert tracking.tracked_metrics(step) == (("train", "", 3), {"loss/policy": 0.5, "actor/approx_kl": 0.1}, 3)
    held = ev.EvalResult(run_id="r", step=3, policy_version=3, split="heldout", metrics={"eval/math/accuracy": 1.0})
    assert tracking.tracked_metrics(held) == (("eval", "heldout", 3), {"eval/math/accuracy": 1.0}, 3)
    assert tracking.tracked_metrics(ev.Drain(run_id="r")) is None and tracking.tracked_metrics(None) is None


class Failing:
    name = "failing"

    def __init__(self) -> None:
        self.closed = 0
        self.calls = 0

    def log(self, metrics: dict[str, float], step: int, *, ts: float | None = None) -> None:
        self.calls += 1
        raise OSError("disk full\nsecond line")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed += 1


class Keeping:
    name = "keeping"

    def __init__(self) -> None:
        self.points: list[tuple[int, dict[str, float]]] = []
        self.closed = 0

    def log(self, metrics: dict[str, float], step: int, *, ts: float | None = None) -> None:
        self.points.append((step, metrics))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed += 1


def test_a_failing_tracker_is_disabled_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    bad, good = Failing(), Keeping()
    feed = TrackerFeed("r", [bad, good])
    with caplog.at_level(logging.ERROR, logger="rollstream.tracking"):
        assert feed.feed(events("r")) == 5  # nothing raised
        feed.feed([ev.TrainStep(run_id="r", step=9, policy_version=9, metrics={"loss/policy": 1.0})])
        feed.close()
    assert bad.calls == 1 and bad.closed == 1  # disabled at its first failure, closed once
    assert feed.failed == {"failing": "OSError: disk full"}
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "failing" in errors[0].getMessage() and "disabled" in errors[0].getMessage()
    assert [s for s, _ in good.points] == [0, 0, 1, 2, 2, 9] and good.closed == 1  # the other one went on


def test_a_tracker_that_cannot_start_is_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # not importable, whatever is installed
    with caplog.at_level(logging.ERROR, logger="rollstream.tracking"):
        trackers = make_trackers(config(tensorboard=True, wandb=True), tmp_path / "r")
    assert [t.name for t in trackers] == ["tensorboard"]
    assert any("wandb" in r.getMessage() for r in caplog.records)
    for t in trackers:
        t.close()


def test_wandb_runs_offline_under_the_run_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """wandb is not installed here: a stand-in module records what the tracker asks of it."""
    calls: list[tuple[str, Any]] = []

    class Run:
        def define_metric(self, name: str, **kw: Any) -> None:
            calls.append(("define_metric", (name, kw)))

        def log(self, data: dict[str, Any]) -> None:
            calls.append(("log", data))

        def finish(self) -> None:
            calls.append(("finish", None))

    def init(**kw: Any) -> Run:
        calls.append(("init", kw))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    cfg = config(wandb=True, wandb_project="proj")
    (tracker,) = make_trackers(cfg, tmp_path / "r9")
    assert isinstance(tracker, WandbTracker)
    feed = TrackerFeed("r9", [tracker])
    feed.feed(events("r9"))
    feed.close()
    kind, kw = calls[0]
    assert kind == "init"
    assert kw["mode"] == "offline" and kw["project"] == "proj" and kw["name"] == "r9"
    assert kw["dir"] == str(tmp_path / "r9") and (tmp_path / "r9" / "wandb").is_dir()  # wandb writes <dir>/wandb
    assert kw["config"]["tracking"] == {"tensorboard": False, "wandb": True, "wandb_project": "proj"}
    assert ("define_metric", ("*", {"step_metric": "step"})) in calls
    logged = [c[1] for c in calls if c[0] == "log"]
    assert {"loss/policy": 0.5, "rollout/reward_mean": 0.25, "perf/step_s": 1.5, "step": 1} in logged
    assert {"init/eval/accuracy": 0.125, "init/eval/arith/accuracy": 0.25, "step": 0} in logged
    assert len(logged) == 5 and calls[-1] == ("finish", None)


# --------------------------------------------------------------------------- pre-flight


def test_check_trackers_refuses_a_missing_package_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    check_trackers(config())  # off: nothing needed
    check_trackers(config(tensorboard=True))  # installed here
    with pytest.raises(ValueError) as e:
        check_trackers(config(wandb=True))  # not installed here
    msg = str(e.value)
    assert isinstance(e.value, ConfigError) and "\n" not in msg
    assert "tracking.wandb=true" in msg and "pip install 'rollstream[trackers]'" in msg
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ConfigError, match=r"tracking\.tensorboard=true needs the tensorboard package"):
        check_trackers(config(tensorboard=True))


def test_run_refuses_wandb_before_anything_starts(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    res = subprocess.run([sys.executable, "-m", "cli", "run", str(REPO / "examples" / "main.yaml"),
                          "--set", "tracking.wandb=true", "--set", f"run.runs_dir={runs}"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert len(lines) == 1 and lines[0].startswith("error:") and "tracking.wandb=true" in lines[0], res.stderr
    assert not runs.exists()


# --------------------------------------------------------------------------- the real recorder


async def test_the_recorder_writes_tensorboard_files(bootstrap: str, run_id: str, store_dsn: str,
                                                     tmp_path: Path) -> None:
    """The real recorder over the real broker: every train step and eval in ``runs/<id>/tb``,
    once; a second recorder instance (restart) adds only steps that are not in the record yet."""
    from tests.store.recorded_run import publish

    run_dir = tmp_path / run_id
    cfg = config(tensorboard=True)

    async def record(evs: list[ev.Event], group: str) -> Recorder:
        await publish(bootstrap, run_id, [*evs, ev.RunFinished(run_id=run_id, status="completed")], junk=False)
        rec = Recorder(RecorderSettings(run_id=run_id, dsn=store_dsn, kafka=KafkaSettings(bootstrap=bootstrap),
                                        group_id=group, stop_when_finished=True, idle_exit_s=0.5, config=cfg,
                                        run_dir=str(run_dir)))
        await asyncio.wait_for(rec.run(), timeout=120)
        return rec

    evs = events(run_id)
    first = await record(evs[:5], f"{run_id}-a")
    assert first.tracking is not None and first.tracking.logged == 3 and not first.tracking.failed
    assert steps_values(scalars(run_dir / "tb"))["loss/policy"] == [(1, 0.5)]
    # a restarted recorder: step 1 published once more (new offset) is in the record already
    again = ev.TrainStep(run_id=run_id, step=1, policy_version=0, metrics={"loss/policy": 7.0})
    second = await record([again, *evs[5:]], f"{run_id}-a")
    assert second.tracking is not None and second.tracking.logged == 2
    assert steps_values(scalars(run_dir / "tb")) == EXPECTED
    assert len(list((run_dir / "tb").glob("events.out.tfevents.*"))) == 2  # one file per recorder instance


async def test_the_recorder_goes_on_when_a_tracker_fails(bootstrap: str, run_id: str, store_dsn: str,
                                                         tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import store as st
    from tests.store.recorded_run import publish

    def broken(self: TensorBoardTracker, metrics: dict[str, float], step: int, *, ts: float | None = None) -> None:
        raise RuntimeError("tensorboard writer died")

    monkeypatch.setattr(TensorBoardTracker, "log", broken)
    sent = await publish(bootstrap, run_id, [*events(run_id), ev.RunFinished(run_id=run_id, status="completed")],
                         junk=False)
    rec = Recorder(RecorderSettings(run_id=run_id, dsn=store_dsn, kafka=KafkaSettings(bootstrap=bootstrap),
                                    group_id=f"{run_id}-b", stop_when_finished=True, idle_exit_s=0.5,
                                    config=config(tensorboard=True), run_dir=str(tmp_path / run_id)))
    assert await asyncio.wait_for(rec.run(), timeout=120) == sent
    assert rec.tracking is not None and rec.tracking.failed == {"tensorboard": "RuntimeError: tensorboard writer died"}
    client = st.connect(store_dsn)
    n = client.query("SELECT count() FROM train_steps FINAL WHERE run_id = {r:String}",
                     parameters={"r": run_id}).result_rows[0][0]
    assert n == 2
