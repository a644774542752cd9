"""rollstream against TRL's ``GRPOTrainer`` (CPU): time to a target held-out accuracy, tokens/s, ratios.

    .venv/bin/pip install -e '.[bench]'      # TRL, pinned (adds trl, datasets; changes no pinned package)
    .venv/bin/python bench/peer_trl.py [--steps 120] [--target 0.5] [--eval-every 10] [--batch 256]
                                       [--group 8] [--impls rollstream,trl] [--threads N] [--warm DIR]
                                       [--no-stop-at-target] [--seed N]

Both train the main example's tiny model from the same weights (after its supervised warm-up,
made once and kept in ``--warm``) on the same task (``arith``) with the same reward (the domain's
verifier), held-out evaluation (greedy, every ``--eval-every`` steps) and hyper-parameters
(``--batch`` samples per step in groups of ``--group``, at most ``--steps`` steps). rollstream is
``rollstream run examples/main.yaml`` as shipped (Kafka, one process per service); TRL runs in this
process and stops at ``--target`` unless ``--no-stop-at-target``. ``--threads N`` gives TRL and
every service N torch threads; ``--impls`` runs one side alone.

Prints the starting accuracy and the settings; per implementation, whether it reached the target
and when (step, seconds), the final accuracy, steps and RL wall time, seconds per step and
generated tokens/s, and its accuracy curve; then the ratios: TRL ÷ rollstream time to the target
(goal, reported and not asserted: at least 1.5×; also counted from the same point, each model
loaded), rollstream ÷ TRL tokens/s and TRL ÷ rollstream seconds per step. bench/README.md
("peer_trl.py") lists every shared setting and each clock, and keeps the measured runs. With
``--threads 1`` the defaults took 6.5 minutes on a loaded 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

GOAL_SPEEDUP = 1.5
"""rollstream's goal: this many times faster than TRL to the same held-out accuracy."""


@dataclass
class Setup:
    """What both implementations share (see the module docstring)."""

    steps: int
    batch: int
    group: int
    micro: int
    eval_every: int
    target: float
    lr: float = 2e-4
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    clip: float = 0.2
    max_new_tokens: int = 24
    temperature: float = 1.0
    seed: int = 0
    heldout: int = 256
    threads: int | None = None
    """torch threads per process (TRL's, and every rollstream service's); None = torch's default."""


@dataclass
class Outcome:
    """One implementation's run."""

    impl: str
    curve: list[tuple[int, float, float]] = field(default_factory=list)
    """(step, held-out accuracy, seconds since the start of RL)."""
    tokens: int = 0
    wall_s: float = 0.0
    steps: int = 0
    note: str = ""
    ready_s: float = 0.0
    """Seconds from the clock's start to the point TRL's clock starts at (its model loaded, about
    to generate): for rollstream, the trainer's weights version 0 on Kafka; 0 for TRL."""

    def reached_from_ready(self, target: float) -> float | None:
        """Seconds to ``target`` counted from ``ready_s``."""
        r = self.reached(target)
        return None if r is None else r[1] - self.ready_s

    def reached(self, target: float) -> tuple[int, float] | None:
        """(step, seconds) of the first evaluation at or above ``target``."""
        return next(((s, t) for s, a, t in self.curve if a >= target), None)


def time_to_target(outcomes: list[Outcome], target: float) -> list[float | None]:
    """Seconds to ``target`` per outcome (None where it was not reached)."""
    return [None if (r := o.reached(target)) is None else r[1] for o in outcomes]


def speedup(ours: float | None, peer: float | None) -> str:
    """``peer ÷ ours`` as text; a bound or ``n/a`` when one side never reached the target."""
    if ours is None and peer is None:
        return "n/a (neither reached the target)"
    if ours is None:
        return "< 1 (rollstream did not reach the target)"
    if peer is None:
        return f"> {1:.2f}x (TRL did not reach the target within its run)"
    return f"{peer / ours:.2f}x"


# --------------------------------------------------------------------------- shared evaluation


def domain_and_source() -> tuple[Any, Any]:
    import learn_offline as lo

    from envs import make_source
    from schemas.config import parse_raw

    cfg = parse_raw(json.loads(json.dumps(lo.TUNED)))
    domain = cfg.data.domains[0]
    return domain, make_source(domain.source, **domain.kwargs)


def verify(domain: Any, verifier: str, text: str, reference: str) -> Any:
    """The reward router's scoring of one response (``envs.score_response``, the domain's options)."""
    import envs

    return envs.score_response(verifier, text, reference, domain.verifier_kwargs, answer=domain.answer,
                               format_reward=domain.format_reward, isolation="inline")


