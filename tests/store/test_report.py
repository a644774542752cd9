"""``rollstream report``: a small but real record (chDB store per run), one run and two runs overlaid."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from store import report as rp

ROOT = Path(__file__).resolve().parents[2]

# Runs in a subprocess (one chDB directory per process): builds runs/<rid>/store from real events.
MAKE_RECORD = textwrap.dedent("""
    import sys
    from schemas import events as ev
    import store as st
    from store.rows import COLUMNS, typed_rows

    runs_dir, rid, shift = sys.argv[1], sys.argv[2], float(sys.argv[3])
    client = st.connect(st.default_dsn(runs_dir, rid))
    st.apply_ddl(client)
    events = []
    for step in range(4):
        ids = []
        for k, domain in enumerate(("math", "code")):
            sid = f"s{step}-{k}"
            ids.append(sid)
            task = ev.RolloutTask(run_id=rid, sample_id=sid, group_id=f"g{step}", index=k, group_size=2,
                                  prompt_id=f"p{k}", domain=domain, prompt="1+1=", policy_version=step)
            gen = ev.Generation(run_id=rid, task=task, prompt_ids=[1, 2], response_ids=[3] * (5 + step),
                                response_text="2", logprobs=[-0.1] * (5 + step), loss_mask=[1] * (5 + step),
                                finish_reason="stop", policy_version=step, policy_version_end=step,
                                queued_s=0.1 * k, gen_s=0.5 + step, env_s=0.0)
            scored = ev.ScoredSample(run_id=rid, generation=gen, reward=shift + 0.1 * step + 0.2 * k,
                                     reward_s=0.01)
            out = ev.SampleOutcome(run_id=rid, sample_id=sid, group_id=f"g{step}", status="trained",
                                   policy_version=step, trained_version=step, step=step)
            events += [task, gen, scored, out]
        events.append(ev.TrainStep(run_id=rid, step=step, policy_version=step, sample_ids=ids,
                                   staleness_hist={0: 1, 1: 1},
                                   metrics={"rollout/reward_mean": shift + 0.1 * step, "actor/approx_kl": 0.01 * step,
                                            "actor/entropy": 2.0 - 0.1 * step, "rollout/response_len_mean": 5.0 + step,
                                            "loss/clipfrac": 0.05, "rollout/staleness_mean": 0.5,
                                            "perf/train_tokens_per_s": 1000.0 + step}))
        events.append(ev.EvalResult(run_id=rid, step=step, policy_version=step, split="heldout",
                                    metrics={"eval/accuracy": shift + 0.1 * step, "eval/math/accuracy": 0.5,
                                             "eval/code/accuracy": 0.2 + 0.05 * step}))
    # one issued task that never came back
    events.append(ev.RolloutTask(run_id=rid, sample_id="lost", group_id="gx", index=0, group_size=1,
                                 prompt_id="px", domain="math", prompt="?"))
    for e in events:
        for table, rows in typed_rows(e).items():
            client.insert(table, rows, column_names=COLUMNS[table])
