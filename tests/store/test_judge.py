"""Judge and reward-model scoring in the record, on the real ClickHouse engine (chDB): the
recorder stores a judged run (judged samples, unparseable judge answers, a judge failure, a
request still waiting for its judge, unjudged domains) with the judge columns of DDL 007 filled;
a ``JudgeRequest`` goes to ``events`` only; the queries of docs/analytics.md "Judges and reward
models" (run as they are written there) return the expected numbers; ``rollstream report``
extracts the judge per domain; and a store made before DDL 007 gets the new columns on open."""

from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

import store as st
from runtime.records import Record
from schemas import events as ev
from schemas.topics import topic_name
from services.recorder import Recorder, RecorderSettings
from services.reward_router import with_verdict
from store import report as rp
from store.rows import COLUMNS, typed_rows
from tests.schemas.examples import example_events
from tests.store.recorded_run import topic_of

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "analytics.md"
LLM = "qwen-judge"  # the essay domain's judge: verifier 0.5 + judge 0.5
RM = "rm-small"  # the math domain's reward model: judge 1.0
WEIGHTS = {"essay": {"verifier": 0.5, "judge": 0.5}, "math": {"judge": 1.0}}
JUDGE_OF = {"essay": LLM, "math": RM}
NO_INT = "no integer in the judge's answer {!r}"

# sample, domain, trainer step (-1: not decided yet), verifier correct, judge score, judge_s, judge error
SAMPLES: list[tuple[str, str, int, int, float, float, str]] = [
    ("essay/0", "essay", 0, 1, 0.8, 0.5, ""),
    ("essay/1", "essay", 0, 0, 0.2, 1.5, ""),
    ("essay/2", "essay", 0, 1, 0.7, 0.25, NO_INT.format("a fine essay")),
    ("arith/0", "arith", 0, 1, 0.0, 0.0, ""),
    ("essay/3", "essay", 1, 1, 1.0, 0.5, ""),
    ("essay/4", "essay", 1, 0, 0.9, 0.5, "judge answered 15, outside [1, 10]"),
    ("essay/5", "essay", 1, 0, 0.0, 1.0, NO_INT.format("meh, 3 stars")),
    ("math/0", "math", 1, 1, 0.9, 0.125, ""),
    ("math/1", "math", 1, 0, 0.6, 0.375, ""),
    ("arith/1", "arith", 1, 0, 0.0, 0.0, ""),
    ("essay/6", "essay", -1, 1, 0.0, 2.0, "judge model failed: RuntimeError: CUDA out of memory"),
]
WAITING = "essay/7"  # sent to its judge, no verdict yet


def doc_query(columns: str) -> str:
    """The one ```sql block of docs/analytics.md whose ``-- columns:`` line starts with ``columns``."""
    blocks = [m.group(1).strip() for m in re.finditer(r"```sql\n(.*?)```", DOC.read_text(), re.S)]
    found = [q for q in blocks if re.search(rf"^-- columns: {re.escape(columns)}\b", q, re.M)]
    assert len(found) == 1, f"{len(found)} queries in docs/analytics.md with columns {columns!r}..."
    return found[0]


