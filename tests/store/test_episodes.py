"""Multi-turn episodes in the record, on the real ClickHouse engine (chDB): the recorder's row
builder turns a synthetic run (a retried multi-turn episode, a single-turn sample, an episode
still in flight) into rows; the `episodes` view reads one row per sample, the episode its
generation names; and the ready queries of docs/analytics.md (run as they are written there)
return the expected rows. A store made before DDL 006 gets the new columns on open."""

from __future__ import annotations

import json
import re
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
from store.rows import COLUMNS, typed_rows
from tests.schemas.examples import example_events
from tests.store.recorded_run import topic_of

DOC = Path(__file__).resolve().parents[2] / "docs" / "analytics.md"
A = "grid/0@0000aaaa"  # the first attempt of grid/0: its step 1 timed out, its answer came late
B = "grid/0@1234abcd"  # the retry that the generation names


def doc_query(columns: str) -> str:
    """The one ```sql block of docs/analytics.md whose ``-- columns:`` line starts with ``columns``."""
    blocks = [m.group(1).strip() for m in re.finditer(r"```sql\n(.*?)```", DOC.read_text(), re.S)]
    found = [q for q in blocks if re.search(rf"^-- columns: {re.escape(columns)}\b", q, re.M)]
    assert len(found) == 1, f"{len(found)} queries in docs/analytics.md with columns {columns!r}..."
    return found[0]


def synthetic_run(run_id: str) -> list[ev.Event]:
    """Events of three samples, in the order the bus would carry them."""
    t0 = time.time() - 100.0

    def obs(episode: str, step: int, ts: float, text: str, env_s: float, **kw: Any) -> ev.EnvObservation:
        return ev.EnvObservation(run_id=run_id, ts=t0 + ts, episode_id=episode, step=step, observation=text,
                                 env_s=env_s, **kw)

    def act(episode: str, step: int, ts: float, action: str, version: int) -> ev.EnvStep:
        return ev.EnvStep(run_id=run_id, ts=t0 + ts, episode_id=episode, step=step, action=action,
                          policy_version=version)

    def reset(episode: str, sample: str, ts: float, env: str) -> ev.EnvReset:
        return ev.EnvReset(run_id=run_id, ts=t0 + ts, episode_id=episode, sample_id=sample,
                           env=ev.EnvSpec(name=env), seed=7)

    def task(sid: str, domain: str, ts: float) -> ev.RolloutTask:
        return ev.RolloutTask(run_id=run_id, ts=t0 + ts, sample_id=sid, group_id=sid.split("/")[0], index=0,
                              group_size=1, prompt_id=f"{domain}-1", domain=domain, prompt="go", policy_version=1)

    def rest(t: ev.RolloutTask, ts: float, reward: float, **gen: Any) -> list[ev.Event]:
        g = ev.Generation(run_id=run_id, ts=t0 + ts, task=t, prompt_ids=[1, 2], response_ids=[3, 4, 5],
                          response_text="...", logprobs=[-0.5] * 3, loss_mask=[1] * 3, finish_reason="stop",
                          policy_version=1, policy_version_end=gen.pop("policy_version_end", 1), worker_id="w0",
                          queued_s=0.5, gen_s=1.0, **gen)
        return [g,
                ev.ScoredSample(run_id=run_id, ts=t0 + ts + 0.5, generation=g, reward=reward, verifier="env",
                                reward_s=0.01, policy_version=1),
                ev.SampleOutcome(run_id=run_id, ts=t0 + ts + 1.0, sample_id=t.sample_id,
                                 group_id=t.group_id, status="trained", policy_version=1, trained_version=2, step=2)]

    grid = task("grid/0", "grid", 0.0)
    single = task("arith/0", "arith", 1.0)
    maze = task("maze/0", "maze", 2.0)
    return [
        grid, single, maze,
        # attempt A: reset, one action; the agent gave up waiting for its answer and retried
        reset(A, "grid/0", 0.1, "gridworld"), obs(A, 0, 0.2, "start at (0,0)", 0.05), act(A, 1, 0.5, "right", 1),
        # attempt B, played to the end (step 2 sent twice: a re-sent request is not a second turn)
        reset(B, "grid/0", 11.0, "gridworld"), obs(B, 0, 11.5, "start at (0,0)", 0.25),
        act(B, 1, 12.0, "right", 1), obs(B, 1, 12.75, "at (0,1)", 0.5),
        act(B, 2, 13.0, "down", 1), act(B, 2, 13.5, "down", 1), obs(B, 2, 14.25, "at (1,1)", 0.75, reward=0.5),
        act(B, 3, 15.0, "down", 2),
        obs(B, 3, 16.0, "goal", 1.0, reward=1.0, terminated=True, info={"success": True}),
        *rest(grid, 16.5, 1.0, env_s=2.5, num_turns=3, episode_id=B, step_rewards=[0.0, 0.5, 1.0],
              turn_versions=[1, 1, 2], state_hashes=["s00", "s01", "s11"], env_finish="terminated", success=True,
              policy_version_end=2),
        # attempt A's late answer (after B): the newest events of grid/0, yet not its episode
        obs(A, 1, 17.2, "", 16.5, error="timeout: step took 16.5 s > 10 s", terminated=True, failed=True),
        *rest(single, 18.0, 0.25),
        # maze/0: not generated yet, on its second attempt
        reset("maze/0@00000001", "maze/0", 20.0, "maze"), obs("maze/0@00000001", 0, 20.5, "dark", 0.125),
        reset("maze/0@00000002", "maze/0", 30.0, "maze"), obs("maze/0@00000002", 0, 30.25, "dark", 0.125),
        act("maze/0@00000002", 1, 31.0, "north", 2), obs("maze/0@00000002", 1, 31.5, "wall", 0.25),
    ]


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
    run_id = f"ep{int(time.time() * 1e6) % 10**12:012d}"
    client = st.connect(store_dsn)
    st.apply_ddl(client)
    record(client, synthetic_run(run_id), store_dsn)
    return client, run_id


