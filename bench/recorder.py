"""Recorder headroom: the events/s the recorder sustains into the embedded ClickHouse (chDB),
against the events/s a run produces, side by side in one invocation.

    .venv/bin/python bench/recorder.py [--n 60000] [--batch B] [--steps 20] [--warmup 50]
                                       [--run RUN --runs-dir DIR] [--bootstrap HOST:PORT]
                                       [--skip-e2e] [--profile] [--json OUT]

1. **Produced**: runs the main example shortened (``--warmup`` supervised + ``--steps`` RL steps,
   a temporary runs directory, its topics deleted afterwards), or reads ``--run RUN --runs-dir
   DIR``, and takes from the run's ``events`` table the average events/s of the RL phase, per
   topic, the peak second, the mix of event kinds and the run's own ``recorder_lag``.
2. **Store only** (a subprocess): N synthetic events in the run's mix, written with the recorder's
   own ``Recorder.rows_for`` and ``Recorder.insert`` in batches of ``--batch`` (default: the run's
   ``store.batch_max_records``) into a fresh embedded store.
3. **End to end** (a subprocess, skipped by ``--skip-e2e``): the same N events produced to a
   throwaway run's topics, then the real recorder (``Recorder.run``) drains that backlog into a
   fresh store; the throwaway topics are deleted at the end.

Prints the run's production per topic, the event mix (the run's payload sizes beside the synthetic
ones), the headroom table (sustained ÷ produced events/s, against the run's average and its peak
second; the goal is 20×), where each measurement's time went (row mapping, chDB inserts, the rest)
and, with ``--profile``, py-spy's ``--gil`` profile of both. ``--json`` also writes the results.
The example run and the end-to-end part need a reachable Kafka broker. bench/README.md
("recorder.py") says exactly what each part times and keeps the measured runs.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from uuid import uuid4

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cpu_name, find_broker

from runtime.bus import Record
from runtime.probe import NO_BROKER
from schemas import events as ev
from schemas.config import KafkaSettings
from schemas.topics import TOPICS, topic_name

ROOT = Path(__file__).resolve().parents[1]
# --------------------------------------------------------------------------- the run's production


def sql(query: str, run: str, runs_dir: str) -> list[dict[str, Any]]:
    """Rows of ``query`` on ``run``'s record (``rollstream sql`` in a subprocess: this process
    never opens a chDB store itself)."""
    proc = subprocess.run(
        [sys.executable, "-m", "cli", "sql", query, "--run", run, "--runs-dir", runs_dir,
         "--format", "json"], cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"bench/recorder.py: rollstream sql failed: {(proc.stderr or proc.stdout).strip()}")
    rows: list[dict[str, Any]] = json.loads(proc.stdout or "[]")
    return rows


def production(run: str, runs_dir: str) -> dict[str, Any]:
    """Rates, mix and sizes of what ``run`` produced (from its ``events`` table)."""
    def q(query: str) -> list[dict[str, Any]]:
        return sql(query, run, runs_dir)

    us = "toUnixTimestamp64Micro(ts) / 1e6"
    bounds = q(f"SELECT minIf({us}, kind = 'Generation') AS rl0, max({us}) AS t1, min({us}) AS t0, "
               f"count() AS n FROM events WHERE run_id = '{run}'")[0]
    if not bounds["n"]:
        raise SystemExit(f"bench/recorder.py: run {run} has no events in its record")
    rl0, t1 = float(bounds["rl0"] or bounds["t0"]), float(bounds["t1"])
    in_rl = f"run_id = '{run}' AND {us} >= {rl0!r}"
    n_rl = int(q(f"SELECT count() AS n FROM events WHERE {in_rl}")[0]["n"])
    topics = q(f"SELECT name, count() AS n, min({us}) AS t0, max({us}) AS t1 FROM events WHERE {in_rl} "
               "GROUP BY name ORDER BY n DESC")
    peak = q(f"SELECT toStartOfSecond(ts) AS s, count() AS n FROM events WHERE run_id = '{run}' "
               "GROUP BY s ORDER BY n DESC LIMIT 1")[0]
    kinds = q(
        "SELECT kind, argMax(name, c) AS topic, sum(c) AS n, sum(bytes) / sum(c) AS payload FROM ("
        f"SELECT kind, name, count() AS c, sum(length(payload)) AS bytes FROM events WHERE run_id = '{run}' "
        "GROUP BY kind, name) GROUP BY kind ORDER BY n DESC")
    sizes = q(
        "SELECT avgIf(length(JSONExtractArrayRaw(payload, 'prompt_ids')), kind = 'Generation') AS prompt_ids, "
        "avgIf(length(JSONExtractArrayRaw(payload, 'response_ids')), kind = 'Generation') AS response_ids, "
        "avgIf(length(JSONExtractString(payload, 'response_text')), kind = 'Generation') AS response_text, "
        "avgIf(length(JSONExtractArrayRaw(payload, 'sample_ids')), kind = 'TrainStep') AS sample_ids, "
        "avgIf(length(JSONExtractKeys(payload, 'metrics')), kind = 'TrainStep') AS metrics "
        f"FROM events WHERE run_id = '{run}'")[0]
    lag = q("SELECT count() AS n, max(lag_records) AS max, avg(lag_records) AS avg FROM recorder_lag "
            f"WHERE run_id = '{run}'")[0]
    span = max(t1 - rl0, 1e-9)
    per_topic = []
    for t in topics:
        tspan = float(t["t1"]) - float(t["t0"])
        per_topic.append({"topic": t["name"], "n": int(t["n"]), "span_s": tspan,
                          "rate": int(t["n"]) / tspan if tspan > 0 else 0.0})
    return {
        "run": run, "events": int(bounds["n"]), "rl_events": n_rl, "rl_span_s": span, "avg_rate": n_rl / span,
        "run_span_s": t1 - float(bounds["t0"]), "peak_rate": float(peak["n"]), "peak_at": peak["s"],
        "per_topic": per_topic, "lag_reports": int(lag["n"]), "lag_max": int(lag["max"] or 0),
        "lag_avg": float(lag["avg"] or 0.0) if lag["n"] else 0.0,
        "mix": {k["kind"]: {"topic": k["topic"], "n": int(k["n"]), "payload": float(k["payload"])} for k in kinds},
        "sizes": {k: (round(float(v)) if v == v and v is not None else 0) for k, v in sizes.items()},
    }


def run_example(run_id: str, steps: int, warmup: int, runs_dir: Path) -> float:
    """Run the main example shortened as ``run_id``; its wall seconds."""
    sets = [f"train.steps={steps}", f"train.warmup_sft_steps={warmup}", f"run.runs_dir={runs_dir}",
            f"train.checkpoint_every={max(steps, 1)}"]
    cmd = [sys.executable, "-m", "cli", "run", str(ROOT / "examples" / "main.yaml"), "--run-id", run_id,
           *[a for kv in sets for a in ("--set", kv)]]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise SystemExit(f"bench/recorder.py: the example run failed:\n{tail}")
    return wall


# --------------------------------------------------------------------------- synthetic events


def apportion(mix: dict[str, int], n: int) -> dict[str, int]:
    """Split ``n`` over the kinds in proportion to ``mix`` (largest remainder)."""
    total = sum(mix.values())
    exact = {k: n * v / total for k, v in mix.items()}
    out = {k: int(x) for k, x in exact.items()}
    for k in sorted(exact, key=lambda k: exact[k] - out[k], reverse=True)[: n - sum(out.values())]:
        out[k] += 1
    return {k: v for k, v in out.items() if v}


def templates() -> dict[str, ev.Event]:
    from tests.schemas.examples import example_events

    return {type(e).__name__: e for e in example_events()}


def make_event(kind: str, i: int, run_id: str, sizes: dict[str, int], tpl: dict[str, ev.Event],
               ts: float) -> ev.Event:
    """The ``i``-th synthetic event of ``kind``: the example of that type with fresh ids."""
    rep = msgspec.structs.replace
    rng = random.Random(i)
    g, j = divmod(i, 8)
    sid, gid = f"g{g:07d}/{j}", f"g{g:07d}"
    eid = uuid4().hex

    def task() -> ev.RolloutTask:
        t = tpl["RolloutTask"]
        assert isinstance(t, ev.RolloutTask)
        a, b = rng.randrange(100), rng.randrange(100)
        return rep(t, run_id=run_id, event_id=uuid4().hex, ts=ts, sample_id=sid, group_id=gid, index=j,
                   group_size=8, prompt_id=f"arith:{a}+{b}", prompt=f"{a}+{b}=", reference=str(a + b), env=None,
                   max_new_tokens=None)

    def gen() -> ev.Generation:
        t = tpl["Generation"]
        assert isinstance(t, ev.Generation)
        p, r = max(1, sizes.get("prompt_ids", 4)), max(1, sizes.get("response_ids", 3))
        text_len = sizes.get("response_text", 2)
        return rep(t, run_id=run_id, event_id=uuid4().hex, ts=ts, task=task(),
                   prompt_ids=[rng.randrange(64) for _ in range(p)],
                   response_ids=[rng.randrange(64) for _ in range(r)],
                   response_text="".join(rng.choice("0123456789+-= \n") for _ in range(text_len)),
                   logprobs=[-rng.expovariate(2.0) for _ in range(r)], loss_mask=[1] * r,
                   gen_s=rng.random(), queued_s=rng.random() / 10, env_s=0.0, num_turns=1, episode_id="",
                   step_rewards=[], turn_versions=[], state_hashes=[], env_finish="", success=False)

    if kind == "RolloutTask":
        return rep(task(), event_id=eid)
    if kind == "Generation":
        return rep(gen(), event_id=eid)
    if kind == "ScoredSample":
        t = tpl["ScoredSample"]
        assert isinstance(t, ev.ScoredSample)
        reward = float(rng.random() < 0.5)
        return rep(t, run_id=run_id, event_id=eid, ts=ts, generation=gen(), reward=reward,
                   rewards={"correct": reward}, verifier="final_number", details=f"got {i % 200}, want {i % 199}",
                   reward_s=rng.random() / 1000, judge="", judge_s=0.0)
    if kind == "SampleOutcome":
        return rep(tpl[kind], run_id=run_id, event_id=eid, ts=ts, sample_id=sid, group_id=gid, step=g // 32)
    if kind == "TrainStep":
        t = tpl[kind]
        assert isinstance(t, ev.TrainStep)
        m = max(1, sizes.get("metrics", 2))
        return rep(t, run_id=run_id, event_id=eid, ts=ts, step=i, policy_version=i,
                   metrics={f"bench/metric_{k:02d}_mean": rng.random() for k in range(m)},
                   sample_ids=[f"g{(i * 32 + k // 8):07d}/{k % 8}" for k in range(max(1, sizes.get("sample_ids", 1)))])
    if kind in ("WeightsPublished", "EvalResult"):
        return rep(tpl[kind], run_id=run_id, event_id=eid, ts=ts, step=i, policy_version=i)
    return rep(tpl[kind], run_id=run_id, event_id=eid, ts=ts)


def build(run_id: str, plan: dict[str, Any], n: int) -> list[tuple[str, ev.Event]]:
    """``n`` (topic, event) pairs in the plan's mix, shuffled (a poll mixes topics too)."""
    tpl = templates()
    counts = apportion({k: v["n"] for k, v in plan["mix"].items() if k in tpl}, n)
    t0 = time.time()
    out = [(topic_name(run_id, plan["mix"][k]["topic"]), make_event(k, i, run_id, plan["sizes"], tpl, t0 + i * 1e-4))
           for k, c in counts.items() for i in range(c)]
    random.Random(0).shuffle(out)
    return out


