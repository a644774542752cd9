"""``rollstream run``: prepare a run and supervise its services as OS processes.

1. find Kafka (docs/architecture.md, "Finding the broker"; the local broker is started if missing)
   and create the run's topics, ``runs/<run_id>/config.yaml`` and (when
   ``model.path`` is empty) the tiny model (:mod:`launch.prepare`; ``--prepare-only`` stops here);
2. start ``rollstream service <name> --run <run_id>`` for each service of the run, in the table's
   start order (:data:`schemas.services.SERVICES`; :func:`run_labels`), each logging to
   ``runs/<run_id>/logs/<label>.log`` with the bootstrap address, the store DSN and its label in its
   environment; publish ``ServiceStarted`` for each on the run's ``control`` topic;
3. follow ``metrics``, ``control`` and ``weights``: live progress (or a ``stalled: ...`` line after
   ``run.stall_after_s`` without a step), healing (:mod:`launch.healing`: restarts with backoff,
   ``ServiceRestarted``; past ``run.max_restarts`` the run fails with ``ServiceFailed`` and one
   line), and ``runs/<run_id>/supervisor.json`` for ``rollstream status`` (:mod:`launch.state`);
4. past ``run.max_wall_s`` publish a ``Drain``; a run not finished :data:`WALL_GRACE_S` later fails;
5. on ``RunFinished``: SIGTERM the services that run until told to stop, in their stop waves; wait
   for every producer to exit, then tell the recorder (:data:`PRODUCERS_DONE`) and let it catch up;
   write ``summary.json`` (from the record; with ``store.record_live: false`` no recorder runs and
   it comes from the topics, :func:`launch.progress.tallies_of_topics`).

Ctrl-C (or SIGTERM) stops every service (SIGTERM, then SIGKILL after a grace period).
``--launcher ray`` uses this supervisor too: :mod:`launch.ray_launcher` subclasses it so that each
process is started by a Ray actor (:class:`ServiceProcess` is what the supervisor needs of one).
docs/architecture.md, "Services", tells more.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.markup import escape

from launch.healing import (
    Healer,
    ServiceSlot,
    describe_exit,
    last_error_line,
    last_log_line,
    mark_log,
    service_of,
)
from launch.prepare import (
    RunError,
    config_text,
    load_run_config,
    new_run_id,
    prepare_model,
    prepare_run,
    write_run_config,
)
from launch.progress import Progress, summarize, tallies_of_topics
from launch.runinfo import RunInfo, probe_run
from launch.state import write_state
from launch.status import WARM_UP_FACTOR, lag_services, stall_text
from launch.threads import torch_threads
from rollout.factory import SERVER_ENGINES, servers_down
from runtime.bus import Consumer, Producer
from schemas import events as ev
from schemas.config import RunConfig
from schemas.errors import one_line, to_thread
from schemas.services import SERVICES, ServiceSpec, in_start_order, stop_waves
from schemas.topics import topic_name
from store.runs import PRODUCERS_DONE, run_dir_of, store_dsn_of

__all__ = [
    "LABEL_ENV", "PRODUCERS_DONE", "Progress", "RunError", "Supervisor", "config_text", "judged", "last_log_line",
    "load_run_config", "multi_turn", "needed", "new_run_id", "prepare_model", "prepare_run", "run_dir_of",
    "run_labels", "run_supervised", "service_command", "store_dsn_of", "summarize", "write_run_config",
]

log = logging.getLogger("rollstream.supervisor")

STATE_EVERY_S = 2.0
"""How often ``supervisor.json`` is rewritten when nothing changed, seconds."""
LINE_EVERY_S = 5.0
"""How often the progress line is printed, seconds."""
WALL_GRACE_S = 600.0
"""After ``run.max_wall_s`` and the ``Drain`` it caused: how long the run may take to finish its
step under way and its final evaluation before it is stopped as failed, seconds."""
STALL_PROBE_EVERY_S = 30.0
"""While stalled: how often the broker is asked what each stage is doing, seconds."""
LABEL_ENV = "ROLLSTREAM_SERVICE_LABEL"
"""The environment variable that tells a service process its label (``judge0``...): a judge
worker's transactional id is made of it (:meth:`ServiceSpec.transactional_id`), stable across its
restarts."""


def service_command(name: str, run_id: str, runs_dir: str) -> list[str]:
    """The command line of one service process (``name``: the service, ``env`` for ``env0``)."""
    return [sys.executable, "-m", "cli", "service", name, "--run", run_id, "--runs-dir", runs_dir]


def produces(label: str) -> bool:
    """Whether the process ``label`` writes to the run's topics (all but the recorder)."""
    spec = SERVICES.get(service_of(label))
    return spec is None or bool(spec.produces)


