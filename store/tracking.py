"""Experiment trackers fed by the recorder: TensorBoard event files and W&B offline runs.

Both are optional extras (``pip install 'rollstream[trackers]'``), turned on by the run config's
``tracking`` section; :func:`check_trackers` refuses, before anything starts, a tracker whose
package is missing. The recorder (:mod:`services.recorder`) feeds them through a
:class:`TrackerFeed` after each insert, so a tracker only ever sees what is in the record:

* every ``TrainStep`` at its ``step``, under exactly the names of ``train_steps.metrics``
  (``loss/policy``, ``rollout/reward_mean``, ``perf/step_s``...);
* every ``EvalResult`` at its ``step``: split ``heldout`` under exactly the names of
  ``evals.metrics`` (``eval/accuracy``, ``eval/<domain>/accuracy``, ``eval/response_len``); any
  other split (``init``: the model before the warm-up) as ``<split>/<name>``
  (``init/eval/accuracy``), so two splits at one step never share a name.

Each (train step) and each (eval split, step) reaches the trackers once: a restarted recorder
starts from the steps already in the store (those were fed before) and a step published twice
is logged once. Trackers write under the run's folder: ``runs/<id>/tb`` (TensorBoard, flushed
after every poll that logged something) and ``runs/<id>/wandb`` (W&B, ``mode="offline"``;
upload later with ``wandb sync``). A tracker that fails is logged once and disabled; recording
goes on.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import msgspec

from schemas import events as ev
from schemas.config import ConfigError, RunConfig
from schemas.errors import one_line

log = logging.getLogger("rollstream.tracking")

INSTALL_HINT = "pip install 'rollstream[trackers]'"
MAIN_EVAL_SPLIT = "heldout"
"""The eval split logged under the record's own metric names (others get a ``<split>/`` prefix)."""
WANDB_STEP_KEY = "step"
"""The W&B x-axis every metric is plotted against (the trainer step of the event)."""


class Tracker(Protocol):
    """Where metrics go besides the record."""

    name: str

    def log(self, metrics: dict[str, float], step: int, *, ts: float | None = None) -> None:
        """Log ``metrics`` (name -> value) at trainer step ``step``; ``ts``: when they were
        measured (unix seconds; default now)."""

    def flush(self) -> None:
        """Make what was logged visible to readers (a running job can be watched)."""

    def close(self) -> None:
        """Flush and release everything."""


# --------------------------------------------------------------------------- trackers


