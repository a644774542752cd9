"""Bus throughput, codec speed and Kafka's overhead in a run, measured side by side in one run.

    .venv/bin/python bench/bus.py [--bootstrap HOST:PORT] [--n N] [--seconds S] [--compression C]
                                  [--overhead-steps 20] [--only-overhead] [--threads N] [--rate 50]
                                  [--warm DIR] [--profile-out FILE] [--config CFG]

It prints four parts:

1. Kafka end to end: events/s from the first send to the commit of the last event, through
   :class:`runtime.bus.Producer` and a :class:`runtime.bus.Consumer` group, for ``--n`` small
   (``RolloutTask``) and ``N / 10`` large events (``Generation``, 4096 tokens).
2. Codecs: msgspec msgpack against stdlib ``json``, round trips per second (``--seconds`` each).
3. Batch compression with the functions aiokafka calls: lz4 against zstd, MB/s and size.
4. Kafka overhead in a run (``--overhead-steps`` RL steps, 0 skips it; ``--only-overhead`` runs it
   alone; needs py-spy): the main example's s/step through Kafka (``rollstream run``, plain and
   under py-spy at ``--rate`` Hz) against the same handlers in one process, the overhead share,
   the Kafka client's CPU per step by category (:func:`classify`) and per process, and every
   process's CPU per step from ``/proc`` (:class:`ProcCpu`). ``--threads N`` sets every process's
   torch threads; ``--profile-out`` keeps the raw profile; ``--warm`` is the warmed-up tiny model.
   ``--config CFG`` measures the Kafka part on another example as shipped (no in-process loop).

Needs a reachable Kafka broker; creates the topics of a throwaway run and deletes them at the end.
The defaults took 2 minutes on a quiet 2-core machine. bench/README.md ("bus.py") says exactly
what each table measures and keeps the measured runs.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from uuid import uuid4

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: common, async_speedup, learn_offline

from aiokafka.codec import lz4_encode, zstd_encode

from runtime.bus import BusError, Compression, Consumer, Producer, TopicAdmin, next_offsets
from schemas.config import KafkaSettings
from schemas.events import Event, Generation, RolloutTask
from schemas.topics import topic_name

GOAL_OVERHEAD = 0.03
"""Goal (reported, not asserted): Kafka's share of the step time."""


def small_event(run_id: str, i: int) -> RolloutTask:
    return RolloutTask(
        run_id=run_id,
        sample_id=f"grp{i // 8:06d}/{i % 8}",
        group_id=f"grp{i // 8:06d}",
        index=i % 8,
        group_size=8,
        prompt_id=f"arith-{i // 8}",
        domain="arith",
        prompt=f"Compute {i % 997} + {i % 991}. Put the answer after 'Answer:'.",
        reference=str(i % 997 + i % 991),
        policy_version=3,
        max_new_tokens=64,
    )


def large_event(run_id: str, i: int, tokens: int = 4096) -> Generation:
    rng = random.Random(i)
    return Generation(
        run_id=run_id,
        task=small_event(run_id, i),
        prompt_ids=[rng.randrange(32_000) for _ in range(256)],
        response_ids=[rng.randrange(32_000) for _ in range(tokens)],
        response_text="".join(rng.choice("abcdefghij klmnop") for _ in range(tokens * 3)),
        logprobs=[-rng.expovariate(2.0) for _ in range(tokens)],
        loss_mask=[1] * tokens,
        finish_reason="length",
        policy_version=3,
        policy_version_end=3,
        worker_id="w0",
        gen_s=1.5,
    )


# --------------------------------------------------------------------------- codecs


def _rate(fn: Callable[[], Any], seconds: float) -> float:
    """Calls per second of ``fn`` over at least ``seconds`` (after a short warm-up)."""
    for _ in range(3):
        fn()
    n, batch = 0, 1
    t0 = time.perf_counter()
    while True:
        for _ in range(batch):
            fn()
        n += batch
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return n / dt
        batch = min(batch * 2, 4096)


