"""The headline: streaming vs batch-synchronous, same model, task, steps and seed, side by side.

    .venv/bin/python bench/async_speedup.py [--steps 12] [--levels low,medium,high] [--mean-s 1.0]

Workload: the main example's task (2-digit arithmetic, ``arith``) and tiny model (0.87M
parameters), warmed up once (``bench/learn_offline.py``'s supervised warm-up, 300 steps) and
shared by every mode; ``train.batch_size`` 64 (8 groups of 8), ``--steps`` GRPO steps. Every
sample's reward takes a simulated latency drawn from a lognormal distribution with mean
``--mean-s`` and log-space sigma 0.5 / 1.0 / 1.5 (levels low / medium / high variance), as
``reward.latency`` does in the reward router (the same draw function; keyed by sample id, so
the draws of two modes differ but their distribution is the same).

Modes, run one after the other:

* ``sync``: the batch-synchronous loop of ROLL's and verl's default trainer, in one process:
  generate the whole batch (``TorchEngine``), then score it (every sample's latency waited out
  concurrently; the stage ends with the slowest), then train (``TorchStrategy``: the trainer
  service's strategy) and swap the weights into the engine. Barriers at each stage.
* ``stream k``: ``rollstream run examples/main.yaml`` with ``rollout.async_ratio = k`` (0, 1, 2)
  and ``train.max_staleness = k``: the real services through Kafka, the same warmed-up model
  (``model.path``, no warm-up), ``reward.latency: lognormal``.

Per mode it prints:

* wall time per training step: ``(t(last step) - t(first step)) / (steps - 1)``, so start-up,
  model loading and the first evaluation are not counted (for ``stream``, from the record's
  ``train_steps.ts``);
* the speedup over ``sync``;
* the ideal bound and the fraction of it reached. The sync loop measures its compute per step:
  generation ``G`` and training with the weight swap ``T``; ``E[max L]`` is the expected slowest
  of 64 latencies (Monte Carlo). Sync's bound is ``G + E[max L] + T``. A streaming mode's bound
  is ``max(G + T, E[max of a group's 8 L] / (1 + k))``: generation and training in series,
  because they share this machine's 2 cores, and at most ``64 (1 + k)`` samples in flight, each
  holding its slot at least until its group's slowest reward is in (Little's law);
* final held-out greedy accuracy (256 held-out problems), so that speed is never bought with
  learning.

Takes about 15 minutes with the defaults on 2 cores.
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
                             micro_batch_size=cfg.train.micro_batch_size, temperature=cfg.rollout.temperature,
                             algo=cfg.algorithm, total_steps=cfg.train.steps, min_lr_ratio=cfg.train.min_lr_ratio)
    engine = TorchEngine(model, max_batch=cfg.rollout.max_batch, seed=cfg.run.seed)
    tag = uuid.uuid4().hex[:6]
    ends: list[float] = []
    gen_s: list[float] = []
    train_s: list[float] = []
    for step in range(1, cfg.train.steps + 1):
        t0 = time.perf_counter()
        samples, _ = await lo.rollout_step(engine, source, verifier, cfg, rng)  # generate all, score all (inline)
        t1 = time.perf_counter()
        await asyncio.gather(*(asyncio.sleep(draw_latency_s("lognormal", mean_s, sigma, f"{tag}/{step}/{s.sample_id}"))
                               for s in samples))  # the reward stage ends with its slowest sample
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


def stream_mode(k: int, cfg: RunConfig, model: Path, sigma: float, mean_s: float, runs: Path,
                env: dict[str, str]) -> Result:
    """``rollstream run`` with ``rollout.async_ratio = k``; per-step time from the record."""
    run_id = f"bench-async{k}-{uuid.uuid4().hex[:6]}"
    sets = [f"model.path={model}", "train.warmup_sft_steps=0", f"train.steps={cfg.train.steps}",
            f"train.batch_size={BATCH}", f"train.micro_batch_size={BATCH}", f"rollout.group_size={GROUP}",
            f"train.eval_every={cfg.train.steps}", f"train.checkpoint_every={cfg.train.steps}",
            f"rollout.async_ratio={k}", f"train.max_staleness={k}", "reward.latency=lognormal",
            f"reward.latency_mean_s={mean_s}", f"reward.latency_sigma={sigma}", f"run.runs_dir={runs}",
            f"run.seed={cfg.run.seed}"]
    cmd = [sys.executable, "-m", "services.cli", "run", str(REPO / "examples" / "main.yaml"), "--run-id", run_id,
           *[a for kv in sets for a in ("--set", kv)]]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"stream {k}: rollstream run failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    q = (f"SELECT step, toUnixTimestamp64Micro(ts) / 1e6 AS t FROM train_steps FINAL WHERE run_id = '{run_id}' "
         "ORDER BY step")
    out = subprocess.run([sys.executable, "-m", "services.cli", "sql", q, "--run", run_id, "--runs-dir", str(runs),
                          "--format", "json"], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    rows = json.loads(out.stdout)
    ts = [float(r["t"]) for r in rows]
    summary = json.loads((runs / run_id / "summary.json").read_text())
    s = summary["samples"]
    return Result(f"stream {k}", (ts[-1] - ts[0]) / (len(ts) - 1), float(summary["eval"]["final"]["accuracy"]),
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
    ap.add_argument("--modes", default="sync,0,1,2", help="sync and/or async ratios of the streaming runs")
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
                    r = stream_mode(int(m), cfg, model, sigma, a.mean_s, work / "runs", env)
                results.append(r)
                print(f"  {level}: {r.mode}: {r.step_s:.2f} s/step, accuracy {r.accuracy:.3f} ({r.detail})", flush=True)
            tables.append((level, sigma, emax, gmax, g, t, results))
        print(f"\nasync speedup: arith, tiny model, batch {BATCH} ({BATCH // GROUP} groups of {GROUP}), {a.steps} steps, "
              f"reward latency lognormal mean {a.mean_s:g}s; {machine()}")
        print(f"{'variance':8} {'mode':9} {'s/step':>7} {'speedup':>8} {'bound s':>8} {'of bound':>8} {'accuracy':>8}  notes")
        for level, sigma, emax, gmax, g, t, results in tables:
            base = next((r.step_s for r in results if r.mode == "sync"), float("nan"))
            for r in results:
                k = 0 if r.mode == "sync" else int(r.mode.split()[1])
                bound = g + emax + t if r.mode == "sync" else max(g + t, gmax / (1 + k))
                print(f"{level:8} {r.mode:9} {r.step_s:7.2f} {base / r.step_s:7.2f}x {bound:8.2f} "
                      f"{bound / r.step_s:8.0%} {r.accuracy:8.3f}  sigma {sigma}, E[max L] {emax:.2f}s (group {gmax:.2f}s); "
                      f"{r.detail}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
