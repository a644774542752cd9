"""``rollstream status RUN``: where a run stands, from another terminal, during the run and after.

It combines the supervisor's state file (``runs/<run_id>/supervisor.json``,
:mod:`launch.state`: each service's state, pid, restarts, last exit code and error line,
and whether the supervisor itself is still alive) with what the broker says
(:mod:`launch.runinfo`: consumer lag per service group, the trainer's step and policy
version, the feeder's last task, the run's control history), and names a stall: no training
step for ``run.stall_after_s`` seconds, with what every stage is doing. A run that ended before it
finished (``interrupted``, ``failed``, or ``abandoned``: its supervisor gone) gets the command that
resumes it (``resume``). On a finished run the lag is what was left at the end (the trainer's:
samples scored after its last step, never trained), which is normal, and the table says so.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from launch.healing import service_of
from launch.runinfo import RunInfo, probe_run
from launch.runs import resume_command
from launch.state import pid_alive, read_state
from rollout.factory import servers_down
from runtime.probe import NO_BROKER
from schemas.config import KafkaSettings
from schemas.errors import one_line
from schemas.services import SERVICES, in_start_order

WARM_UP_FACTOR = 5
"""Before the first weights version (the trainer's supervised warm-up) a stall takes this many
times ``run.stall_after_s``."""


def start_rank(service: str) -> int:
    """Where ``service`` starts among the run's services (an unknown one last)."""
    spec = SERVICES.get(service)
    return spec.start_order if spec is not None else len(SERVICES)


def lag_named(service: str) -> bool:
    """Whether a stall line names the lag of ``service``'s group (:attr:`ServiceSpec.lag_label`)."""
    return service in SERVICES and bool(SERVICES[service].lag_label)


def optional(service: str) -> bool:
    """Whether a run starts ``service`` only for some domains (env: multi-turn, judge: judged)."""
    return SERVICES[service].needed != "always"


def lag_services(services: Iterable[str]) -> list[str]:
    """The services whose lag a stall names for a run with these service labels, in the order a
    sample flows: the optional ones (``env``, ``judge``) only when the run has them."""
    present = {service_of(label) for label in services}
    return [s for s in SERVICES if lag_named(s) and (not optional(s) or s in present)]


def ago(ts: float | None, now: float) -> float | None:
    return None if ts is None else max(0.0, now - ts)


def stall_text(*, idle_s: float, stall_after_s: float, any_weights: bool, lags: dict[str, int | None],
               feeder_idle_s: float | None, tasks_issued: int, services: dict[str, dict[str, Any]],
               draining: str = "", drain_age_s: float | None = None,
               servers_down: dict[str, str] | None = None) -> str | None:
    """One line naming a stall (``None``: the run is not stalled): no training step (no new
    weights version) for ``idle_s`` >= ``stall_after_s`` seconds (before the first weights
    version, the trainer's warm-up, ``WARM_UP_FACTOR`` times as long), then what each stage
    shows: the lag of the rollout, reward and trainer groups (and of the env and judge workers' when
    ``lags`` has ``env`` / ``judge``), how long the feeder has issued nothing, the services not running, a drain
    under way, and the generation servers that do not answer (``servers_down``: URL -> why)."""
    if idle_s < stall_after_s * (1 if any_weights else WARM_UP_FACTOR):
        return None
    parts = [f"no training step for {idle_s:.0f} s" if any_weights
             else f"no weights published {idle_s:.0f} s after the start (trainer still warming up?)"]
    seen = [f"{SERVICES[s].lag_label} {'?' if lags.get(s) is None else lags[s]}" for s in SERVICES
            if lag_named(s) and (not optional(s) or s in lags)]
    parts.append(", ".join(seen))
    if feeder_idle_s is None:
        parts.append("feeder has issued no task yet")
    elif feeder_idle_s >= min(stall_after_s, 30.0):
        parts.append(f"feeder has issued nothing for {feeder_idle_s:.0f} s ({tasks_issued} tasks in all)")
    down = [f"{label} {s['state']}" + (f" ({s['restarts']} restarts)" if s.get("restarts") else "")
            for label, s in services.items() if s.get("state") not in ("running", "exited", "stopped", "unknown", None)]
    if down:
        parts.append("; ".join(down))
    if servers_down:
        parts.append("; ".join(f"generation server {url} not answering ({why}; rollout.server_urls)"
                               for url, why in servers_down.items()))
    if draining:
        parts.append(f"draining ({draining})" + (f" for {drain_age_s:.0f} s" if drain_age_s is not None else ""))
    return "; ".join(parts)


def phase_of(state: dict[str, Any] | None, sup_alive: bool, info: RunInfo | None) -> str:
    """``starting``, ``running``, ``draining``, ``finished``, ``stopped`` (finished after
    someone's Drain), ``failed``, ``interrupted``, or ``abandoned`` (the supervisor is gone
    before the run finished)."""
    if info is not None and info.finished is not None:
        if info.finished.status == "stopped" or any(d.origin != "trainer" for d in info.drains):
            return "stopped"
        return "finished" if info.finished.status == "completed" else info.finished.status
    recorded = (state or {}).get("phase")
    if recorded in ("failed", "interrupted"):
        return str(recorded)
    if state is not None and not sup_alive and recorded != "finished":
        return "abandoned"
    if info is not None and info.drains:
        return "draining"
    if info is not None and info.started is not None:
        return "running"
    return str(recorded or "starting")


async def gather(run_id: str, run_dir: Path, *, bootstrap: str | None, kafka: KafkaSettings,
                 steps: int | None, stall_after_s: float, timeout_s: float = 20.0,
                 server_urls: Sequence[str] = ()) -> dict[str, Any]:
    """The status of ``run_id`` as a JSON-able dict (what ``--format json`` prints); a stall of a
    run with ``server_urls`` (a server engine's) names those that do not answer."""
    now = time.time()
    state = read_state(run_dir)
    sup_pid = int((state or {}).get("supervisor_pid") or 0)
    sup_alive = pid_alive(sup_pid)
    info: RunInfo | None = None
    kafka_error = ""
    if bootstrap:
        try:
            info = await probe_run(kafka, bootstrap, run_id, timeout_s=timeout_s)
        except TimeoutError:
            kafka_error = f"Kafka at {bootstrap} did not answer within {timeout_s:g} s"
        except Exception as e:
            kafka_error = one_line(e)
    else:
        kafka_error = NO_BROKER
    progress = (state or {}).get("progress") or {}
    services: dict[str, dict[str, Any]] = {}
    for label, s in sorted(((state or {}).get("services") or {}).items(),
                           key=lambda kv: (start_rank(service_of(kv[0])), kv[0])):
        alive = pid_alive(s.get("pid"))
        st_ = s.get("state")
        if (st_ == "running" and not alive) or (st_ == "restarting" and not sup_alive):
            st_ = "gone"  # it died after the supervisor, or the supervisor died before restarting it
        services[label] = {**s, "state": st_, "alive": alive}
    if not services and info is not None:  # no supervisor (services started one by one)
        services = {s.name: {"state": "unknown"} for s in in_start_order() if s.name in info.lags or not s.grouped}
    if info is not None:
        for label, s in services.items():
            svc = service_of(label)
            s["lag"] = info.lags.get(svc) if svc in SERVICES and SERVICES[svc].grouped else None
            s["restarts"] = max(int(s.get("restarts") or 0), info.restarts.get(label, 0))
    w = info.weights if info else None
    t = info.train_step if info else None
    started_ts = (info.started.ts if info and info.started else None) or (state or {}).get("started_at")
    last_ts = (info.last_progress_ts if info else None) or progress.get("last_progress_at")
    idle = ago(last_ts or started_ts, now)
    phase = phase_of(state, sup_alive, info)
    drain = info.drains[0] if info and info.drains else None
    report: dict[str, Any] = {
        "run_id": run_id,
        "run_dir": str(run_dir),
        "phase": phase,
        "finished": info.as_dict()["finished"] if info else None,
        "error": (state or {}).get("error", ""),
        "supervisor": ({"pid": sup_pid, "alive": sup_alive, "phase": state.get("phase"),
                        "updated_s_ago": ago(state.get("updated_at"), now)} if state else None),
        "step": (t.step + 1) if t else progress.get("step"),
        "steps": steps or progress.get("steps"),
        "policy_version": w.policy_version if w else progress.get("policy_version"),
        "reward_mean": t.metrics.get("rollout/reward_mean") if t else None,
        "last_progress_s_ago": ago(last_ts, now),
        "started_s_ago": ago(started_ts, now),
        "draining": drain.reason if drain else "",
        "feeder": {"tasks_issued": info.tasks_issued if info else None,
                   "last_issued_s_ago": ago(info.last_task_ts, now) if info else None},
        "services": services,
        "kafka": {"bootstrap": bootstrap, "topics": info is not None, "error": kafka_error},
        "stall": None,
        "servers_down": {},
        "store": store_line(run_dir, now),
        "resume": None,
    }
    # a run that ended before it finished (Ctrl-C, a failed service, its supervisor killed) resumes
    # where it stopped; one with RunFinished on the record or a summary has nothing left to do
    if (phase in ("interrupted", "failed", "abandoned") and not sup_alive and not (info and info.finished)
            and not (run_dir / "summary.json").exists()):
        report["resume"] = resume_command(run_id, run_dir.parent)
    if info is not None and phase in ("running", "draining", "starting", "abandoned") and idle is not None:
        down = await servers_down(server_urls) if server_urls else {}
        report["servers_down"] = down
        report["stall"] = stall_text(
            idle_s=idle, stall_after_s=stall_after_s, any_weights=w is not None,
            lags={s: info.lag(s) for s in lag_services(services)}, feeder_idle_s=ago(info.last_task_ts, now),
            tasks_issued=info.tasks_issued, services=services, draining=report["draining"],
            drain_age_s=ago(drain.ts, now) if drain else None, servers_down=down)
    return report


def store_line(run_dir: Path, now: float) -> str:
    """The recorder's word on its store (``recorder_store.json``): ``store: unreachable for 42 s
    (recorder retrying ...)`` or ``store: up ...``; empty when the recorder published nothing."""
    from store.outage import OUTAGE_FILE, StoreOutage, describe_outage

    try:
        outage = msgspec.json.decode((run_dir / OUTAGE_FILE).read_bytes(), type=StoreOutage)
    except (OSError, msgspec.DecodeError):
        return ""
    return describe_outage(outage, now)


def _fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} s"


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def render(report: dict[str, Any], console: Console) -> None:
    """The status as a few lines and a table of services."""
    sup = report["supervisor"]
    phase = report["phase"]
    ended = phase in ("finished", "stopped", "failed", "interrupted")
    who = ("no supervisor state (services started one by one?)" if sup is None
           else f"supervisor pid {sup['pid']} {'alive' if sup['alive'] else 'exited' if ended else 'gone'}")
    color = {"running": "green", "finished": "green", "stopped": "yellow", "draining": "yellow"}.get(phase, "red")
    console.print(f"run {escape(report['run_id'])}: [{color}]{phase}[/{color}] ({who})")
    if report["finished"]:
        console.print(f"  finished: {report['finished']['status']}")
    if report["resume"]:
        console.print(f"  [red]interrupted before it finished[/red]: resume it with `{escape(report['resume'])}`")
    if report["error"]:
        console.print(f"  error: {escape(report['error'])}")
    step = report["step"] if report["step"] is not None else 0
    steps = report["steps"] if report["steps"] is not None else "?"
    version = report["policy_version"]
    console.print(f"  trainer: step {step}/{steps}, policy version "
                  f"{'-' if version is None else version}, last step {_fmt_s(report['last_progress_s_ago'])} ago")
    if report.get("store"):
        color = "yellow" if "unreachable" in report["store"] else "green"
        console.print(f"  [{color}]{escape(report['store'])}[/{color}]")
    f = report["feeder"]
    if f["tasks_issued"] is not None:
        console.print(f"  feeder: {f['tasks_issued']} tasks issued, last {_fmt_s(f['last_issued_s_ago'])} ago")
    if report["draining"] and phase == "draining":
        console.print(f"  draining: {escape(report['draining'])}")
    k = report["kafka"]
    if k["error"]:
        console.print(f"  [yellow]kafka {escape(str(k['bootstrap'] or ''))}: {escape(k['error'])}[/yellow]")
    if not console.is_terminal:  # a pipe or a file: no need to fit 80 columns
        console = Console(file=console.file, width=200, highlight=False, soft_wrap=True)
    room = max(24, console.width - 72)
    table = Table(box=None, pad_edge=False)
    for col in ("service", "state", "pid", "restarts", "last exit", "lag", "last error"):
        table.add_column(col, no_wrap=col != "lag")
    for label, s in report["services"].items():
        lag = s.get("lag")
        lag_text = "-" if not lag else ", ".join(f"{t} {n}" for t, n in lag.items() if n) or "0"
        if lag and lag_text != "0" and phase in ("finished", "stopped"):
            lag_text += " (left at the end: normal)"  # e.g. samples scored after the last step
        elif lag and service_of(label) == "trainer" and lag_text != "0":
            lag_text += " (since its checkpoint)"  # the trainer commits with its checkpoints
        code = s.get("last_exit_code")
        table.add_row(label, str(s.get("state", "")), str(s.get("pid") or "-"), str(s.get("restarts", 0)),
                      "-" if code is None else str(code), lag_text, escape(_cut(str(s.get("last_error") or ""), room)))
    console.print(table)
    orphans = [f"{label} (pid {s['pid']})" for label, s in report["services"].items() if s.get("alive")]
    if sup is not None and not sup["alive"] and orphans:
        console.print(f"[yellow]the supervisor is gone; still running:[/yellow] {', '.join(orphans)}")
    if report["stall"]:
        console.print(f"[yellow]stalled:[/yellow] {escape(report['stall'])}")
