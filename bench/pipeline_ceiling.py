"""The event path's own ceiling: the main example's services through Kafka with the model work taken out.

    .venv/bin/python bench/pipeline_ceiling.py [--bootstrap HOST:PORT] [--seconds 75] [--steps N] [--rate 50]
                                               [--set KEY=VALUE ...] [--no-profile] [--profile-out FILE]
                                               [--samples-per-record N] [--after-only] [--top 8]

Every service of ``examples/main.yaml`` (feeder, rollout, reward, trainer, recorder) runs as in
``rollstream run``: the real supervisor starts each one's real ``run(settings)`` in its own process,
through the real broker and the embedded store. Inside those processes (this file's ``service``
mode, which the supervisor runs instead of ``rollstream service``) three factories are replaced:

* the rollout engine (:class:`InstantEngine`): answers at once with one of two precomputed
  completions (a 19-token worked answer; its token ids, logprobs, loss mask and policy version are
  a valid ``Generation``), picked by the sample id's crc32;
* the verifier function (:func:`instant_verify`, whatever verifier name the reward router and the
  trainer's evaluation look up): reward 1 for the right one of the two, 0 for the other; the
  scoring path around it (answer extraction, and the verifier thread with its time bound, or the
  inline call of ``exact`` and ``final_number``, as for the real verifier) is the real one;
* the training backend (:class:`NoTrainStrategy`): a step trains nothing; the trainer keeps every
  rule (groups, staleness by policy version, outcomes, checkpoints, evaluations) and publishes every
  version (a directory holding a marker file, and its ``WeightsPublished``).

It prints per row the samples/s the event path sustained (samples that got their terminal outcome,
from the first to the last training step, from the record), the trained samples/s, and each
process's CPU ms per sample from ``/proc`` (``bus.ProcCpu``; the broker is shared with anyone else
using it) and the ms per sample its threads were runnable but waited for a core. Rows: today's
path (one sample per Kafka record); where the run config has ``kafka.samples_per_record``, "before" (1) and "after" (its default, or ``--samples-per-record``),
side by side. Then, unless ``--no-profile``, the last row again under py-spy: where each service's
CPU goes: by call site (``bus.classify``'s Kafka categories, the store, our handler code, the event
loop) and by mechanism (:func:`mechanism`: socket writes, zstd, msgpack, aiokafka's producer,
fetcher, protocol...), each as a share of the service's samples. The last line is ``pipeline ceiling: N samples/s`` (the last row).
bench/README.md ("pipeline_ceiling.py") keeps the measured runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
import zlib
from collections import defaultdict
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any
from uuid import uuid4

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

RIGHT = "4+5+0=9;3+2+0=5;59\n"
"""The precomputed right answer (about the main example's response length, 19 tokens)."""
WRONG = "4+5+0=9;3+2+1=6;69\n"
"""The precomputed wrong one."""
LOGPROB = -0.05
"""Every precomputed token's behaviour logprob."""
UNTIL_DRAINED = 1_000_000
"""``train.steps`` of a run bounded by ``--seconds`` alone."""
SKIP_STEPS = 2
"""Training steps at a run's start left out of its rate (start-up, the first weights)."""
MARKER = "NO_WEIGHTS"
"""The file a published version's directory holds (:class:`NoTrainStrategy`)."""


# --------------------------------------------------------------------------- the stubs


def char_ids(text: str) -> list[int]:
    """Token ids of ``text``: its bytes (a character tokenizer, no model's)."""
    return list(text.encode())


def answer_of(request_id: str) -> str:
    """Which precomputed completion a request gets: the right one for about half the sample ids."""
    return RIGHT if zlib.crc32(request_id.encode()) & 1 else WRONG


class InstantEngine:
    """A :class:`rollout.engine.Engine` that answers every request at once with its precomputed
    completion (:func:`answer_of`), cut at ``max_new_tokens`` (``finish_reason="length"``)."""

    chat = False
    tokenizer = None
    max_positions = 4096

    def __init__(self, policy_version: int = -1) -> None:
        self.policy_version = policy_version
        self.answers = {text: char_ids(text) for text in (RIGHT, WRONG)}

    def encode(self, prompt: str, system_prompt: str | None = None) -> list[int]:
        return char_ids(prompt)

    async def generate(self, requests: Iterable[Any] | AsyncIterable[Any]) -> AsyncIterator[Any]:
        from rollout.engine import Completion

        reqs = [r async for r in requests] if isinstance(requests, AsyncIterable) else list(requests)
        for req in reqs:
            text = answer_of(req.request_id)
            n = min(len(text), req.params.max_new_tokens)
            yield Completion(request_id=req.request_id, prompt_ids=list(req.prompt_ids),
                             token_ids=self.answers[text][:n], logprobs=[LOGPROB] * n, text=text[:n],
                             finish_reason="stop" if n == len(text) else "length",
                             policy_version=self.policy_version, policy_version_end=self.policy_version)

    async def load_weights(self, ref: str | Path, version: int | None = None) -> None:
        if not (Path(ref) / MARKER).is_file():
            raise FileNotFoundError(f"{ref}: no {MARKER} (not published by the bench's trainer)")
        if version is not None:
            self.policy_version = version


def instant_verify(response: str, reference: str, **_: Any) -> Any:
    """The verifier, instant: correct when ``response`` is the precomputed right answer."""
    from envs.base import VerifyResult

    ok = response == RIGHT
    return VerifyResult(reward=float(ok), correct=ok, details="bench: instant verifier")


class NoTrainStrategy:
    """A :class:`trainer.strategy.Strategy` that trains nothing: a step counts, its metrics are the
    batch's tokens; checkpoints hold the step; an exported version is a directory with a marker."""

    tokenizer = None

    def __init__(self) -> None:
        self.step = 0

    def warmup(self, batches: Iterable[Any], *, lr: float, grad_clip: float) -> list[float]:
        return []

    def init_reference(self, path: str | Path | None = None) -> None:
        pass

    def init_critic(self) -> None:
        pass

    def train_step(self, samples: list[Any]) -> dict[str, float]:
        self.step += 1
        tokens = sum(sum(s.loss_mask) for s in samples)
        return {"loss/policy": 0.0, "train/tokens": float(tokens)}

    def save_checkpoint(self, path: str | Path) -> Path:
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        (p / "bench_step.json").write_text(json.dumps({"step": self.step}))
        return p

    def load_checkpoint(self, path: str | Path) -> int:
        self.step = int(json.loads((Path(path) / "bench_step.json").read_text())["step"])
        return self.step

    def export_weights(self, path: str | Path) -> tuple[Path, str]:
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        body = f"bench: no weights, after step {self.step}\n".encode()
        (p / MARKER).write_bytes(body)
        return p, hashlib.sha256(body).hexdigest()


def install_stubs(service: str) -> None:
    """Replace, in this process, the factories ``service`` uses (before the service imports them)."""
    if service in ("reward", "trainer"):
        import envs.verifiers

        # the router and the evaluation run every verifier through run_verifier[_async], which look it
        # up: the stub runs where the real one would (inline for exact / final_number, else a thread)
        real = envs.verifiers.get_verifier
        inline = envs.verifiers.runs_inline(lambda *a, **k: instant_verify(*a, **k))
        envs.verifiers.get_verifier = (  # type: ignore[assignment]
            lambda name: inline if envs.verifiers.inline_safe(real(name)) else instant_verify)
    if service == "rollout":
        import services.rollout_worker as rw

        rw.make_engine = lambda *a, **k: InstantEngine(k.get("policy_version", -1))  # type: ignore[assignment]
    if service == "trainer":
        import services.trainer.evaluation as evaluation
        import services.trainer.service as trainer

        trainer.make_strategy = lambda *a, **k: NoTrainStrategy()  # type: ignore[assignment]
        evaluation.make_engine = lambda *a, **k: InstantEngine(k.get("policy_version", 0))  # type: ignore[assignment]


def service_command(name: str, run_id: str, runs_dir: str) -> list[str]:
    """The supervisor's command line of one service process: this file's ``service`` mode."""
    return [sys.executable, str(Path(__file__).resolve()), "service", name, "--run", run_id, "--runs-dir", runs_dir]


def entry(argv: list[str]) -> None:
    """``service NAME ...``: one service with the stubs (``rollstream service``'s arguments);
    ``run CONFIG ...``: ``rollstream run`` whose supervisor starts the services in ``service`` mode."""
    import cli
    import launch.supervisor

    if argv[0] == "service":
        install_stubs(argv[1])
    else:
        launch.supervisor.service_command = service_command  # type: ignore[assignment]
    sys.argv = ["rollstream", *argv]
    cli.main()


# --------------------------------------------------------------------------- measuring


def batching_default() -> int | None:
    """The default of ``kafka.samples_per_record`` when this version's run config has the key, else None."""
    from schemas.config import KafkaSettings

    value = getattr(KafkaSettings(), "samples_per_record", None)
    return None if value is None else int(value)


def rows_to_run(default: int | None, override: int | None) -> list[tuple[str, list[str]]]:
    """The rows: (name, extra ``--set``s). Without the key: today's path alone."""
    if default is None:
        return [("today (one sample per record)", [])]
    after = override or default
    return [("before: kafka.samples_per_record=1", ["kafka.samples_per_record=1"]),
            (f"after: kafka.samples_per_record={after}", [f"kafka.samples_per_record={after}"])]


def window_rate(step_ts: list[float], outcome_ts: list[float], skip: int = SKIP_STEPS) -> tuple[float, int, float]:
    """Samples/s from the record: the outcomes decided after step ``skip``'s and up to the last
    step's timestamp, over that time; (samples/s, samples, seconds). The first steps (start-up,
    the first weights) are left out."""
    if len(step_ts) < skip + 2:
        raise ValueError(f"{len(step_ts)} training steps recorded; need {skip + 2} or more")
    t0, t1 = step_ts[skip], step_ts[-1]
    n = sum(1 for t in outcome_ts if t0 < t <= t1)
    return n / (t1 - t0), n, t1 - t0


PROCESS = re.compile(r"^process (\d+):.*pipeline_ceiling\.py (?:service (\S+)|(run))")
"""A service process's pid and command line in a py-spy profile (``run``: the supervisor). py-spy
keeps the command line it first saw: a service caught between the supervisor's fork and its exec
reads as ``run``, so the pid's ``/proc`` label (``bus.ProcCpu``) decides where there is one."""
IDLE = re.compile(r"(Selector\.select|^select|^Condition\.wait|^Event\.wait|^Popen\._wait) \(|^_worker \(concurrent/futures/thread\.py")
"""Leaf frames of a waiting thread (py-spy's ``--nonblocking`` samples them too)."""
OURS = ("services/", "envs/", "trainer/", "rollout/", "schemas/", "launch/", "store/")
STUBS = re.compile(r"^(InstantEngine|NoTrainStrategy|instant_verify|answer_of|char_ids)")
MECHANISMS: list[tuple[str, re.Pattern[str]]] = [(name, re.compile(rx)) for name, rx in (
    ("socket writes (asyncio transport)", r"^(_SelectorSocketTransport\.write|StreamWriter\.write) "),
    ("zstd (de)compression", r"^zstd_(encode|decode) "),
    ("msgpack encode, keys (runtime)", r"^(Producer\.encode|make_output|key_for|encode_key|check_size) "),
    ("msgpack decode, topic lookup (runtime)", r"^(Consumer\.decode|Consumer\.decoder_for|parse_topic|spec_for_topic) "),
    ("transactions", r"transaction|Txn|_commit_txn|send_offsets"),
    ("commits", r"^\S*[Cc]ommit\S* "),
    ("aiokafka protocol (request/response structs)", r"\(aiokafka/protocol/"),
    ("aiokafka record batches (build, parse)", r"\(aiokafka/record/"),
    ("producer send (accumulator, partitioner, futures)", r"\(aiokafka/(producer/|partitioner)"),
    ("consumer getmany (fetcher)", r"\(aiokafka/consumer/"),
    ("group coordinator", r"\(aiokafka/coordinator/"),
    ("aiokafka client, connection", r"\(aiokafka/"),
    ("chDB insert, rows (recorder's store)", r"\((store/|chdb/|clickhouse_connect/)"),
    ("runtime loops, handler calls, offsets", r"\(runtime/"),
    ("service handlers (ours; the bench's stubs apart)", r"\((services|envs|trainer|rollout|schemas|launch)/"),
    ("the bench's stubs", r"^(InstantEngine|NoTrainStrategy|instant_verify|answer_of|char_ids)"),
)]
"""What a profile sample's time is spent in: the leaf-most frame (asyncio's and the threads' own
frames skipped, but for socket writes) that one of these matches decides."""
PLUMBING = re.compile(r"\((asyncio|threading|concurrent/futures|selectors)[/.]")


def mechanism(frames: list[str]) -> str:
    """The :data:`MECHANISMS` entry of one stack (root first); the event loop's own work when no
    frame but asyncio's matches, else ``other``."""
    for frame in reversed(frames):
        for name, rx in MECHANISMS:
            if rx.search(frame) and (name.startswith("socket") or not PLUMBING.search(frame)):
                return name
    return "asyncio event loop, threads (own work)" if PLUMBING.search(frames[-1]) else "other"


def call_site(frames: list[str], classify: Callable[[list[str]], str | None]) -> str:
    """The category of one stack: ``classify``'s Kafka categories (by the Kafka call it is under),
    else the recorder's store, our handler code, the event loop, or other."""
    kafka = classify(frames)
    if kafka is not None:
        return kafka
    if any(x in f for f in frames for x in ("(store/", "(chdb/", "(clickhouse_connect/")):
        return "store (chDB insert)"
    if any(any(f"({p}" in f for p in OURS) or STUBS.match(f) for f in frames):
        return "handler code (ours)"
    return "asyncio loop, threads" if PLUMBING.search(frames[-1]) else "other"


SITES = ("serialisation", "produce", "consume", "commit", "transactions", "connection I/O", "runtime bookkeeping",
         "store (chDB insert)", "handler code (ours)", "asyncio loop, threads", "other")
"""The rows of the call-site table (``bus.CATEGORIES`` first)."""


def profile_table(lines: Iterable[str], classify: Callable[[list[str]], str | None],
                  labels: dict[int, str | None] | None = None
                  ) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """From py-spy ``--format raw --subprocesses`` lines: per service, samples by :func:`call_site`
    and by :func:`mechanism` (a process is the service ``labels`` names for its pid, else the one its
    command line names). Start-up imports and waiting threads are left out."""
    sites: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    mechs: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        procs = [f for f in frames if f.startswith("process ")]
        m = PROCESS.search(procs[-1]) if procs else None
        rest = [f for f in frames if not f.startswith("process ")]
        if m is None or not rest or any(f.startswith("_find_and_load ") for f in rest) or IDLE.search(rest[-1]):
            continue
        service = (labels or {}).get(int(m.group(1))) or m.group(2) or "supervisor"
        sites[service][call_site(rest, classify)] += int(count)
        mechs[service][mechanism(rest)] += int(count)
    return sites, mechs


HOPS_SQL = """
SELECT quantile(0.5)(g - t) AS `task -> generation`, quantile(0.5)(r - g) AS `generation -> scored`,
       quantile(0.5)(o - r) AS `scored -> outcome`, quantile(0.5)(o - t) AS `task -> outcome`,
       quantile(0.9)(o - t) AS `task -> outcome p90`
FROM (SELECT toUnixTimestamp64Micro(t.issued_ts) / 1e6 AS t, toUnixTimestamp64Micro(g.generated_ts) / 1e6 AS g,
             toUnixTimestamp64Micro(r.scored_ts) / 1e6 AS r, toUnixTimestamp64Micro(o.decided_ts) / 1e6 AS o
      FROM sample_outcomes AS o FINAL
      JOIN sample_tasks AS t FINAL ON t.run_id = o.run_id AND t.sample_id = o.sample_id
      JOIN sample_generations AS g FINAL ON g.run_id = o.run_id AND g.sample_id = o.sample_id
      JOIN sample_rewards AS r FINAL ON r.run_id = o.run_id AND r.sample_id = o.sample_id
      WHERE o.run_id = '{run_id}' AND o.status = 'trained'
        AND toUnixTimestamp64Micro(o.decided_ts) / 1e6 > {t0} AND toUnixTimestamp64Micro(o.decided_ts) / 1e6 <= {t1})
"""
"""Median seconds of each hop of the samples trained in the measured window (from the record)."""


def sql_rows(query: str, run_id: str, runs: Path, env: dict[str, str]) -> list[dict[str, Any]]:
    import common  # bench/common.py

    return common.sql(query, run_id, runs, env)


def run_row(name: str, sets: list[str], args: argparse.Namespace, work: Path, env: dict[str, str],
            prefix: list[str] | None = None) -> dict[str, Any]:
    """One run of the main example with the stubs; its rate and CPU per sample."""
    import bus  # bench/bus.py: ProcCpu, broker_pid

    tag = "prof" if prefix else "row"
    run_id = f"ceiling-{tag}-{uuid4().hex[:6]}"
    cmd = [*(prefix or []), sys.executable, str(Path(__file__).resolve()), "run", str(REPO / "examples" / "main.yaml"),
           "--run-id", run_id, *[a for kv in [*base_sets(args, work), *sets] for a in ("--set", kv)]]
    t0 = time.perf_counter()
    with bus.ProcCpu(run_id, bus.broker_pid(args.bootstrap)) as cpu:
        import subprocess

        res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=args.timeout_s)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"bench/pipeline_ceiling.py: run {run_id} ({name}) failed (exit {res.returncode}):\n"
                         f"{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    runs = work / "runs"
    steps = [float(r["t"]) for r in sql_rows(
        f"SELECT toUnixTimestamp64Micro(ts) / 1e6 AS t FROM train_steps FINAL WHERE run_id = '{run_id}' ORDER BY step",
        run_id, runs, env)]
    outcomes = sql_rows(f"SELECT toUnixTimestamp64Micro(decided_ts) / 1e6 AS t, status FROM sample_outcomes FINAL "
                        f"WHERE run_id = '{run_id}'", run_id, runs, env)
    rate, n, seconds = window_rate(steps, [float(o["t"]) for o in outcomes])
    t0 = steps[SKIP_STEPS]
    trained = sum(1 for o in outcomes if o["status"] == "trained" and t0 < float(o["t"]) <= steps[-1])
    statuses: dict[str, int] = defaultdict(int)
    for o in outcomes:
        statuses[str(o["status"])] += 1
    used = cpu.between(t0, steps[-1])
    waited = cpu.waits_between(t0, steps[-1])
    hops = sql_rows(HOPS_SQL.format(run_id=run_id, t0=t0, t1=steps[-1]), run_id, runs, env)
    return {"name": name, "hops": {k: float(v) for k, v in hops[0].items()} if hops else {}, "run_id": run_id, "rate": rate, "trained_rate": trained / seconds, "samples": n,
            "seconds": seconds, "steps": len(steps), "wall": wall, "statuses": dict(statuses),
            "cpu_ms": {k: 1000 * v / max(1, n) for k, v in used.items()}, "labels": dict(cpu.labels),
            "wait_ms": {k: 1000 * v / max(1, n) for k, v in waited.items()}}


