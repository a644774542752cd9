"""``rollstream report``: plots and a self-contained HTML page from a run's record.

Data comes from the run's record (SQL over ``train_steps``, ``evals`` and the ``samples`` view) and
from ``runs/<run_id>/config.yaml`` and ``summary.json``. The record is where ``rollstream run`` wrote
it: ``--store`` when given, else the store the run's config names, else ``runs/<run_id>/store``. chDB lets one process open only one store
directory, so every run is *extracted in its own subprocess* (``python -m store.report dump RUN``
prints JSON); the parent process only plots. That makes one run and two overlaid runs the same code.
A run still in progress is read through its recorder (:func:`store.connect_reader`).

Progress: the extraction runs :data:`QUERIES` queries (and :data:`AGENTIC_QUERIES` for a run with
multi-turn episodes); the child prints ``progress: ...`` on stderr before each one, and the parent
hands those lines to its ``progress`` callback (the CLI shows them in its status line). The page
itself (headline, plots, captions, tables) is :mod:`store.report_page`.

Held-out answers: the last held-out ``EvalResult`` that recorded answers (``events.payload``) is
extracted too; the parent reads the images those answers show from the run's blob store
(``runs/<run_id>/blobs``, :func:`answer_images`) as PNG thumbnails for the page, or the reason a
blob cannot be read.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import store as st
from blobs import BlobError, BlobStore, blob_dir_of, decode_image, encode_png
from schemas.topics import topic_name
from store.queries import QUERIES as READY
from store.report_page import STAGES, finite, make_figures, render_html

__all__ = ["AGENTIC_QUERIES", "QUERIES", "ReportError", "answer_images", "default_out_dir", "extract", "load_runs",
           "make_figures", "render_html", "write_report"]

QUERIES = ("train steps", "evals", "latency per stage", "reward by domain", "samples by status", "judges by domain",
           "weights", "start and finish", "held-out answers")
"""What :func:`extract` queries of every run, in order (one query each)."""
AGENTIC_QUERIES = ("success by step", "turns per episode", "how episodes ended")
"""What it queries next of a run with multi-turn episodes."""
PROGRESS_PREFIX = "progress: "


class ReportError(RuntimeError):
    """A report problem, as one line for the user."""


# --------------------------------------------------------------------------- extraction (child process)


def _epoch(ts: Any) -> float | None:
    """A store timestamp (naive UTC ``datetime``) as seconds since the epoch."""
    if not isinstance(ts, datetime) or ts.year < 1971:
        return None
    return (ts if ts.tzinfo else ts.replace(tzinfo=UTC)).timestamp()


def extract(client: Any, run_id: str, progress: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Everything the report plots, from one run's store, as JSON-able data.

    Runs the :data:`QUERIES` in order (then the :data:`AGENTIC_QUERIES` when the run has
    multi-turn episodes), calling ``progress("query i/n: what (previous took Xs)")`` before each."""
    p = {"r": run_id, "run": run_id, "t": topic_name(run_id, "metrics")}
    agentic = client.query("SELECT count() FROM sample_generations WHERE run_id = {r:String} AND episode_id != ''",
                           parameters=p).result_rows[0][0] > 0  # milliseconds: not announced
    names = [*QUERIES, *(AGENTIC_QUERIES if agentic else ())]
    done = [0, time.monotonic()]

    def q(sql: str) -> list[Any]:
        i = int(done[0])
        took = f" (previous took {time.monotonic() - done[1]:.1f}s)" if i else ""
        progress(f"query {i + 1}/{len(names)}: {names[i]}{took}")
        done[0], done[1] = i + 1, time.monotonic()
        return list(client.query(sql, parameters=p).result_rows)

    steps = []
    hist: dict[int, int] = {}
    last_step_ts = None
    for step, metrics, sh, ts in q("SELECT step, metrics, staleness_hist, ts FROM train_steps FINAL "
                                   "WHERE run_id = {r:String} ORDER BY step"):
        steps.append({"step": int(step), "metrics": {k: finite(v) for k, v in dict(metrics).items()}})
        last_step_ts = _epoch(ts)
        for k, v in dict(sh).items():
            hist[int(k)] = hist.get(int(k), 0) + int(v)
    evals = [{"step": int(s), "split": str(split), "metrics": {k: finite(v) for k, v in dict(m).items()}}
             for s, split, m in q("SELECT step, split, metrics FROM evals FINAL WHERE run_id = {r:String} "
                                  "ORDER BY step, ts")]
    aggs = ", ".join(f"avg({c}), quantile(0.5)({c}), quantile(0.95)({c}), count({c})" for c in STAGES)
    row = q(f"SELECT {aggs} FROM samples WHERE run_id = {{r:String}}")[0]
    latency = {c: {"mean": finite(row[4 * i]), "p50": finite(row[4 * i + 1]), "p95": finite(row[4 * i + 2]),
                   "n": int(row[4 * i + 3] or 0)} for i, c in enumerate(STAGES)}
    domain_reward = [{"domain": str(d), "step": int(s), "reward": finite(r), "n": int(n)}
                     for d, s, r, n in q("SELECT domain, step, avg(reward), count() FROM samples "
                                         "WHERE run_id = {r:String} AND status = 'trained' AND step >= 0 "
                                         "AND reward IS NOT NULL GROUP BY domain, step ORDER BY domain, step")]
    status = {str(s): int(n) for s, n in q("SELECT status, count() FROM samples WHERE run_id = {r:String} "
                                           "GROUP BY status ORDER BY status")}
    # judged domains: the judge's mean score (over its verdicts) and the samples it left unscored
    judges = [{"domain": str(d), "judge": str(j), "judged": int(n), "judge_mean": finite(m), "unscored": int(u),
               "judge_s_mean": finite(js)}
              for d, j, n, m, u, js in q(
                  "SELECT domain, judge, count(), avgIf(rewards['judge'], judge_error = ''), "
                  "countIf(judge_error != ''), avg(judge_s) FROM samples WHERE run_id = {r:String} "
                  "AND reward IS NOT NULL AND judge != '' GROUP BY domain, judge ORDER BY domain, judge")]
    n, first, last, size = q("SELECT count(), min(policy_version), max(policy_version), sum(num_bytes) "
                             "FROM weights FINAL WHERE run_id = {r:String}")[0]
    weights = {"versions": int(n), "first": int(first or 0), "last": int(last or 0), "bytes_total": int(size or 0)}
    control = dict(q("SELECT kind, min(ts) FROM events WHERE run_id = {r:String} AND name = 'control' "
                     "AND kind IN ('RunStarted', 'RunFinished') GROUP BY kind"))
    times = {"started": _epoch(control.get("RunStarted")), "finished": _epoch(control.get("RunFinished")),
             "last_step": last_step_ts}
    answers = None  # the last held-out evaluation that recorded answers (EvalResult.answers, in events)
    for step, payload in q("SELECT JSONExtractInt(payload, 'step') AS s, payload FROM events "
                           "WHERE topic = {t:String} AND run_id = {r:String} AND kind = 'EvalResult' "
                           "AND JSONExtractString(payload, 'split') = 'heldout' AND JSONLength(payload, 'answers') > 0 "
                           "ORDER BY s DESC, ts DESC LIMIT 1"):
        answers = {"step": int(step), "items": json.loads(payload)["answers"]}
    episodes: dict[str, Any] = {"by_step": [], "turns": [], "endings": []}
    if agentic:
        episodes["by_step"] = [
            {"step": int(s), "episodes": int(n), "succeeded": int(w), "turns_mean": finite(t)}
            for s, n, w, t in q("SELECT step, count(), countIf(success = 1), avg(num_turns) FROM episodes "
                                "WHERE run_id = {r:String} AND multi_turn = 1 AND status = 'trained' AND step >= 0 "
                                "GROUP BY step ORDER BY step")]
        episodes["turns"] = [{"num_turns": int(t), "episodes": int(n), "succeeded": int(w)}
                             for t, n, _share, w, _ret in q(READY["turns"])]
        episodes["endings"] = [{"env_finish": str(e), "episodes": int(n), "succeeded": int(w)}
                               for e, n, _share, w in q(READY["episode-endings"])]
    return {"run_id": run_id, "train_steps": steps, "evals": evals, "staleness_hist": sorted(hist.items()),
            "latency": latency, "domain_reward": domain_reward, "status": status, "judges": judges,
            "weights": weights, "times": times, "episodes": episodes, "answers": answers}


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
    out["blob_dir"] = str(blob_dir_of(run_dir))
    weights = run_dir / "weights"
    out["weights_on_disk"] = sorted(p.name for p in weights.iterdir() if p.is_dir()) if weights.is_dir() else []
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


