"""``rollstream runs list|rm|export-log``, ``rollstream logs RUN [SERVICE]`` and ``rollstream export RUN DIR``:
the runs of a runs directory, their logs and their models (:mod:`launch.runs`)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.markup import escape

from cli.app import UserError, app, find_broker, friendly, out

runs_app = typer.Typer(help="List and delete runs.", no_args_is_help=True)
app.add_typer(runs_app, name="runs")

RUNS_DIR = typer.Option(Path("runs"), "--runs-dir", help="Directory of run folders.")


def _run_dir(run: str, runs_dir: Path) -> Path:
    """``runs_dir/run``, which must be a run folder (holds ``config.yaml``)."""
    from schemas.topics import check_run_id

    check_run_id(run)
    run_dir = runs_dir.resolve() / run
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"run {run} not found: no {runs_dir / run / 'config.yaml'} (`rollstream runs list` lists runs)")
    return run_dir


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def _wall(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.1f} min" if s >= 60 else f"{s:.0f} s"


@runs_app.command("list")
@friendly
def runs_list(
    runs_dir: Path = RUNS_DIR,
    fmt: str = typer.Option("table", "--format", help="table or json."),
) -> None:
    """Every run of the runs directory, oldest first: id, name (run.name), state (running, finished, stopped, failed, interrupted, prepared), training steps done / train.steps, final held-out accuracy, wall time and disk use."""
    import json

    from launch.runs import list_runs

    if fmt not in ("table", "json"):
        raise UserError(f"--format {fmt!r}: one of table, json")
    rows = list_runs(runs_dir)
    if fmt == "json":
        out.print(json.dumps([r.as_dict() for r in rows]), markup=False, soft_wrap=True)
        return
    if not rows:
        out.print(f"no runs in {runs_dir}")
        return
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for col in ("run", "name", "state", "steps", "accuracy", "wall", "disk"):
        table.add_column(col, no_wrap=True, justify="right" if col in ("steps", "accuracy", "wall", "disk") else "left")
    for r in rows:
        steps = f"{'-' if r.step is None else r.step}/{'?' if r.steps is None else r.steps}"
        acc = "-" if r.accuracy is None else f"{r.accuracy:.3f}"
        table.add_row(r.run_id, r.name, r.state, steps, acc, _wall(r.wall_s), _mb(r.disk_bytes))
    out.print(table)


@runs_app.command("rm")
@friendly
def runs_rm(
    run: str = typer.Argument(..., help="Run id."),
    runs_dir: Path = RUNS_DIR,
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    keep_topics: bool = typer.Option(False, "--keep-topics", help="Delete the run's folder only, not its topics."),
) -> None:
    """Delete a run: its folder (config, logs, model, weights, checkpoints, record), its weights left in shared memory (/dev/shm) and its topics on the broker. A running run is refused. Asks first unless --yes (needed when stdin is not a terminal).

    Kafka is found as for `rollstream status`. Rows in a ClickHouse server (store.dsn) are not deleted.
    """
    import asyncio

    from launch.runs import RunFilesError, delete_topics, disk_bytes, remove_run, state_of
    from launch.state import read_state
    from runtime.probe import NO_BROKER, kafka_reachable
    from schemas.config import KafkaSettings

    run_dir = _run_dir(run, runs_dir)
    state = read_state(run_dir)
    if state_of(run_dir, state) == "running":
        raise UserError(f"run {run} is running (supervisor pid {state and state.get('supervisor_pid')}); "
                        f"stop it first: rollstream stop {run}")
    bootstrap = None
    if not keep_topics:
        bootstrap = find_broker(str((state or {}).get("bootstrap") or "") or None)
        if not bootstrap:
            raise UserError(f"{NO_BROKER}: the run's topics cannot be deleted (--keep-topics deletes its folder only)")
        if not kafka_reachable(bootstrap, timeout_s=5):
            raise UserError(f"no Kafka broker answers at {bootstrap}: the run's topics cannot be deleted "
                            "(--keep-topics deletes its folder only)")
    if not yes:
        if not sys.stdin.isatty():
            raise UserError(f"deleting run {run} needs confirmation: add --yes")
        what = f"{run_dir} ({_mb(disk_bytes(run_dir))})" + ("" if keep_topics else f" and its topics on {bootstrap}")
        if not typer.confirm(f"delete {what}?"):
            raise typer.Exit(1)
    try:
        freed = remove_run(run_dir)
    except RunFilesError as e:
        raise UserError(str(e)) from None
    deleted: list[str] = []
    if bootstrap:
        deleted = asyncio.run(delete_topics(KafkaSettings(), bootstrap, run))
    topics = "" if keep_topics else f" and {len(deleted)} topics"
    out.print(f"deleted run {run}: {run_dir} ({_mb(freed)}){topics}")


@runs_app.command("export-log")
@friendly
def runs_export_log(
    run: str = typer.Argument(..., help="Run id."),
    archive: Path = typer.Argument(..., help="The archive to write: a name ending .tar.xz, .tar.gz or .tar."),
    log_dir: Path | None = typer.Option(None, "--log-dir", help="The broker's log directory (log.dirs), when it is not the local stack's of --home (<home>/kafka/data)."),
    fmt: str = typer.Option("table", "--format", help="table or json."),
) -> None:
    """Write a run's topics, as the broker's log directory holds them, to one archive that `rollstream record RUN --from-log ARCHIVE` builds the record from on another machine (no broker, no Java there). It holds the run's partitions and what a broker needs to start on them (meta.properties, the KRaft metadata log), no index files and no other run's topics.

    The broker may keep running: files it deletes meanwhile make the archive be written again. A single broker's log directory only (node.id=1: `rollstream stack up`, compose), not a local cluster's.
    """
    import json

    from cli.app import home
    from infra.kafka.logdir import archive_mode, export_log
    from schemas.topics import check_run_id

    if fmt not in ("table", "json"):
        raise UserError(f"--format {fmt!r}: one of table, json")
    check_run_id(run)
    archive_mode(archive)
    if log_dir is None:
        log_dir = home() / "kafka" / "data"
        if not (log_dir / "meta.properties").is_file():
            raise UserError(f"no Kafka log directory in the local stack of {home()} ({log_dir}): name the broker's "
                            "with --log-dir (its log.dirs), or the stack's home with --home")
    done = export_log(log_dir, run, archive)
    if fmt == "json":
        out.print(json.dumps({"run_id": run, "archive": str(done.path), "partitions": done.partitions,
                              "files": done.files, "bytes": done.bytes_out, "bytes_unpacked": done.bytes_in}),
                  markup=False, soft_wrap=True)
        return
    out.print(f"exported run {run}'s {done.partitions} partitions to {done.path} ({_mb(done.bytes_out)}, "
              f"{_mb(done.bytes_in)} unpacked); build its record elsewhere with "
              f"`rollstream record {run} --from-log {done.path.name}`")


@app.command("logs")
@friendly
def logs_cmd(
    run: str = typer.Argument(..., help="Run id."),
    service: str = typer.Argument("", help="A service label (trainer, rollout, rollout0, recorder, cli...); default: list the logs."),
    runs_dir: Path = RUNS_DIR,
    follow_: bool = typer.Option(False, "--follow", "-f", help="Keep printing what is appended until the run ends or Ctrl-C; without SERVICE, every log, each line prefixed with its service."),
    lines: int = typer.Option(None, "--lines", "-n", min=0, help="Start with the last N lines of each log (default: all of one log; with -f and no SERVICE, 10)."),
) -> None:
    """Print a service's log of a run (runs/RUN/logs/SERVICE.log); without SERVICE, list the logs with their size and last line."""
    from launch import runs as rn
    from launch.state import pid_alive, read_state

    run_dir = _run_dir(run, runs_dir)
    logs = rn.log_files(run_dir)
    if not logs:
        raise UserError(f"run {run} has no logs in {run_dir / 'logs'}")
    if service and service not in logs:
        raise UserError(f"run {run} has no log of {service!r}; it has: {', '.join(logs)}")
    if not service and not follow_:
        from rich.table import Table

        table = Table(box=None, pad_edge=False)
        table.add_column("service", no_wrap=True, min_width=max(len(label) for label in logs))
        table.add_column("size", no_wrap=True, min_width=6, justify="right")
        table.add_column("last line", no_wrap=True, overflow="ellipsis")
        for label, path in logs.items():
            table.add_row(label, _mb(path.stat().st_size), escape(_last_line(path)))
        out.print(table)
        return
    chosen = {service: logs[service]} if service else logs
    if lines is None and not service:
        lines = 10

    def ended() -> bool:
        if not follow_:
            return True
        state = read_state(run_dir)
        return state is not None and not pid_alive(state.get("supervisor_pid"))

    try:
        rn.follow(chosen, _write, until=ended, last_lines=lines)
    except KeyboardInterrupt:  # the way to stop following
        return