def codec_rates(event: Event, seconds: float) -> dict[str, float]:
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(type(event))
    packed = enc.encode(event)
    as_dict = msgspec.to_builtins(event)
    as_json = json.dumps(as_dict).encode()
    assert dec.decode(packed) == event
    assert json.loads(as_json) == as_dict
    return {
        "msgpack_rate": _rate(lambda: dec.decode(enc.encode(event)), seconds),
        "json_rate": _rate(lambda: json.loads(json.dumps(as_dict).encode()), seconds),
        "msgpack_bytes": float(len(packed)),
        "json_bytes": float(len(as_json)),
    }


def compression_rates(events: list[Event], seconds: float) -> dict[str, tuple[float, float]]:
    """codec -> (MB/s compressing one batch of ``events``, compressed/raw size)."""
    enc = msgspec.msgpack.Encoder()
    blob = b"".join(enc.encode(e) for e in events)
    out = {}
    for name, fn in (("lz4", lz4_encode), ("zstd", zstd_encode)):
        ratio = len(fn(blob)) / len(blob)
        out[name] = (_rate(functools.partial(fn, blob), seconds) * len(blob) / 1e6, ratio)
    return out


# --------------------------------------------------------------------------- kafka


async def kafka_rate(
    kafka: KafkaSettings, run_id: str, topic: str, events: list[Event], compression: Compression
) -> dict[str, float]:
    """Produce ``events`` while a group consumes and commits them; events/s and MB/s."""
    n = len(events)
    consumer = Consumer(kafka, group_id=f"bench-{run_id}-{topic.rsplit('.', 1)[-1]}", topics=[topic])
    await consumer.start()
    try:
        # join the group before the clock starts (a rebalance is not what we measure)
        deadline = time.monotonic() + 30
        while not consumer.assignment():
            if time.monotonic() > deadline:
                raise BusError("bench consumer got no partitions within 30 s")
            await consumer.getmany(timeout_ms=100)
        async with Producer(kafka, compression=compression, client_suffix="bench") as producer:
            payload = [producer.encode(e) for e in events]
            keys = [str(i).encode() for i in range(n)]
            nbytes = sum(map(len, payload))
            got = 0

            async def consume() -> None:
                nonlocal got
                stop_at = time.monotonic() + 120
                while got < n:
                    if time.monotonic() > stop_at:
                        raise BusError(f"only {got} of {n} events came back within 120 s")
                    recs = await consumer.getmany(timeout_ms=200, max_records=2000)
                    if recs:
                        bad = [r.error for r in recs if r.error]
                        if bad:
                            raise BusError(f"bench read undecodable records: {bad[0]}")
                        await consumer.commit(next_offsets(recs))
                        got += len(recs)

            t0 = time.perf_counter()
            reader = asyncio.create_task(consume())
            futs = [await producer.send_raw(topic, v, k) for v, k in zip(payload, keys, strict=True)]
            await asyncio.gather(*futs)
            t_acked = time.perf_counter() - t0
            await reader
            dt = time.perf_counter() - t0
    finally:
        await consumer.stop()
    return {"events_s": n / dt, "mb_s": nbytes / dt / 1e6, "acked_s": n / t_acked, "n": n, "seconds": dt}


# --------------------------------------------------------------------------- Kafka overhead in a run

CATEGORIES = ("serialisation", "produce", "consume", "commit", "transactions", "connection I/O", "runtime bookkeeping")
"""Where a profile sample of a service counts as Kafka overhead (see :func:`classify`)."""
_TXN = re.compile(r"transaction|Txn|_commit_txn|send_offsets")
_SERIAL = re.compile(r"(^|\.)(encode|decode|decoder_for|key_for|encode_key|check_size|make_output)$")
_KAFKA_FUNCS = {"make_output", "KafkaIO.send_outputs", "KafkaIO.transaction", "TxnLoop._commit_txn_ready",
                "TxnLoop._txn_plan", "RecordLoop._commit_ready", "KafkaIO.poll", "KafkaIO.commit", "Runner.commit",
                "Runner.send"}
_OURS = ("runtime/clients.py", "runtime/records.py")
_RUNTIME = ("runtime/loops.py", "runtime/txn_loop.py", "runtime/handling.py", "runtime/kafka_io.py",
            "runtime/runner.py", "runtime/service.py", "runtime/offsets.py", "runtime/bus.py", "runtime/records.py")