async def heldout_accuracy(model_dir: Path, setup: Setup) -> float:
    """Greedy held-out accuracy of ``model_dir`` as the trainer service's evaluation computes it."""
    from rollout.engine import GenerationRequest, TorchEngine
    from rollout.sampling import SamplingParams

    domain, source = domain_and_source()
    verifier = domain.verifier or source.default_verifier
    problems = source.heldout(setup.heldout)
    engine = TorchEngine(model_dir, max_batch=256, seed=setup.seed)
    params = SamplingParams(max_new_tokens=setup.max_new_tokens, greedy=True)
    reqs = [GenerationRequest(p.prompt_id, engine.encode(p.prompt), params) for p in problems]
    by_id = {p.prompt_id: p for p in problems}
    done = [c async for c in engine.generate(reqs)]
    return sum(int(verify(domain, verifier, c.text, by_id[c.request_id].reference).correct) for c in done) / len(
        problems)


# --------------------------------------------------------------------------- rollstream


def run_rollstream(model: Path, setup: Setup, runs: Path) -> Outcome:
    """``rollstream run examples/main.yaml`` from ``model``; the curve and tokens from its record."""
    run_id = f"bench-peer-{uuid.uuid4().hex[:6]}"
    env = dict(os.environ, PYTHONHASHSEED="0")
    if setup.threads:
        env["OMP_NUM_THREADS"] = str(setup.threads)  # every service process's torch threads
    sets = [f"model.path={model}", "train.warmup_sft_steps=0", f"train.steps={setup.steps}",
            f"train.batch_size={setup.batch}", f"train.micro_batch_size={setup.micro}",
            f"rollout.group_size={setup.group}", f"train.eval_every={setup.eval_every}",
            f"train.checkpoint_every={setup.steps}", f"train.lr={setup.lr}", f"train.min_lr_ratio={setup.min_lr_ratio}",
            f"train.grad_clip={setup.grad_clip}", f"algorithm.pg_clip={setup.clip}",
            f"rollout.max_new_tokens={setup.max_new_tokens}", f"rollout.temperature={setup.temperature}",
            "rollout.top_p=1.0", f"data.heldout_size={setup.heldout}", f"run.runs_dir={runs}", f"run.seed={setup.seed}"]
    common.rollstream_run(run_id, sets, env)
    q = lambda s: common.sql(s, run_id, runs, env)  # noqa: E731
    start = q(f"SELECT toUnixTimestamp64Micro(min(issued_ts)) / 1e6 AS t FROM sample_tasks WHERE run_id = '{run_id}'")
    gen = q("SELECT sum(response_len) AS n, toUnixTimestamp64Micro(max(generated_ts)) / 1e6 AS t "
            f"FROM sample_generations FINAL WHERE run_id = '{run_id}'")
    steps = q(f"SELECT count() AS n, toUnixTimestamp64Micro(max(ts)) / 1e6 AS t FROM train_steps FINAL "
              f"WHERE run_id = '{run_id}'")
    evals = q("SELECT step, metrics['eval/accuracy'] AS acc, toUnixTimestamp64Micro(ts) / 1e6 AS t FROM evals FINAL "
              f"WHERE run_id = '{run_id}' AND mapContains(metrics, 'eval/accuracy') ORDER BY step")
    ready = q(f"SELECT toUnixTimestamp64Micro(min(ts)) / 1e6 AS t FROM weights FINAL WHERE run_id = '{run_id}' "
              "AND policy_version = 0")
    t0 = float(start[0]["t"])
    out = Outcome("rollstream", tokens=int(gen[0]["n"]), steps=int(steps[0]["n"]),
                  wall_s=max(float(steps[0]["t"]), float(gen[0]["t"])) - t0)
    out.curve = [(int(r["step"]), float(r["acc"]), float(r["t"]) - t0) for r in evals if int(r["step"]) > 0]
    out.ready_s = float(ready[0]["t"]) - t0
    out.note = f"run {run_id}, async_ratio 1; weights version 0 published {out.ready_s:.1f} s after the first task"
    return out


# --------------------------------------------------------------------------- TRL