def _write(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _last_line(path: Path) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(max(0, path.stat().st_size - 4096))
            tail = [ln for ln in fh.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    line = tail[-1] if tail else ""
    return line if len(line) <= 120 else line[:119] + "…"


@app.command("export")
@friendly
def export_cmd(
    run: str = typer.Argument(..., help="Run id."),
    dest: Path = typer.Argument(..., help="New (or empty) directory to write the model to."),
    step: int = typer.Option(None, "--step", min=0, help="The policy after this many training steps (a kept one); default: the final model."),
    runs_dir: Path = RUNS_DIR,
) -> None:
    """Export a kept model of a run as a plain Hugging Face directory with its tokenizer (for transformers, `rollstream serve`, vLLM).

    Kept: the final model (runs/RUN/final), the last 3 published weight versions (runs/RUN/weights) and each checkpoint's model (runs/RUN/checkpoints; train.checkpoint_every, train.keep_checkpoints). An unknown step is refused with the list of those kept.
    """
    from launch.runs import RunFilesError, export_model

    run_dir = _run_dir(run, runs_dir)
    try:
        got, source = export_model(run_dir, step, dest)
    except RunFilesError as e:
        raise UserError(str(e)) from None
    out.print(f"exported run {run}, step {got} ({source.relative_to(run_dir)}): {dest}")