def rows(client: Any, query: str, run_id: str) -> list[dict[str, Any]]:
    result = client.query(query, parameters={"run": run_id}, settings={"readonly": 2})
    return [dict(zip(result.column_names, r, strict=True)) for r in result.result_rows]


def test_typed_rows_fill_every_column() -> None:
    events = [*example_events(), *synthetic_run("cols")]
    for e in events:
        for table, table_rows in typed_rows(e).items():
            for row in table_rows:
                assert len(row) == len(COLUMNS[table]), (table, type(e).__name__)
    (gen,) = [e for e in synthetic_run("cols") if isinstance(e, ev.Generation) and e.episode_id]
    named = dict(zip(COLUMNS["sample_generations"], typed_rows(gen)["sample_generations"][0], strict=True))
    assert named["episode_id"] == B and named["env_finish"] == "terminated" and named["success"] == 1
    assert named["step_rewards"] == [0.0, 0.5, 1.0] and named["turn_versions"] == [1, 1, 2]
    assert named["state_hashes"] == ["s00", "s01", "s11"]


def test_the_new_columns_are_stored(recorded: tuple[Any, str]) -> None:
    client, run_id = recorded
    p = {"r": run_id}
    gen = client.query("SELECT episode_id, env_finish, env_error, success, step_rewards, turn_versions, state_hashes "
                       "FROM sample_generations FINAL WHERE run_id = {r:String} AND sample_id = 'grid/0'",
                       parameters=p).result_rows
    assert gen == [(B, "terminated", "", 1, [0.0, 0.5, 1.0], [1, 1, 2], ["s00", "s01", "s11"])]
    env = client.query("SELECT kind, step, env_s, failed FROM env_events FINAL WHERE run_id = {r:String} "
                       "AND episode_id = {e:String} ORDER BY step, kind, ts", parameters={**p, "e": A}).result_rows
    assert env == [("EnvObservation", 0, 0.05, 0), ("EnvReset", 0, 0.0, 0),
                   ("EnvObservation", 1, 16.5, 1), ("EnvStep", 1, 0.0, 0)]