def as_records(pairs: list[tuple[str, ev.Event]]) -> list[Record]:
    """Decoded records as a consumer hands them to the recorder (offsets per partition)."""
    from runtime.records import key_for

    enc = msgspec.msgpack.Encoder()
    nxt: Counter[tuple[str, int]] = Counter()
    out = []
    for topic, event in pairs:
        spec = TOPICS[topic.split(".", 2)[2]]
        key = key_for(spec, event)
        part = zlib.crc32(key or b"") % spec.partitions
        off = nxt[(topic, part)]
        nxt[(topic, part)] += 1
        out.append(Record(topic=topic, partition=part, offset=off, key=key, value_bytes=enc.encode(event),
                          event=event, error=None, ts=event.ts))
    return out


# --------------------------------------------------------------------------- children (one store each)


class _Timed:
    """Wraps a bound method; accumulates its wall time."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.seconds, self.calls, self.tables = fn, 0.0, 0, 0

    def __call__(self, *a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1
            if a and isinstance(a[0], dict):  # insert(tables): one chDB insert per non-empty table
                self.tables += sum(1 for rows in a[0].values() if rows)

    def reset(self) -> None:
        self.seconds, self.calls, self.tables = 0.0, 0, 0


def child_store(spec: dict[str, Any]) -> dict[str, Any]:
    import store as st
    from services.recorder import Recorder, RecorderSettings

    run_id, n, batch = spec["run_id"], spec["n"], spec["batch"]
    records = as_records(build(run_id, spec["plan"], n))
    warm = as_records(build(run_id + "w", spec["plan"], min(200, n)))
    rec = Recorder(RecorderSettings(run_id=run_id, dsn=f"chdb://{spec['store']}", batch_max_records=batch,
                                    serve_queries=False))
    rec._client = st.connect(rec.settings.dsn)
    st.apply_ddl(rec._client)
    rec.insert(rec.rows_for(warm))
    # the N ready-made records stay alive in this process (a recorder holds one poll): keep them
    # out of the garbage collector's full passes, which would otherwise scan them again and again
    gc.collect()
    gc.freeze()
    spy = Spy(spec.get("spy", ""), spec.get("spy_out", ""))
    spy.start()
    t_rows = t_ins = 0.0
    rows = inserts = 0
    t_start = time.perf_counter()
    for k in range(0, n, batch):
        t0 = time.perf_counter()
        tables = rec.rows_for(records[k:k + batch])
        t1 = time.perf_counter()
        rec.insert(tables)
        t2 = time.perf_counter()
        t_rows += t1 - t0
        t_ins += t2 - t1
        rows += sum(map(len, tables.values()))
        inserts += sum(1 for r in tables.values() if r)
    total = time.perf_counter() - t_start
    spy.stop()
    stored = int(rec._client.query("SELECT count() FROM events WHERE run_id = {r:String}",
                                   parameters={"r": run_id}).result_rows[0][0])
    version = str(rec._client.query("SELECT version()").result_rows[0][0])
    return {"n": n, "stored": stored, "seconds": total, "events_s": n / total, "rows_s": t_rows,
            "insert_s": t_ins, "rows": rows, "inserts": inserts, "batches": -(-n // batch), "engine": version}


async def child_e2e(spec: dict[str, Any]) -> dict[str, Any]:
    from runtime.bus import Producer, TopicAdmin
    from services.recorder import Recorder, RecorderSettings

    kafka = KafkaSettings(bootstrap=spec["bootstrap"], connect_timeout_s=10.0)
    run_id, n, batch = spec["run_id"], spec["n"], spec["batch"]
    pairs = build(run_id, spec["plan"], n)
    out: dict[str, Any] = {"n": n}
    async with TopicAdmin(kafka) as admin:
        await admin.ensure_run_topics(run_id)
        try:
            t0 = time.perf_counter()
            async with Producer(kafka, client_suffix="bench") as producer:
                futs = [await producer.send(topic, event) for topic, event in pairs]
                await asyncio.gather(*futs)
            out["produce_s"] = time.perf_counter() - t0
            del pairs, futs  # the recorder's process holds no backlog of events
            gc.collect()
            rec = Recorder(RecorderSettings(run_id=run_id, dsn=f"chdb://{spec['store']}", kafka=kafka,
                                            batch_max_records=batch))
            rows_t, ins_t = _Timed(rec.rows_for), _Timed(rec.insert)
            rec.rows_for, rec.insert = rows_t, ins_t  # type: ignore[method-assign]
            stop = asyncio.Event()
            spy = Spy(spec.get("spy", ""), spec.get("spy_out", ""))
            spy.start()
            t_start = time.perf_counter()
            task = asyncio.create_task(rec.run(stop))
            t_first = n_first = None
            deadline = t_start + spec["timeout_s"]
            while rec.recorded < n:
                if task.done():
                    await task
                    raise SystemExit(f"the recorder stopped after {rec.recorded} of {n} events")
                if time.perf_counter() > deadline:
                    stop.set()
                    raise SystemExit(f"only {rec.recorded} of {n} events recorded in {spec['timeout_s']} s")
                if t_first is None and rec.recorded:
                    t_first, n_first = time.perf_counter(), rec.recorded
                    rows_t.reset()  # the breakdown covers the timed part only
                    ins_t.reset()
                await asyncio.sleep(0.005)
            t_end = time.perf_counter()
            spy.stop()
            r_s, i_s, polls, inserts = rows_t.seconds, ins_t.seconds, rows_t.calls, ins_t.tables
            stop.set()
            await task
            stored = int(rec._client.query("SELECT count() FROM events WHERE run_id = {r:String}",
                                           parameters={"r": run_id}).result_rows[0][0])
            assert t_first is not None and n_first is not None
            steady = t_end - t_first
            out.update(startup_s=t_first - t_start, first_batch=n_first, steady_s=steady,
                       events_s=(n - n_first) / steady if steady > 0 else float("nan"),
                       events_s_incl_startup=n / (t_end - t_start), rows_s=r_s, insert_s=i_s, polls=polls,
                       inserts=inserts,
                       stored=stored)
        finally:
            await admin.delete_run_topics(run_id)
    return out


def spawn(kind: str, spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Run one measurement in a fresh process; its JSON result."""
    spec_file = workdir / f"{kind}-{uuid4().hex[:6]}.json"
    result_file = spec_file.with_suffix(".out.json")
    spec_file.write_text(json.dumps(spec))
    cmd = [sys.executable, __file__, "--child", kind, "--spec", str(spec_file), "--result", str(result_file)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not result_file.exists():
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        raise SystemExit(f"bench/recorder.py: the {kind} measurement failed:\n{tail}")
    res: dict[str, Any] = json.loads(result_file.read_text())
    return res


# --------------------------------------------------------------------------- profile


class Spy:
    """py-spy sampling this process (every thread) between ``start`` and ``stop``; raw
    (folded) stacks to ``out``. A no-op without a py-spy binary."""

    def __init__(self, binary: str, out: str) -> None:
        self.binary, self.out = binary, out
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if not self.binary:
            return
        self.proc = subprocess.Popen(
            [self.binary, "record", "--pid", str(os.getpid()), "--format", "raw", "--rate", "250",
             "--nonblocking", "--gil", "-o", self.out], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # let it attach before the measured part starts

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


IDLE = ("select ", "poll ", "epoll", "wait (threading", "_worker (concurrent", "sleep", "acquire", "thread (",
        "EpollSelector.select", "_run_once")
"""Leaf frames of a thread that waits (py-spy's idle detection misses some)."""
PLUMBING = ("asyncio/", "concurrent/futures", "threading.py", "<module>", "main (", "child_store (", "contextvars")
"""Frames every busy stack passes through (event loop, thread pool): not shown as functions."""


def profile_shares(folded: Path, skip: tuple[str, ...], k: int = 14) -> dict[str, Any]:
    """From a py-spy raw profile: the share of busy samples under each function (inclusive)
    and in each leaf frame (self), leaving out waiting threads and stacks with a frame in
    ``skip`` (start-up, the bench's own code)."""
    incl: Counter[str] = Counter()
    self_t: Counter[str] = Counter()
    busy = idle = 0
    for line in folded.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if any(s in stack for s in skip):
            continue
        c = int(count)
        if any(frames[-1].startswith(w) for w in IDLE):
            idle += c
            continue
        busy += c
        self_t[_short(frames[-1])] += c
        for f in {_short(f) for f in frames if not any(w in f for w in PLUMBING)}:
            incl[f] += c
    tot = max(busy, 1)
    return {"busy": busy, "idle": idle,
            "inclusive": [(f, c / tot) for f, c in incl.most_common(k)],
            "self": [(f, c / tot) for f, c in self_t.most_common(k)]}


def _short(frame: str) -> str:
    """``func (path/to/file.py:NN)`` -> ``func (file.py)``."""
    name, _, where = frame.partition(" (")
    file = where.rstrip(")").rsplit(":", 1)[0]
    parts = Path(file).parts
    return f"{name} ({'/'.join(parts[-2:])})" if file else name


# --------------------------------------------------------------------------- main


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _table(rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for j, r in enumerate(rows):
        print("  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]))
        if j == 0:
            print("  ".join("-" * w for w in widths))


async def _delete_topics(bootstrap: str, run_id: str) -> list[str]:
    from runtime.bus import TopicAdmin

    async with TopicAdmin(KafkaSettings(bootstrap=bootstrap, connect_timeout_s=10.0)) as admin:
        return await admin.delete_run_topics(run_id)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=60_000, help="synthetic events per measurement (default 60000)")
    ap.add_argument("--batch", type=int, default=0, help="records per insert (default: the run's store.batch_max_records)")
    ap.add_argument("--run", default="", help="measure this existing run's production instead of running the example")
    ap.add_argument("--runs-dir", default="runs", help="where --run lives (default runs)")
    ap.add_argument("--steps", type=int, default=20, help="RL steps of the example run (default 20)")
    ap.add_argument("--warmup", type=int, default=50, help="supervised warm-up steps of the example run (default 50)")
    ap.add_argument("--bootstrap", default="", help="Kafka (default: $ROLLSTREAM_BOOTSTRAP, else the local broker)")
    ap.add_argument("--skip-e2e", action="store_true", help="store-only measurement only (no broker needed)")
    ap.add_argument("--profile", action="store_true", help="also profile both measurements with py-spy")
    ap.add_argument("--json", default="", help="also write the results as JSON here")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--spec", default="", help=argparse.SUPPRESS)
    ap.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        spec = json.loads(Path(args.spec).read_text())
        res = child_store(spec) if args.child == "store" else asyncio.run(child_e2e(spec))
        Path(args.result).write_text(json.dumps(res))
        return 0

    t_all = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="rollstream-bench-recorder-"))
    try:
        return _main(args, work, t_all)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _main(args: argparse.Namespace, work: Path, t_all: float) -> int:
    import chdb
    import clickhouse_connect

    example_wall = None
    if args.run:
        run, runs_dir = args.run, Path(args.runs_dir).resolve()
    else:
        runs_dir = work / "runs"
        print(f"running the main example ({args.warmup} warm-up + {args.steps} RL steps)...", flush=True)
        run = f"benchrec-{uuid4().hex[:8]}"
        try:
            example_wall = run_example(run, args.steps, args.warmup, runs_dir)
        finally:  # the example run's topics go, whatever happened
            boot = find_broker(args.bootstrap)
            if boot:
                asyncio.run(_delete_topics(boot, run))
    prod = production(run, str(runs_dir))
    batch = args.batch
    if not batch:
        import yaml

        cfg = runs_dir / run / "config.yaml"
        batch = int(((yaml.safe_load(cfg.read_text()) if cfg.exists() else {}).get("store") or {})
                    .get("batch_max_records", 2000))
    plan = {"mix": prod["mix"], "sizes": prod["sizes"]}
    tpl = templates()
    missing = [k for k in plan["mix"] if k not in tpl]

    print(f"store only: {args.n} events, batches of {batch}...", flush=True)
    store = spawn("store", {"run_id": f"benchrec{uuid4().hex[:8]}", "n": args.n, "batch": batch, "plan": plan,
                            "store": str(work / "store-only")}, work)
    e2e: dict[str, Any] | None = None
    boot = ""
    if not args.skip_e2e:
        boot = find_broker(args.bootstrap) or ""
        if not boot:
            print(f"bench/recorder.py: {NO_BROKER}; or use --skip-e2e for the store-only part", file=sys.stderr)
            return 2
        print(f"end to end through Kafka at {boot}: {args.n} events...", flush=True)
        e2e = spawn("e2e", {"run_id": f"benchrec{uuid4().hex[:8]}", "n": args.n, "batch": batch, "plan": plan,
                            "store": str(work / "e2e"), "bootstrap": boot, "timeout_s": 600}, work)
    profiles: dict[str, dict[str, Any]] = {}
    if args.profile:
        spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
        if not spy:
            print("bench/recorder.py: --profile needs py-spy (.venv/bin/pip install py-spy)", file=sys.stderr)
        else:
            print("profiling both again with py-spy...", flush=True)
            out = work / "store.folded"
            spawn("store", {"run_id": f"benchrec{uuid4().hex[:8]}", "n": args.n, "batch": batch, "plan": plan,
                            "store": str(work / "store-prof"), "spy": spy, "spy_out": str(out)}, work)
            if out.exists():
                profiles["store only"] = profile_shares(out, skip=())
            out = work / "e2e.folded"
            if boot:
                spawn("e2e", {"run_id": f"benchrec{uuid4().hex[:8]}", "n": args.n, "batch": batch, "plan": plan,
                              "store": str(work / "e2e-prof"), "bootstrap": boot, "timeout_s": 600, "spy": spy,
                              "spy_out": str(out)}, work)
                if out.exists():
                    profiles["end to end"] = profile_shares(
                        out, skip=("child_e2e (", "Recorder.on_start (", "aiokafka/producer"))

    # ------------------------------------------------------------------ report
    print()
    print(f"rollstream recorder bench — {platform.machine()} {cpu_name()}, {os.cpu_count()} cores, "
          f"python {platform.python_version()}, chdb {chdb.__version__} (ClickHouse {store['engine']}), "
          f"clickhouse-connect {clickhouse_connect.__version__}, msgspec {msgspec.__version__}")
    src = (f"existing run {run}" if args.run else
           f"main example, {args.warmup} warm-up + {args.steps} RL steps, {example_wall:.0f} s wall")
    print(f"production: {src}; batch_max_records {batch}; N = {args.n} synthetic events per measurement")
    print()
    print(f"What the run produced ({prod['events']} events in {prod['run_span_s']:.0f} s; RL phase "
          f"{prod['rl_events']} events in {prod['rl_span_s']:.1f} s; peak second {prod['peak_at']})")
    rows: list[tuple[str, ...]] = [("topic", "events (RL phase)", "span s", "events/s")]
    for t in prod["per_topic"]:
        rows.append((t["topic"], str(t["n"]), f"{t['span_s']:.1f}", _fmt(t["rate"]) if t["n"] >= 10 else "-"))
    _table(rows)
    if prod["lag_reports"]:
        print(f"the run's own recorder, sharing the machine with every service: consumer lag over "
              f"{prod['lag_reports']} reports (recorder_lag) max {prod['lag_max']} messages, mean "
              f"{prod['lag_avg']:.0f} (= {prod['lag_avg'] / prod['avg_rate']:.1f} s of average production)")
    print()
    counts = apportion({k: v["n"] for k, v in plan["mix"].items() if k in tpl}, args.n)
    sample = {k: make_event(k, 1, "benchrecx", plan["sizes"], tpl, time.time()) for k in counts}
    print("Event mix (synthetic events follow the run's mix; payload = the events row's JSON)")
    rows = [("kind", "topic", "run events", "share", "synthetic N", "run payload B", "synthetic payload B")]
    total = sum(v["n"] for v in plan["mix"].values())
    for k, v in plan["mix"].items():
        rows.append((k, v["topic"], str(v["n"]), f"{v['n'] / total:.1%}", str(counts.get(k, 0)),
                     f"{v['payload']:.0f}", str(len(msgspec.json.encode(sample[k]))) if k in sample else "-"))
    _table(rows)
    if missing:
        print(f"(no template for {', '.join(missing)}: left out)")
    print()
    print("Recorder throughput vs production (headroom = sustained ÷ produced; goal ≥ 20×)")
    avg, peak = prod["avg_rate"], prod["peak_rate"]
    rows = [("rate", "events/s", "÷ run average", "÷ run peak 1 s")]
    rows.append(("run average, RL phase (produced)", _fmt(avg), "1.0x", f"{avg / peak:.2f}x"))
    rows.append(("run peak 1 s (produced)", _fmt(peak), f"{peak / avg:.1f}x", "1.0x"))
    rows.append(("store only: rows_for + insert (sustained)", _fmt(store["events_s"]),
                 f"{store['events_s'] / avg:.1f}x", f"{store['events_s'] / peak:.1f}x"))
    if e2e:
        rows.append(("end to end: Kafka -> recorder -> chDB (sustained)", _fmt(e2e["events_s"]),
                     f"{e2e['events_s'] / avg:.1f}x", f"{e2e['events_s'] / peak:.1f}x"))
    _table(rows)
    print()
    print(f"store only: {store['n']} events ({store['rows']} rows in all tables) in {store['seconds']:.2f} s: "
          f"row mapping {store['rows_s']:.2f} s ({store['rows_s'] / store['seconds']:.0%}), chDB inserts "
          f"{store['insert_s']:.2f} s ({store['insert_s'] / store['seconds']:.0%}: {store['inserts']} inserts, "
          f"{store['inserts'] / store['batches']:.1f} tables per batch, {1e3 * store['insert_s'] / store['inserts']:.1f} "
          f"ms each); {store['stored']} in the store")
    if e2e:
        st_ = e2e["steady_s"]
        rest = st_ - e2e["rows_s"] - e2e["insert_s"]
        print(f"end to end: produced and acked in {e2e['produce_s']:.1f} s; recorder start to first stored batch "
              f"{e2e['startup_s']:.1f} s ({e2e['first_batch']} events; group join, store open, DDL); then "
              f"{e2e['n'] - e2e['first_batch']} events in {st_:.2f} s over {e2e['polls']} polls: row mapping "
              f"{e2e['rows_s']:.2f} s ({e2e['rows_s'] / st_:.0%}), chDB inserts {e2e['insert_s']:.2f} s "
              f"({e2e['insert_s'] / st_:.0%}: {e2e['inserts']} inserts, {e2e['inserts'] / max(e2e['polls'], 1):.1f} "
              f"tables per poll, {1e3 * e2e['insert_s'] / max(e2e['inserts'], 1):.1f} ms each), the rest (Kafka fetch, decode, commit, lag) {rest:.2f} s "
              f"({rest / st_:.0%}); {e2e['events_s_incl_startup']:,.0f} events/s counting start-up; "
              f"{e2e['stored']} in the store")
    for name, prof in profiles.items():
        print()
        print(f"py-spy --gil, {name} (the measured part only, {prof['busy']} samples at 250/s of the thread "
              "holding the GIL): share under each function (inclusive)")
        _table([("function", "share")] + [(f, f"{x:.0%}") for f, x in prof["inclusive"]])
        print(f"py-spy, {name}: heaviest leaf frames (self time)")
        _table([("frame", "share")] + [(f, f"{x:.0%}") for f, x in prof["self"]])
    print()
    print(f"total {time.perf_counter() - t_all:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"production": prod, "store_only": store, "end_to_end": e2e,
                                               "batch": batch, "n": args.n}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