def run_trl(model: Path, setup: Setup, work: Path, stop_at_target: bool) -> Outcome:
    """TRL's ``GRPOTrainer`` on CPU, same model, data, reward, hyper-parameters and evaluation."""
    try:
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise SystemExit(f"bench/peer_trl.py: TRL is not installed ({e.name} missing): run "
                         "`.venv/bin/pip install -e '.[bench]'`, or pass --impls rollstream") from None
    import torch

    domain, source = domain_and_source()
    verifier = domain.verifier or source.default_verifier
    rng = random.Random(setup.seed)
    problems = [source.sample(rng) for _ in range(setup.steps * setup.batch // setup.group)]
    data = Dataset.from_dict({"prompt": [p.prompt for p in problems], "reference": [p.reference for p in problems]})
    out = Outcome("TRL GRPOTrainer")
    counted = {"tokens": 0}

    def reward(completions: list[str], reference: list[str], completion_ids: list[list[int]],
               **_: Any) -> list[float | None]:
        counted["tokens"] += sum(len(c) for c in completion_ids)
        return [float(verify(domain, verifier, c, r).reward) for c, r in zip(completions, reference, strict=True)]

    tok = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    snap = work / "trl-eval"
    tok.save_pretrained(str(snap))

    class Evaluate(TrainerCallback):  # type: ignore[misc]
        t0 = 0.0
        eval_s = 0.0

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            step = state.global_step
            if step % setup.eval_every and step != setup.steps:
                return
            t = time.perf_counter()
            model.save_pretrained(str(snap))
            acc = asyncio.run(heldout_accuracy(snap, setup))
            self.eval_s += time.perf_counter() - t
            out.curve.append((step, acc, time.perf_counter() - self.t0))
            print(f"  TRL step {step:4d}  held-out greedy accuracy {acc:6.1%}  t={out.curve[-1][2]:6.1f}s", flush=True)
            if stop_at_target and acc >= setup.target:
                control.should_training_stop = True

    config = GRPOConfig(
        output_dir=str(work / "trl"), use_cpu=True, bf16=False, fp16=False, seed=setup.seed, data_seed=setup.seed,
        max_steps=setup.steps, per_device_train_batch_size=setup.micro,
        gradient_accumulation_steps=setup.batch // setup.micro, num_generations=setup.group,
        max_completion_length=setup.max_new_tokens, temperature=setup.temperature, top_p=1.0, top_k=0,
        learning_rate=setup.lr, lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": setup.min_lr_ratio}, warmup_steps=0, weight_decay=0.0,
        max_grad_norm=setup.grad_clip, beta=0.0, epsilon=setup.clip, num_iterations=1, loss_type="dapo",
        scale_rewards="group", report_to="none", save_strategy="no", logging_steps=max(1, setup.eval_every),
        disable_dropout=True, dataloader_num_workers=0, gradient_checkpointing=False, disable_tqdm=True, remove_unused_columns=False, log_completions=False,
    )
    policy = AutoModelForCausalLM.from_pretrained(str(model), local_files_only=True, dtype=torch.float32)
    cb = Evaluate()
    trainer = GRPOTrainer(model=policy, reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=tok, callbacks=[cb])
    trainer.remove_callback(PrinterCallback)  # its per-log dict lines; the evaluations print the curve
    t0 = time.perf_counter()
    trainer.train()
    out.wall_s = time.perf_counter() - t0
    out.steps = int(trainer.state.global_step)
    out.tokens = counted["tokens"]
    out.note = f"trl {__import__('trl').__version__}; evaluations {cb.eval_s:.1f}s of it"
    return out


# --------------------------------------------------------------------------- main


def report(setup: Setup, start_acc: float, outcomes: list[Outcome]) -> None:
    print(f"\npeer TRL: arith, tiny model (warm start, held-out greedy {start_acc:.1%}), batch {setup.batch} "
          f"({setup.batch // setup.group} groups of {setup.group}), lr {setup.lr:g} cosine to {setup.min_lr_ratio:g}x "
          f"over {setup.steps} steps, T={setup.temperature:g}, {setup.max_new_tokens} new tokens, seed {setup.seed}; "
          f"target held-out accuracy {setup.target:.0%}, evaluated every {setup.eval_every} steps; "
          f"torch threads per process: {setup.threads or 'default'}")
    print(f"machine: {common.machine()}")
    rows: list[tuple[str, ...]] = [("implementation", "reached", "at step", "time to target s", "final acc", "steps run", "RL wall s",
             "s/step", "gen tokens", "gen tok/s")]
    for o in outcomes:
        r = o.reached(setup.target)
        rows.append((o.impl, "yes" if r else "no", str(r[0]) if r else "-", f"{r[1]:.1f}" if r else "-",
                     f"{o.curve[-1][1]:.3f}" if o.curve else "-", str(o.steps), f"{o.wall_s:.1f}",
                     f"{o.wall_s / max(o.steps, 1):.2f}", str(o.tokens), f"{o.tokens / max(o.wall_s, 1e-9):,.0f}"))
    common.table(rows)
    for o in outcomes:
        curve = ", ".join(f"{s}:{a:.2f}@{t:.0f}s" for s, a, t in o.curve)
        print(f"  {o.impl}: {o.note}; curve (step:acc@s) {curve}")
    by = {o.impl: o for o in outcomes}
    ours, peer = by.get("rollstream"), by.get("TRL GRPOTrainer")
    if ours and peer:
        t_ours, t_peer = time_to_target([ours, peer], setup.target)
        tps = (ours.tokens / max(ours.wall_s, 1e-9)) / max(peer.tokens / max(peer.wall_s, 1e-9), 1e-9)
        per_step = (peer.wall_s / max(peer.steps, 1)) / max(ours.wall_s / max(ours.steps, 1), 1e-9)
        print(f"\nratios: time to {setup.target:.0%} held-out, TRL ÷ rollstream = {speedup(t_ours, t_peer)} "
              f"(goal >= {GOAL_SPEEDUP}x); generated tokens/s, rollstream ÷ TRL = {tps:.2f}x; "
              f"seconds per step, TRL ÷ rollstream = {per_step:.2f}x")
        print(f"  from the same point, TRL's on_train_begin and rollstream's weights version 0 (each model loaded, "
              f"nothing generated yet): TRL ÷ rollstream = "
              f"{speedup(ours.reached_from_ready(setup.target), peer.reached_from_ready(setup.target))}")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--steps", type=int, default=120, help="optimizer steps at most (the lr schedule's length)")
    ap.add_argument("--target", type=float, default=0.5, help="target held-out greedy accuracy, 0..1")
    ap.add_argument("--eval-every", type=int, default=10, help="steps between held-out evaluations")
    ap.add_argument("--batch", type=int, default=256, help="samples per optimizer step (a multiple of --group)")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (TRL num_generations)")
    ap.add_argument("--impls", default="rollstream,trl", help="which to run: rollstream and/or trl")
    ap.add_argument("--warm", type=Path, default=None,
                    help=f"warmed-up model directory (created when missing; default {common.DEFAULT_WARM})")
    ap.add_argument("--no-stop-at-target", action="store_true", help="TRL trains all --steps even after the target")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of both sides' sampling, task order and TRL's data order (the warm start is shared)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of TRL and of every rollstream service (OMP_NUM_THREADS; "
                         "default: torch's default, one per core)")
    a = ap.parse_args()
    impls = [x.strip() for x in a.impls.split(",") if x.strip()]
    if not impls or set(impls) - {"rollstream", "trl"}:
        raise SystemExit(f"--impls {a.impls!r}: name rollstream and/or trl, comma-separated")
    if a.steps < 1 or a.eval_every < 1 or not 0 < a.target <= 1:
        raise SystemExit("--steps and --eval-every must be >= 1 and --target in (0, 1]")
    if a.group < 2 or a.batch % a.group:
        raise SystemExit(f"--batch {a.batch} must be a multiple of --group {a.group} (>= 2)")
    micro = min(64, a.batch)
    if a.batch % micro:
        raise SystemExit(f"--batch {a.batch}: above 64 it must be a multiple of 64 (the micro-batch)")
    import torch
    from transformers.utils import logging as hf_logging

    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notes on TRL's calls

    if a.threads:
        torch.set_num_threads(a.threads)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    setup = Setup(steps=a.steps, batch=a.batch, group=a.group, micro=micro, eval_every=a.eval_every, target=a.target,
                  threads=a.threads, seed=a.seed)
    model = common.warm_model_at(a.warm)
    work = Path(tempfile.mkdtemp(prefix="peer_trl-"))
    try:
        start_acc = asyncio.run(heldout_accuracy(model, setup))
        print(f"warm model {model}: held-out greedy accuracy {start_acc:.1%}", flush=True)
        outcomes = []
        for impl in impls:
            t = time.perf_counter()
            o = run_rollstream(model, setup, work / "runs") if impl == "rollstream" else \
                run_trl(model, setup, work, stop_at_target=not a.no_stop_at_target)
            print(f"{o.impl}: done in {time.perf_counter() - t:.0f}s", flush=True)
            outcomes.append(o)
        report(setup, start_acc, outcomes)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
