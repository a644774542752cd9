"""``rollstream status RUN`` and ``rollstream stop RUN``: watch and stop a run from another
terminal (:mod:`launch.status`, :mod:`launch.stop`). ``status`` exits :data:`INTERRUPTED_EXIT`
for a run that ended before it finished. ``rollstream record RUN`` builds a run's record from its
topics (:mod:`launch.record`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer

from cli.app import UserError, app, console, find_broker, friendly, opt, out

INTERRUPTED_EXIT = 3
"""``rollstream status``'s exit status for a run that ended before it finished (it can be resumed)."""


def _run_files(run: str, runs_dir: Path) -> tuple[Path, Any, dict[str, Any] | None]:
    """``(run_dir, config or None, supervisor state or None)`` of ``run``."""
    from launch.prepare import RunError, load_run_config
    from launch.state import read_state
    from schemas.topics import check_run_id

    check_run_id(run)
    run_dir = runs_dir.resolve() / run
    cfg = None
    if (run_dir / "config.yaml").is_file():
        try:
            cfg = load_run_config(str(runs_dir), run, [])
        except RunError as e:
            raise UserError(str(e)) from None
    return run_dir, cfg, read_state(run_dir)


def _bootstrap(cfg: Any, state: dict[str, Any] | None) -> str | None:
    """The broker by :func:`cli.app.find_broker`, where the run's configured address is the Kafka
    its supervisor used, else kafka.bootstrap of its config (never started here)."""
    return find_broker(str((state or {}).get("bootstrap") or "") or (cfg.kafka.bootstrap if cfg else None))


def _kafka(cfg: Any) -> Any:
    import msgspec

    from schemas.config import KafkaSettings

    kafka = cfg.kafka if cfg is not None else KafkaSettings()
    return msgspec.structs.replace(kafka, connect_timeout_s=min(kafka.connect_timeout_s, 10.0))


def _unknown_run_quickly(run: str, runs_dir: Path, cfg: Any, state: dict[str, Any] | None,
                         bootstrap: str | None) -> None:
    """A run with no folder here is looked up on Kafka only: answer in seconds when no broker
    answers there (instead of waiting out the client's connect timeout)."""
    if cfg is not None or state is not None or not bootstrap:
        return
    from infra.kafka import broker as stack

    if not stack.kafka_reachable(bootstrap, timeout_s=3):
        raise UserError(f"run {run} not found: no {runs_dir / run / 'config.yaml'}, and no Kafka broker answers "
                        f"at {bootstrap} to look for its topics")


def _missing(run: str, runs_dir: Path, bootstrap: str | None) -> UserError:
    where = f" and no topics on the broker at {bootstrap}" if bootstrap else ""
    return UserError(f"run {run} not found: no {runs_dir / run / 'config.yaml'}{where}")


