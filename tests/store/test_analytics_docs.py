"""docs/analytics.md cannot rot: its ```sql blocks are the ready queries of store/queries.py as they
are, every one runs against a record made by the real recorder from real events through the
broker, returns rows and exactly the columns it names; and every column of every table and view
of the store is documented with its exact type."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

import store as st
from schemas.config import KafkaSettings
from services.recorder import Recorder, RecorderSettings
from store.queries import QUERIES as READY
from store.queries import doc_names, render_doc
from store.server import check_read_only
from tests.store.recorded_run import publish, run_events

DOC = Path(__file__).resolve().parents[2] / "docs" / "analytics.md"


def sql_blocks(text: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"```sql\n(.*?)```", text, re.S)]


def declared_columns(query: str) -> list[str]:
    m = re.search(r"^-- columns: (.+)$", query, re.M)
    assert m, f"a ```sql block without a '-- columns:' line:\n{query}"
    return [c.strip() for c in m.group(1).split(",")]


def documented_columns(text: str) -> dict[str, dict[str, str]]:
    """``### `table` `` sections -> {column: type} from their markdown tables."""
    out: dict[str, dict[str, str]] = {}
    for m in re.finditer(r"^### `(\w+)`[^\n]*\n(.*?)(?=^### |^## |\Z)", text, re.S | re.M):
        rows = re.findall(r"^\| `(\w+)` \| `([^`]+)` \| .+ \|$", m.group(2), re.M)
        out[m.group(1)] = dict(rows)
    return out


QUERIES = sql_blocks(DOC.read_text())


@pytest.fixture(scope="module")
def recorded(bootstrap: str, store_dsn: str) -> tuple[Any, str]:
    """(client, run_id) of a run recorded by the real recorder from the real broker."""
    import uuid

    run_id = f"docs{uuid.uuid4().hex[:10]}"

    async def go() -> int:
        sent = await publish(bootstrap, run_id, run_events(run_id))
        settings = RecorderSettings(run_id=run_id, dsn=store_dsn, kafka=KafkaSettings(bootstrap=bootstrap),
                                    group_id=f"{run_id}-rec", stop_when_finished=True, idle_exit_s=0.5,
                                    lag_report_every_s=0.0)
        recorded = await asyncio.wait_for(Recorder(settings).run(), timeout=120)
        assert recorded == sent
        return recorded

    asyncio.run(go())
    return st.connect(store_dsn), run_id


def test_the_doc_shows_every_ready_query_as_it_is() -> None:
    text = DOC.read_text()
    assert doc_names(text) == list(READY), "docs/analytics.md shows other ready queries than store/queries.py"
    assert render_doc(text) == text, "docs/analytics.md is stale: python -m store.queries docs/analytics.md"
    assert sorted(QUERIES) == sorted(q.strip() for q in READY.values())  # no ```sql block without a name


def test_the_doc_has_the_promised_queries() -> None:
    text = DOC.read_text()
    for title in ("Reward by domain over steps", "Staleness histogram", "Latency per stage", "Slowest samples",
                  "Dead letters by reason", "Episodes"):
        assert f"### {title}" in text, title
    assert len(QUERIES) >= 10


@pytest.mark.parametrize("query", QUERIES, ids=[f"q{i}" for i in range(len(QUERIES))])
def test_every_query_runs_and_returns_its_columns(recorded: tuple[Any, str], query: str) -> None:
    client, run_id = recorded
    assert check_read_only(query) is None  # `rollstream sql` (and the recorder's server) accept it as is
    result = client.query(query, parameters={"run": run_id}, settings={"readonly": 2})
    assert list(result.column_names) == declared_columns(query)
    assert result.result_rows, f"no rows:\n{query}"


def test_queries_see_the_facts_of_the_run(recorded: tuple[Any, str]) -> None:
    """Spot checks that the queries compute what they say (not just any rows)."""
    client, run_id = recorded

    def run(columns: str) -> list[tuple[Any, ...]]:
        """Rows of the one query whose column list starts with ``columns``."""
        (q,) = [q for q in QUERIES if ", ".join(declared_columns(q)).startswith(columns)]
        return list(client.query(q, parameters={"run": run_id}).result_rows)

    assert run("versions_behind") == [(0, 6), (1, 2)]
    latency = {r[0]: r for r in run("stage, samples")}
    assert latency["queue wait"][2] == 0.25 and latency["generation"][2] == 1.25
    assert latency["reward"][2] == 0.05 and latency["total"][1] == 11  # 8 + episode + stale + filtered
    dead = run("service, stage, reason")
    assert {(r[0], r[1], r[3]) for r in dead} == {("rollout", "handle", 1), ("rollout", "decode", 1)}
    episodes = {(r[0], r[1]): r for r in run("domain, multi_turn")}
    mt = episodes[("countdown", 1)]
    # env time per turn: reset->obs 0.25, step1->obs 0.5, step2->obs 0.75
    assert mt[2] == 1 and mt[3] == 2.0 and mt[4] == 1.5 and mt[5] == 1.0 and mt[6] == 1 and mt[9] == 1
    assert episodes[("arith", 0)][3] == 1.0
    turns = run("episode_id, step")
    assert [(r[1], r[2]) for r in turns] == [(0, "EnvReset"), (0, "EnvObservation"), (1, "EnvStep"),
                                             (1, "EnvObservation"), (2, "EnvStep"), (2, "EnvObservation")]
    status = {(r[0], r[1]): r[2] for r in run("status, reason, samples")}
    assert status == {("trained", ""): 9, ("dropped_stale", "stale: gap 2 > 1"): 1,
                      ("filtered", "all-equal rewards"): 1,
                      ("dead_letter", "handle: engine error: CUDA out of memory"): 1, ("scored", ""): 1}
    assert run("step, domain, prompt") == [(1, "arith", "3+4=", "7", "7", True), (1, "arith", "5+6=", "11", "12", False)]
    curve = run("step, policy_version")
    assert [(r[0], r[2], r[7]) for r in curve] == [(0, 0.3, None), (1, 0.5, 0.5)]
    lag = run("ts, lag_records")
    assert lag[-1][1] == 0 and lag[-1][3] == lag[0][1] + lag[0][3]


def test_every_column_of_every_table_is_documented(recorded: tuple[Any, str]) -> None:
    client, _ = recorded
    actual: dict[str, dict[str, str]] = {}
    for table, name, typ in client.query(
            "SELECT table, name, type FROM system.columns WHERE database = currentDatabase() "
            "ORDER BY table, position").result_rows:
        actual.setdefault(table, {})[name] = typ
    documented = documented_columns(DOC.read_text())
    assert set(actual) <= set(documented), f"undocumented tables: {sorted(set(actual) - set(documented))}"
    for table, cols in actual.items():
        assert documented[table] == cols, f"docs/analytics.md disagrees with the store about `{table}`"
    assert set(documented) == set(actual), f"documented but missing: {sorted(set(documented) - set(actual))}"
