"""``rollstream replay into|rescore|step``: a run's record, played back (:mod:`replay`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from cli.app import UserError, app, console, friendly, home, opt, out, quiet_transformers

replay_app = typer.Typer(
    help="Play a run's record back: re-publish it into a new run (into), re-score it with a changed "
         "config (rescore), or recompute one training step (step).",
    no_args_is_help=True,
)
app.add_typer(replay_app, name="replay")

RUNS_DIR_HELP = "Directory of run folders."
SET_HELP = "Override the run's recorded config: section.key=value (repeatable)."


def _check_format(fmt: str) -> None:
    if fmt not in ("table", "json"):
        raise UserError(f"--format {fmt!r}: one of table, json")


def _settings(run: str, runs_dir: Path, topics: str = "", **kw: Any) -> Any:
    """Checked :class:`replay.ReplaySettings` (before any store or broker is touched)."""
    import replay as rp
    from infra.kafka.broker import local_bootstrap

    try:
        settings = rp.ReplaySettings(run_id=run, runs_dir=str(runs_dir), store=opt("store") or "",
                                     bootstrap=opt("bootstrap") or "", local_bootstrap=local_bootstrap(home()) or "",
                                     topics=rp.parse_topics(topics), **kw)
        rp.check_settings(settings)
    except rp.ReplayError as e:
        raise UserError(str(e)) from None
    return settings


@replay_app.command("into")
@friendly
def replay_into(
    run: str = typer.Argument(..., help="The recorded run."),
    new_run: str = typer.Argument(..., help="The new run whose topics receive the copy (a fresh run id)."),
    from_step: int | None = typer.Option(None, "--from-step", help="First training step of the slice."),
    to_step: int | None = typer.Option(None, "--to-step", help="Last training step of the slice (inclusive)."),
    topics: str = typer.Option("", "--topics", help="Comma-separated topics to re-publish (default: all), "
                               "e.g. generations or tasks,generations."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP + " Written to the new run's config.yaml."),
    fmt: str = typer.Option("table", "--format", help="table or json."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help=RUNS_DIR_HELP),
) -> None:
    """Re-publish a slice of the record into NEW_RUN's topics, in the recorded order, and write NEW_RUN's config.yaml, so `rollstream service NAME --run NEW_RUN` can consume the traffic."""
    import asyncio
    import json

    import replay as rp

    _check_format(fmt)
    settings = _settings(run, runs_dir, topics, from_step=from_step, to_step=to_step, overrides=list(set_),
                         into=new_run)
    if not opt("debug"):
        logging.getLogger("aiokafka").setLevel(logging.ERROR)  # metadata retries right after topic creation
    try:
        with console.status(f"reading the record of {run}...") as status:
            summary = asyncio.run(rp.replay_into(settings, progress=status.update))
    except rp.ReplayError as e:
        raise UserError(str(e)) from None
    if summary.config_note:
        console.print(f"[yellow]warning:[/yellow] {escape(summary.config_note)}")
    if fmt == "json":
        out.print(json.dumps(summary.to_dict()), soft_wrap=True, markup=False)
    else:
        out.print(rp.into_table(summary))
        out.print(f"kafka: {summary.bootstrap}")
        out.print(f"config: {summary.config_path}")


@replay_app.command("rescore")
@friendly
def replay_rescore(
    run: str = typer.Argument(..., help="The recorded run."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP + " E.g. data.domains.0.verifier=format."),
    from_step: int | None = typer.Option(None, "--from-step", help="First training step of the slice."),
    to_step: int | None = typer.Option(None, "--to-step", help="Last training step of the slice (inclusive)."),
    examples: int = typer.Option(5, "--examples", help="Changed samples to show."),
    fmt: str = typer.Option("table", "--format", help="table or json."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help=RUNS_DIR_HELP),
) -> None:
    """Re-run the verifiers over the recorded generations with the run's config plus --set; report per domain how rewards and advantages would change. Nothing is published."""
    import json

    import replay as rp

    _check_format(fmt)
    if examples < 0:
        raise UserError(f"--examples {examples}: must be >= 0")
    settings = _settings(run, runs_dir, from_step=from_step, to_step=to_step, overrides=list(set_))
    try:
        with console.status(f"reading the record of {run}...") as status:
            report = rp.rescore(settings, progress=status.update, examples=examples)
    except rp.ReplayError as e:
        raise UserError(str(e)) from None
    if fmt == "json":
        out.print(json.dumps(report), soft_wrap=True, markup=False)
    else:
        for line in rp.rescore_lines(report):
            out.print(line, markup=False)


@replay_app.command("step")
@friendly
def replay_step(
    run: str = typer.Argument(..., help="The recorded run."),
    step: int = typer.Argument(..., help="The training step to recompute (0-based)."),
    fmt: str = typer.Option("table", "--format", help="table or json."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help=RUNS_DIR_HELP),
) -> None:
    """Recompute training step N from its recorded batch and the checkpoint it started from, exactly as recorded; print loss, gradient norm and every metric beside the recorded ones."""
    import json

    import msgspec
    from rich.table import Table

    import store as st
    from launch.supervisor import load_run_config
    from replay import step as rs
    from schemas.topics import check_run_id
    from store.runs import record_dsn

    _check_format(fmt)
    check_run_id(run)
    if step < 0:
        raise UserError(f"step {step}: steps start at 0")
    if not (runs_dir / run / "config.yaml").exists():
        raise UserError(f"run {run} not found: no {runs_dir / run / 'config.yaml'}")
    cfg = load_run_config(str(runs_dir), run, [])
    # the run's folder is where its config was found (checkpoints, model and default store live there)
    cfg = msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, runs_dir=str(runs_dir)))
    ckpt_dir = runs_dir / run / "checkpoints"
    if not any(ckpt_dir.glob("step_*")):
        raise UserError(f"run {run} has no checkpoints in {ckpt_dir} (replay step restores the one the step started from)")
    dsn = record_dsn(runs_dir, run, opt("store"))
    if st.check_dsn(dsn) == "chdb" and not Path(st.chdb_path(dsn)).exists():
        raise UserError(f"run {run} has no store at {st.chdb_path(dsn)}")
    quiet_transformers()
    try:
        with console.status(f"replaying step {step} of {run}...") as status:
            res = rs.replay_train_step(cfg, run, step, dsn=dsn, progress=status.update)
    except rs.ReplayError as e:
        raise UserError(str(e)) from None
    if fmt == "json":
        out.print(json.dumps({"run_id": run, "step": res.step, "from_checkpoint": res.from_checkpoint,
                              "max_abs_diff": res.max_abs_diff,
                              "metrics": [{"metric": k, "recorded": a, "replayed": b, "abs_diff": d}
                                          for k, a, b, d in res.rows]}), soft_wrap=True, markup=False)
        return
    table = Table(title=f"{run}: step {res.step} recomputed from the checkpoint of step {res.from_checkpoint}")
    for col in ("metric", "recorded", "replayed", "|difference|"):
        table.add_column(col, justify="left" if col == "metric" else "right")

    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.9g}"

    for key, a, b, d in res.rows:
        table.add_row(key, num(a), num(b), "-" if d is None else f"{d:.2e}")
    out.print(table)
    out.print(f"max |difference| {res.max_abs_diff:.2e} over {sum(d is not None for *_, d in res.rows)} metrics")
