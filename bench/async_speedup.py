"""The headline: streaming vs batch-synchronous, same model, task, steps and seed, side by side.

    .venv/bin/python bench/async_speedup.py [--steps 12] [--levels low,medium,high] [--mean-s 1.0]
                                            [--modes sync,0,1,2] [--threads 2] [--warm DIR]

Workload: the main example's task (``arith``) and tiny model, warmed up once
(``bench/learn_offline.py``'s supervised warm-up; ``--warm`` keeps it) and shared by every mode;
batch 64 (8 groups of 8), ``--steps`` GRPO steps. Every sample's reward takes a simulated
lognormal latency of mean ``--mean-s``, sigma 0.5 / 1.0 / 1.5 for the ``--levels`` low / medium /
high, drawn as the reward router draws it, so every mode waits the same latencies.

Modes (``--modes``), run one after the other for each level:

* ``sync``: generate the whole batch, score it, train, swap the weights, with a barrier at each
  stage, in one process (``--threads`` torch threads);
* ``k`` (``stream k``): ``rollstream run examples/main.yaml`` with ``rollout.async_ratio`` and
  ``train.max_staleness`` k, through Kafka; ``ka`` (``stream k alo``) runs the reward router with
  ``reward.delivery: at_least_once``.

Prints one row per level and mode: wall time per training step (first to last step), the speedup
over ``sync``, the ideal bound and the share of it reached, the policy's bound
(``bench/policy_sim.py``) and the share of it reached, the final held-out greedy accuracy, and
notes (sync's compute per step, a stream's stale samples, measured and simulated).
bench/README.md ("async_speedup.py") defines the bounds and keeps the measured runs. Takes about
15 minutes with the defaults on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

import learn_offline as lo  # noqa: E402  (bench/learn_offline.py: warm-up, rollout step, evaluation)
import torch  # noqa: E402
from common import machine, warm_model  # noqa: E402  (bench/common.py: shared bench helpers)
from policy_sim import router_draws, simulate_run  # noqa: E402  (bench/policy_sim.py)
from transformers.utils import logging as hf_logging  # noqa: E402

from envs import make_source  # noqa: E402
from rollout.engine import TorchEngine  # noqa: E402
from schemas.config import RunConfig, parse_raw  # noqa: E402
from services.env_worker import draw_latency_s  # noqa: E402
from trainer.strategy import TorchStrategy  # noqa: E402

LEVELS = {"low": 0.5, "medium": 1.0, "high": 1.5}
"""Variance level -> lognormal sigma of the simulated reward latency."""
BATCH, GROUP = 64, 8


@dataclass
class Result:
    mode: str
    step_s: float
    accuracy: float
    detail: str = ""


def bench_config(steps: int) -> RunConfig:
    raw = json.loads(json.dumps(lo.TUNED))
    raw["train"].update({"steps": steps, "batch_size": BATCH, "micro_batch_size": BATCH, "eval_every": 0})
    raw["rollout"]["group_size"] = GROUP
    cfg: RunConfig = parse_raw(raw)
    return cfg


async def sync_mode(cfg: RunConfig, model: Path, sigma: float, mean_s: float, work: Path) -> tuple[Result, float, float]:
    """The batch-synchronous loop; returns its result and its measured compute per step (G, T)."""
    rng = random.Random(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    domain = cfg.data.domains[0]
    source = make_source(domain.source, **domain.kwargs)
    verifier = domain.verifier or source.default_verifier
    strategy = TorchStrategy(model, lr=cfg.train.lr, grad_clip=cfg.train.grad_clip,
                             micro_batch_size=cfg.train.micro_rows, temperature=cfg.rollout.temperature,
                             algo=cfg.algorithm, total_steps=cfg.train.steps, min_lr_ratio=cfg.train.min_lr_ratio,
                             lr_warmup_steps=cfg.train.lr_warmup_steps,
                             skip_zero_advantage=cfg.train.skip_zero_advantage)  # as the trainer service
    engine = TorchEngine(model, max_batch=cfg.rollout.max_batch, seed=cfg.run.seed)
    per_step = cfg.train.batch_size // cfg.rollout.group_size
    ends: list[float] = []
    gen_s: list[float] = []
    train_s: list[float] = []
    for step in range(1, cfg.train.steps + 1):
        t0 = time.perf_counter()
        samples, _ = await lo.rollout_step(engine, source, verifier, cfg, rng)  # generate all, score all (inline)
        t1 = time.perf_counter()
        # the reward stage ends with its slowest sample; the latencies are those that a run's reward
        # router draws for the same groups (g<index>/<member>, the feeder's numbering)
        await asyncio.gather(*(asyncio.sleep(draw_latency_s("lognormal", mean_s, sigma, run_sample_id(s.sample_id, step,
                                                                                                        per_step)))
                               for s in samples))
        t2 = time.perf_counter()
        strategy.train_step(samples)
        new_dir, _ = strategy.export_weights(work / f"v{step}")
        await engine.load_weights(new_dir, version=step)
        shutil.rmtree(work / f"v{step - 1}", ignore_errors=True)
        t3 = time.perf_counter()
        gen_s.append(t1 - t0)
        train_s.append(t3 - t2)
        ends.append(t3)
    heldout = source.heldout(cfg.data.heldout_size)
    acc = await lo.evaluate(engine, heldout, verifier, cfg.rollout.max_new_tokens)
    step_s = (ends[-1] - ends[0]) / (len(ends) - 1)
    g, t = statistics.mean(gen_s[1:]), statistics.mean(train_s[1:])
    return Result("sync", step_s, acc, f"G {g:.2f}s  T {t:.2f}s"), g, t


def run_sample_id(sample_id: str, step: int, groups_per_step: int) -> str:
    """The id that the sample ``<g>/<i>`` of the sync loop's step ``step`` (from 1) would have in a
    run whose feeder issues ``groups_per_step`` groups a step: ``g<index:06d>/<i>``."""
    g, i = sample_id.split("/")
    return f"g{(step - 1) * groups_per_step + int(g):06d}/{i}"


def stream_mode(k: int, cfg: RunConfig, model: Path, sigma: float, mean_s: float, runs: Path,
                env: dict[str, str], at_least_once: bool = False) -> Result:
    """``rollstream run`` with ``rollout.async_ratio = k`` (and ``reward.delivery: at_least_once``
    when asked); per-step time from the record."""
    run_id = f"bench-async{k}-{uuid.uuid4().hex[:6]}"
    sets = [f"model.path={model}", "train.warmup_sft_steps=0", f"train.steps={cfg.train.steps}",
            f"train.batch_size={BATCH}", f"train.micro_batch_size={BATCH}", f"rollout.group_size={GROUP}",
            f"train.eval_every={cfg.train.steps}", f"train.checkpoint_every={cfg.train.steps}",
            f"rollout.async_ratio={k}", f"train.max_staleness={k}", "reward.latency=lognormal",
            f"reward.latency_mean_s={mean_s}", f"reward.latency_sigma={sigma}", f"run.runs_dir={runs}",
            f"run.seed={cfg.run.seed}", f"reward.delivery={'at_least_once' if at_least_once else 'exactly_once'}"]
    cmd = [sys.executable, "-m", "cli", "run", str(REPO / "examples" / "main.yaml"), "--run-id", run_id,
           *[a for kv in sets for a in ("--set", kv)]]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"stream {k}: rollstream run failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    q = (f"SELECT step, toUnixTimestamp64Micro(ts) / 1e6 AS t FROM train_steps FINAL WHERE run_id = '{run_id}' "
         "ORDER BY step")
    out = subprocess.run([sys.executable, "-m", "cli", "sql", q, "--run", run_id, "--runs-dir", str(runs),
                          "--format", "json"], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    rows = json.loads(out.stdout)
    ts = [float(r["t"]) for r in rows]
    summary = json.loads((runs / run_id / "summary.json").read_text())
    s = summary["samples"]
    mode = f"stream {k}" + (" alo" if at_least_once else "")
    return Result(mode, (ts[-1] - ts[0]) / (len(ts) - 1), float(summary["eval"]["final"]["accuracy"]),
                  f"stale {s['dropped_stale']}/{s['issued']}")


def expected_max(sigma: float, mean_s: float, n: int, trials: int = 2000) -> float:
    rng = random.Random(0)
    return statistics.mean(max(draw_latency_s("lognormal", mean_s, sigma, f"{rng.random()}") for _ in range(n))
                           for _ in range(trials))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12, help="GRPO steps per mode")
    ap.add_argument("--levels", default="low,medium,high", help="latency variance levels: low, medium, high")
    ap.add_argument("--mean-s", type=float, default=1.0, help="mean simulated reward latency, seconds")
    ap.add_argument("--modes", default="sync,0,1,2",
                    help="sync and/or async ratios of the streaming runs; a ratio with a trailing 'a' (2a) runs the "
                         "reward router with reward.delivery=at_least_once")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the sync loop")
    ap.add_argument("--warm", type=Path, default=None,
                    help="reuse this warmed-up model directory (created there when it does not exist yet)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    levels = [x.strip() for x in a.levels.split(",") if x.strip()]
    unknown = [x for x in levels if x not in LEVELS]
    if unknown or a.steps < 2:
        raise SystemExit(f"--levels: one or more of {', '.join(LEVELS)}; --steps >= 2")
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    cfg = bench_config(a.steps)
    env = dict(os.environ, PYTHONHASHSEED="0")
    work = Path(tempfile.mkdtemp(prefix="async_speedup-"))
    try:
        t0 = time.perf_counter()
        if a.warm is not None and (a.warm / "config.json").is_file():
            model = a.warm
        else:
            model = warm_model(cfg, a.warm or work / "warm")
            print(f"warm-up done in {time.perf_counter() - t0:.0f}s; model {model}", flush=True)
        tables = []
        for level in levels:
            sigma = LEVELS[level]
            emax = expected_max(sigma, a.mean_s, BATCH)
            gmax = expected_max(sigma, a.mean_s, GROUP)
            results: list[Result] = []
            g = t = float("nan")
            for m in modes:
                if m == "sync":
                    r, g, t = asyncio.run(sync_mode(cfg, model, sigma, a.mean_s, work / "sync"))
                else:
                    r = stream_mode(int(m.rstrip("a")), cfg, model, sigma, a.mean_s, work / "runs", env,
                                    at_least_once=m.endswith("a"))
                results.append(r)
                print(f"  {level}: {r.mode}: {r.step_s:.2f} s/step, accuracy {r.accuracy:.3f} ({r.detail})", flush=True)
            tables.append((level, sigma, emax, gmax, g, t, results))
        print(f"\nasync speedup: arith, tiny model, batch {BATCH} ({BATCH // GROUP} groups of {GROUP}), {a.steps} steps, "
              f"reward latency lognormal mean {a.mean_s:g}s; {machine()}")
        print(f"{'variance':8} {'mode':13} {'s/step':>7} {'speedup':>8} {'bound s':>8} {'of bound':>8} "
              f"{'policy s':>8} {'of policy':>9} {'accuracy':>8}  notes")
        for level, sigma, emax, gmax, g, t, results in tables:
            base = next((r.step_s for r in results if r.mode == "sync"), float("nan"))
            for r in results:
                k = 0 if r.mode == "sync" else int(r.mode.split()[1])
                # on-policy (sync, stream 0) waits for the batch's slowest reward; k >= 1 overlaps groups
                bound = g + emax + t if k == 0 else max(g + t, gmax / (1 + k))
                # with the latencies that this mode drew (every mode draws the same ones)
                run = simulate_run(k, a.steps, g, t, router_draws(a.mean_s, sigma), BATCH, GROUP)
                policy = (run.ends[-1] - run.ends[0]) / (len(run.ends) - 1)
                sim_stale = "" if r.mode == "sync" else f" (policy {run.stale}/{run.issued})"
                print(f"{level:8} {r.mode:13} {r.step_s:7.2f} {base / r.step_s:7.2f}x {bound:8.2f} "
                      f"{bound / r.step_s:8.0%} {policy:8.2f} {policy / r.step_s:9.0%} {r.accuracy:8.3f}  "
                      f"sigma {sigma}, E[max L] {emax:.2f}s (group {gmax:.2f}s); {r.detail}{sim_stale}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