def test_episodes_view_reads_the_episode_the_generation_names(recorded: tuple[Any, str]) -> None:
    client, run_id = recorded
    got = {r["sample_id"]: r for r in rows(client, "SELECT * FROM episodes WHERE run_id = {run:String}", run_id)}
    assert set(got) == {"grid/0", "arith/0", "maze/0"}  # a retried sample is one row

    grid = got["grid/0"]
    assert grid["multi_turn"] == 1 and grid["episode_id"] == B and grid["attempts"] == 2
    assert grid["num_turns"] == 3 and grid["total_reward"] == 1.5 and grid["reward"] == 1.0
    assert grid["env_s"] == pytest.approx(0.25 + 0.5 + 0.75 + 1.0)  # the worker's env_s, B only
    assert grid["env_wait_s"] == pytest.approx(0.5 + 0.75 + 1.25 + 1.0)  # request -> observation ts
    assert grid["terminated"] == 1 and grid["truncated"] == 0 and grid["env_errors"] == 0  # A's failure is not B's
    assert grid["success"] == 1 and grid["env_finish"] == "terminated" and grid["env_error"] == ""
    assert grid["status"] == "trained" and grid["step"] == 2

    single = got["arith/0"]
    assert single["multi_turn"] == 0 and single["episode_id"] == "" and single["attempts"] == 0
    assert single["num_turns"] == 1 and single["env_s"] == 0.0 and single["total_reward"] == 0.25
    assert single["reward"] == 0.25 and single["status"] == "trained"
    assert single["terminated"] is None and single["truncated"] is None and single["success"] is None
    assert single["env_finish"] == "" and single["env_wait_s"] is None

    maze = got["maze/0"]  # in flight: its latest attempt so far
    assert maze["multi_turn"] == 1 and maze["episode_id"] == "maze/0@00000002" and maze["attempts"] == 2
    assert maze["num_turns"] == 1 and maze["env_s"] == 0.375 and maze["total_reward"] == 0.0
    assert maze["terminated"] == 0 and maze["success"] is None and maze["status"] == "issued"


def test_doc_turn_by_turn_query(recorded: tuple[Any, str]) -> None:
    client, run_id = recorded
    got = rows(client, doc_query("step, action, policy_version, observation"), run_id)
    assert [tuple(r.values()) for r in got] == [
        (0, "", None, "start at (0,0)", 0.0, 0.25, 0, 0, 0, "", B),
        (1, "right", 1, "at (0,1)", 0.0, 0.5, 0, 0, 0, "", B),
        (2, "down", 1, "at (1,1)", 0.5, 0.75, 0, 0, 0, "", B),
        (3, "down", 2, "goal", 1.0, 1.0, 1, 0, 0, "", B),
    ]


def test_doc_turns_histogram_query(recorded: tuple[Any, str]) -> None:
    client, run_id = recorded
    got = rows(client, doc_query("num_turns, episodes"), run_id)
    assert [(r["num_turns"], r["episodes"], r["share"], r["succeeded"], r["total_reward_mean"]) for r in got] == [
        (1, 1, 0.5, 0, 0.0), (3, 1, 0.5, 1, 1.5)]


def test_doc_env_latency_query(recorded: tuple[Any, str]) -> None:
    client, run_id = recorded
    got = rows(client, doc_query("env, answer, observations"), run_id)
    assert [(r["env"], r["answer"], r["observations"], r["max_s"], r["failed"]) for r in got] == [
        ("gridworld", "reset", 2, 0.25, 0), ("gridworld", "step", 4, 16.5, 1),
        ("maze", "reset", 2, 0.125, 0), ("maze", "step", 1, 0.25, 0),
        ("(all)", "reset", 4, 0.25, 0), ("(all)", "step", 5, 16.5, 1)]
    for r in got:
        assert r["p50_s"] <= r["p90_s"] <= r["p99_s"] <= r["max_s"]
    by = {(r["env"], r["answer"]): r for r in got}
    assert by[("gridworld", "reset")]["p50_s"] == 0.15 and by[("(all)", "step")]["mean_s"] == 3.8


