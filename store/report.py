"""``rollstream report``: plots and a self-contained HTML page from a run's record.

Data comes from the run's record (SQL over ``train_steps``, ``evals`` and the ``samples`` view) and
from ``runs/<run_id>/config.yaml`` and ``summary.json``. The record is where ``rollstream run`` wrote
it: ``--store`` when given, else the store the run's config names, else ``runs/<run_id>/store``. chDB lets one process open only one store
directory, so every run is *extracted in its own subprocess* (``python -m store.report dump RUN``
prints JSON); the parent process only plots. That makes one run and two overlaid runs the same code.
A run still in progress is read through its recorder (:func:`store.connect_reader`).

Progress: the extraction runs :data:`QUERIES` queries; the child prints ``progress: ...`` on
stderr before each one, and the parent hands those lines to its ``progress`` callback (the
CLI shows them in its status line).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import store as st

# train_steps metric -> (plot file stem, title, y label)
STEP_METRICS: list[tuple[str, str, str, str]] = [
    ("rollout/reward_mean", "reward_mean", "Mean reward of the trained batch", "reward"),
    ("actor/approx_kl", "kl", "Approximate KL (actor/approx_kl)", "KL"),
    ("actor/entropy", "entropy", "Policy entropy (actor/entropy)", "entropy (nats/token)"),
    ("rollout/response_len_mean", "response_len", "Mean response length", "tokens"),
    ("loss/clipfrac", "clipfrac", "PPO clip fraction (loss/clipfrac)", "fraction clipped"),
    ("rollout/staleness_mean", "staleness_mean", "Mean staleness of the trained batch", "policy versions behind"),
    ("perf/train_tokens_per_s", "train_tokens_per_s", "Trainer throughput", "tokens / s"),
]
STAGES = ("queue_s", "gen_s", "env_s", "reward_s", "train_wait_s")
LINESTYLES = ("-", "--", ":", "-.")
QUERIES = ("train steps", "evals", "latency per stage", "reward by domain", "samples by status", "judges by domain")
"""What :func:`extract` queries, in order (one query each)."""
PROGRESS_PREFIX = "progress: "


class ReportError(RuntimeError):
    """A report problem, as one line for the user."""


# --------------------------------------------------------------------------- extraction (child process)


def _num(v: Any) -> float | None:
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) or math.isinf(f) else f


def extract(client: Any, run_id: str, progress: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Everything the report plots, from one run's store, as JSON-able data.

    Runs the :data:`QUERIES` in order, calling ``progress("query i/n: what (previous took Xs)")``
    before each."""
    p = {"r": run_id}
    done = [0, time.monotonic()]

    def q(sql: str) -> list[Any]:
        i = int(done[0])
        took = f" (previous took {time.monotonic() - done[1]:.1f}s)" if i else ""
        progress(f"query {i + 1}/{len(QUERIES)}: {QUERIES[i]}{took}")
        done[0], done[1] = i + 1, time.monotonic()
        return list(client.query(sql, parameters=p).result_rows)

    steps = []
    hist: dict[int, int] = {}
    for step, metrics, sh in q("SELECT step, metrics, staleness_hist FROM train_steps FINAL "
                               "WHERE run_id = {r:String} ORDER BY step"):
        steps.append({"step": int(step), "metrics": {k: _num(v) for k, v in dict(metrics).items()}})
        for k, v in dict(sh).items():
            hist[int(k)] = hist.get(int(k), 0) + int(v)
    evals = [{"step": int(s), "split": str(split), "metrics": {k: _num(v) for k, v in dict(m).items()}}
             for s, split, m in q("SELECT step, split, metrics FROM evals FINAL WHERE run_id = {r:String} "
                                  "ORDER BY step, ts")]
    aggs = ", ".join(f"avg({c}), quantile(0.5)({c}), quantile(0.95)({c}), count({c})" for c in STAGES)
    row = q(f"SELECT {aggs} FROM samples WHERE run_id = {{r:String}}")[0]
    latency = {c: {"mean": _num(row[4 * i]), "p50": _num(row[4 * i + 1]), "p95": _num(row[4 * i + 2]),
                   "n": int(row[4 * i + 3] or 0)} for i, c in enumerate(STAGES)}
    domain_reward = [{"domain": str(d), "step": int(s), "reward": _num(r), "n": int(n)}
                     for d, s, r, n in q("SELECT domain, step, avg(reward), count() FROM samples "
                                         "WHERE run_id = {r:String} AND status = 'trained' AND step >= 0 "
                                         "AND reward IS NOT NULL GROUP BY domain, step ORDER BY domain, step")]
    status = {str(s): int(n) for s, n in q("SELECT status, count() FROM samples WHERE run_id = {r:String} "
                                           "GROUP BY status ORDER BY status")}
    # judged domains: the judge's mean score (over its verdicts) and the samples it left unscored
    judges = [{"domain": str(d), "judge": str(j), "judged": int(n), "judge_mean": _num(m), "unscored": int(u),
               "judge_s_mean": _num(js)}
              for d, j, n, m, u, js in q(
                  "SELECT domain, judge, count(), avgIf(rewards['judge'], judge_error = ''), "
                  "countIf(judge_error != ''), avg(judge_s) FROM samples WHERE run_id = {r:String} "
                  "AND reward IS NOT NULL AND judge != '' GROUP BY domain, judge ORDER BY domain, judge")]
    return {"run_id": run_id, "train_steps": steps, "evals": evals, "staleness_hist": sorted(hist.items()),
            "latency": latency, "domain_reward": domain_reward, "status": status, "judges": judges}