@app.command("status")
@friendly
def status_cmd(
    run: str = typer.Argument(..., help="Run id."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Directory of run folders."),
    fmt: str = typer.Option("table", "--format", help="table or json."),
) -> None:
    """Where a run stands, during the run or after it: each service's state, pid, restarts, last exit code and last error line (from runs/<run>/supervisor.json, which `rollstream run` keeps current), the consumer lag of each service's group, the trainer's step and policy version and the time since the last one; a stall is named with what each stage shows.

    Kafka is --bootstrap / ROLLSTREAM_BOOTSTRAP when given, else the one the run's supervisor used, else kafka.bootstrap of the run's config, else the local broker.

    Exit status 3 when the run ended before it finished (interrupted, failed, or its supervisor gone): the output then names the command that resumes it (`rollstream resume RUN`, also "resume" in --format json).
    """
    import asyncio
    import json

    from launch.status import gather, render
    from rollout.factory import SERVER_ENGINES

    if fmt not in ("table", "json"):
        raise UserError(f"--format {fmt!r}: one of table, json")
    run_dir, cfg, state = _run_files(run, runs_dir)
    bootstrap = _bootstrap(cfg, state)
    if cfg is None and state is None and not bootstrap:
        raise _missing(run, runs_dir, None)
    _unknown_run_quickly(run, runs_dir, cfg, state, bootstrap)
    report = asyncio.run(gather(
        run, run_dir, bootstrap=bootstrap, kafka=_kafka(cfg), steps=cfg.train.steps if cfg else None,
        stall_after_s=cfg.run.stall_after_s if cfg else 120.0,
        server_urls=cfg.rollout.server_urls if cfg and cfg.rollout.engine in SERVER_ENGINES else ()))
    if cfg is None and state is None and not report["kafka"]["topics"]:
        if report["kafka"]["error"]:
            raise UserError(f"run {run} not found in {runs_dir} and Kafka did not tell: {report['kafka']['error']}")
        raise _missing(run, runs_dir, bootstrap)
    if fmt == "json":
        out.print(json.dumps(report, default=str), markup=False, soft_wrap=True)
    else:
        render(report, out)
    if report["resume"]:
        raise typer.Exit(INTERRUPTED_EXIT)


@app.command("stop")
@friendly
def stop_cmd(
    run: str = typer.Argument(..., help="Run id."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Directory of run folders."),
    no_wait: bool = typer.Option(False, "--no-wait", help="Publish the drain and return at once."),
    timeout: float = typer.Option(600.0, "--timeout", help="Longest wait for the run to finish, seconds."),
    reason: str = typer.Option("stopped by user", "--reason", help="Reason recorded with the drain."),
) -> None:
    """Stop a run gracefully: publish Drain on its control topic (the feeder stops issuing tasks, in-flight samples end, the run finishes and `rollstream run` writes its summary), then wait until RunFinished appears (at most --timeout seconds). A run that already finished is left alone.

    Kafka is found as for `rollstream status`.
    """
    import asyncio

    from launch.state import pid_alive, read_state
    from launch.stop import NoSuchRun, StopOutcome, stop_run
    from runtime.probe import NO_BROKER

    run_dir, cfg, state = _run_files(run, runs_dir)
    bootstrap = _bootstrap(cfg, state)
    if not bootstrap:
        if cfg is None and state is None:
            raise _missing(run, runs_dir, None)
        raise UserError(NO_BROKER)
    _unknown_run_quickly(run, runs_dir, cfg, state, bootstrap)
    steps = cfg.train.steps if cfg else None
    t0 = time.monotonic()

    def progress(o: StopOutcome, elapsed: float) -> None:
        at = f"step {o.step}/{steps if steps else '?'}" if o.policy_version >= 0 else "no weights yet"
        console.print(f"stopping {run}: waiting for RunFinished ({elapsed:.0f} s; trainer at {at})")

    try:
        outcome = asyncio.run(stop_run(_kafka(cfg), bootstrap, run, reason=reason, wait=not no_wait,
                                       timeout_s=timeout, progress=progress))
    except NoSuchRun:
        raise _missing(run, runs_dir, bootstrap) from None
    if outcome.already_finished:
        assert outcome.finished is not None
        out.print(f"run {run} already finished ({outcome.finished.status}); nothing to stop")
        return
    if no_wait:
        out.print(f"run {run}: drain published on its control topic ({reason}); "
                  f"`rollstream status {run}` follows it")
        return
    if outcome.finished is None:
        raise UserError(f"run {run} did not finish within {timeout:g} s of the drain (it stays on the control "
                        f"topic); `rollstream status {run}` shows what it waits for")
    out.print(f"run {run} finished ({outcome.finished.status}) {outcome.waited_s:.0f} s after the drain, "
              f"at step {outcome.step}" + (f"/{steps}" if steps else ""))
    # the supervisor, when one runs, writes the summary next
    deadline = t0 + timeout
    while state is not None and pid_alive(state.get("supervisor_pid")) and time.monotonic() < deadline:
        if (run_dir / "summary.json").exists():
            break
        time.sleep(0.5)
        state = read_state(run_dir)
    if (run_dir / "summary.json").exists():
        out.print(f"summary: {run_dir / 'summary.json'}")


@app.command("record")
@friendly
def record_cmd(
    run: str = typer.Argument(..., help="Run id."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Directory of run folders (where the default store is)."),
    from_log: Path | None = typer.Option(None, "--from-log", help="Read the run's topics from a copy of the broker's log directory (log.dirs; a local stack's <home>/kafka/data), or from an archive of `rollstream runs export-log`, instead of from a broker: on a machine with no broker and no Java."),
    fmt: str = typer.Option("table", "--format", help="table or json."),
) -> None:
    """Build a run's record (the ClickHouse store) from its topics, as the live recorder would have: for a run with store.record_live=false, or to complete a record. Reads every topic of the run to its end with the recorder's own code and stops; running it again adds only what the store lacks.

    The store is --store / ROLLSTREAM_STORE when given, else store.dsn of the run's config, else <runs-dir>/<run>/store (made when missing, also on a machine without the run's folder). Kafka is found as for `rollstream status`. Topics keep their events for 7 days (retention.ms): record before that. With --from-log no broker is asked: the segment files are read as a read_committed consumer reads them (aborted transactions left out).
    """
    import asyncio
    import json

    from launch.record import record_log, record_run
    from runtime.probe import NO_BROKER
    from store.runs import record_dsn

    if fmt not in ("table", "json"):
        raise UserError(f"--format {fmt!r}: one of table, json")
    _, cfg, state = _run_files(run, runs_dir)

    def progress(line: str) -> None:
        console.print(f"recording {run}: {line}")

    if from_log is not None:
        dsn = record_dsn(runs_dir, run, opt("store"))
        result = asyncio.run(record_log(from_log, run, dsn, progress=progress))
    else:
        bootstrap = _bootstrap(cfg, state)
        if not bootstrap:
            raise UserError(NO_BROKER)
        from infra.kafka import broker as stack

        if not stack.kafka_reachable(bootstrap, timeout_s=5):
            raise UserError(f"no Kafka broker answers at {bootstrap} (the broker that holds the run's topics: --bootstrap)")
        dsn = record_dsn(runs_dir, run, opt("store"))
        result = asyncio.run(record_run(_kafka(cfg), bootstrap, run, dsn, progress=progress))
    if fmt == "json":
        out.print(json.dumps(result.to_dict()), markup=False, soft_wrap=True)
    else:
        tables = ", ".join(f"{t} {n}" for t, n in sorted(result.tables.items()) if n and t != "events")
        out.print(f"recorded run {run} into {result.dsn}: {result.events} events from {result.messages} Kafka records "
                  f"({result.skipped} already stored) in {result.wall_s:.1f} s" + (f"; {tables}" if tables else ""))
    if result.trimmed:
        console.print(f"[yellow]warning:[/yellow] retention had deleted {result.trimmed} Kafka records of the run "
                      "before this read: the record lacks their events")
    if not result.finished:
        console.print(f"[yellow]warning:[/yellow] no RunFinished on the run's topics (it runs, or ended before it "
                      f"finished): the record holds its events so far; `rollstream record {run}` again adds the rest")
