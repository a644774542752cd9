"""``rollstream report``: a small but real record (chDB store per run, with multi-turn episodes), one
run and two runs overlaid; the headline, captions and conventions of the page."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from store import report as rp
from store import report_page as page

ROOT = Path(__file__).resolve().parents[2]

# Runs in a subprocess (one chDB directory per process): builds runs/<rid>/store from real events.
MAKE_RECORD = textwrap.dedent("""
    import sys
    from schemas import events as ev
    import store as st
    from store.rows import COLUMNS, event_row, typed_rows

    runs_dir, rid, shift = sys.argv[1], sys.argv[2], float(sys.argv[3])
    client = st.connect(st.default_dsn(runs_dir, rid))
    st.apply_ddl(client)
    t0 = 1_800_000_000.0
    events = [ev.RunStarted(run_id=rid, ts=t0, config_json="{}"),
              ev.WeightsPublished(run_id=rid, ts=t0, policy_version=0, step=0, uri="/w/v0", num_bytes=2_000_000),
              ev.EvalResult(run_id=rid, step=0, policy_version=0, split="init", metrics={"eval/accuracy": 0.05})]
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
        # one multi-turn episode per step: turns 1..3, every other one a success
        sid = f"s{step}-ep"
        task = ev.RolloutTask(run_id=rid, sample_id=sid, group_id=f"g{step}", index=2, group_size=3,
                              prompt_id="grid", domain="grid", prompt="walk", policy_version=step)
        gen = ev.Generation(run_id=rid, task=task, prompt_ids=[1], response_ids=[3], response_text="R",
                            logprobs=[-0.1], loss_mask=[1], finish_reason="stop", policy_version=step,
                            policy_version_end=step, num_turns=1 + step % 3, episode_id=f"{sid}@0000000{step}",
                            env_finish=("terminated", "max_turns")[step % 2], success=step % 2 == 0)
        scored = ev.ScoredSample(run_id=rid, generation=gen, reward=float(step % 2 == 0))
        out = ev.SampleOutcome(run_id=rid, sample_id=sid, group_id=f"g{step}", status="trained",
                               policy_version=step, trained_version=step, step=step)
        events += [task, gen, scored, out]
        ids.append(sid)
        events.append(ev.WeightsPublished(run_id=rid, ts=t0 + 30 * step, policy_version=step + 1, step=step + 1,
                                          uri=f"/w/v{step + 1}", num_bytes=2_000_000))
        events.append(ev.TrainStep(run_id=rid, step=step, policy_version=step, sample_ids=ids,
                                   staleness_hist={0: 1, 1: 1},
                                   metrics={"rollout/reward_mean": shift + 0.1 * step, "actor/approx_kl": 0.01 * step,
                                            "actor/entropy": 2.0 - 0.1 * step, "rollout/response_len_mean": 5.0 + step,
                                            "loss/clipfrac": 0.05, "rollout/staleness_mean": 0.5,
                                            "perf/train_tokens_per_s": 1000.0 + step}))
        events.append(ev.EvalResult(run_id=rid, step=step, policy_version=step, split="heldout",
                                    metrics={"eval/accuracy": shift + 0.1 * step, "eval/math/accuracy": 0.5,
                                             "eval/code/accuracy": 0.2 + 0.05 * step}))
    if shift:  # run-b is visual: its held-out evaluations recorded answers with images, one blob missing
        import envs
        from blobs import BlobStore, blob_dir_of, sha256_hex

        problems = envs.make_source("shapes").heldout(3)
        store = BlobStore(blob_dir_of(f"{runs_dir}/{rid}"))
        for p in problems[:2]:
            store.put(p.images[0])
        for step in (1, 3):
            answers = [ev.EvalAnswer(domain="see", prompt_id=p.prompt_id, prompt=p.prompt, reference=p.reference,
                                     response=p.reference if i != 1 else "blue<b>", correct=i != 1,
                                     image_hashes=[sha256_hex(p.images[0])]) for i, p in enumerate(problems)]
            e = ev.EvalResult(run_id=rid, step=step, policy_version=step, split="heldout",
                              metrics={"eval/accuracy": 0.5}, answers=answers[:step])
            client.insert("events", [event_row(f"rs.{rid}.metrics", 0, 100 + step, rid, "metrics", None, e, None,
                                               e.ts)], column_names=COLUMNS["events"])
    # one issued task that never came back
    events.append(ev.RolloutTask(run_id=rid, sample_id="lost", group_id="gx", index=0, group_size=1,
                                 prompt_id="px", domain="math", prompt="?"))
    events.append(ev.RunFinished(run_id=rid, ts=t0 + 125.0, status="completed"))
    for offset, e in enumerate(events):
        for table, rows in typed_rows(e).items():
            client.insert(table, rows, column_names=COLUMNS[table])
        if isinstance(e, (ev.RunStarted, ev.RunFinished)):
            client.insert("events", [event_row(f"rs.{rid}.control", 0, offset, rid, "control", None, e, None, e.ts)],
                          column_names=COLUMNS["events"])