class TensorBoardTracker:
    """TensorBoard event files in ``logdir`` (``runs/<id>/tb``), with tensorboard's own writer
    (no TensorFlow, no torch). A restarted recorder adds a new event file to the same folder;
    TensorBoard reads them all as one run."""

    name = "tensorboard"

    def __init__(self, logdir: str | Path, flush_every_s: float = 5.0) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        self._writer = EventFileWriter(str(self.logdir), flush_secs=flush_every_s)

    def log(self, metrics: dict[str, float], step: int, *, ts: float | None = None) -> None:
        summary = self._summary_pb2.Summary(value=[
            self._summary_pb2.Summary.Value(tag=name, simple_value=float(value)) for name, value in metrics.items()])
        self._writer.add_event(self._event_pb2.Event(wall_time=time.time() if ts is None else ts, step=int(step),
                                                     summary=summary))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A W&B run in offline mode under ``<run_dir>/wandb`` (``wandb.init(dir=run_dir)`` puts its
    ``wandb/offline-run-*`` folder there), named after the run id, with the run config as its
    config. Every metric is plotted against ``step`` (the event's trainer step), so events that
    arrive out of step order (several partitions) are all kept."""

    name = "wandb"

    def __init__(self, run_dir: str | Path, run_id: str, project: str, config: dict[str, Any]) -> None:
        import wandb

        run_dir = Path(run_dir)
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(mode="offline", dir=str(run_dir), project=project, name=run_id, config=config)
        self._run.define_metric(WANDB_STEP_KEY)
        self._run.define_metric("*", step_metric=WANDB_STEP_KEY)

    def log(self, metrics: dict[str, float], step: int, *, ts: float | None = None) -> None:
        self._run.log({**metrics, WANDB_STEP_KEY: int(step)})

    def flush(self) -> None:
        pass  # the offline run's writer process writes continuously

    def close(self) -> None:
        self._run.finish()


# --------------------------------------------------------------------------- config


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def check_trackers(cfg: RunConfig) -> None:
    """Raise :class:`ConfigError` (a ``ValueError``; one line naming the key and what to do)
    when a tracker the config turns on cannot run here (its package is not installed)."""
    for key, on, package in (("tracking.tensorboard", cfg.tracking.tensorboard, "tensorboard"),
                             ("tracking.wandb", cfg.tracking.wandb, "wandb")):
        if on and not _installed(package):
            raise ConfigError(f"config: {key}=true needs the {package} package, which is not installed: "
                              f"{INSTALL_HINT} (or set {key}=false)")


def make_trackers(cfg: RunConfig, run_dir: str | Path, run_id: str = "") -> list[Tracker]:
    """The trackers ``cfg.tracking`` turns on, writing under ``run_dir`` (``runs/<id>``;
    ``run_id`` defaults to its name). One that cannot start is logged and left out: trackers
    never stop the recorder."""
    run_dir = Path(run_dir)
    run_id = run_id or run_dir.name
    t = cfg.tracking
    makers: list[tuple[str, Any]] = []
    if t.tensorboard:
        makers.append(("tensorboard", lambda: TensorBoardTracker(run_dir / "tb")))
    if t.wandb:
        makers.append(("wandb", lambda: WandbTracker(run_dir, run_id, t.wandb_project, msgspec.to_builtins(cfg))))
    out: list[Tracker] = []
    for name, make in makers:
        try:
            out.append(make())
        except Exception as e:
            log.error("tracker %s could not start (%s); it is off for this recorder, recording goes on",
                      name, one_line(e))
    return out


# --------------------------------------------------------------------------- feeding


def tracked_metrics(event: ev.Event | None) -> tuple[tuple[str, str, int], dict[str, float], int] | None:
    """``(dedupe key, metrics, step)`` of an event the trackers log (``TrainStep``,
    ``EvalResult``), with the names described in the module docstring; ``None`` otherwise."""
    if isinstance(event, ev.TrainStep):
        return ("train", "", event.step), {k: float(v) for k, v in event.metrics.items()}, event.step
    if isinstance(event, ev.EvalResult):
        prefix = "" if event.split == MAIN_EVAL_SPLIT else f"{event.split}/"
        return (("eval", event.split, event.step), {f"{prefix}{k}": float(v) for k, v in event.metrics.items()},
                event.step)
    return None


class TrackerFeed:
    """Feeds one run's ``TrainStep`` / ``EvalResult`` events to its trackers, each train step
    and each (eval split, step) once. A tracker call that raises disables that tracker (logged
    once); nothing here raises."""

    def __init__(self, run_id: str, trackers: Iterable[Tracker]) -> None:
        self.run_id = run_id
        self.trackers: list[Tracker] = list(trackers)
        self.seen: set[tuple[str, str, int]] = set()
        self.failed: dict[str, str] = {}
        """Tracker name -> why it was disabled."""
        self.logged = 0
        """Points (one event's metrics) handed to the trackers."""

    def seed_from_store(self, client: Any) -> None:
        """Mark the steps already in the store as fed (a restarted recorder fed them before)."""
        p = {"r": self.run_id}
        try:
            steps = client.query("SELECT DISTINCT step FROM train_steps WHERE run_id = {r:String}",
                                 parameters=p).result_rows
            evals = client.query("SELECT DISTINCT split, step FROM evals WHERE run_id = {r:String}",
                                 parameters=p).result_rows
        except Exception as e:
            log.warning("trackers: could not read the steps already recorded (%s); they may be logged twice",
                        one_line(e))
            return
        self.seen.update(("train", "", int(s)) for (s,) in steps)
        self.seen.update(("eval", str(split), int(s)) for split, s in evals)

    def feed(self, events: Iterable[ev.Event | None]) -> int:
        """Log the events' metrics not fed yet, then flush; the number of points logged."""
        if not self.trackers:
            return 0
        n = 0
        for event in events:
            point = tracked_metrics(event)
            if point is None or event is None or event.run_id != self.run_id:
                continue
            key, metrics, step = point
            if key in self.seen:
                continue
            self.seen.add(key)
            n += 1
            for t in list(self.trackers):
                self._call(t, "log", metrics, step, ts=event.ts)
        if n:
            for t in list(self.trackers):
                self._call(t, "flush")
        self.logged += n
        return n

    def close(self) -> None:
        """Close every tracker still on (errors are logged, not raised)."""
        for t in list(self.trackers):
            self._call(t, "close")
        self.trackers.clear()

    def _call(self, tracker: Tracker, method: str, *args: Any, **kwargs: Any) -> None:
        try:
            getattr(tracker, method)(*args, **kwargs)
        except Exception as e:
            self.trackers.remove(tracker)
            self.failed[tracker.name] = one_line(e)
            log.error("tracker %s failed in %s (%s); it is disabled, recording goes on", tracker.name, method,
                      self.failed[tracker.name])
            if method != "close":
                try:
                    tracker.close()
                except Exception:
                    pass
