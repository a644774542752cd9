"""``rollstream report``: plots and an HTML page from a run's record."""

from __future__ import annotations

from pathlib import Path

import typer

from cli.app import UserError, app, console, friendly, opt, out


@app.command("report")
@friendly
def report(
    run: str = typer.Argument(..., help="Run id."),
    run2: str = typer.Argument(None, help="A second run to overlay on the first."),
    out_dir: Path = typer.Option(None, "--out", help="Output directory (default runs/<run>/report/)."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Directory of run folders."),
) -> None:
    """Plots and a self-contained index.html from a run's record (two runs: overlaid curves): a headline (accuracy before and after the warm-up and at the end, steps, samples, wall time; episode success for agentic runs), captioned plots, a visual run's held-out images with the last evaluation's answers (from the run's blob store), the config's difference from the defaults.

    The record is read from --store / ROLLSTREAM_STORE when given, else from the store each run's config names, else from the run's embedded store <runs-dir>/<run>/store.
    """
    from store import report as rp
    from store.report_page import config_value, steps_done

    run_ids = [run] + ([run2] if run2 else [])
    if run2 and run2 == run:
        raise UserError("give two different runs to compare")
    dest = out_dir or rp.default_out_dir(run_ids, runs_dir)
    try:
        with console.status(f"reading the record of {', '.join(run_ids)}...") as status:
            runs = rp.load_runs(run_ids, runs_dir, opt("store"), progress=status.update)
            index = rp.write_report(runs, dest, progress=lambda m: status.update(m))
    except rp.ReportError as e:
        raise UserError(str(e)) from None
    for r in runs:
        total = config_value(r, "train", "steps")
        out.print(f"{r['run_id']}: {steps_done(r)}{f'/{total}' if total else ''} steps done, {len(r['evals'])} evals, "
                  f"{sum(r['status'].values())} samples")
    out.print(f"report: {index}")
