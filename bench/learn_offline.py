"""Does the ML core learn? A synchronous GRPO run without Kafka, in one process.

    .venv/bin/python bench/learn_offline.py                 # the tuned run
    .venv/bin/python bench/learn_offline.py --engine-bench  # engine tokens/s only

init tiny model -> supervised warm-up -> loop:
    sample prompts, generate ``group_size`` answers each with ``TorchEngine`` (T = rollout
    temperature), score with the domain's verifier, GRPO advantages, one PPO-clip optimizer step
    (``TorchStrategy``), export the weights and hot-swap them into the engine;
    greedy accuracy on the held-out split every ``train.eval_every`` steps.

The defaults are the tuned values of the main example (:data:`TUNED`: 2-digit additions and
subtractions, ``arith``); override any run config key with ``--set section.key=value`` (e.g.
``--set train.lr=3e-4``). Trainer and engine run where ``train.device`` and ``rollout.device``
say (both ``auto``: the GPU when torch sees one, in bfloat16; else the CPU in float32), e.g.
``--set train.device=cpu --set rollout.device=cpu`` on a GPU machine. ``--clip-high`` sets the
upper PPO clip, ``--threads`` torch's threads, ``--out DIR`` keeps the work directory.

Prints where each part runs, the warm-up's loss, a line every 5 RL steps (reward, pass@n, clip
fraction, KL, entropy, grad norm), the accuracy curve, and a JSON summary: the wall time
(everything counted: model init, warm-up, RL, evaluations), the accuracy gain and the rollout's
tokens/s. ``--engine-bench`` instead prints ``TorchEngine``'s tokens/s next to transformers'
``generate_batch`` on a fresh tiny model. bench/README.md ("learn_offline.py") describes the tuned
task and the measured runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from transformers.utils import logging as hf_logging

from envs import Problem, TaskSource, make_source, run_verifier
from rollout.engine import GenerationRequest, TorchEngine, generate_all
from rollout.model_init import count_parameters, encode_prompt, init_tiny_model
from rollout.sampling import SamplingParams
from schemas.config import RunConfig, parse_raw
from schemas.devices import placement
from trainer.batch import TrainSample
from trainer.sft import SFTExample
from trainer.strategy import TorchStrategy

TUNED: dict[str, Any] = {
    "run": {"seed": 0},
    "model": {
        "init": {
            "hidden_size": 128,
            "num_layers": 4,
            "num_heads": 4,
            "intermediate_size": 384,
            "max_position_embeddings": 64,
        }
    },
    "data": {
        "domains": [
            {
                "name": "arith",
                "source": "arith",
                "kwargs": {"ops": "+-", "min_value": 0, "max_value": 99, "demo_scratchpad": 1.0},
            }
        ],
        "heldout_size": 256,
    },
    "rollout": {"group_size": 8, "max_new_tokens": 24, "temperature": 1.0, "top_p": 1.0, "max_batch": 256},
    "train": {
        "steps": 200,
        "batch_size": 256,
        "lr": 2e-4,
        "min_lr_ratio": 0.1,
        "micro_batch_size": 64,
        "grad_clip": 1.0,
        "eval_every": 20,
        "warmup_sft_steps": 300,
        "warmup_lr": 1e-3,
        "warmup_batch_size": 32,
    },
    "algorithm": {"pg_clip": 0.2},
}
"""The tuned defaults (become the main example's config)."""


@dataclass
class Curve:
    """Held-out greedy accuracy by RL step, with wall-clock seconds since start."""

    points: list[tuple[int, float, float]] = field(default_factory=list)

    def add(self, step: int, acc: float, t: float) -> None:
        self.points.append((step, acc, t))
        print(f"  eval step {step:4d}  held-out greedy acc {acc:6.1%}  t={t:6.1f}s", flush=True)


def answer_ids(tokenizer: Any, answer: str) -> list[int]:
    """Token ids the model should produce for ``answer``: its characters then EOS."""
    return [*tokenizer(answer, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]


def score(verifier: str, text: str, reference: str) -> float:
    """Reward of one response (built-in verifiers are pure and fast: run inline, no thread)."""
    return run_verifier(verifier, text, reference, isolation="inline").reward


async def evaluate(engine: TorchEngine, problems: list[Problem], verifier: str, max_new_tokens: int) -> float:
    """Greedy accuracy of ``engine`` on ``problems``."""
    params = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
    reqs = [GenerationRequest(p.prompt_id, engine.encode(p.prompt), params) for p in problems]
    done = await generate_all(engine, reqs)
    return sum(score(verifier, c.text, p.reference) for c, p in zip(done, problems, strict=True)) / len(
        problems
    )


def warm_up(strategy: TorchStrategy, source: TaskSource, cfg: RunConfig, rng: random.Random) -> list[float]:
    """Supervised warm-up on ``warmup_sft_steps`` batches of freshly drawn training problems."""
    tok = strategy.tokenizer

    def batches() -> Any:
        for _ in range(cfg.train.warmup_sft_steps):
            probs = [source.sample(rng) for _ in range(cfg.train.warmup_batch_size)]
            yield [
                SFTExample(encode_prompt(tok, p.prompt), answer_ids(tok, source.demonstration(p, rng)))
                for p in probs
            ]

    return strategy.warmup(batches(), lr=cfg.train.warmup_lr, grad_clip=cfg.train.grad_clip)


async def rollout_step(
    engine: TorchEngine, source: TaskSource, verifier: str, cfg: RunConfig, rng: random.Random
) -> tuple[list[TrainSample], dict[str, float]]:
    """Generate one batch of groups, score it, and turn it into GRPO training samples."""
    n = cfg.rollout.group_size
    problems = [source.sample(rng) for _ in range(cfg.train.batch_size // n)]
    params = SamplingParams(
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
    )
    reqs = [
        GenerationRequest(f"{g}/{i}", engine.encode(p.prompt), params)
        for g, p in enumerate(problems)
        for i in range(n)
    ]
    done = await generate_all(engine, reqs)
    rewards = torch.tensor(
        [score(verifier, c.text, problems[i // n].reference) for i, c in enumerate(done)]
    )  # (G*n,)
    samples = [  # advantages: computed by the strategy from reward and group (algorithm.adv_estimator)
        TrainSample(c.prompt_ids, c.token_ids, c.logprobs, [1] * len(c.token_ids), float(r), c.request_id,
                    group_id=c.request_id.split("/")[0])
        for c, r in zip(done, rewards.tolist(), strict=True)
    ]
    solved = (rewards.view(-1, n).max(dim=1).values > 0).float().mean()
    stats = {
        "reward_mean": float(rewards.mean()),
        "pass_at_n": float(solved),
        "resp_len": sum(len(c.token_ids) for c in done) / len(done),
        "tokens": float(sum(len(c.token_ids) for c in done)),
    }
    return samples, stats


async def learn(cfg: RunConfig, work: Path, clip_high: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    rng = random.Random(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    domain = cfg.data.domains[0]
    source = make_source(domain.source, **domain.kwargs)
    verifier = domain.verifier or source.default_verifier
    heldout = source.heldout(cfg.data.heldout_size)

    model_dir = init_tiny_model(work / "init", cfg.model.init, seed=cfg.run.seed)
    where = placement(cfg)  # train.device / rollout.device (auto: CUDA when there is one) and their dtypes
    print(f"trainer on {where['trainer'][0]} ({where['trainer'][1]}), engine on {where['rollout'][0]} "
          f"({where['rollout'][1]})", flush=True)
    strategy = TorchStrategy(
        model_dir,
        lr=cfg.train.lr,
        weight_decay=cfg.train.weight_decay,
        grad_clip=cfg.train.grad_clip,
        micro_batch_size=cfg.train.micro_rows,
        temperature=cfg.rollout.temperature,
        algo=cfg.algorithm,
        clip_high=clip_high,
        total_steps=cfg.train.steps,
        min_lr_ratio=cfg.train.min_lr_ratio,
        lr_warmup_steps=cfg.train.lr_warmup_steps,
        device=where["trainer"][0],
        dtype=where["trainer"][1],
        skip_zero_advantage=cfg.train.skip_zero_advantage,
    )
    print(f"model: {count_parameters(strategy.model):,} parameters", flush=True)
    losses = warm_up(strategy, source, cfg, rng)
    t_sft = time.perf_counter() - t0
    print(f"warm-up: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, {t_sft:.1f}s", flush=True)

    weights, _ = strategy.export_weights(work / "weights" / "v0")
    engine = TorchEngine(weights, max_batch=cfg.rollout.max_batch, seed=cfg.run.seed, device=where["rollout"][0],
                         dtype=where["rollout"][1])
    curve = Curve()
    curve.add(
        0, await evaluate(engine, heldout, verifier, cfg.rollout.max_new_tokens), time.perf_counter() - t0
    )
    gen_s = gen_tokens = 0.0
    for step in range(1, cfg.train.steps + 1):
        t_gen = time.perf_counter()
        samples, stats = await rollout_step(engine, source, verifier, cfg, rng)
        gen_s += time.perf_counter() - t_gen
        gen_tokens += stats["tokens"]
        metrics = strategy.train_step(samples)
        new_dir, _ = strategy.export_weights(work / "weights" / f"v{step}")
        await engine.load_weights(new_dir, version=step)
        shutil.rmtree(work / "weights" / f"v{step - 1}", ignore_errors=True)
        if step % 5 == 0:
            print(
                f"step {step:4d} reward {stats['reward_mean']:.2f} pass@n {stats['pass_at_n']:.2f} "
                f"len {stats['resp_len']:.1f} clipfrac {metrics['loss/clipfrac']:.3f} "
                f"kl {metrics['actor/approx_kl']:.4f} ent {metrics['actor/entropy']:.3f} "
                f"gnorm {metrics['actor/grad_norm']:.2f} t={time.perf_counter() - t0:.0f}s",
                flush=True,
            )
        if (cfg.train.eval_every and step % cfg.train.eval_every == 0) or step == cfg.train.steps:
            acc = await evaluate(engine, heldout, verifier, cfg.rollout.max_new_tokens)
            curve.add(step, acc, time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    start_acc, end_acc = curve.points[0][1], curve.points[-1][1]
    summary = {
        "wall_s": round(wall, 1),
        "warmup_s": round(t_sft, 1),
        "acc_start": start_acc,
        "acc_end": end_acc,
        "gain_points": round(100 * (end_acc - start_acc), 1),
        "rollout_tokens_per_s": round(gen_tokens / max(gen_s, 1e-9)),
        "curve": [(s, round(a, 4), round(t, 1)) for s, a, t in curve.points],
    }
    print(json.dumps(summary), flush=True)
    return summary


async def engine_bench(cfg: RunConfig, work: Path) -> None:
    """Tokens/s of ``TorchEngine`` next to transformers' own continuous batching
    (``generate_batch``) on the same fresh tiny model, prompts and sampling settings."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model_dir = init_tiny_model(work / "bench", cfg.model.init, seed=0)
    engine = TorchEngine(model_dir, max_batch=cfg.rollout.max_batch)
    source = make_source("arith")
    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=32, temperature=1.0)
    prompts = [engine.encode(source.sample(rng).prompt) for _ in range(512)]
    reqs = [GenerationRequest(str(i), p, params) for i, p in enumerate(prompts)]
    await generate_all(engine, reqs[:64])  # warm-up
    t, n0 = time.perf_counter(), engine.tokens_generated
    await generate_all(engine, reqs)
    ours = (engine.tokens_generated - n0) / (time.perf_counter() - t)
    print(f"TorchEngine (max_batch={cfg.rollout.max_batch}): {ours:,.0f} tok/s", flush=True)

    gen_cfg = GenerationConfig(
        max_new_tokens=32, do_sample=True, temperature=1.0, eos_token_id=engine.tokenizer.eos_token_id
    )
    cb_cfg = ContinuousBatchingConfig(return_logprobs=True)
    kwargs: dict[str, Any] = {"generation_config": gen_cfg, "continuous_batching_config": cb_cfg}
    engine.model.generate_batch(
        prompts, persistent_manager=True, **kwargs
    )  # warm-up; sizes and keeps the manager
    t = time.perf_counter()
    out = engine.model.generate_batch(prompts, persistent_manager=True, **kwargs)
    hf = sum(len(o.generated_tokens) for o in out.values()) / (time.perf_counter() - t)
    engine.model.destroy_cached_continuous_batching_manager()
    print(f"transformers generate_batch: {hf:,.0f} tok/s  (TorchEngine / generate_batch = {ours / hf:.1f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a run config key"
    )
    ap.add_argument(
        "--clip-high", type=float, default=None, help="upper PPO clip (default: algorithm.pg_clip)"
    )
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--out", type=Path, default=None, help="work dir (default: a temp dir, removed)")
    ap.add_argument("--engine-bench", action="store_true", help="only measure engine tokens/s")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    cfg: RunConfig = parse_raw(json.loads(json.dumps(TUNED)), args.set)
    work = args.out or Path(tempfile.mkdtemp(prefix="learn_offline-"))
    try:
        if args.engine_bench:
            asyncio.run(engine_bench(cfg, work))
        else:
            clip_high = args.clip_high if args.clip_high is not None else cfg.algorithm.pg_clip
            asyncio.run(learn(cfg, work, clip_high))
    finally:
        if args.out is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