def _dump_main(argv: list[str]) -> int:
    """``python -m store.report dump RUN --runs-dir DIR [--store DSN]``: print the run's data as JSON."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m store.report")
    ap.add_argument("cmd", choices=["dump"])
    ap.add_argument("run_id")
    ap.add_argument("--runs-dir", default="runs")
    ap.add_argument("--store", default="")
    a = ap.parse_args(argv)
    def progress(msg: str) -> None:
        print(PROGRESS_PREFIX + msg, file=sys.stderr, flush=True)

    try:
        client = st.connect_reader(a.store or st.default_dsn(a.runs_dir, a.run_id))
        data = extract(client, a.run_id, progress)
    except st.StoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a query failing on an incomplete/old store
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        print(f"error: cannot read the record of run {a.run_id}: {first}", file=sys.stderr)
        return 2
    sys.stdout.write(json.dumps(data))
    return 0


# --------------------------------------------------------------------------- loading (parent process)


def check_run(run_id: str, runs_dir: Path, store: str | None) -> str:
    """The DSN of ``run_id``'s record (``store``, else the store its config names, else its embedded
    store: :func:`store.runs.record_dsn`); :class:`ReportError` for an unknown run or a run
    without a store, :class:`store.StoreError` for a bad DSN."""
    from schemas.topics import check_run_id
    from store.runs import record_dsn

    check_run_id(run_id)
    run_dir = runs_dir / run_id
    dsn = record_dsn(runs_dir, run_id, store)
    scheme = st.check_dsn(dsn)
    if store:
        return dsn
    if not run_dir.is_dir():
        raise ReportError(f"unknown run {run_id!r}: no directory {run_dir}")
    if scheme == "chdb" and not Path(st.chdb_path(dsn)).is_dir():
        raise ReportError(f"run {run_id} has no store at {st.chdb_path(dsn)}")
    return dsn


def _start_dump(run_id: str, runs_dir: Path, dsn: str) -> subprocess.Popen[str]:
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "store.report", "dump", run_id, "--runs-dir", str(runs_dir.resolve()),
           "--store", dsn]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _finish_dump(run_id: str, proc: subprocess.Popen[str], timeout_s: float,
                 progress: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Wait for one dump child: its ``progress:`` stderr lines go to ``progress`` as they come."""
    assert proc.stdout is not None and proc.stderr is not None
    err_lines: list[str] = []
    out_parts: list[str] = []

    def pump_stderr(stream: Any) -> None:
        for line in stream:
            if line.startswith(PROGRESS_PREFIX):
                progress(f"{run_id}: {line[len(PROGRESS_PREFIX):].strip()}")
            else:
                err_lines.append(line)

    pumps = [threading.Thread(target=pump_stderr, args=(proc.stderr,), daemon=True),
             threading.Thread(target=lambda: out_parts.append(proc.stdout.read() if proc.stdout else ""),
                              daemon=True)]
    for t in pumps:
        t.start()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise ReportError(f"reading the record of run {run_id} took over {timeout_s:.0f}s") from None
    finally:
        for t in pumps:
            t.join(timeout=10)
    stdout, stderr = "".join(out_parts), "".join(err_lines)
    if proc.returncode != 0:
        lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
        err = next((ln for ln in reversed(lines) if ln.startswith("error:")), lines[-1] if lines else "")
        raise ReportError(err.removeprefix("error:").strip() or f"extracting run {run_id} failed "
                          f"(exit {proc.returncode})")
    try:
        data: dict[str, Any] = json.loads(stdout)
    except json.JSONDecodeError:
        raise ReportError(f"extracting run {run_id} printed no valid JSON") from None
    return data