def synthetic_run(run_id: str) -> list[ev.Event]:
    """The run's events in the order the bus would carry them: per sample its task, generation,
    the router's ``JudgeRequest`` (judged domains) and the judge's ``ScoredSample``, its outcome."""
    t0 = time.time() - 100.0
    out: list[ev.Event] = []
    for i, (sid, domain, step, correct, score, judge_s, error) in enumerate([*SAMPLES, (WAITING, "essay", -1, 0, 0.0,
                                                                                       0.0, "")]):
        t = t0 + i
        task = ev.RolloutTask(run_id=run_id, ts=t, sample_id=sid, group_id=f"{domain}-{step}", index=0,
                              group_size=1, prompt_id=f"{domain}-{i}", domain=domain, prompt="write", policy_version=1)
        gen = ev.Generation(run_id=run_id, ts=t + 0.25, task=task, prompt_ids=[1, 2], response_ids=[3, 4],
                            response_text="an answer", logprobs=[-0.5] * 2, loss_mask=[1] * 2, finish_reason="stop",
                            policy_version=1, policy_version_end=1, worker_id="w0", queued_s=0.125, gen_s=0.125)
        judge = JUDGE_OF.get(domain, "")
        rewards = {"correct": float(correct), "verifier": float(correct)} if judge else {"correct": float(correct)}
        router = ev.ScoredSample(run_id=run_id, ts=t + 0.5, generation=gen, reward=0.0 if judge else float(correct),
                                 rewards=rewards, verifier="exact", details="checked", reward_s=0.0625,
                                 policy_version=1)
        out += [task, gen]
        if judge:
            out.append(ev.JudgeRequest(run_id=run_id, ts=t + 0.5, scored=router, judge=judge))
            if sid == WAITING:
                continue
            out.append(with_verdict(router, judge, WEIGHTS[domain], score=score, answer=f"{score}", error=error,
                                    judge_s=judge_s))
        else:
            out.append(router)
        if step >= 0:
            out.append(ev.SampleOutcome(run_id=run_id, ts=t + 0.75, sample_id=sid, group_id=task.group_id,
                                        status="trained", policy_version=1, trained_version=2 + step, step=step))
    return out


def record(client: Any, events: list[ev.Event], dsn: str) -> None:
    """What the recorder does with a poll of these events: its row builder, then one insert per table."""
    recorder = Recorder(RecorderSettings(run_id=events[0].run_id, dsn=dsn))
    records = [Record(topic=topic_name(e.run_id, topic_of(e)), partition=0, offset=i, key=None,
                      value_bytes=msgspec.msgpack.encode(e), event=e, error=None, ts=e.ts)
               for i, e in enumerate(events)]
    recorder._client = client
    recorder.insert(recorder.rows_for(records))


@pytest.fixture(scope="module")
def recorded(store_dsn: str) -> tuple[Any, str]:
    run_id = f"jg{int(time.time() * 1e6) % 10**12:012d}"
    client = st.connect(store_dsn)
    st.apply_ddl(client)
    record(client, synthetic_run(run_id), store_dsn)
    return client, run_id


def rows(client: Any, query: str, run_id: str) -> list[dict[str, Any]]:
    result = client.query(query, parameters={"run": run_id}, settings={"readonly": 2})
    return [dict(zip(result.column_names, r, strict=True)) for r in result.result_rows]


def test_typed_rows_carry_the_judge_fields() -> None:
    scored = [e for e in synthetic_run("cols") if isinstance(e, ev.ScoredSample)]
    for e in [*example_events(), *scored]:
        for table, table_rows in typed_rows(e).items():
            for row in table_rows:
                assert len(row) == len(COLUMNS[table]), (table, type(e).__name__)
    (failed,) = [e for e in scored if e.generation.task.sample_id == "essay/4"]
    named = dict(zip(COLUMNS["sample_rewards"], typed_rows(failed)["sample_rewards"][0], strict=True))
    assert (named["judge"], named["judge_s"], named["judge_error"]) == (LLM, 0.5, "judge answered 15, outside [1, 10]")
    assert named["rewards"] == {"correct": 0.0, "verifier": 0.0, "judge": 0.0}
    (request,) = [e for e in example_events() if isinstance(e, ev.JudgeRequest)]
    assert typed_rows(request) == {}  # the judge's ScoredSample fills sample_rewards, not its request


def test_the_recorder_subscribes_to_judge_requests() -> None:
    settings = Recorder(RecorderSettings(run_id="jgrun", dsn="chdb:///unused")).service_settings()
    assert topic_name("jgrun", "judge.requests") in settings.subscription.topics and not settings.subscription.topic_pattern
    every_run = Recorder(RecorderSettings(run_id="", dsn="chdb:///unused")).service_settings()
    assert not every_run.subscription.topics and re.match(every_run.subscription.topic_pattern,
                                                            topic_name("jgrun", "judge.requests"))