def numbered(service: str, n: int) -> list[str]:
    """Labels of ``n`` processes of ``service``: ``[service]`` for one, ``service0``, ``service1``... for several."""
    return [f"{service}{i}" for i in range(n)] if n > 1 else [service]


def run_labels(cfg: RunConfig) -> list[str]:
    """Service labels of a run in start order (:func:`schemas.services.in_start_order`): each service
    the run needs (:func:`needed`), numbered when it has several processes (``rollout0``,
    ``rollout1``... for ``rollout.workers`` 2)."""
    return [label for spec in in_start_order() if needed(spec, cfg) for label in numbered(spec.name, spec.replicas(cfg))]


class ServiceProcess(Protocol):
    """What the supervisor uses of a service process: ``subprocess.Popen``, or a launcher's handle
    (:class:`launch.ray_launcher.RayProcess`)."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


def multi_turn(cfg: RunConfig) -> bool:
    """Whether a domain of ``cfg`` is multi-turn (its task source is also an environment)."""
    import envs  # registers the built-in sources and environments

    return bool(envs.episodic_domains(cfg))


def judged(cfg: RunConfig) -> bool:
    """Whether a domain of ``cfg`` has a judge (``data.domains[].judge``)."""
    from services.judge_worker import judged_domains

    return bool(judged_domains(cfg))


def needed(spec: ServiceSpec, cfg: RunConfig) -> bool:
    """Whether a run of ``cfg`` starts ``spec`` (:attr:`ServiceSpec.needed`: env workers only when a
    domain is multi-turn, judge workers only when a domain has a judge, the recorder only with
    ``store.record_live``)."""
    return {"always": lambda: True, "multi_turn": lambda: multi_turn(cfg), "judged": lambda: judged(cfg),
            "record_live": lambda: cfg.store.record_live}[spec.needed]()


class Supervisor:
    """The service processes of one run: started, followed, healed, stopped."""

    def __init__(self, cfg: RunConfig, run_id: str, bootstrap: str, console: Console) -> None:
        self.cfg = cfg
        self.run_id = run_id
        self.bootstrap = bootstrap
        self.console = console
        self.run_dir = run_dir_of(cfg, run_id)
        self.progress = Progress(steps=cfg.train.steps)
        r = cfg.run
        self.healer = Healer(max_restarts=r.max_restarts, backoff_s=r.restart_backoff_s,
                             backoff_max_s=r.restart_backoff_max_s)
        self.slots: list[ServiceSlot] = []
        self.procs: dict[str, ServiceProcess] = {}
        self.pending: list[ev.Event] = []
        """Lifecycle events not published yet (published by :meth:`follow`)."""
        self.phase = "starting"
        self.error = ""
        self.failure: str | None = None
        """The run's error line once a service failed for good."""
        self.started_at = time.time()
        self._env: dict[str, str] = {}
        self._state_at = 0.0
        self._stall_info: RunInfo | None = None
        self._stall_probe: asyncio.Task[RunInfo | None] | None = None
        self._servers_probe: asyncio.Task[dict[str, str]] | None = None
        self._servers_down: dict[str, str] = {}  # generation servers not answering, at the last probe
        self._wall_drained = False
        self._stall_probe_at = 0.0

    # ----------------------------------------------------------------- processes

    def labels(self) -> list[str]:
        """Service labels in start order (:func:`run_labels`)."""
        return run_labels(self.cfg)

    def threads_env(self, label: str) -> dict[str, str]:
        """The label and the torch threads of process ``label`` (:mod:`launch.threads`; an
        ``OMP_NUM_THREADS`` of our own environment wins)."""
        env = {LABEL_ENV: label}
        if "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(torch_threads(self.cfg, self.labels(), ray=self.ray)[label])
        return env

    ray = False
    """Whether the processes are Ray actors (their threads follow their placement)."""

    def host_of(self, slot: ServiceSlot) -> str:
        """The host ``slot``'s process runs on (this one; a launcher's supervisor may say another)."""
        return socket.gethostname()

    def start_children(self) -> None:
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        (self.run_dir / PRODUCERS_DONE).unlink(missing_ok=True)  # a resumed run is producing again
        # PYTHONHASHSEED: a few reasoning-gym generators iterate over sets, so the feeder and the
        # trainer agree on the held-out split only with one hash seed in every service
        self._env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=self.bootstrap, PYTHONUNBUFFERED="1",
                         ROLLSTREAM_STORE=store_dsn_of(self.cfg, self.run_id))
        self._env.setdefault("PYTHONHASHSEED", "0")
        for label in self.labels():
            slot = ServiceSlot(label, logs / f"{label}.log")
            if slot.log_path.exists() and slot.log_path.stat().st_size:  # a resumed run: its own process from here
                mark_log(slot.log_path, f"start of {label} (the run resumed)")
            self.slots.append(slot)
            self._spawn(slot)
            self.pending.append(ev.ServiceStarted(run_id=self.run_id, service=label, pid=slot.pid,
                                                  host=self.host_of(slot)))
        self.phase = "running"
        self.write_state()

    def _spawn(self, slot: ServiceSlot) -> None:
        with open(slot.log_path, "ab") as fh:
            proc = subprocess.Popen(service_command(slot.service, self.run_id, self.cfg.run.runs_dir), stdout=fh,
                                    stderr=subprocess.STDOUT, env={**self._env, **self.threads_env(slot.label)},
                                    start_new_session=True)
        self.procs[slot.label] = proc
        slot.pid, slot.state, slot.started_at = int(getattr(proc, "pid", 0) or 0), "running", time.time()

    def _restart(self, slot: ServiceSlot) -> None:
        previous = slot.pid
        slot.restarts += 1
        mark_log(slot.log_path, f"restart {slot.restarts} of {slot.label} (pid {previous} "
                 f"{describe_exit(slot.last_exit_code)}; waited {slot.backoff_s:g} s)")
        self._spawn(slot)
        log.info("restarted %s: pid %d (restart %d)", slot.label, slot.pid, slot.restarts)
        self.pending.append(ev.ServiceRestarted(
            run_id=self.run_id, service=slot.label, pid=slot.pid, exit_code=int(slot.last_exit_code or 0),
            restarts=slot.restarts, reason=slot.reason, backoff_s=slot.backoff_s, previous_pid=previous))
        self.console.print(f"[yellow]restarted {slot.label}[/yellow] (pid {slot.pid}, restart "
                           f"{slot.restarts}/{self.healer.max_restarts})")
        self.write_state()

    def check_children(self) -> None:
        """Notice services that ended, judge their exits, restart the ones whose backoff is over;
        a service past its restarts sets :attr:`failure`."""
        finished = self.progress.finished is not None
        for slot in self.slots:
            proc = self.procs.get(slot.label)
            verdict = None
            code = proc.poll() if slot.state == "running" and proc is not None else None
            if code is not None:
                verdict = self.healer.on_exit(slot, int(code), last_error_line(slot.log_path, last_process_only=True),
                                              finished)
            elif slot.state == "exited":
                verdict = self.healer.recheck(slot, finished)
            if verdict is not None:
                self._noted(slot, verdict)
            if self.healer.due(slot) and self.failure is None:
                self._restart(slot)

    def _noted(self, slot: ServiceSlot, verdict: str) -> None:
        log.info("service %s: %s -> %s", slot.label, slot.reason, verdict)
        if verdict == "restart":
            self.console.print(f"[yellow]service {escape(slot.label)} {escape(slot.reason)}[/yellow]; restarting "
                               f"in {slot.backoff_s:g} s")
        elif verdict == "fail" and self.failure is None:
            self.failure = self.healer.failure_line(slot)
            self.pending.append(ev.ServiceFailed(run_id=self.run_id, service=slot.label, pid=slot.pid,
                                                 exit_code=int(slot.last_exit_code or 0), restarts=slot.restarts,
                                                 reason=slot.reason))
        self.write_state()

    def terminate(self, names: tuple[str, ...] | None = None, grace_s: float = 30.0) -> None:
        """SIGTERM the running services (of ``names``, else all), SIGKILL after ``grace_s``."""
        targets = [(s, self.procs[s.label]) for s in self.slots
                   if s.label in self.procs and self.procs[s.label].poll() is None
                   and (names is None or s.service in names)]
        for _, proc in targets:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for slot, proc in targets:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            slot.state, slot.last_exit_code = "stopped", proc.returncode
        for slot in self.slots:  # the others that ended meanwhile ended by themselves
            ended = self.procs.get(slot.label)
            if slot.state == "running" and ended is not None and ended.poll() is not None:
                slot.state, slot.last_exit_code = "exited", ended.returncode
            elif slot.state == "restarting":  # its restart is called off
                slot.state = "stopped"
        self.write_state()

    def wait_producers(self, timeout_s: float = 60.0) -> None:
        """Wait (up to ``timeout_s``) for every service that produces to exit (all but the recorder:
        trainer and feeder end by themselves on ``RunFinished``), then write :data:`PRODUCERS_DONE`
        (not if one runs on)."""
        deadline = time.monotonic() + timeout_s
        try:
            for proc in [p for label, p in self.procs.items() if produces(label)]:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return  # the recorder falls back to waiting for quiet topics
        (self.run_dir / PRODUCERS_DONE).touch()

    def wait_recorder(self, timeout_s: float = 120.0) -> None:
        """Wait (up to ``timeout_s``) for the services that produce nothing (the recorder) to catch up
        and exit by themselves; SIGTERM them after that."""
        deadline = time.monotonic() + timeout_s
        for slot in [s for s in self.slots if not produces(s.label) and s.label in self.procs]:
            proc = self.procs[slot.label]
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.terminate((slot.service,))
            if slot.state == "running" and proc.poll() is not None:
                slot.state, slot.last_exit_code = "exited", proc.returncode

    # ----------------------------------------------------------------- state

    def snapshot(self) -> dict[str, Any]:
        """What ``supervisor.json`` holds (:mod:`launch.state`)."""
        p = self.progress
        return {
            "run_id": self.run_id, "supervisor_pid": os.getpid(), "host": socket.gethostname(),
            "bootstrap": self.bootstrap, "phase": self.phase, "error": self.error,
            "started_at": self.started_at, "updated_at": time.time(),
            "progress": {"step": p.step, "steps": p.steps, "policy_version": p.policy_version,
                         "last_progress_at": p.last_progress_ts, "draining": p.draining},
            "services": {s.label: s.as_dict() for s in self.slots},
        }

    def write_state(self) -> None:
        try:
            write_state(self.run_dir, self.snapshot())
        except OSError as e:  # a full disk must not stop the run
            log.warning("cannot write %s: %s", self.run_dir / "supervisor.json", one_line(e))
        self._state_at = time.monotonic()

    # ----------------------------------------------------------------- following the run

    async def _publish(self, producer: Producer) -> None:
        topic = topic_name(self.run_id, "control")
        while self.pending:
            event = self.pending.pop(0)
            try:
                await asyncio.wait_for(producer.send_and_wait(topic, event), timeout=30)
            except Exception as e:  # the record misses it; the run goes on
                log.warning("could not publish %s: %s", type(event).__name__, one_line(e))

    def _stall_line(self) -> str | None:
        """``stalled: ...`` once no training step happened for ``run.stall_after_s`` (asks the
        broker what each stage is doing, at most every ``STALL_PROBE_EVERY_S``)."""
        idle = self.progress.idle_s()
        limit = self.cfg.run.stall_after_s
        if idle < limit * (1 if self.progress.policy_version >= 0 else WARM_UP_FACTOR):
            return None
        probe = self._stall_probe
        if probe is not None and probe.done():
            self._stall_info = None if probe.cancelled() or probe.exception() else probe.result()
            self._stall_probe = None
        if self._stall_probe is None and time.monotonic() - self._stall_probe_at > STALL_PROBE_EVERY_S:
            self._stall_probe_at = time.monotonic()
            self._stall_probe = asyncio.create_task(probe_run(self.cfg.kafka, self.bootstrap, self.run_id))
            r = self.cfg.rollout
            if r.engine in SERVER_ENGINES:
                self._servers_probe = asyncio.create_task(servers_down(r.server_urls))
        down = self._servers_probe
        if down is not None and down.done():
            self._servers_down = {} if down.cancelled() or down.exception() else down.result()
            self._servers_probe = None
        info, now = self._stall_info, time.time()
        services = {s.label: s.as_dict() for s in self.slots}
        text = stall_text(
            idle_s=idle, stall_after_s=limit, any_weights=self.progress.policy_version >= 0,
            lags={s: info.lag(s) if info else None for s in lag_services(services)},
            feeder_idle_s=(now - info.last_task_ts) if info and info.last_task_ts else None,
            tasks_issued=info.tasks_issued if info else 0, services=services, draining=self.progress.draining,
            servers_down=self._servers_down)
        if info is None:
            text = (text or "").split("; ", 1)[0] + " (asking the broker what each stage does...)"
        return f"stalled: {text}"

    async def follow(self, stop: asyncio.Event) -> None:
        """Consume metrics/control/weights until RunFinished, a failed service, ``stop`` or the
        wall limit; heal the services and keep the state file current meanwhile."""
        topics = [topic_name(self.run_id, n) for n in ("metrics", "control", "weights")]
        consumer = Consumer(self.cfg.kafka, self.bootstrap, group_id=None, topics=topics,
                            auto_offset_reset="earliest", client_suffix="supervisor",
                            fetch_min_bytes=64 * 1024)  # progress: up to 0.5 s late is fine
        producer = Producer(self.cfg.kafka, self.bootstrap)
        await consumer.start()
        await producer.start()
        last_line = 0.0
        try:
            while not stop.is_set():
                for rec in await consumer.getmany(timeout_ms=500):
                    if rec.event is not None:
                        self.progress.observe(rec.event)
                await self._publish(producer)
                if self.progress.finished is not None:
                    self.phase = "finishing"
                    return
                self.check_children()
                if self.failure is not None:
                    await self._publish(producer)
                    raise RunError(self.failure)
                await self._wall_limit(producer)
                if time.monotonic() - last_line > LINE_EVERY_S:
                    line = self._stall_line()
                    self.console.print(escape(line) if line else self.progress.line())
                    last_line = time.monotonic()
                if time.monotonic() - self._state_at > STATE_EVERY_S:
                    self.write_state()
        finally:
            for task in (self._stall_probe, self._servers_probe):
                if task is not None:
                    task.cancel()
            await producer.stop()
            await consumer.stop()

    async def _wall_limit(self, producer: Producer) -> None:
        """Past ``run.max_wall_s``: drain the run once; past the grace after that: fail it."""
        limit = self.cfg.run.max_wall_s
        elapsed = time.monotonic() - self.progress.started
        if elapsed <= limit:
            return
        if not self._wall_drained:
            self._wall_drained = True
            reason = f"run.max_wall_s={limit:g}s reached"
            self.console.print(f"{reason}: draining the run (no step starts now; final evaluation follows)")
            drain = ev.Drain(run_id=self.run_id, reason=reason, origin="supervisor")
            await producer.send_and_wait(topic_name(self.run_id, "control"), drain)
        elif elapsed > limit + WALL_GRACE_S:
            raise RunError(f"run exceeded run.max_wall_s={limit:g}s and did not finish within {WALL_GRACE_S:g}s "
                           "of the drain; stopped")


