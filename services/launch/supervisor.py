"""``rollstream run``: prepare a run and supervise its services as OS processes.

1. resolve the config and the run id (the CLI, which also refuses a backend that cannot run);
2. find Kafka (``--bootstrap`` / ``kafka.bootstrap`` / ``$ROLLSTREAM_BOOTSTRAP`` / the local
   broker, started if missing) and create the run's topics; create ``runs/<run_id>/`` with
   ``config.yaml``;
3. create the tiny model (when ``model.path`` is empty) in ``runs/<run_id>/model``
   (:func:`prepare_run`; ``rollstream run --prepare-only`` stops here);
4. start ``rollstream service <name> --run <run_id>`` for recorder, feeder, reward,
   rollout (× ``rollout.workers``) and trainer, each logging to ``runs/<run_id>/logs/<name>.log``,
   with the bootstrap address and the store DSN in their environment (``ROLLSTREAM_BOOTSTRAP``,
   ``ROLLSTREAM_STORE``);
5. follow the run's ``metrics`` and ``control`` topics and show live progress;
6. on ``RunFinished``: wait for the services to exit (SIGTERM the long-running ones), let the
   recorder catch up, compute ``summary.json`` from the record (SQL) and print its gist.

Ctrl-C (or SIGTERM) stops every service cleanly (SIGTERM, then SIGKILL after a grace period).
A service that dies stops the run with one line naming it and the last line of its log.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from schemas import events as ev
from schemas.config import RunConfig, to_dict
from schemas.topics import check_run_id, topic_name
from services import store as st
from services.kafka.bus import Consumer, TopicAdmin, message_count
from services.launch.runs import run_dir_of, store_dsn_of

LONG_RUNNING = ("rollout", "reward")


class RunError(RuntimeError):
    """The run could not start or a service failed; one line for the user."""


@dataclass
class Progress:
    """What the supervisor knows from the events (shown live, and part of the summary)."""

    step: int = 0
    steps: int = 0
    reward_mean: float = float("nan")
    eval_acc: dict[str, float] = field(default_factory=dict)
    evals: list[tuple[int, str, float]] = field(default_factory=list)
    staleness_mean: float = 0.0
    samples_trained: int = 0
    gen_tokens: int = 0
    train_tokens: float = 0.0
    started: float = field(default_factory=time.monotonic)
    finished: ev.RunFinished | None = None
    versions: list[int] = field(default_factory=list)

    def observe(self, event: Any) -> None:
        if isinstance(event, ev.TrainStep):
            self.step = event.step + 1
            self.reward_mean = event.metrics.get("rollout/reward_mean", self.reward_mean)
            self.staleness_mean = event.metrics.get("rollout/staleness_mean", 0.0)
            self.samples_trained += len(event.sample_ids)
            self.train_tokens += event.metrics.get("train/tokens", 0.0)
            self.gen_tokens += int(event.metrics.get("rollout/response_len_mean", 0.0) * len(event.sample_ids))
        elif isinstance(event, ev.EvalResult):
            acc = event.metrics.get("eval/accuracy", float("nan"))
            self.eval_acc[event.split] = acc
            self.evals.append((event.step, event.split, acc))
        elif isinstance(event, ev.WeightsPublished):
            self.versions.append(event.policy_version)
        elif isinstance(event, ev.RunFinished):
            self.finished = event

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        acc = self.evals[-1][2] if self.evals else float("nan")
        return (
            f"step {self.step}/{self.steps}  reward {self.reward_mean:.3f}  eval acc {acc:.3f}  "
            f"staleness {self.staleness_mean:.2f}  samples/s {self.samples_trained / max(elapsed, 1e-9):.1f}  "
            f"gen tok/s {self.gen_tokens / max(elapsed, 1e-9):.0f}  {elapsed:.0f}s"
        )


def new_run_id(cfg: RunConfig) -> str:
    return check_run_id(f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid() % 1000:03d}")


def config_text(cfg: RunConfig) -> str:
    """The run's ``config.yaml`` as written."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def write_run_config(cfg: RunConfig, run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    path.write_text(config_text(cfg))
    return path


def prepare_model(cfg: RunConfig, run_dir: Path) -> Path:
    """The model directory of the run (created when ``model.path`` is empty)."""
    if cfg.model.path:
        path = Path(cfg.model.path)
        if not (path / "config.json").exists():
            raise RunError(f"model.path {path} is not a Hugging Face model directory (no config.json)")
        return path
    from rollout.model_init import init_tiny_model

    path = run_dir / "model"
    if not (path / "config.json").exists():
        init_tiny_model(path, cfg.model.init, seed=cfg.run.seed)
    return path


def service_command(name: str, run_id: str, runs_dir: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", "service", name, "--run", run_id, "--runs-dir", runs_dir]


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path


def last_log_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or [""])[-1][:300]