def test_the_judge_columns_are_stored(recorded: tuple[Any, str]) -> None:
    client, run_id = recorded
    got = {r[0]: r[1:] for r in client.query(
        "SELECT sample_id, judge, judge_s, judge_error, rewards['judge'] FROM sample_rewards FINAL "
        "WHERE run_id = {r:String}", parameters={"r": run_id}).result_rows}
    assert set(got) == {s[0] for s in SAMPLES}  # the waiting request has no row
    for sid, domain, _, _, score, judge_s, error in SAMPLES:
        judge = JUDGE_OF.get(domain, "")
        assert got[sid] == (judge, judge_s, error, (0.0 if error else score) if judge else 0.0), sid
    view = {r[0]: r[1:] for r in client.query(
        "SELECT sample_id, status, judge, judge_s, judge_error, verifier, rewards FROM samples "
        "WHERE run_id = {r:String}", parameters={"r": run_id}).result_rows}
    assert view["essay/0"] == ("trained", LLM, 0.5, "", "exact", {"correct": 1.0, "verifier": 1.0, "judge": 0.8})
    assert view["arith/1"] == ("trained", "", 0.0, "", "exact", {"correct": 0.0})
    assert view["essay/6"][:4] == ("scored", LLM, 2.0, "judge model failed: RuntimeError: CUDA out of memory")
    assert view[WAITING] == ("generated", None, None, None, None, {})


def test_judge_requests_are_in_events(recorded: tuple[Any, str]) -> None:
    client, run_id = recorded
    got = client.query("SELECT name, JSONExtractString(payload, 'judge'), "
                       "JSONExtractString(payload, 'scored', 'generation', 'task', 'sample_id') FROM events "
                       "WHERE run_id = {r:String} AND kind = 'JudgeRequest' ORDER BY offset",
                       parameters={"r": run_id}).result_rows
    judged = [s[0] for s in SAMPLES if s[1] in JUDGE_OF]
    assert got == [("judge.requests", JUDGE_OF[sid.split("/")[0]], sid) for sid in [*judged, WAITING]]


def test_doc_reward_components_query(recorded: tuple[Any, str]) -> None:
    client, run_id = recorded
    got = {(r["domain"], r["step"], r["component"]): (r["samples"], r["mean"])
           for r in rows(client, doc_query("domain, step, component"), run_id)}
    assert got == {
        ("arith", 0, "(reward)"): (1, 1.0), ("arith", 0, "correct"): (1, 1.0),
        ("arith", 1, "(reward)"): (1, 0.0), ("arith", 1, "correct"): (1, 0.0),
        # essay/0..2: rewards 0.5 * verifier + 0.5 * judge; essay/2's judge gave no score (0)
        ("essay", 0, "(reward)"): (3, 0.5), ("essay", 0, "correct"): (3, 0.6667),
        ("essay", 0, "judge"): (3, 0.3333), ("essay", 0, "verifier"): (3, 0.6667),
        ("essay", 1, "(reward)"): (3, 0.3333), ("essay", 1, "correct"): (3, 0.3333),
        ("essay", 1, "judge"): (3, 0.3333), ("essay", 1, "verifier"): (3, 0.3333),
        ("math", 1, "(reward)"): (2, 0.75), ("math", 1, "correct"): (2, 0.5),
        ("math", 1, "judge"): (2, 0.75), ("math", 1, "verifier"): (2, 0.5),
    }
    first = [(r["domain"], r["step"], r["component"]) for r in rows(client, doc_query("domain, step, component"),
                                                                      run_id)][:2]
    assert first == [("arith", 0, "(reward)"), ("arith", 0, "correct")]