async def run_supervised(cfg: RunConfig, run_id: str, bootstrap: str, console: Console, *,
                         on_run_dir: Callable[[Path], None] | None = None,
                         make_supervisor: Callable[[RunConfig, str, str, Console], Supervisor] | None = None,
                         ) -> dict[str, Any]:
    """Everything of ``rollstream run`` after config parsing. Returns the summary.
    ``make_supervisor``: another launcher's supervisor (``--launcher ray``), default :class:`Supervisor`."""
    run_dir = run_dir_of(cfg, run_id)
    await prepare_run(cfg, run_id, bootstrap, console, on_run_dir=on_run_dir)
    sup = (make_supervisor or Supervisor)(cfg, run_id, bootstrap, console)
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
    except RunError as e:
        sup.error = str(e)
        raise
    finally:
        if ok:
            # the services that finish exit on RunFinished; the others run until told to stop, in waves
            # (env and judge workers after the rollout and reward workers that may still wait on them)
            for wave in stop_waves():
                await to_thread(sup.terminate, wave)
            await to_thread(sup.wait_producers)
            await to_thread(sup.wait_recorder)
        else:
            console.print("[yellow]stopping the services...[/yellow]")
        await to_thread(sup.terminate, None)
        from weights.shm import remove_segments, segment_prefix  # here: weights imports torch

        remove_segments(segment_prefix(run_dir))  # the trainer's shared-memory weights (train.weights_handoff)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if not ok:
            sup.phase = "interrupted" if stop.is_set() and not sup.error else "failed"
            sup.error = sup.error or f"run {run_id} {'interrupted' if stop.is_set() else 'stopped before it finished'}"
            sup.write_state()
    if not ok:
        why = "interrupted" if stop.is_set() else "stopped before it finished"
        raise RunError(f"run {run_id} {why}; every service was stopped (logs: {run_dir / 'logs'})")
    wall_s = time.monotonic() - t0
    # without a live record the summary counts the run's topics (launch.record: `rollstream record` builds it)
    tallies = None if cfg.store.record_live else await tallies_of_topics(cfg.kafka, bootstrap, run_id)
    summary = summarize(cfg, run_id, sup.progress, wall_s, tallies)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    sup.phase = "finished"
    sup.write_state()
    return summary

