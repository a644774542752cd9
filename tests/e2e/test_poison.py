"""End to end with poison: during a short `rollstream run` (real broker, real store), undecodable
bytes and well-formed but impossible events land on `tasks`, `generations` and `scored`, naming
real issued samples. The run still completes; in SQL every bad record is one `DeadLetter` in
`dlq` naming its sample, the affected samples end as `dead_letter`, their groups complete
without them, and every issued sample has exactly one terminal status."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest

from runtime.bus import Consumer, Producer
from schemas import events as ev
from schemas.config import KafkaSettings
from schemas.topics import topic_name
from tests.e2e.faults import sql
from tests.e2e.test_run import SHORT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TERMINAL = ("trained", "dropped_stale", "filtered", "dead_letter")


async def issued_tasks(kafka: KafkaSettings, run_id: str, groups: int, timeout_s: float = 120) -> dict[str, Any]:
    """Wait until the feeder issued the first ``groups`` groups; their tasks by sample id."""
    out: dict[str, ev.RolloutTask] = {}
    wanted = {f"g{k:06d}" for k in range(groups)}
    deadline = time.monotonic() + timeout_s
    # the run's topics appear once `rollstream run` created them: refresh metadata often
    async with Consumer(kafka, group_id=None, topics=[topic_name(run_id, "tasks")], metadata_max_age_ms=300) as c:
        while not wanted <= {t.group_id for t in out.values()}:
            assert time.monotonic() < deadline, f"the feeder issued only {sorted(out)}"
            out.update({r.event.sample_id: r.event for r in await c.getmany(timeout_ms=200)
                        if isinstance(r.event, ev.RolloutTask)})
    return out


def generation(task: ev.RolloutTask, **kw: Any) -> ev.Generation:
    base: dict[str, Any] = {"prompt_ids": [1, 2], "response_ids": [5, 6], "response_text": "x",
                            "logprobs": [-0.5, -0.5], "loss_mask": [1, 1], "finish_reason": "stop",
                            "policy_version": 0, "policy_version_end": 0}
    return ev.Generation(run_id=task.run_id, task=task, **{**base, **kw})


async def inject(kafka: KafkaSettings, run_id: str, tasks: dict[str, ev.RolloutTask]) -> list[tuple[str, int, int, str]]:
    """Put the poison on the bus; ``(topic, partition, offset, sample_id it names)`` of each."""
    t = {k: tasks[f"g{k:06d}/1"] for k in range(1, 8)}
    wrong_shape = msgspec.msgpack.encode({
        "kind": "ScoredSample", "run_id": run_id, "reward": "high",
        "generation": {"task": {"sample_id": t[5].sample_id, "group_id": t[5].group_id}}})
    raw: list[tuple[str, bytes, str, str]] = [  # (topic, value, key, sample named)
        ("tasks", b"\xc1 not msgpack", t[1].sample_id, t[1].sample_id),
        ("generations", b"\xc1 not msgpack", t[3].sample_id, t[3].sample_id),
        ("scored", wrong_shape, t[5].group_id, t[5].sample_id),
        ("scored", b"\xc1 not msgpack", tasks["g000006/1"].group_id, ""),  # names the group only
    ]
    events: list[tuple[str, ev.Event, str]] = [
        ("tasks", msgspec.structs.replace(t[2], event_id=uuid.uuid4().hex, domain="no-such-domain"), t[2].sample_id),
        ("generations", generation(t[4], logprobs=[-0.5]), t[4].sample_id),  # 2 tokens, 1 logprob
        ("scored", ev.ScoredSample(run_id=run_id, generation=generation(t[7]), reward=float("nan")), t[7].sample_id),
    ]
    out = []
    async with Producer(kafka) as p:
        for name, value, key, sid in raw:
            md = await (await p.send_raw(topic_name(run_id, name), value, key))
            out.append((md.topic, md.partition, md.offset, sid))
        for name, event, sid in events:
            md = await p.send_and_wait(topic_name(run_id, name), event)
            out.append((md.topic, md.partition, md.offset, sid))
    return out


def test_poison_is_dead_lettered_and_every_sample_accounted_for(
    tmp_path: Path, bootstrap: str, repo_root: Path
) -> None:
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)
    runs = tmp_path / "runs"
    run_id = f"e2e-poison-{uuid.uuid4().hex[:6]}"
    overrides = [*SHORT, "rollout.async_ratio=1", f"run.runs_dir={runs}"]
    cmd = [sys.executable, "-m", "cli", "run", str(repo_root / "examples" / "main.yaml"), "--run-id", run_id,
           *[a for kv in overrides for a in ("--set", kv)]]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        kafka = KafkaSettings(bootstrap=bootstrap)
        # batch 16 × (1 + async_ratio 1) / group 4: the first 8 groups go out at once
        tasks = asyncio.run(issued_tasks(kafka, run_id, groups=8))
        injected = asyncio.run(inject(kafka, run_id, tasks))
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out

    summary = json.loads((runs / run_id / "summary.json").read_text())
    s = summary["samples"]
    assert s["unaccounted"] == 0 and s["issued"] == sum(s[k] for k in TERMINAL), s
    assert summary["steps"] == 4

    # every bad record: exactly one dead letter, naming the sample the record named
    rows = sql(f"SELECT source_topic, partition, offset, sample_id, stage, service, error FROM dlq FINAL "
               f"WHERE run_id = '{run_id}'", runs, run_id, env)
    letters = {(r["source_topic"], r["partition"], r["offset"]): r for r in rows}
    assert len(rows) == len(letters) == len(injected), rows
    for topic, partition, offset, sid in injected:
        letter = letters[(topic, partition, offset)]
        assert letter["sample_id"] == sid, letter
    stages = sorted((r["source_topic"].rsplit(".", 1)[1], r["stage"]) for r in rows)
    assert stages == sorted([("tasks", "decode"), ("tasks", "handle"), ("generations", "decode"),
                             ("generations", "handle"), ("scored", "decode"), ("scored", "decode"),
                             ("scored", "handle")])
    assert any("unknown domain 'no-such-domain'" in r["error"] for r in rows)
    assert any("lengths differ" in r["error"] for r in rows)
    assert any("reward is nan" in r["error"] for r in rows)

    # the named samples end as dead_letter; their groups completed with the members that remain;
    # no sample has two statuses
    named = sorted({sid for *_, sid in injected if sid})
    groups = sorted({sid.rsplit("/", 1)[0] for sid in named} | {"g000006"})
    statuses = sql(f"SELECT sample_id, group_id, status FROM samples WHERE run_id = '{run_id}' "
                   f"AND group_id IN ({', '.join(repr(g) for g in groups)})", runs, run_id, env)
    by_id = {r["sample_id"]: r for r in statuses}
    assert len(by_id) == len(statuses) == 4 * len(groups)
    assert {sid: by_id[sid]["status"] for sid in named} == dict.fromkeys(named, "dead_letter")
    others = [r for r in statuses if r["sample_id"] not in named]
    assert all(r["status"] in TERMINAL[:3] for r in others), others
    assert sum(r["status"] == "trained" for r in others) >= 3  # at least one such group was trained
    twice = sql(f"SELECT sample_id, count() AS n FROM samples WHERE run_id = '{run_id}' GROUP BY sample_id "
                "HAVING n > 1", runs, run_id, env)
    assert twice == []