def test_doc_episodes_query(recorded: tuple[Any, str]) -> None:
    client, run_id = recorded
    got = {(r["domain"], r["multi_turn"]): r for r in rows(client, doc_query("domain, multi_turn"), run_id)}
    assert set(got) == {("grid", 1), ("arith", 0), ("maze", 1)}
    grid = got[("grid", 1)]
    assert (grid["turns_mean"], grid["env_s_mean"], grid["succeeded"], grid["retried"]) == (3.0, 2.5, 1, 1)


OLD_STORE = r"""
import json, shutil, sys, tempfile
from datetime import UTC, datetime
from pathlib import Path
import store as st

old = Path(tempfile.mkdtemp())
for version, path in st.ddl_files():
    if version <= 5:
        shutil.copy(path, old / path.name)
client = st.connect(sys.argv[1])
st.apply_ddl(client, old)
t = lambda s: datetime.fromtimestamp(1.7e9 + s, UTC)
r = "old"
client.insert("sample_tasks", [[r, "g/0", "g", "p", "grid", 0, t(0)]],
              column_names=["run_id", "sample_id", "group_id", "prompt_id", "domain", "issued_version", "issued_ts"])
client.insert("sample_generations", [[r, "g/0", 0, 0, 3, "stop", "w", 0.0, 1.0, 0.0, t(9), 1]],
              column_names=["run_id", "sample_id", "policy_version", "policy_version_end", "response_len",
                            "finish_reason", "worker_id", "queued_s", "gen_s", "env_s", "generated_ts", "num_turns"])
cols = ["run_id", "episode_id", "sample_id", "kind", "step", "env", "policy_version", "text", "reward",
        "terminated", "truncated", "error", "event_id", "ts"]
client.insert("env_events", [
    [r, "ep", "g/0", "EnvReset", 0, "grid", -1, "", 0.0, 0, 0, "", "e1", t(1)],
    [r, "ep", "", "EnvObservation", 0, "", -1, "o0", 0.0, 0, 0, "", "e2", t(1.5)],
    [r, "ep", "", "EnvStep", 1, "", 0, "a1", 0.0, 0, 0, "", "e3", t(2)],
    [r, "ep", "", "EnvObservation", 1, "", -1, "o1", 1.0, 1, 0, "", "e4", t(3)],
], column_names=cols)
new = st.apply_ddl(client)
q = lambda sql: [list(map(str, row)) for row in client.query(sql).result_rows]
print(json.dumps({
    "new": new,
    "gen": q("SELECT episode_id, env_finish, success, step_rewards FROM sample_generations FINAL WHERE run_id = 'old'"),
    "env": q("SELECT env_s, failed FROM env_events FINAL WHERE run_id = 'old' ORDER BY ts"),
    "episode": q("SELECT multi_turn, episode_id, num_turns, env_s, env_wait_s, total_reward, terminated, success, "
                 "attempts FROM episodes WHERE run_id = 'old'"),
}))
"""


def test_a_store_made_before_006_gets_the_new_columns(tmp_path: Path) -> None:
    """Runs in a subprocess: chDB lets one process open one store directory."""
    out = subprocess.run([sys.executable, "-c", OLD_STORE, f"chdb://{tmp_path / 'old'}"], capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["new"] == [v for v, _ in st.ddl_files() if v > 5]
    assert got["gen"] == [["", "", "0", "[]"]]
    assert got["env"] == [["0.0", "0"]] * 4
    # no worker-measured env_s in an old record: env_s falls back to request -> observation time
    assert got["episode"] == [["1", "ep", "1", "1.5", "1.5", "1.0", "1", "None", "1"]]
