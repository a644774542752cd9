"""End to end, multi-turn (agentic) domains as a user runs them (a subprocess per CLI call, the real
broker and store):

* the number-guessing environment of ``docs/agentic.md`` (its code block, taken from the markdown
  at test time, saved as ``my_envs.py`` and named in ``data.plugins``; its config block too)
  trains through a short run: the record has its resets, actions and observations, and every
  trained sample is an episode;
* FrozenLake (``examples/frozenlake.yaml``, shortened) survives a ``kill -9`` of its environment
  worker while episodes are in flight: the supervisor restarts it, the restarted worker answers
  (rebuilding the episodes it does not hold), the run completes and every sample is accounted for.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from aiokafka import TopicPartition

from runtime.admin import TopicAdmin
from runtime.bus import Consumer
from schemas import events as ev
from schemas.config import KafkaSettings
from schemas.services import SERVICES
from schemas.topics import topic_name
from tests.e2e.faults import assert_accounted, rollstream, sql
from tests.e2e.test_heal import finish, state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(360)]

SHORT_AGENTIC = [
    "train.steps=2", "train.warmup_sft_steps=10", "train.warmup_batch_size=8", "train.eval_every=1",
    "train.checkpoint_every=1", "data.heldout_size=8", "rollout.group_size=4", "train.batch_size=8",
    "train.micro_batch_size=8",
]
"""A short multi-turn run: 2 steps of 2 groups of 4 episodes, a tiny warm-up, 8 held-out episodes."""


def doc_blocks(repo_root: Path) -> tuple[str, str]:
    """The ``python`` and ``yaml`` code blocks of ``docs/agentic.md`` after "This whole file (49 lines;"."""
    text = (repo_root / "docs" / "agentic.md").read_text()
    at = text.index("This whole file (49 lines;")
    code = re.search(r"```python\n(.*?)```", text[at:], re.S)
    config = re.search(r"```yaml\n(.*?)```", text[at:], re.S)
    assert code and config, "docs/agentic.md lost the code or config block of its own environment"
    return code.group(1), config.group(1)


def start(config: Path, run_id: str, runs: Path, env: dict[str, str], sets: list[str],
          cwd: Path | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "cli", "run", str(config), "--run-id", run_id,
                             *[a for kv in [*sets, f"run.runs_dir={runs}"] for a in ("--set", kv)]],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)


def test_the_docs_environment_trains_through_a_short_run(tmp_path: Path, bootstrap: str, repo_root: Path) -> None:
    code, config = doc_blocks(repo_root)
    assert len(code.splitlines()) < 50, "the doc promises a whole environment in under 50 lines"
    assert "plugins: [my_envs]" in config
    (tmp_path / "my_envs.py").write_text(code)
    (tmp_path / "guess.yaml").write_text(config)
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)
    runs = tmp_path / "runs"
    run_id = f"e2e-guess-{uuid.uuid4().hex[:6]}"
    proc = start(tmp_path / "guess.yaml", run_id, runs, env, SHORT_AGENTIC, cwd=tmp_path)
    finish(proc, timeout_s=240)

    summary = json.loads((runs / run_id / "summary.json").read_text())
    assert summary["steps"] == 2
    s = summary["samples"]
    assert s["unaccounted"] == 0 and s["trained"] > 0
    assert_accounted(s)

    # the environment's resets, actions and observations are in the record, and they are the doc's game
    kinds = sql(f"SELECT kind, count() AS n, countIf(error != '') AS errors FROM env_events FINAL "
                f"WHERE run_id = '{run_id}' GROUP BY kind ORDER BY kind", runs, run_id, env)
    counts = {r["kind"]: r["n"] for r in kinds}
    assert set(counts) == {"EnvObservation", "EnvReset", "EnvStep"} and all(r["errors"] == 0 for r in kinds)
    assert counts["EnvObservation"] == counts["EnvReset"] + counts["EnvStep"]  # one answer per request
    resets = sql(f"SELECT DISTINCT env FROM env_events FINAL WHERE run_id = '{run_id}' AND kind = 'EnvReset'",
                 runs, run_id, env)
    assert resets == [{"env": "guess"}]
    hints = sql(f"SELECT DISTINCT text FROM env_events FINAL WHERE run_id = '{run_id}' AND kind = 'EnvObservation' "
                "AND step > 0", runs, run_id, env)
    assert {h["text"] for h in hints} <= {"Higher.", "Lower.", "Correct!"} and hints

    # every trained sample is a multi-turn episode of the doc's game (at most max_turns: 4 guesses)
    trained = sql(f"SELECT s.sample_id AS sample_id, g.num_turns AS turns, g.episode_id AS episode, "
                  f"length(g.step_rewards) AS rewards, length(g.turn_versions) AS versions, g.env_finish AS finish "
                  f"FROM samples AS s JOIN (SELECT * FROM sample_generations FINAL) AS g "
                  f"ON g.run_id = s.run_id AND g.sample_id = s.sample_id "
                  f"WHERE s.run_id = '{run_id}' AND s.status = 'trained'", runs, run_id, env)
    assert len(trained) == s["trained"]
    for t in trained:
        assert 1 <= t["turns"] <= 4, t
        assert re.fullmatch(re.escape(t["sample_id"]) + r"@[0-9a-f]{8}", t["episode"]), t
        assert t["rewards"] == t["versions"] == t["turns"], t
        assert t["finish"] in ("terminated", "truncated", "max_turns", "context"), t
    episodes = sql(f"SELECT count() AS n, countIf(multi_turn = 1) AS multi FROM episodes "
                   f"WHERE run_id = '{run_id}' AND status = 'trained'", runs, run_id, env)
    assert episodes == [{"n": s["trained"], "multi": s["trained"]}]

    # `rollstream run` started an environment worker for the plugin's multi-turn domain
    started = sql(f"SELECT service FROM service_events FINAL WHERE run_id = '{run_id}' AND kind = 'ServiceStarted' "
                  "ORDER BY service", runs, run_id, env)
    assert [r["service"] for r in started] == ["env", "feeder", "recorder", "reward", "rollout", "trainer"]


async def wait_for_env_traffic(bootstrap: str, run_id: str, proc: subprocess.Popen[str], steps: int,
                               timeout_s: float = 180) -> None:
    """Until the run's ``env.requests`` topic has carried ``steps`` actions (``EnvStep``: episodes in
    flight) and the env group has committed past the reset of at least one of those episodes.

    Without the second condition a kill can land before the worker's first commit: the restarted
    worker then replays every request from offset 0 (resets included), holds every episode again
    and has nothing to rebuild — correct, but not what this test is about."""
    deadline = time.monotonic() + timeout_s
    seen = 0
    stepped: dict[TopicPartition, list[int]] = {}  # offsets of the resets of episodes that then stepped
    reset_at: dict[str, tuple[TopicPartition, int]] = {}
    async with Consumer(KafkaSettings(), bootstrap, group_id=None, topics=[topic_name(run_id, "env.requests")],
                        metadata_max_age_ms=300) as c:
        while seen < steps:
            assert proc.poll() is None, f"the run ended early: {proc.communicate()}"
            assert time.monotonic() < deadline, f"fewer than {steps} env steps within {timeout_s:g} s ({seen})"
            for r in await c.getmany(timeout_ms=300):
                if isinstance(r.event, ev.EnvReset):
                    reset_at[r.event.episode_id] = (r.tp, r.offset)
                elif isinstance(r.event, ev.EnvStep):
                    seen += 1
                    if r.event.episode_id in reset_at:
                        tp, offset = reset_at.pop(r.event.episode_id)
                        stepped.setdefault(tp, []).append(offset)
    async with TopicAdmin(KafkaSettings(), bootstrap) as admin:
        while True:
            assert proc.poll() is None, f"the run ended early: {proc.communicate()}"
            committed = await admin.raw.list_consumer_group_offsets(SERVICES["env"].group_id(run_id))
            if any(o < committed[tp].offset for tp, offsets in stepped.items() if tp in committed for o in offsets):
                return
            assert time.monotonic() < deadline, f"the env group committed no reset within {timeout_s:g} s: {committed}"
            await asyncio.sleep(0.05)


def test_frozenlake_run_survives_kill_9_of_its_env_worker(tmp_path: Path, bootstrap: str, repo_root: Path) -> None:
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)
    runs = tmp_path / "runs"
    run_id = f"e2e-lake-{uuid.uuid4().hex[:6]}"
    sets = [*SHORT_AGENTIC, "train.steps=3", "rollout.max_turns=6", "rollout.max_context_tokens=512",
            "model.init.max_position_embeddings=512", "env.request_timeout_s=30"]
    proc = start(repo_root / "examples" / "frozenlake.yaml", run_id, runs, env, sets)
    try:
        asyncio.run(wait_for_env_traffic(bootstrap, run_id, proc, steps=8))
        victim = state(runs, run_id)["services"]["env"]["pid"]
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
    finally:
        _, err = finish(proc, timeout_s=300)
    assert "service env killed by SIGKILL (exit code -9); restarting in 1 s" in err
    assert "restarted env" in err
    summary = json.loads((runs / run_id / "summary.json").read_text())
    assert summary["steps"] == 3
    s = summary["samples"]
    assert s["unaccounted"] == 0 and s["trained"] > 0
    assert_accounted(s)

    rows = sql(f"SELECT service, kind, exit_code, restarts, previous_pid FROM service_events FINAL "
               f"WHERE run_id = '{run_id}' AND kind != 'ServiceStarted'", runs, run_id, env)
    assert rows == [{"service": "env", "kind": "ServiceRestarted", "exit_code": -9, "restarts": 1,
                     "previous_pid": victim}]

    # the restarted worker answered: observations created after the kill
    after = sql(f"SELECT count() AS n FROM env_events FINAL WHERE run_id = '{run_id}' AND kind = 'EnvObservation' "
                f"AND toUnixTimestamp64Micro(ts) > {int(killed_at * 1e6)}", runs, run_id, env)
    assert after[0]["n"] > 0
    # every dead letter is an episode whose environment failed or did not answer, and is accounted for
    dead = sql(f"SELECT sample_id, reason FROM samples WHERE run_id = '{run_id}' AND status = 'dead_letter'",
               runs, run_id, env)
    assert len(dead) == s["dead_letter"]
    # every request was answered, but those of episodes given up on (dead letters)
    asked = sql(f"SELECT countIf(kind != 'EnvObservation') AS requests, countIf(kind = 'EnvObservation') AS answers "
                f"FROM env_events FINAL WHERE run_id = '{run_id}'", runs, run_id, env)[0]
    assert 0 <= asked["requests"] - asked["answers"] <= len(dead), asked
    # the restarted worker held none of the episodes in flight: it rebuilt them from their history
    log = (runs / run_id / "logs" / "env.log").read_text()
    rebuilds = len(re.findall(r"env: rebuilding episode ", log))
    assert rebuilds >= 1, log[-3000:]
    print(f"frozenlake kill -9 of env: {len(dead)} dead letters {[d['reason'] for d in dead]}, "
          f"{rebuilds} rebuilds, {after[0]['n']} observations after the kill, samples {s}")


def test_a_windowed_frozenlake_run_trains_each_turn_on_its_own_window(tmp_path: Path, bootstrap: str,
                                                                        repo_root: Path) -> None:
    """``rollout.history_turns: 0`` through the real services: every trained episode is laid out as
    one segment per turn in the record (``Generation.segment_starts``), the run accounts for every
    sample, and ``replay step`` recomputes a windowed step from its checkpoint."""
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)
    runs = tmp_path / "runs"
    run_id = f"e2e-window-{uuid.uuid4().hex[:6]}"
    sets = [*SHORT_AGENTIC, "rollout.history_turns=0", "rollout.max_turns=6", "rollout.max_context_tokens=400"]
    proc = start(repo_root / "examples" / "frozenlake.yaml", run_id, runs, env, sets)
    finish(proc, timeout_s=300)
    summary = json.loads((runs / run_id / "summary.json").read_text())
    assert summary["steps"] == 2
    s = summary["samples"]
    assert s["unaccounted"] == 0 and s["trained"] > 0
    assert_accounted(s)
    gens = sql(f"SELECT JSONExtractUInt(payload, 'num_turns') AS turns, "
               f"length(JSONExtractArrayRaw(payload, 'segment_starts')) AS segments "
               f"FROM events FINAL WHERE run_id = '{run_id}' AND kind = 'Generation'", runs, run_id, env)
    assert len(gens) >= s["trained"]
    assert all(g["segments"] == g["turns"] - 1 for g in gens), gens
    assert any(g["turns"] > 1 for g in gens)
    rep = rollstream("replay", "step", run_id, "1", "--format", "json", "--runs-dir", str(runs), env=env, timeout=300)
    assert rep.returncode == 0, rep.stderr
    out = json.loads(rep.stdout)
    assert out["step"] == 1 and out["max_abs_diff"] <= 1e-5, out["metrics"]