def test_doc_agreement_query(recorded: tuple[Any, str]) -> None:
    client, run_id = recorded
    got = rows(client, doc_query("step, samples, judged"), run_id)
    assert [r["step"] for r in got] == [0, 1]
    s0, s1 = got
    # step 0: essay/0 (correct, 0.8) and essay/1 (wrong, 0.2) agree; essay/2 is unscored, arith/0 unjudged
    assert (s0["samples"], s0["judged"], s0["unscored"], s0["compared"]) == (4, 3, 1, 2)
    assert (s0["judge_if_correct"], s0["judge_if_wrong"], s0["agreement"], s0["corr"]) == (0.8, 0.2, 1.0, 1.0)
    # step 1: essay/3 (correct, 1.0), math/0 (correct, 0.9), math/1 (wrong, 0.6: disagrees)
    assert (s1["samples"], s1["judged"], s1["unscored"], s1["compared"]) == (6, 5, 2, 3)
    assert (s1["judge_if_correct"], s1["judge_if_wrong"], s1["agreement"]) == (0.95, 0.6, 0.6667)
    assert s1["corr"] == round(statistics.correlation([1.0, 1.0, 0.0], [1.0, 0.9, 0.6]), 4)


def test_doc_judge_latency_query(recorded: tuple[Any, str]) -> None:
    client, run_id = recorded
    got = {r["judge"]: r for r in rows(client, doc_query("judge, domains, scored"), run_id)}
    assert list(got) == [LLM, RM, "(none)"]
    llm, rm, none = got[LLM], got[RM], got["(none)"]
    llm_s = [s[5] for s in SAMPLES if s[1] == "essay"]
    assert (llm["domains"], llm["scored"], llm["unscored"]) == (["essay"], 7, 4)
    assert llm["max_s"] == 2.0 and llm["mean_s"] == round(sum(llm_s) / 7, 4) and llm["p50_s"] == 0.5
    assert llm["p50_s"] <= llm["p90_s"] <= llm["p99_s"] <= llm["max_s"]
    assert (rm["domains"], rm["scored"], rm["unscored"], rm["p50_s"], rm["max_s"], rm["mean_s"]) == (
        ["math"], 2, 0, 0.25, 0.375, 0.25)
    assert (none["domains"], none["scored"], none["p50_s"], none["max_s"], none["mean_s"]) == (
        ["arith"], 2, None, None, None)
    assert llm["verifier_mean_s"] == none["verifier_mean_s"] == 0.0625


def test_doc_judge_failures_query(recorded: tuple[Any, str]) -> None:
    client, run_id = recorded
    got = {r["domain"]: r for r in rows(client, doc_query("domain, judge, scored"), run_id)}
    assert list(got) == ["arith", "essay", "math"]
    essay = got["essay"]
    assert (essay["judge"], essay["scored"], essay["unscored"], essay["unscored_share"]) == (LLM, 7, 4, 0.5714)
    assert essay["top_reasons"] == [("no integer in the judge's answer <answer>", 2),
                                    ("judge answered N, outside [N, N]", 1),
                                    ("judge model failed: RuntimeError: CUDA out of memory", 1)]
    assert (got["math"]["judge"], got["math"]["scored"], got["math"]["unscored"], got["math"]["top_reasons"]) == (
        RM, 2, 0, [])
    assert (got["arith"]["judge"], got["arith"]["scored"], got["arith"]["unscored"]) == ("", 2, 0)
    assert got["arith"]["unscored_share"] is None