class Supervisor:
    def __init__(self, cfg: RunConfig, run_id: str, bootstrap: str, console: Console) -> None:
        self.cfg = cfg
        self.run_id = run_id
        self.bootstrap = bootstrap
        self.console = console
        self.run_dir = run_dir_of(cfg, run_id)
        self.children: list[Child] = []
        self.progress = Progress(steps=cfg.train.steps)

    def start_children(self) -> None:
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=self.bootstrap, PYTHONUNBUFFERED="1",
                   ROLLSTREAM_STORE=store_dsn_of(self.cfg, self.run_id))
        names = ["recorder", "feeder", "reward", *(["rollout"] * self.cfg.rollout.workers), "trainer"]
        for i, name in enumerate(names):
            label = f"{name}{i - 3}" if name == "rollout" and self.cfg.rollout.workers > 1 else name
            log_path = logs / f"{label}.log"
            fh = open(log_path, "ab")
            proc = subprocess.Popen(service_command(name, self.run_id, self.cfg.run.runs_dir), stdout=fh,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
            fh.close()
            self.children.append(Child(label, proc, log_path))

    def failed_child(self) -> Child | None:
        """A service that exited before the run finished (any exit code counts)."""
        for c in self.children:
            if c.proc.poll() is not None:
                return c
        return None

    def terminate(self, names: tuple[str, ...] | None = None, grace_s: float = 30.0) -> None:
        targets = [c for c in self.children if c.proc.poll() is None and (names is None or c.name.rstrip("0123456789") in names)]
        for c in targets:
            c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in targets:
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()

    async def follow(self, stop: asyncio.Event) -> None:
        """Consume metrics/control/weights until RunFinished, a failed service, ``stop`` or the wall limit."""
        topics = [topic_name(self.run_id, n) for n in ("metrics", "control", "weights")]
        consumer = Consumer(self.cfg.kafka, self.bootstrap, group_id=None, topics=topics,
                            auto_offset_reset="earliest", client_suffix="supervisor")
        await consumer.start()
        last_line = 0.0
        try:
            while not stop.is_set():
                for rec in await consumer.getmany(timeout_ms=500):
                    if rec.event is not None:
                        self.progress.observe(rec.event)
                if self.progress.finished is not None:
                    return
                bad = self.failed_child()
                if bad is not None:
                    raise RunError(f"service {bad.name} exited with code {bad.proc.returncode}: "
                                   f"{last_log_line(bad.log_path)} (log: {bad.log_path})")
                if time.monotonic() - self.progress.started > self.cfg.run.max_wall_s:
                    raise RunError(f"run exceeded run.max_wall_s={self.cfg.run.max_wall_s:g}s; stopped")
                if time.monotonic() - last_line > 5:
                    self.console.print(self.progress.line())
                    last_line = time.monotonic()
        finally:
            await consumer.stop()

    def wait_recorder(self, timeout_s: float = 120.0) -> None:
        for c in self.children:
            if c.name == "recorder":
                try:
                    c.proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    self.terminate(("recorder",))


def summarize(cfg: RunConfig, run_id: str, progress: Progress, wall_s: float) -> dict[str, Any]:
    """The run's summary, computed from the record (SQL over the run's store)."""
    client = st.connect(store_dsn_of(cfg, run_id))
    p = {"r": run_id}
    status_rows = client.query(
        "SELECT status, count() FROM samples WHERE run_id = {r:String} GROUP BY status", parameters=p).result_rows
    by_status = {s: int(n) for s, n in status_rows}
    issued = int(client.query("SELECT count() FROM sample_tasks FINAL WHERE run_id = {r:String}",
                              parameters=p).result_rows[0][0])
    evals = client.query(
        "SELECT step, split, metrics['eval/accuracy'] FROM evals FINAL WHERE run_id = {r:String} ORDER BY ts",
        parameters=p).result_rows
    thr = client.query(
        "SELECT sum(response_len), sum(gen_s), min(generated_ts), max(generated_ts) FROM samples "
        "JOIN sample_generations g USING (run_id, sample_id) WHERE run_id = {r:String}", parameters=p).result_rows
    steps = client.query(
        "SELECT count(), sum(metrics['train/tokens']), sum(metrics['perf/step_s']) FROM train_steps FINAL "
        "WHERE run_id = {r:String}", parameters=p).result_rows[0]
    heldout = [(int(s), float(a)) for s, split, a in evals if split == "heldout"]
    init = [float(a) for s, split, a in evals if split == "init"]
    gen_tokens = int(thr[0][0] or 0) if thr else 0
    gen_span = (thr[0][3] - thr[0][2]).total_seconds() if thr and thr[0][2] and thr[0][3] else 0.0
    summary: dict[str, Any] = {
        "run_id": run_id,
        "config": to_dict(cfg),
        "steps": int(steps[0]),
        "wall_s": round(wall_s, 1),
        "eval": {
            "init": {"accuracy": init[0] if init else None},
            "start": {"accuracy": heldout[0][1] if heldout else None, "step": heldout[0][0] if heldout else None},
            "final": {"accuracy": heldout[-1][1] if heldout else None, "step": heldout[-1][0] if heldout else None},
            "curve": [{"step": s, "accuracy": a} for s, a in heldout],
        },
        "samples": {
            "issued": issued,
            "trained": by_status.get("trained", 0),
            "dropped_stale": by_status.get("dropped_stale", 0),
            "filtered": by_status.get("filtered", 0),
            "dead_letter": by_status.get("dead_letter", 0),
            "unaccounted": sum(n for s, n in by_status.items()
                               if s not in ("trained", "dropped_stale", "filtered", "dead_letter")),
        },
        "throughput": {
            "gen_tokens_per_s": round(gen_tokens / gen_span, 1) if gen_span > 0 else None,
            "train_tokens_per_s": round(float(steps[1] or 0) / float(steps[2]), 1) if steps[2] else None,
        },
        "weights_versions": progress.versions,
    }
    return summary


async def prepare_run(cfg: RunConfig, run_id: str, bootstrap: str, console: Console, *,
                      on_run_dir: Callable[[Path], None] | None = None,
                      allow_prepared: bool = False) -> Path:
    """Steps 2-3 of the module doc: the run's topics, ``runs/<run_id>/config.yaml`` and the model.
    Returns the model directory; starts no service.

    A run id whose topics already hold messages is refused unless the run directory has a
    checkpoint to resume from, or (``allow_prepared``) it already holds this very config (an
    earlier ``--prepare-only`` of the same run: preparing again changes nothing).
    ``on_run_dir(run_dir)`` is called once the run directory exists.
    """
    run_dir = run_dir_of(cfg, run_id)
    if (run_dir / "summary.json").exists():
        raise RunError(f"run {run_id} already finished ({run_dir / 'summary.json'}); pick another --run-id")
    resuming = any((run_dir / "checkpoints").glob("step_*/stream_state.msgpack"))
    config_path = run_dir / "config.yaml"
    prepared = allow_prepared and config_path.is_file() and config_path.read_text() == config_text(cfg)
    async with TopicAdmin(cfg.kafka, bootstrap) as admin:
        existing = {info.topic: info.partitions for info in (await admin.describe(run_id)).values()}
        if not (resuming or prepared) and existing and (held := await message_count(cfg.kafka, bootstrap, existing)):
            raise RunError(f"run id {run_id} already has {held} messages on the broker (an earlier run with this id) "
                           "and no checkpoint here to resume from; pick another --run-id")
        await admin.ensure_run_topics(run_id)
    write_run_config(cfg, run_dir)
    if on_run_dir is not None:
        on_run_dir(run_dir)
    console.print(f"run {run_id}: dir {run_dir}, kafka {bootstrap}")
    with console.status("creating the model..."):
        model_dir = prepare_model(cfg, run_dir)
    console.print(f"model: {model_dir}")
    return model_dir


async def run_supervised(cfg: RunConfig, run_id: str, bootstrap: str, console: Console, *,
                         on_run_dir: Callable[[Path], None] | None = None) -> dict[str, Any]:
    """Everything of ``rollstream run`` after config parsing. Returns the summary."""
    run_dir = run_dir_of(cfg, run_id)
    await prepare_run(cfg, run_id, bootstrap, console, on_run_dir=on_run_dir)
    sup = Supervisor(cfg, run_id, bootstrap, console)
    t0 = time.monotonic()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    sup.start_children()
    ok = False
    try:
        await sup.follow(stop)
        ok = sup.progress.finished is not None
    finally:
        if ok:
            # trainer and feeder exit on RunFinished; rollout and reward run until told to stop
            await asyncio.to_thread(sup.terminate, LONG_RUNNING)
            await asyncio.to_thread(sup.wait_recorder)
        else:
            console.print("[yellow]stopping the services...[/yellow]")
        await asyncio.to_thread(sup.terminate, None)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    if not ok:
        why = "interrupted" if stop.is_set() else "stopped before it finished"
        raise RunError(f"run {run_id} {why}; every service was stopped (logs: {run_dir / 'logs'})")
    summary = summarize(cfg, run_id, sup.progress, time.monotonic() - t0)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def load_run_config(runs_dir: str, run_id: str, overrides: list[str]) -> RunConfig:
    """The config a service of ``run_id`` uses: ``runs/<run_id>/config.yaml`` plus overrides."""
    from schemas.config import parse_config

    path = Path(runs_dir) / run_id / "config.yaml"
    if not path.exists():
        raise RunError(f"run {run_id} has no config at {path} (start runs with `rollstream run`)")
    return parse_config(path.read_text(), overrides, source=str(path))