""")


def make_run(runs_dir: Path, rid: str, shift: float = 0.0) -> None:
    (runs_dir / rid).mkdir(parents=True, exist_ok=True)
    (runs_dir / rid / "config.yaml").write_text(f"run:\n  name: {rid}\ntrain:\n  lr: 2.0e-5\n  steps: 4\n")
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


def check_report(out: Path, n_imgs: int = 16) -> str:
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
    assert "report:" in res.stdout and "run-a: 4/4 steps done" in res.stdout
    index = check_report(runs_dir / "run-a" / "report")
    # the headline comes first: accuracy before the warm-up, at the start and at the end, steps, samples, time
    head = index[index.index("class='headline'"):index.index("class='figs'")]
    for label, value in [("accuracy before warm-up", "5.0%"), ("accuracy after warm-up", "0.0%"),
                         ("accuracy at the end", "30.0%"), ("episode success (training)", "50.0%"),
                         ("steps", "4/4"), ("samples", "13"), ("wall time", "2 min 05 s")]:
        assert f"<div class='label'>{label}</div><div class='value'>{value}</div>" in head, label
    # written captions in page order (the accuracy first), stage names as words, the config as a diff
    captions = re.findall(r"<figcaption>(.*?)</figcaption>", index)
    assert len(captions) == 16 and all(len(c) > 30 and ".png" not in c for c in captions)
    assert captions[0].startswith("Accuracy on the fixed held-out set")
    assert "waiting in queue" in index and "queue_s" not in index
    assert "<td>train.lr</td><td>1e-05</td><td>2e-05</td>" in index and "<td>run.seed</td>" not in index
    assert "5 versions: 0–4" in index and "samples.trained" in index  # weights summarised; summary.json
    assert "Held-out answers" not in index and "class='answer'" not in index  # a text run: no answers section


def test_report_two_runs_overlaid(runs_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    res = cli("report", "run-a", "run-b", "--runs-dir", str(runs_dir), "--out", str(out))
    assert res.returncode == 0, res.stderr
    index = check_report(out)
    assert "run-a vs run-b" in index and index.count("class='headline'") == 2
    # run-b is visual: the last evaluation's answers (step 3), two images from its blob store, one missing
    assert index.count("Held-out answers") == 1 and "run-b: Held-out answers at step 3" in index
    section = index[index.index("run-b: Held-out answers"):index.index("<h2>Samples by status")]
    assert section.count("<img class='answer' src=\"data:image/png;base64,") == 2
    assert section.count("class='qa'") == 3 and "(2 of 3 right)" in section
    assert section.count("✓ right") == 2 and "✗ wrong" in section and "blue&lt;b&gt;" in section  # escaped
    assert "missing from the blob store" in section and "1 image(s) could not be read" in section


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


@pytest.fixture(scope="module")
def loaded(runs_dir: Path) -> list[dict[str, Any]]:
    return rp.load_runs(["run-a", "run-b"], runs_dir)


def test_figures_have_titles_axis_labels_and_captions(loaded: list[dict[str, Any]]) -> None:
    figs = rp.make_figures(loaded)
    assert list(figs) == list(page.ORDER)  # every plot, the agentic ones included, accuracy first
    for stem, (fig, caption) in figs.items():
        ax = fig.axes[0]
        assert ax.get_title() and ax.get_xlabel() and caption, stem
        labels = {t.get_text() for t in ax.get_legend().get_texts()}
        assert any("run-a" in t for t in labels) and any("run-b" in t for t in labels), stem
    assert "π_old" in figs["kl"][1] and "behaviour" in figs["kl"][1]  # which policies the KL compares
    assert loaded[0]["status"] == {"issued": 1, "trained": 12}
    assert dict((int(k), v) for k, v in loaded[0]["staleness_hist"]) == {0: 4, 1: 4}
    assert loaded[0]["latency"]["gen_s"]["n"] == 12
    assert [(t["num_turns"], t["episodes"]) for t in loaded[0]["episodes"]["turns"]] == [(1, 2), (2, 1), (3, 1)]


def test_one_step_convention_log_status_and_integer_counts(loaded: list[dict[str, Any]]) -> None:
    """Steps are steps done (a train step k is drawn at k + 1, as evals and `status` count); the
    status counts are on a log scale; counts have integer ticks."""
    figs = rp.make_figures(loaded[:1])
    assert list(figs["reward_mean"][0].axes[0].lines[0].get_xdata()) == [1, 2, 3, 4]
    assert list(figs["eval_accuracy"][0].axes[0].lines[0].get_xdata()) == [0, 1, 2, 3]  # evals: their steps
    assert figs["status"][0].axes[0].get_yscale() == "log"
    for stem in ("staleness_hist", "turns"):
        ax = figs[stem][0].axes[0]
        assert all(float(t).is_integer() for t in ax.get_xticks()), stem
        assert all(float(t).is_integer() for t in ax.get_yticks()), stem
    assert page.steps_done(loaded[0]) == 4 and page.wall_s(loaded[0]) == 125.0


def test_empty_record_plots_no_data() -> None:
    empty = {"run_id": "e", "train_steps": [], "evals": [], "staleness_hist": [], "latency": {},
             "domain_reward": [], "status": {}}
    figs = rp.make_figures([empty])
    assert not set(page.AGENTIC) & set(figs)  # no episodes: no agentic plots
    for stem, (fig, _caption) in figs.items():
        ax = fig.axes[0]
        assert any(t.get_text() == "no data" for t in ax.texts), stem
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title(), stem


def test_config_diff_shows_only_what_differs_from_the_defaults() -> None:
    rows, n_keys = page.config_diff([{"train": {"lr": 1e-5, "steps": 7}, "run": {"name": "x"}}, None])
    assert rows == [["run.name", "run", "x", "—"], ["train.steps", 40, 7, "—"]] and n_keys > 100


def test_extraction_reports_progress_per_query(runs_dir: Path) -> None:
    """The child announces each query on stderr; the parent hands the lines on as they come."""
    seen: list[str] = []
    runs = rp.load_runs(["run-a", "run-b"], runs_dir, progress=seen.append)
    assert [r["run_id"] for r in runs] == ["run-a", "run-b"]
    names = [*rp.QUERIES, *rp.AGENTIC_QUERIES]  # the runs have episodes
    for rid in ("run-a", "run-b"):
        mine = [m for m in seen if m.startswith(f"{rid}: ")]
        assert [m.split(": ", 2)[1] for m in mine] == [f"query {i}/{len(names)}" for i in range(1, len(names) + 1)]
        assert mine[0].endswith(names[0]) and "previous took" in mine[-1]


def test_a_visual_run_whose_blob_store_is_gone_gets_a_note(tmp_path: Path) -> None:
    """The answers' images come from the run's blob store; without it each answer says why, the page
    notes it, and nothing fails. A run whose answers show no images (a text run) gets no section."""
    answer = {"domain": "see", "prompt_id": "shapes-3", "prompt": "What colour is the square?", "reference": "red",
              "response": "red", "correct": True, "image_hashes": ["ab" * 32]}
    run = {"run_id": "v", "answers": {"step": 2, "items": [answer]}, "blob_dir": str(tmp_path / "gone")}
    images = rp.answer_images([run])
    assert images == {("v", "ab" * 32): f"the run's blob store {tmp_path / 'gone'} is missing"}
    section = page.answers_html(run, images)
    assert "Held-out answers at step 2" in section and "<img" not in section
    assert "blob store" in section and "1 image(s) could not be read" in section and "✓ right" in section
    text = {"run_id": "t", "answers": {"step": 2, "items": [dict(answer, image_hashes=[])]}}
    assert rp.answer_images([text]) == {} and page.answers_html(text, {}) == ""


@pytest.mark.bench
def test_report_of_a_visual_run_shows_held_out_images_and_answers(visual_run: Any, tmp_path: Path) -> None:
    """A real visual run: the last evaluation's 8 recorded answers with their images; the same run
    without its blob store reports too, each image replaced by the reason."""
    res = cli("report", visual_run.run_id, "--runs-dir", str(visual_run.runs))
    assert res.returncode == 0, res.stderr
    index = (visual_run.runs / visual_run.run_id / "report" / "index.html").read_text()
    assert "Held-out answers at step 2" in index
    section = index[index.index("Held-out answers at step 2"):index.index("<h2>Samples by status")]
    assert section.count("class='qa'") == 8 and section.count("<img class='answer'") == 8
    assert "What colour is the square?" in section and "could not be read" not in section

    blobs = visual_run.runs / visual_run.run_id / "blobs"
    blobs.rename(tmp_path / "blobs")  # the run without its blob store (given back below: the run is shared)
    try:
        gone = cli("report", visual_run.run_id, "--runs-dir", str(visual_run.runs), "--out", str(tmp_path / "r"))
    finally:
        (tmp_path / "blobs").rename(blobs)
    assert gone.returncode == 0, gone.stderr
    index = (tmp_path / "r" / "index.html").read_text()
    assert "<img class='answer'" not in index and "8 image(s) could not be read" in index