def _run_files(run_id: str, runs_dir: Path) -> dict[str, Any]:
    """config.yaml (text and parsed) and summary.json of a run, when present."""
    import yaml

    run_dir = runs_dir / run_id
    out: dict[str, Any] = {"config_text": None, "config": None, "summary": None}
    cfg = run_dir / "config.yaml"
    if cfg.is_file():
        out["config_text"] = cfg.read_text()
        try:
            out["config"] = yaml.safe_load(out["config_text"])
        except yaml.YAMLError:
            pass
    summ = run_dir / "summary.json"
    if summ.is_file():
        try:
            out["summary"] = json.loads(summ.read_text())
        except json.JSONDecodeError:
            pass
    return out


def load_runs(run_ids: list[str], runs_dir: Path, store: str | None = None, timeout_s: float = 300.0,
              progress: Callable[[str], None] = lambda m: None) -> list[dict[str, Any]]:
    """Extract every run (one subprocess each, concurrently) and add its config and summary.
    ``progress`` gets ``"<run>: query i/n: ..."`` as each child starts its next query."""
    dsns = [check_run(r, runs_dir, store) for r in run_ids]
    if len(set(dsns)) < len(dsns):  # one store for every run: a chDB store can be open in one process at a time
        datas = [_finish_dump(r, _start_dump(r, runs_dir, dsn), timeout_s, progress)
                 for r, dsn in zip(run_ids, dsns, strict=True)]
    else:  # one store per run: extract them concurrently
        procs = [(r, _start_dump(r, runs_dir, dsn)) for r, dsn in zip(run_ids, dsns, strict=True)]
        try:
            datas = [_finish_dump(r, proc, timeout_s, progress) for r, proc in procs]
        finally:
            for _, proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
    for d in datas:
        d.update(_run_files(d["run_id"], runs_dir))
    return datas


# --------------------------------------------------------------------------- plotting


def _no_data(ax: Any) -> None:
    ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", fontsize=14, color="gray")


def _new_fig(title: str, xlabel: str, ylabel: str) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _finish(fig: Any, ax: Any, plotted: bool) -> Any:
    if plotted:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    else:
        _no_data(ax)
    fig.tight_layout()
    return fig