def base_sets(args: argparse.Namespace, work: Path) -> list[str]:
    """The main example as shipped, but: no supervised warm-up (there is no model to warm up), a run
    that trains until ``--seconds`` have passed (``run.max_wall_s``: then it drains) or ``--steps``,
    this bench's runs directory, versions through the disk (there are no weights to hand over in
    memory: :class:`NoTrainStrategy` writes a marker), and ``--set``."""
    return ["train.warmup_sft_steps=0", "train.weights_handoff=disk", f"train.steps={args.steps or UNTIL_DRAINED}", f"run.max_wall_s={args.seconds}",
            f"run.runs_dir={work / 'runs'}", "run.seed=0", *args.sets]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--bootstrap", default="",
                    help="Kafka (default: $ROLLSTREAM_BOOTSTRAP, else the local broker of `rollstream stack up`)")
    ap.add_argument("--seconds", type=int, default=75,
                    help="each run's run.max_wall_s: it trains until then (start-up included), then drains")
    ap.add_argument("--steps", type=int, default=0, help="stop each run after this many steps instead (0: --seconds)")
    ap.add_argument("--timeout-s", type=int, default=400, help="longest one run may take before the bench fails")
    ap.add_argument("--samples-per-record", type=int, default=None,
                    help="the 'after' row's kafka.samples_per_record (default: the config's default)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="another run config override for every row (e.g. rollout.async_ratio=3)")
    ap.add_argument("--after-only", action="store_true",
                    help="run the 'after' row alone (side-by-side runs of two checkouts, alternating)")
    ap.add_argument("--no-profile", action="store_true", help="skip the py-spy run")
    ap.add_argument("--rate", type=int, default=50, help="py-spy samples per second")
    ap.add_argument("--profile-out", type=Path, default=None, help="keep the raw py-spy profile here")
    ap.add_argument("--top", type=int, default=8, help="mechanisms printed per service")
    args = ap.parse_args()
    import common  # bench/common.py

    from runtime.probe import NO_BROKER

    args.bootstrap = common.find_broker(args.bootstrap)
    if args.bootstrap is None:
        ap.error(NO_BROKER)
    if args.steps and args.steps < SKIP_STEPS + 2:
        ap.error(f"--steps {args.steps}: use 0 or {SKIP_STEPS + 2} or more (the first steps are left out of the rate)")
    if args.seconds < 30:
        ap.error(f"--seconds {args.seconds}: use 30 or more (the services take 10-30 s to start)")
    args.spy = Path(sys.executable).parent / "py-spy"
    if not args.no_profile and not args.spy.exists():
        print("py-spy is not installed (`.venv/bin/pip install -e '.[bench]'`): no profile this time", flush=True)
        args.no_profile = True
    return args


def print_profile(sites: dict[str, dict[str, int]], mechs: dict[str, dict[str, int]], row: dict[str, Any],
                  prof: dict[str, Any], top: int) -> None:
    """The profile's two tables: each service's sampled CPU by call site, then its top mechanisms;
    shares of the service's samples, and ms per sample as that share of its ``/proc`` CPU per sample
    in the unprofiled run of the same row."""
    import common  # bench/common.py

    services = sorted(sites, key=lambda s: -row["cpu_ms"].get(s, 0.0))
    total = {s: max(1, sum(sites[s].values())) for s in services}
    print(f"\nWhere each service's CPU goes (py-spy, whole run of {row['name']!r} at {prof['rate']:,.0f} samples/s; "
          "share of the service's samples; ms per sample = share x its /proc CPU per sample above)")
    common.table([("call site", *services),
                  *[(c, *[f"{sites[s].get(c, 0) / total[s]:.0%} {row['cpu_ms'].get(s, 0.0) * sites[s].get(c, 0) / total[s]:.3f}"
                          for s in services]) for c in SITES],
                  ("profile samples", *[str(total[s]) for s in services])])
    for s in services:
        ranked = sorted(mechs[s].items(), key=lambda kv: -kv[1])[:top]
        print(f"\n{s}: where its CPU goes ({row['cpu_ms'].get(s, 0.0):.3f} ms per sample from /proc)")
        common.table([("mechanism (leaf-most frame that says)", "share", "ms/sample"),
                      *[(m, f"{n / total[s]:.1%}", f"{row['cpu_ms'].get(s, 0.0) * n / total[s]:.3f}") for m, n in ranked]])


def main() -> int:
    args = parse_args()
    sys.path.insert(0, str(HERE))
    import bus  # bench/bus.py
    import common  # bench/common.py

    default = batching_default()
    if default is None:
        print("kafka.samples_per_record is not in this version's run config: measuring today's path only "
              "(one sample per Kafka record)", flush=True)
    rows = rows_to_run(default, args.samples_per_record)
    if args.after_only:
        rows = rows[-1:]
    env = dict(os.environ, PYTHONHASHSEED="0", ROLLSTREAM_BOOTSTRAP=args.bootstrap)
    work = Path(tempfile.mkdtemp(prefix="pipeline-ceiling-"))
    results = []
    sites: dict[str, dict[str, int]] = {}
    mechs: dict[str, dict[str, int]] = {}
    prof: dict[str, Any] = {}
    try:
        for name, sets in rows:
            print(f"{name}: {f'{args.steps} steps' if args.steps else f'{args.seconds} s'} ...", flush=True)
            r = run_row(name, sets, args, work, env)
            print(f"  {r['rate']:,.0f} samples/s ({r['samples']} samples in {r['seconds']:.1f} s; run {r['wall']:.0f} s)",
                  flush=True)
            results.append(r)
        if not args.no_profile:
            name, sets = rows[-1]
            out = work / "profile.txt"
            spy = [str(args.spy), "record", "--subprocesses", "--nonblocking", "--rate", str(args.rate),
                   "--format", "raw", "-o", str(out), "--"]
            print(f"{name} under py-spy ({args.rate} Hz) ...", flush=True)
            prof = run_row(name, sets, args, work, env, prefix=spy)
            if args.profile_out:
                shutil.copyfile(out, args.profile_out)
            sites, mechs = profile_table(out.read_text(errors="replace").splitlines(), bus.classify, prof["labels"])
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nPipeline ceiling: examples/main.yaml (batch 256 = 32 groups of 8, async_ratio 1, max_staleness 1"
          f"{''.join(', ' + kv for kv in args.sets)}), "
          f"{f'{args.steps} steps' if args.steps else f'{args.seconds} s'} per run (rate: from step {SKIP_STEPS} to the last), "
          "instant engine / verifier / training step")
    print(f"machine: {common.machine()}; broker {args.bootstrap}")
    common.table([("row", "samples/s", "trained/s", "samples", "s", "outcomes (whole run)"),
                  *[(r["name"], f"{r['rate']:,.0f}", f"{r['trained_rate']:,.0f}", str(r["samples"]),
                     f"{r['seconds']:.1f}", ", ".join(f"{k} {v}" for k, v in sorted(r["statuses"].items())))
                    for r in results]])
    hops = [k for k in (results[-1]["hops"] or {})]
    if hops:
        from schemas.config import parse_config

        inflight = parse_config((REPO / "examples" / "main.yaml").read_text(), args.sets).max_inflight
        print(f"\nSeconds per hop, trained samples of the window (median unless marked; the feeder keeps at most "
              f"{inflight} samples in flight, so samples/s <= {inflight} / the mean task -> outcome)")
        common.table([("hop", *[r["name"] for r in results]),
                      *[(h, *[f"{r['hops'].get(h, float('nan')):.3f}" for r in results]) for h in hops]])
    labels = sorted({k for r in results for k in r["cpu_ms"]}, key=lambda k: -results[-1]["cpu_ms"].get(k, 0.0))
    print("\nCPU ms per sample by process (/proc, first to last step; the broker's includes its other users)")
    common.table([("process", *[r["name"] for r in results]),
                  *[(k, *[f"{r['cpu_ms'].get(k, 0.0):.3f}" for r in results]) for k in labels],
                  ("all", *[f"{sum(r['cpu_ms'].values()):.3f}" for r in results])])
    if any(r["wait_ms"] for r in results):
        print("\nms per sample each process was runnable but waited for a core (/proc/<pid>/task/*/schedstat, the "
              "same window; hop latency, and what py-spy counts as busy)")
        common.table([("process", *[r["name"] for r in results]),
                      *[(k, *[f"{r['wait_ms'].get(k, 0.0):.3f}" for r in results]) for k in labels],
                      ("all", *[f"{sum(r['wait_ms'].values()):.3f}" for r in results])])
    if sites:
        print_profile(sites, mechs, results[-1], prof, args.top)
    print(f"pipeline ceiling: {results[-1]['rate']:.0f} samples/s")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("service", "run"):
        entry(sys.argv[1:])
    else:
        sys.exit(main())
