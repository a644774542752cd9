"""Judge throughput and discrimination, side by side in one run.

    .venv/bin/python bench/judge.py [--judge models/smollm2-135m-instruct] [--n 64] [--max-batch 16]

For each way of scoring (``llm`` judge with ``score: logprobs``, ``score: number``; a tiny reward
model created on the spot), judges ``n`` responses to ``instruct`` prompts that meet their request
(the source's demonstrations) and ``n`` that do not (random characters), all submitted at once
as the judge service does (they batch up to ``--max-batch``). Prints samples/s, the mean score of
each set (a judge that discriminates scores the good set higher), the share of unscored answers,
and samples/s relative to the first row. The tiny reward model is untrained: its row measures
cost, not judgement.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import envs
from rollout.judge import load_judge
from rollout.model_init import init_tiny_reward_model
from schemas.config import JudgeModelConfig, TinyModelSpec


def pairs(n: int, seed: int = 0) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    src = envs.make_source("instruct")
    rng = random.Random(seed)
    problems = [src.sample(rng) for _ in range(n)]
    good = [(p.prompt, src.demonstration(p, rng)) for p in problems]
    bad = [(p.prompt, "".join(rng.choice("abc xyz+-=019") for _ in range(40))) for p in problems]
    return good, bad


async def measure(name: str, cfg: JudgeModelConfig, n: int, max_batch: int) -> dict[str, float]:
    judge = load_judge(name, cfg, max_batch=max_batch, batch_wait_s=0.02)
    good, bad = pairs(n)
    await judge.judge(*good[0])  # warm up
    t0 = time.perf_counter()
    verdicts = await asyncio.gather(*(judge.judge(p, r) for p, r in good + bad))
    took = time.perf_counter() - t0
    g, b = verdicts[:n], verdicts[n:]
    return {"samples_per_s": 2 * n / took, "good": statistics.mean(v.score for v in g),
            "bad": statistics.mean(v.score for v in b), "unscored": sum(bool(v.error) for v in verdicts) / (2 * n)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--judge", default="models/smollm2-135m-instruct",
                    help="LLM judge directory (rollstream init-model DIR --from smollm2-135m-instruct)")
    ap.add_argument("--n", type=int, default=64, help="responses per set (good and bad)")
    ap.add_argument("--max-batch", type=int, default=16)
    a = ap.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    if not (Path(a.judge) / "config.json").is_file():
        raise SystemExit(f"{a.judge} is not a model directory; create it with "
                         f"`rollstream init-model {a.judge} --from smollm2-135m-instruct`")
    rows: list[tuple[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        rm = init_tiny_reward_model(Path(tmp) / "rm", TinyModelSpec(max_position_embeddings=512))
        setups = [
            ("llm logprobs", JudgeModelConfig(path=a.judge, score="logprobs")),
            ("llm number", JudgeModelConfig(path=a.judge, score="number", max_new_tokens=4)),
            ("tiny reward model (0.8M)", JudgeModelConfig(kind="reward_model", path=str(rm))),
        ]
        for label, cfg in setups:
            rows.append((label, asyncio.run(measure(label, cfg, a.n, a.max_batch))))
    print(f"judge: {a.judge}; {2 * a.n} responses per row, max_batch {a.max_batch}; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads default")
    print(f"{'scoring':26} {'samples/s':>9} {'vs first':>8} {'good':>6} {'bad':>6} {'unscored':>8}")
    base = rows[0][1]["samples_per_s"]
    for label, r in rows:
        print(f"{label:26} {r['samples_per_s']:9.2f} {r['samples_per_s'] / base:7.2f}x {r['good']:6.3f} "
              f"{r['bad']:6.3f} {r['unscored']:8.0%}")


if __name__ == "__main__":
    main()