THUMB_PX = 224
"""A held-out answer's image is shown at most this many pixels wide or high (a PNG thumbnail)."""


def answer_images(runs: list[dict[str, Any]]) -> dict[tuple[str, str], bytes | str]:
    """``(run, digest) -> PNG thumbnail`` of every image the runs' recorded held-out answers show,
    read from each run's blob store; a blob that cannot be read maps to the one-line reason."""
    out: dict[tuple[str, str], bytes | str] = {}
    for run in runs:
        items = (run.get("answers") or {}).get("items") or []
        digests = list(dict.fromkeys(h for a in items for h in a.get("image_hashes") or []))
        root = Path(run.get("blob_dir") or blob_dir_of(Path("runs") / run["run_id"]))
        blobs = BlobStore(root)
        for h in digests:
            if not root.is_dir():
                out[run["run_id"], h] = f"the run's blob store {root} is missing"
                continue
            try:
                img = decode_image(blobs.get(h), h)
            except BlobError as e:
                out[run["run_id"], h] = str(e)
                continue
            img.thumbnail((THUMB_PX, THUMB_PX))
            out[run["run_id"], h] = encode_png(img)
    return out


def write_report(runs: list[dict[str, Any]], out_dir: Path,
                 progress: Callable[[str], None] = lambda m: None) -> Path:
    """Plot ``runs`` into ``out_dir`` (PNGs, data.json, index.html). Returns the index.html path."""
    import matplotlib

    matplotlib.use("Agg")
    out_dir.mkdir(parents=True, exist_ok=True)
    progress("plotting...")
    figs = make_figures(runs)
    pngs: dict[str, bytes] = {}
    for n, (stem, (fig, _caption)) in enumerate(figs.items(), 1):
        progress(f"plotting {stem} ({n}/{len(figs)})...")
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        pngs[stem] = buf.getvalue()
        (out_dir / f"{stem}.png").write_bytes(pngs[stem])
    progress("writing index.html...")
    (out_dir / "data.json").write_text(json.dumps(runs, indent=1, default=str))
    index = out_dir / "index.html"
    index.write_text(render_html(runs, pngs, {stem: caption for stem, (_fig, caption) in figs.items()},
                                 answer_images(runs)))
    return index


def default_out_dir(run_ids: list[str], runs_dir: Path) -> Path:
    """``runs/<run>/report`` for one run, ``runs/<run1>/report-vs-<run2>`` for two."""
    base = runs_dir / run_ids[0]
    return base / "report" if len(run_ids) == 1 else base / ("report-vs-" + "-".join(run_ids[1:]))


if __name__ == "__main__":
    sys.exit(_dump_main(sys.argv[1:]))