def _step_series(run: dict[str, Any], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for s in run["train_steps"]:
        v = s["metrics"].get(key)
        if v is not None:
            xs.append(s["step"])
            ys.append(v)
    return xs, ys


def make_figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every plot of the report as ``{file stem: matplotlib Figure}`` (one line style per run)."""
    figs: dict[str, Any] = {}
    for key, stem, title, ylabel in STEP_METRICS:
        fig, ax = _new_fig(title, "trainer step", ylabel)
        plotted = False
        for i, run in enumerate(runs):
            xs, ys = _step_series(run, key)
            if xs:
                ax.plot(xs, ys, LINESTYLES[i % 4], marker="." if len(xs) < 50 else None, label=run["run_id"])
                plotted = True
        figs[stem] = _finish(fig, ax, plotted)

    # eval accuracy (every split) and per-domain accuracy (every split)
    fig, ax = _new_fig("Eval accuracy", "trainer step", "accuracy")
    fig_d, ax_d = _new_fig("Eval accuracy by domain", "trainer step", "accuracy")
    plotted = plotted_d = False
    for i, run in enumerate(runs):
        splits = sorted({e["split"] for e in run["evals"]})
        for split in splits:
            pts = [(e["step"], e["metrics"].get("eval/accuracy")) for e in run["evals"] if e["split"] == split]
            pts = [(s, a) for s, a in pts if a is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), LINESTYLES[i % 4], marker="o", label=f"{run['run_id']} {split}")
                plotted = True
            domains = sorted({k.split("/")[1] for e in run["evals"] if e["split"] == split for k in e["metrics"]
                              if k.startswith("eval/") and k.endswith("/accuracy") and k.count("/") == 2})
            for dom in domains:
                key = f"eval/{dom}/accuracy"
                pts = [(e["step"], e["metrics"].get(key)) for e in run["evals"] if e["split"] == split]
                pts = [(s, a) for s, a in pts if a is not None]
                if pts:
                    ax_d.plot(*zip(*pts, strict=True), LINESTYLES[i % 4], marker="o",
                              label=f"{run['run_id']} {split} {dom}")
                    plotted_d = True
    figs["eval_accuracy"] = _finish(fig, ax, plotted)
    figs["eval_accuracy_by_domain"] = _finish(fig_d, ax_d, plotted_d)

    # per-domain reward of trained samples by step
    fig, ax = _new_fig("Reward by domain (trained samples)", "trainer step", "mean reward")
    plotted = False
    for i, run in enumerate(runs):
        for dom in sorted({d["domain"] for d in run["domain_reward"]}):
            pts = [(d["step"], d["reward"]) for d in run["domain_reward"] if d["domain"] == dom and d["reward"] is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), LINESTYLES[i % 4], marker=".", label=f"{run['run_id']} {dom}")
                plotted = True
    figs["reward_by_domain"] = _finish(fig, ax, plotted)

    width = 0.8 / max(1, len(runs))
    # staleness histogram, summed over steps
    fig, ax = _new_fig("Staleness of trained samples (all steps)", "policy versions behind", "samples")
    plotted = False
    for i, run in enumerate(runs):
        hist = [(int(k), int(v)) for k, v in run["staleness_hist"]]
        if hist:
            ax.bar([k + (i - (len(runs) - 1) / 2) * width for k, _ in hist], [v for _, v in hist], width=width,
                   label=run["run_id"])
            plotted = True
    figs["staleness_hist"] = _finish(fig, ax, plotted)

    # latency per stage: mean / p50 / p95 of every run
    fig, ax = _new_fig("Latency per stage", "stage", "seconds")
    bars = [(run["run_id"], stat) for run in runs for stat in ("mean", "p50", "p95")]
    bw = 0.8 / len(bars)
    plotted = False
    for j, (rid, stat) in enumerate(bars):
        run = next(r for r in runs if r["run_id"] == rid)
        vals = [run["latency"].get(c, {}).get(stat) for c in STAGES]
        if any(v is not None for v in vals):
            ax.bar([k + (j - (len(bars) - 1) / 2) * bw for k in range(len(STAGES))],
                   [v or 0.0 for v in vals], width=bw, label=f"{rid} {stat}")
            plotted = True
    ax.set_xticks(range(len(STAGES)), list(STAGES))
    figs["latency"] = _finish(fig, ax, plotted)

    # sample status counts
    fig, ax = _new_fig("Samples by status", "status", "samples")
    statuses = sorted({s for run in runs for s in run["status"]})
    plotted = False
    for i, run in enumerate(runs):
        if run["status"]:
            ax.bar([k + (i - (len(runs) - 1) / 2) * width for k in range(len(statuses))],
                   [run["status"].get(s, 0) for s in statuses], width=width, label=run["run_id"])
            plotted = True
    if statuses:
        ax.set_xticks(range(len(statuses)), statuses)
    figs["status"] = _finish(fig, ax, plotted)
    return figs


# --------------------------------------------------------------------------- HTML


def _flatten(d: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(d, dict):
        rows: list[tuple[str, Any]] = []
        for k, v in d.items():
            rows += _flatten(v, f"{prefix}.{k}" if prefix else str(k))
        return rows
    if isinstance(d, list) and d and all(isinstance(x, dict) for x in d):
        return [(prefix, json.dumps(d, default=str))]
    return [(prefix, d)]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def _table(header: list[str], rows: list[list[Any]]) -> str:
    h = "".join(f"<th>{html.escape(c)}</th>" for c in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>"


def _keyed_table(per_run: list[tuple[str, dict[str, Any] | None]]) -> str:
    """A key column and one value column per run (flattened nested dicts)."""
    flat = [dict(_flatten(d)) if d else {} for _, d in per_run]
    keys: list[str] = []
    for f in flat:
        keys += [k for k in f if k not in keys]
    if not keys:
        return "<p class='note'>not present</p>"
    return _table(["key", *[r for r, _ in per_run]], [[k, *[f.get(k) for f in flat]] for k in keys])


def render_html(runs: list[dict[str, Any]], pngs: dict[str, bytes]) -> str:
    ids = [r["run_id"] for r in runs]
    title = "rollstream report: " + " vs ".join(ids)
    imgs = "".join(
        f"<figure><img src=\"data:image/png;base64,{base64.b64encode(b).decode()}\" alt=\"{html.escape(stem)}\">"
        f"<figcaption>{html.escape(stem)}.png</figcaption></figure>" for stem, b in pngs.items())
    statuses = sorted({s for r in runs for s in r["status"]})
    status_t = _table(["status", *ids], [[s, *[r["status"].get(s, 0) for r in runs]] for s in statuses]) \
        if statuses else "<p class='note'>no samples recorded</p>"
    judge_rows = [[r["run_id"], j["domain"], j["judge"], j["judged"], j["judge_mean"], j["unscored"],
                   j["judge_s_mean"]] for r in runs for j in r.get("judges", [])]
    judges_t = ("<h2>Judges by domain</h2>" + _table(
        ["run", "domain", "judge", "judged", "judge score mean", "unscored (judge_error)", "judge call mean (s)"],
        judge_rows)) if judge_rows else ""
    lat_rows = [[r["run_id"], c, *[r["latency"][c][k] for k in ("mean", "p50", "p95", "n")]]
                for r in runs for c in STAGES if c in r["latency"]]
    lat_t = _table(["run", "stage", "mean (s)", "p50 (s)", "p95 (s)", "samples"], lat_rows)
    steps_t = _table(["run", "train steps", "evals", "last step"],
                     [[r["run_id"], len(r["train_steps"]), len(r["evals"]),
                       r["train_steps"][-1]["step"] if r["train_steps"] else None] for r in runs])
    summary_t = _keyed_table([(r["run_id"], {k: v for k, v in (r.get("summary") or {}).items() if k != "config"})
                              for r in runs])
    config_t = _keyed_table([(r["run_id"], r.get("config") if isinstance(r.get("config"), dict) else None)
                             for r in runs])
    css = ("body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px}"
           "figure{display:inline-block;margin:.5em;vertical-align:top}img{max-width:680px;border:1px solid #ddd}"
           "table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:2px 8px;"
           "font-size:13px;text-align:left;vertical-align:top}th{background:#f3f3f3}.note{color:#888}")
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{css}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<h2>Record</h2>{steps_t}<h2>Samples by status</h2>{status_t}{judges_t}"
            f"<h2>Plots</h2>{imgs}<h2>Latency per stage</h2>{lat_t}"
            f"<h2>Summary (summary.json)</h2>{summary_t}<h2>Config (config.yaml)</h2>{config_t}"
            "</body></html>")


def write_report(runs: list[dict[str, Any]], out_dir: Path,
                 progress: Callable[[str], None] = lambda m: None) -> Path:
    """Plot ``runs`` into ``out_dir`` (PNGs, data.json, index.html). Returns the index.html path."""
    import matplotlib

    matplotlib.use("Agg")
    out_dir.mkdir(parents=True, exist_ok=True)
    progress("plotting...")
    figs = make_figures(runs)
    pngs: dict[str, bytes] = {}
    for n, (stem, fig) in enumerate(figs.items(), 1):
        progress(f"plotting {stem} ({n}/{len(figs)})...")
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        pngs[stem] = buf.getvalue()
        (out_dir / f"{stem}.png").write_bytes(pngs[stem])
    progress("writing index.html...")
    (out_dir / "data.json").write_text(json.dumps(runs, indent=1, default=str))
    index = out_dir / "index.html"
    index.write_text(render_html(runs, pngs))
    return index


def default_out_dir(run_ids: list[str], runs_dir: Path) -> Path:
    """``runs/<run>/report`` for one run, ``runs/<run1>/report-vs-<run2>`` for two."""
    base = runs_dir / run_ids[0]
    return base / "report" if len(run_ids) == 1 else base / ("report-vs-" + "-".join(run_ids[1:]))


if __name__ == "__main__":
    sys.exit(_dump_main(sys.argv[1:]))