def test_report_extracts_the_judges(recorded: tuple[Any, str]) -> None:
    client, run_id = recorded
    data = rp.extract(client, run_id)
    judges = {(j["domain"], j["judge"]): j for j in data["judges"]}
    assert set(judges) == {("essay", LLM), ("math", RM)}  # unjudged domains are not listed
    essay = judges[("essay", LLM)]
    assert (essay["judged"], essay["unscored"]) == (7, 4)
    assert math.isclose(essay["judge_mean"], (0.8 + 0.2 + 1.0) / 3)  # the judge's scores, failures left out
    assert (judges[("math", RM)]["judged"], judges[("math", RM)]["unscored"]) == (2, 0)
    assert math.isclose(judges[("math", RM)]["judge_mean"], 0.75)
    page = rp.render_html([data], {}, {})
    assert "Judges by domain" in page and LLM in page
    assert "Judges by domain" not in rp.render_html([{**data, "judges": []}], {}, {})


OLD_STORE = r"""
import json, shutil, sys, tempfile
from datetime import UTC, datetime
from pathlib import Path
import store as st
from store.rows import COLUMNS

old = Path(tempfile.mkdtemp())
for version, path in st.ddl_files():
    if version <= 6:
        shutil.copy(path, old / path.name)
client = st.connect(sys.argv[1])
st.apply_ddl(client, old)
before = [r[0] for r in client.query("SELECT name FROM system.columns WHERE database = currentDatabase() "
                                     "AND table = 'sample_rewards' ORDER BY position").result_rows]
t = lambda s: datetime.fromtimestamp(1.7e9 + s, UTC)
r = "old"
client.insert("sample_tasks", [[r, "g/0", "g", "p", "essay", 0, t(0)]],
              column_names=["run_id", "sample_id", "group_id", "prompt_id", "domain", "issued_version", "issued_ts"])
client.insert("sample_rewards", [[r, "g/0", 1.0, {"correct": 1.0}, "exact", "", 0.5, t(1)]],
              column_names=["run_id", "sample_id", "reward", "rewards", "verifier", "details", "reward_s", "scored_ts"])
new = st.apply_ddl(client)
client.insert("sample_tasks", [[r, "g/1", "g", "p", "essay", 0, t(0)]],
              column_names=["run_id", "sample_id", "group_id", "prompt_id", "domain", "issued_version", "issued_ts"])
client.insert("sample_rewards", [[r, "g/1", 0.5, {"correct": 1.0, "judge": 0.0}, "exact", "", 0.5, t(2), "j", 0.25,
                                  "judge answered 15, outside [1, 10]"]], column_names=COLUMNS["sample_rewards"])
q = lambda sql: [list(map(str, row)) for row in client.query(sql, parameters={"run": r}).result_rows]
print(json.dumps({
    "before": before,
    "new": new,
    "rewards": q("SELECT sample_id, judge, judge_s, judge_error FROM sample_rewards FINAL WHERE run_id = 'old' "
                 "ORDER BY sample_id"),
    "samples": q("SELECT sample_id, status, reward, judge, judge_s, judge_error FROM samples WHERE run_id = 'old' "
                 "ORDER BY sample_id"),
    "failures": q(sys.argv[2]),
}))
"""


def test_a_store_made_before_007_gets_the_judge_columns(tmp_path: Path) -> None:
    """Runs in a subprocess: chDB lets one process open one store directory."""
    failures = doc_query("domain, judge, scored")
    out = subprocess.run([sys.executable, "-c", OLD_STORE, f"chdb://{tmp_path / 'old'}", failures],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert "judge" not in got["before"]
    assert got["new"] == [v for v, _ in st.ddl_files() if v > 6]
    assert got["rewards"] == [["g/0", "", "0.0", ""], ["g/1", "j", "0.25", "judge answered 15, outside [1, 10]"]]
    assert got["samples"] == [["g/0", "scored", "1.0", "", "0.0", ""],
                              ["g/1", "scored", "0.5", "j", "0.25", "judge answered 15, outside [1, 10]"]]
    # the documented failures query reads the old row (no judge) next to the new one
    assert got["failures"] == [["essay", "", "1", "0", "0", "None", "[]"],
                               ["essay", "j", "1", "1", "1", "1.0", "[('judge answered N, outside [N, N]', 1)]"]]