""")


def make_run(runs_dir: Path, rid: str, shift: float = 0.0) -> None:
    (runs_dir / rid).mkdir(parents=True, exist_ok=True)
    (runs_dir / rid / "config.yaml").write_text(f"run:\n  name: {rid}\ntrain:\n  lr: 1.0e-5\n")
    (runs_dir / rid / "summary.json").write_text(f'{{"run_id": "{rid}", "steps": 4, "samples": {{"trained": 8}}}}')
    res = subprocess.run([sys.executable, "-c", MAKE_RECORD, str(runs_dir), rid, str(shift)], cwd=ROOT,
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("runs")
    make_run(d, "run-a", 0.0)
    make_run(d, "run-b", 0.3)
    return d


def check_report(out: Path, n_imgs: int = 13) -> str:
    index = (out / "index.html").read_text()
    assert index.count('<img src="data:image/png;base64,') == n_imgs
    pngs = sorted(out.glob("*.png"))
    assert len(pngs) == n_imgs
    for p in pngs:
        assert p.stat().st_size > 1000 and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return index


def test_report_one_run(runs_dir: Path) -> None:
    res = cli("report", "run-a", "--runs-dir", str(runs_dir))
    assert res.returncode == 0, res.stderr
    assert "report:" in res.stdout and "4 train steps" in res.stdout
    index = check_report(runs_dir / "run-a" / "report")
    assert "run-a" in index and "train.lr" in index and "samples.trained" in index  # config + summary tables


def test_report_two_runs_overlaid(runs_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    res = cli("report", "run-a", "run-b", "--runs-dir", str(runs_dir), "--out", str(out))
    assert res.returncode == 0, res.stderr
    index = check_report(out)
    assert "run-a vs run-b" in index


def test_report_errors_are_one_line(runs_dir: Path) -> None:
    res = cli("report", "nope", "--runs-dir", str(runs_dir))
    assert res.returncode == 1 and "unknown run 'nope'" in res.stderr and "Traceback" not in res.stderr
    (runs_dir / "bare").mkdir()
    res = cli("report", "bare", "--runs-dir", str(runs_dir))
    assert res.returncode == 1 and "has no store" in res.stderr and "Traceback" not in res.stderr


def test_report_store_in_use(runs_dir: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; import store as st; "
         f"c = st.connect(st.default_dsn({str(runs_dir)!r}, 'run-a')); print('open', flush=True); time.sleep(60)"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        res = cli("report", "run-a", "--runs-dir", str(runs_dir))
        assert res.returncode == 1 and "in use by another process" in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1
    finally:
        holder.kill()
        holder.wait()


def test_figures_have_titles_and_axis_labels(runs_dir: Path) -> None:
    runs = rp.load_runs(["run-a", "run-b"], runs_dir)
    figs = rp.make_figures(runs)
    assert {"reward_mean", "kl", "entropy", "response_len", "clipfrac", "staleness_mean", "train_tokens_per_s",
            "eval_accuracy", "eval_accuracy_by_domain", "reward_by_domain", "staleness_hist", "latency",
            "status"} <= set(figs)
    for stem, fig in figs.items():
        ax = fig.axes[0]
        assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel(), stem
        labels = {t.get_text() for t in ax.get_legend().get_texts()}
        assert any("run-a" in t for t in labels) and any("run-b" in t for t in labels), stem
    assert runs[0]["status"] == {"issued": 1, "trained": 8}
    assert dict((int(k), v) for k, v in runs[0]["staleness_hist"]) == {0: 4, 1: 4}
    assert runs[0]["latency"]["gen_s"]["n"] == 8


def test_empty_record_plots_no_data() -> None:
    empty = {"run_id": "e", "train_steps": [], "evals": [], "staleness_hist": [], "latency": {},
             "domain_reward": [], "status": {}}
    figs = rp.make_figures([empty])
    for stem, fig in figs.items():
        ax = fig.axes[0]
        assert any(t.get_text() == "no data" for t in ax.texts), stem
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title(), stem


def test_extraction_reports_progress_per_query(runs_dir: Path) -> None:
    """The child announces each query on stderr; the parent hands the lines on as they come."""
    seen: list[str] = []
    runs = rp.load_runs(["run-a", "run-b"], runs_dir, progress=seen.append)
    assert [r["run_id"] for r in runs] == ["run-a", "run-b"]
    for rid in ("run-a", "run-b"):
        mine = [m for m in seen if m.startswith(f"{rid}: ")]
        assert [m.split(": ", 2)[1] for m in mine] == [f"query {i}/{len(rp.QUERIES)}" for i in
                                                       range(1, len(rp.QUERIES) + 1)]
        assert mine[0].endswith(rp.QUERIES[0]) and "previous took" in mine[-1]