def _frame(text: str) -> tuple[str, str]:
    """``"func (path:line)"`` -> (func, path); the path always starts with ``/`` (py-spy writes
    site-packages and repository files relative, e.g. ``aiokafka/conn.py``)."""
    func, _, rest = text.partition(" (")
    path = rest.rsplit(":", 1)[0]
    return func, path if path.startswith("/") else "/" + path


def classify(frames: list[str]) -> str | None:
    """The Kafka category of one sampled stack (root first), or ``None`` when it is not Kafka work.

    The stack's root-most Kafka frame (in aiokafka, in ``runtime/clients.py`` / ``records.py``,
    or one of the runtime's send/poll/commit calls) decides that the sample is Kafka work; the frames
    from there to the leaf say which: a transaction call anywhere under it -> ``transactions``; a
    commit -> ``commit``; our msgpack encode/decode, key or size check -> ``serialisation``; the
    producer -> ``produce``; the consumer, fetcher or group coordinator -> ``consume``; else aiokafka's
    connection and protocol code (shared by both directions) -> ``connection I/O``. A sample whose
    leaf is the runtime's own code (loops, offsets, dedupe) with no Kafka frame above it ->
    ``runtime bookkeeping``.
    """
    parsed = [_frame(f) for f in frames]
    start = next((i for i, (func, path) in enumerate(parsed)
                  if "/aiokafka/" in path or path.endswith(_OURS) or func in _KAFKA_FUNCS), None)
    if start is None:
        return "runtime bookkeeping" if parsed and parsed[-1][1].endswith(_RUNTIME) else None
    sub = parsed[start:]
    if any(_TXN.search(func) for func, _ in sub):
        return "transactions"
    if any("commit" in func.lower() for func, _ in sub):
        return "commit"
    if any(_SERIAL.search(func) and ("/runtime/" in path or "/services/" in path) for func, path in sub):
        return "serialisation"
    if any("/aiokafka/producer/" in path or func.startswith("Producer.") or func == "KafkaIO.send_outputs" for func, path in sub):
        return "produce"
    if any("/aiokafka/consumer/" in path or "/aiokafka/coordinator/" in path or func.startswith("Consumer.")
           or func == "KafkaIO.poll" for func, path in sub):
        return "consume"
    return "connection I/O"


_IDLE = re.compile(r"(EpollSelector\.select|select|Condition\.wait|Event\.wait) \(|_worker \(concurrent/futures/thread\.py")
"""Leaf frames of a waiting thread: the event loop's selector, a condition or event, and a thread
pool's worker blocked on its work queue (py-spy's ``--nonblocking`` sampling counts them)."""
_SERVICE = re.compile(r"-m cli (?:service (\S+)|(run))")


def profile_breakdown(path: Path, rate: int) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """From a py-spy ``--format raw --subprocesses`` profile: per service, CPU seconds per Kafka
    category; and per service, all seconds sampled. Samples of module imports (start-up) and of
    threads waiting in the selector or on a condition are left out of both."""
    by: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    total: dict[str, float] = defaultdict(float)
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        procs = [f for f in frames if f.startswith("process ")]
        m = _SERVICE.search(procs[-1]) if procs else None
        service = (m.group(1) or "supervisor") if m else "other"
        rest = [f for f in frames if not f.startswith("process ")]
        if any(f.startswith("_find_and_load ") for f in rest) or (rest and _IDLE.match(rest[-1])):
            continue  # start-up imports, and waiting in the event loop's selector
        seconds = int(count) / rate
        total[service] += seconds
        cat = classify(rest)
        if cat is not None:
            by[service][cat] += seconds
    return by, total


def broker_cpu_s(bootstrap: str) -> float | None:
    """CPU seconds (user + system) the broker process listening on ``bootstrap``'s port has used so
    far, when it runs on this machine and ``ss`` can name it; else ``None``."""
    pid = broker_pid(bootstrap)
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class ProcCpu:
    """CPU seconds (user + system, from ``/proc/<pid>/stat``) of a run's processes over time: every
    ``interval_s`` a thread reads the CPU time of each process whose command line names the run
    (``--run <id>`` for a service, ``--run-id <id>`` for the supervisor) and of the broker process
    ``broker_pid``. Unlike py-spy's samples this is what the kernel charged: native threads
    (chDB's, torch's OpenMP workers, spinning included) count, waiting threads do not. It also
    reads how long each process's threads were runnable but waited for a core
    (``/proc/<pid>/task/*/schedstat``, :meth:`waits_between`): on a machine with fewer cores than
    busy processes that wait is hop latency, and py-spy counts it as busy."""

    def __init__(self, run_id: str, broker_pid: int | None, interval_s: float = 0.25) -> None:
        self.run_id, self.broker_pid, self.interval_s = run_id, broker_pid, interval_s
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.wait_samples: list[tuple[float, dict[str, float]]] = []
        self._labels: dict[int, str | None] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="proc-cpu")

    def _label(self, pid: int) -> str | None:
        if pid == self.broker_pid:
            return "broker"
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        if "--run-id" in cmd and self.run_id in cmd:
            return "supervisor"
        if "service" in cmd and "--run" in cmd and self.run_id in cmd:
            return cmd[cmd.index("service") + 1]
        return None

    def _loop(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        while not self._stop.wait(self.interval_s):
            now = time.time()
            cpu: dict[str, float] = defaultdict(float)
            wait: dict[str, float] = defaultdict(float)
            for entry in os.listdir("/proc"):
                if not entry.isdigit():
                    continue
                pid = int(entry)
                try:
                    # a child the supervisor forked has its command line until it execs the service:
                    # a "supervisor" label is read again, so no service is counted as the supervisor
                    if self._labels.get(pid, "supervisor") == "supervisor":
                        self._labels[pid] = self._label(pid)
                    label = self._labels[pid]
                    if label is not None:
                        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                        cpu[label] += (int(fields[11]) + int(fields[12])) / tick
                        wait[label] += runnable_wait_s(pid)
                except (OSError, ValueError, IndexError):
                    continue  # gone, or not ours to read
            self.samples.append((now, dict(cpu)))
            self.wait_samples.append((now, dict(wait)))

    @property
    def labels(self) -> dict[int, str | None]:
        """pid -> its label (``None``: not the run's), as last read."""
        return self._labels

    def __enter__(self) -> ProcCpu:
        if Path("/proc/self/stat").exists():
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def between(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds each label used from wall time ``t0`` to ``t1`` (the nearest samples); empty
        without samples. A process that exited before ``t1`` is left out."""
        return _delta(self.samples, t0, t1)

    def waits_between(self, t0: float, t1: float) -> dict[str, float]:
        """Seconds each label's threads were runnable but waited for a core from ``t0`` to ``t1``
        (summed over its threads), as :meth:`between`."""
        return _delta(self.wait_samples, t0, t1)


def runnable_wait_s(pid: int) -> float:
    """Seconds the threads of ``pid`` have spent runnable, waiting for a core (the second field of
    each ``/proc/<pid>/task/<tid>/schedstat``, nanoseconds), summed; 0.0 where the kernel keeps none."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended, or no schedstat in this kernel
    return total / 1e9


def _delta(samples: list[tuple[float, dict[str, float]]], t0: float, t1: float) -> dict[str, float]:
    """Each label's counter at the sample nearest ``t1`` less the one nearest ``t0``."""
    if not samples:
        return {}
    a = min(samples, key=lambda x: abs(x[0] - t0))[1]
    b = min(samples, key=lambda x: abs(x[0] - t1))[1]
    return {k: b[k] - a.get(k, 0.0) for k in b}


def broker_pid(bootstrap: str) -> int | None:
    """The pid of the process listening on ``bootstrap``'s port when it runs here and ``ss`` names it."""
    port = bootstrap.rsplit(":", 1)[-1]
    try:
        out = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    pid = re.search(r"pid=(\d+)", out)
    return int(pid.group(1)) if pid else None


def overhead(args: argparse.Namespace) -> int:
    """The main example's pipeline through Kafka against the same handlers in one process; prints
    the overhead as a share of step time and the Kafka CPU time per step by category."""
    import common  # bench/common.py

    steps = args.overhead_steps
    main = args.config is None
    env = dict(os.environ, PYTHONHASHSEED="0", ROLLSTREAM_BOOTSTRAP=args.bootstrap)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)  # every service process's torch threads
    work = Path(tempfile.mkdtemp(prefix="bus-overhead-"))
    sets = ["train.warmup_sft_steps=0", f"train.steps={steps}", "rollout.async_ratio=0",
            "train.max_staleness=0", f"train.eval_every={steps}", f"train.checkpoint_every={steps}",
            f"run.runs_dir={work / 'runs'}", "run.seed=0"]
    if main:
        model = common.warm_model_at(args.warm)
        sets.insert(0, f"model.path={model}")
    else:
        sets.append("data.heldout_size=16")
    what = ("the main example (batch 256 = 32 groups of 8, async_ratio 0), {steps} RL steps from the warmed-up model"
            if main else f"{args.config} as shipped but async_ratio 0 and no warm-up, {{steps}} RL steps")

    phases: list[tuple[str, float]] = []
    proc_cpu: dict[str, float] = {}  # CPU seconds per process per step, unprofiled run, from /proc

    def kafka_run(tag: str, prefix: list[str] | None) -> tuple[str, float, float]:
        run_id = f"bench-bus-{tag}-{uuid4().hex[:6]}"
        t0 = time.perf_counter()
        with ProcCpu(run_id, broker_pid(args.bootstrap)) as cpu:
            common.rollstream_run(run_id, sets, env, prefix=prefix, config=args.config)
        wall = time.perf_counter() - t0
        rows = common.sql(f"SELECT toUnixTimestamp64Micro(ts) / 1e6 AS t FROM train_steps FINAL "
                          f"WHERE run_id = '{run_id}' ORDER BY step", run_id, work / "runs", env)
        ts = [float(r["t"]) for r in rows]
        if len(ts) < 2:
            raise SystemExit(f"bench/bus.py: run {run_id} recorded {len(ts)} train steps, need 2 or more")
        if prefix is None:
            used = cpu.between(ts[0], ts[-1])
            proc_cpu.update({k: v / (len(ts) - 1) for k, v in used.items()})
            try:
                phases[:] = step_phases(common.sql(PHASES_SQL.format(run_id=run_id), run_id, work / "runs", env))
            except SystemExit as e:  # the phase table is a diagnosis: the measurement stands without it
                print(f"  (no phase breakdown: {e})", flush=True)
        return run_id, (ts[-1] - ts[0]) / (len(ts) - 1), wall

    try:
        print(f"\nKafka overhead: {what.format(steps=steps)}, through Kafka"
              f"{' and in one process' if main else ''}", flush=True)
        cpu0 = broker_cpu_s(args.bootstrap)
        _, kafka_step, kafka_wall = kafka_run("plain", None)
        cpu1 = broker_cpu_s(args.bootstrap)
        print(f"  through Kafka: {kafka_step:.3f} s/step ({kafka_wall:.0f} s in all)", flush=True)
        prof = work / "profile.txt"
        spy = [str(Path(sys.executable).parent / "py-spy"), "record", "--subprocesses", "--nonblocking", "--rate",
               str(args.rate), "--format", "raw", "-o", str(prof), "--"]
        _, prof_step, _ = kafka_run("profiled", spy)
        if args.profile_out:
            shutil.copyfile(prof, args.profile_out)
        print(f"  through Kafka under py-spy: {prof_step:.3f} s/step", flush=True)
        inproc_step = 0.0
        if main:
            inproc_step, g, t = inprocess(steps, model, work / "inproc", args.threads)
            print(f"  in one process: {inproc_step:.3f} s/step (generate + score {g:.3f} s, train + weight swap "
                  f"{t:.3f} s)", flush=True)
        by, total = profile_breakdown(prof, args.rate)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    cats: dict[str, float] = defaultdict(float)
    for per in by.values():
        for cat, sec in per.items():
            cats[cat] += sec
    kafka_s = sum(cats.values()) / steps  # Kafka CPU seconds per step, every service together
    threads = f"{args.threads} torch threads per process" if args.threads else "torch's default threads"
    print(f"\nStep time (wall, steps 2..{steps}; {threads}): the same handlers, in-process vs through Kafka")
    print(f"machine: {common.machine()}")
    if main:
        rows: list[tuple[str, ...]] = [("pipeline", "s/step", "÷ in-process"),
                ("in one process (generate, score, train, swap)", f"{inproc_step:.3f}", "1.00x"),
                ("through Kafka (rollstream run)", f"{kafka_step:.3f}", f"{kafka_step / inproc_step:.2f}x"),
                ("through Kafka under py-spy", f"{prof_step:.3f}", f"{prof_step / inproc_step:.2f}x")]
        _table(rows)
        print(f"whole-pipeline overhead (Kafka, separate processes, recorder, polling): "
              f"{(kafka_step - inproc_step) / kafka_step:.1%} of the Kafka step time")
    else:
        _table([("pipeline", "s/step"), ("through Kafka (rollstream run)", f"{kafka_step:.3f}"),
                ("through Kafka under py-spy", f"{prof_step:.3f}")])
        print(f"(no in-process loop for {args.config}: the Kafka part below is the measurement)")
    if phases:
        print("where a step's wall time goes through Kafka (unprofiled run, mean over steps 2.., from the record):")
        _table([("phase", "s/step", "of step"), *[(name, f"{sec:.3f}", f"{sec / kafka_step:.0%}") for name, sec in phases]])
    if proc_cpu:
        print(f"\nCPU per step by process (from /proc, unprofiled run, first to last train step; native threads and "
              f"OpenMP spinning included; {os.cpu_count()} cores = {os.cpu_count() or 1:.0f} s of CPU per second)")
        order = sorted(proc_cpu, key=lambda k: -proc_cpu[k])
        _table([("process", "ms/step", "of one core"),
                *[(k, f"{1000 * proc_cpu[k]:.0f}", f"{proc_cpu[k] / kafka_step:.0%}") for k in order],
                ("all", f"{1000 * sum(proc_cpu.values()):.0f}", f"{sum(proc_cpu.values()) / kafka_step:.0%}")])
    print(f"\nKafka client CPU per step by category (py-spy, {args.rate} Hz, every service process; "
          f"share of the profiled step time {prof_step:.3f} s; goal: all Kafka under {GOAL_OVERHEAD:.0%})")
    services = sorted(by, key=lambda s: -sum(by[s].values()))
    rows = [("category", "ms/step", "of step", *services)]
    for cat in CATEGORIES:
        rows.append((cat, f"{1000 * cats[cat] / steps:.1f}", f"{cats[cat] / steps / prof_step:.2%}",
                     *[f"{1000 * by[s][cat] / steps:.1f}" for s in services]))
    rows.append(("all Kafka", f"{1000 * kafka_s:.1f}", f"{kafka_s / prof_step:.2%}",
                 *[f"{1000 * sum(by[s].values()) / steps:.1f}" for s in services]))
    rows.append(("all CPU sampled", f"{1000 * sum(total.values()) / steps:.1f}",
                 f"{sum(total.values()) / steps / prof_step:.0%}",
                 *[f"{1000 * total[s] / steps:.1f}" for s in services]))
    _table(rows)
    sampled = sum(total.values()) / steps
    print(f"all Kafka = {kafka_s / max(sampled, 1e-9):.1%} of the services' sampled time (py-spy counts a thread "
          "that is runnable but waiting for a core as busy, so on a loaded machine both rows run high)")
    if cpu0 is not None and cpu1 is not None:
        print(f"broker CPU during the unprofiled run: {cpu1 - cpu0:.1f} s ({(cpu1 - cpu0) / kafka_wall:.1%} of one core "
              "over the run's wall time, start-up included; other users of the broker count too)")
    else:
        print("broker CPU: not measured (no local broker process found listening on the bootstrap port)")
    return 0


PHASES_SQL = """
SELECT o.step AS step,
       toUnixTimestamp64Micro(min(t.issued_ts)) / 1e6 AS issued,
       toUnixTimestamp64Micro(max(g.generated_ts)) / 1e6 AS generated,
       toUnixTimestamp64Micro(max(r.scored_ts)) / 1e6 AS scored,
       toUnixTimestamp64Micro(any(s.ts)) / 1e6 AS trained
FROM sample_outcomes AS o FINAL
JOIN sample_tasks AS t FINAL ON t.run_id = o.run_id AND t.sample_id = o.sample_id
JOIN sample_generations AS g FINAL ON g.run_id = o.run_id AND g.sample_id = o.sample_id
JOIN sample_rewards AS r FINAL ON r.run_id = o.run_id AND r.sample_id = o.sample_id
JOIN train_steps AS s FINAL ON s.run_id = o.run_id AND s.step = o.step
WHERE o.run_id = '{run_id}' AND o.status = 'trained'
GROUP BY o.step ORDER BY o.step
"""
"""Per trained step: when its first task was issued, its last generation done, its last sample
scored, and the step recorded."""


def step_phases(rows: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """Mean seconds per phase over steps 2.. of :data:`PHASES_SQL`'s rows: issue of the step's first
    task -> its last generation (generation), -> its last score (scoring), -> the step recorded
    (training, with the trainer's wait for its batch), -> the next step's first task (weights
    published and picked up, next batch issued)."""
    steps = [{k: float(v) for k, v in r.items()} for r in rows][1:]
    if len(steps) < 2:
        return []
    nxt = steps[1:]
    n = len(nxt)
    return [
        ("generate (first task issued -> last generation)", sum(r["generated"] - r["issued"] for r in steps[:n]) / n),
        ("score (-> last sample scored)", sum(r["scored"] - r["generated"] for r in steps[:n]) / n),
        ("train (-> train step recorded)", sum(r["trained"] - r["scored"] for r in steps[:n]) / n),
        ("publish + next issue (-> next step's first task)",
         sum(b["issued"] - a["trained"] for a, b in zip(steps, nxt, strict=False)) / n),
    ]


def inprocess(steps: int, model: Path, work: Path, threads: int | None) -> tuple[float, float, float]:
    """The same handlers wired in one process: ``bench/async_speedup.py``'s batch-synchronous loop
    (TorchEngine generation, the verifier, TorchStrategy's step and the weight swap) with no reward
    latency, on the main example's config; (s/step, generate+score s, train+swap s)."""
    import async_speedup as asp
    import learn_offline as lo
    import torch
    from transformers.utils import logging as hf_logging

    from schemas.config import parse_raw

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    if threads:
        torch.set_num_threads(threads)

    raw = json.loads(json.dumps(lo.TUNED))
    raw["train"].update({"steps": steps, "eval_every": 0})
    result, g, t = asyncio.run(asp.sync_mode(parse_raw(raw), model, 0.0, 0.0, work))
    return result.step_s, g, t


# --------------------------------------------------------------------------- main


def _fmt(x: float) -> str:
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:.2f}"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--bootstrap", default="",
                    help="Kafka (default: $ROLLSTREAM_BOOTSTRAP, else the local broker of `rollstream stack up`)")
    ap.add_argument("--n", type=int, default=20_000, help="small events through Kafka (large: N/10)")
    ap.add_argument("--seconds", type=float, default=1.0, help="time per codec measurement")
    ap.add_argument(
        "--compression",
        default="zstd",
        choices=["zstd", "lz4", "gzip", "snappy", "none"],
        help="producer codec",
    )
    ap.add_argument("--overhead-steps", type=int, default=20,
                    help="RL steps of each run of the Kafka-overhead part (0 skips that part)")
    ap.add_argument("--threads", type=int, default=None,
                    help="overhead part: torch threads of every service (OMP_NUM_THREADS) and of the in-process "
                         "loop (default: torch's default, one per core)")
    ap.add_argument("--profile-out", type=Path, default=None,
                    help="overhead part: keep the raw py-spy profile of the Kafka run here")
    ap.add_argument("--only-overhead", action="store_true", help="run the Kafka-overhead part alone")
    ap.add_argument("--rate", type=int, default=50, help="py-spy samples per second in the overhead part")
    ap.add_argument("--config", type=Path, default=None,
                    help="overhead part on this example config instead of the main example (see the docstring)")
    ap.add_argument("--warm", type=Path, default=None,
                    help="warmed-up model directory for the overhead part (created when missing; "
                         "default .cache/bench/warm)")
    args = ap.parse_args()
    from common import find_broker  # bench/common.py

    from runtime.probe import NO_BROKER

    args.bootstrap = find_broker(args.bootstrap)
    if args.bootstrap is None:
        ap.error(NO_BROKER)
    if args.overhead_steps and args.overhead_steps < 3:
        ap.error(f"--overhead-steps {args.overhead_steps}: use 0 (skip) or 3 or more")
    if args.only_overhead and not args.overhead_steps:
        ap.error("--only-overhead needs --overhead-steps >= 3")
    if args.overhead_steps and not (Path(sys.executable).parent / "py-spy").exists():
        ap.error("the overhead part profiles with py-spy, which is not installed: "
                 "`.venv/bin/pip install -e '.[bench]'`, or pass --overhead-steps 0")
    return args


async def bus(args: argparse.Namespace) -> int:
    """Tables 1-3: Kafka end to end, codecs, batch compression."""
    kafka = KafkaSettings(bootstrap=args.bootstrap, connect_timeout_s=10.0)
    run_id = f"bench{uuid4().hex[:8]}"
    t_start = time.perf_counter()

    smalls: list[Event] = [small_event(run_id, i) for i in range(args.n)]
    n_large = max(1, args.n // 10)
    larges: list[Event] = [large_event(run_id, i) for i in range(n_large)]

    try:
        async with TopicAdmin(kafka) as admin:
            await admin.ensure_run_topics(run_id)
            try:
                k_small = await kafka_rate(
                    kafka, run_id, topic_name(run_id, "tasks"), smalls, args.compression
                )
                k_large = await kafka_rate(
                    kafka, run_id, topic_name(run_id, "generations"), larges, args.compression
                )
            finally:
                await admin.delete_run_topics(run_id)
    except BusError as e:
        print(f"bench/bus.py: {e}", file=sys.stderr)
        return 1
    c_small = codec_rates(smalls[0], args.seconds)
    c_large = codec_rates(larges[0], args.seconds)
    z_small = compression_rates(smalls[:2000], args.seconds / 2)
    z_large = compression_rates(larges[:16], args.seconds / 2)

    print(
        f"rollstream bus bench — broker {args.bootstrap}, python {platform.python_version()}, "
        f"{os.cpu_count()} cores, msgspec {msgspec.__version__}"
    )
    print()
    print(
        f"Kafka end to end (produce idempotent acks=all {args.compression}, "
        "consume read_committed, commit per batch)"
    )
    rows: list[tuple[str, ...]] = [
        ("event", "n", "bytes/event", "events/s", "MB/s", "acked events/s"),
        (
            "small RolloutTask",
            str(args.n),
            str(int(c_small["msgpack_bytes"])),
            _fmt(k_small["events_s"]),
            _fmt(k_small["mb_s"]),
            _fmt(k_small["acked_s"]),
        ),
        (
            "large Generation 4096 tok",
            str(n_large),
            str(int(c_large["msgpack_bytes"])),
            _fmt(k_large["events_s"]),
            _fmt(k_large["mb_s"]),
            _fmt(k_large["acked_s"]),
        ),
    ]
    _table(rows)
    print()
    print("Codec: encode + decode round trips per second (json given a ready dict, decodes to a dict)")
    rows = [
        ("event", "msgpack/s", "json/s", "msgpack ÷ json", "msgpack bytes", "json bytes"),
        *[
            (
                name,
                _fmt(c["msgpack_rate"]),
                _fmt(c["json_rate"]),
                f"{c['msgpack_rate'] / c['json_rate']:.1f}x",
                str(int(c["msgpack_bytes"])),
                str(int(c["json_bytes"])),
            )
            for name, c in (("small RolloutTask", c_small), ("large Generation 4096 tok", c_large))
        ],
    ]
    _table(rows)
    print()
    print("Batch compression as aiokafka does it (lz4 = level 9 LZ4-HC, zstd = level 3)")
    rows = [("event batch", "lz4 MB/s", "zstd MB/s", "zstd ÷ lz4 speed", "lz4 size", "zstd size")]
    for name, z in (("2000 small", z_small), ("16 large", z_large)):
        rows.append(
            (
                name,
                _fmt(z["lz4"][0]),
                _fmt(z["zstd"][0]),
                f"{z['zstd'][0] / z['lz4'][0]:.1f}x",
                f"{z['lz4'][1]:.0%}",
                f"{z['zstd'][1]:.0%}",
            )
        )
    _table(rows)
    print()
    print(f"total {time.perf_counter() - t_start:.1f} s")
    return 0


def _table(rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for j, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
        print("  ".join(cells))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def main() -> int:
    args = parse_args()
    if args.config is not None and not args.config.is_file():
        raise SystemExit(f"bench/bus.py: --config {args.config}: no such file")
    if not args.only_overhead:
        rc = asyncio.run(bus(args))
        if rc:
            return rc
    return overhead(args) if args.overhead_steps else 0


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    sys.exit(main())
