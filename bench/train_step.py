"""Trainer step time with the output projection over every position vs only from the first trained
token on (``logits_to_keep``), side by side on one model and one batch.

    .venv/bin/python bench/train_step.py [--model models/smollm2-135m-instruct] [--batch 32]

Prompts are long and answers short in instruct-model tasks (a chat template, a system prompt and a
question, then ``<answer>42</answer>``), so most positions of a training sequence are prompt: their
logits (vocabulary-wide: 49,152 columns for SmolLM2) are never used. Prints the median step time of
each variant over ``--repeats`` steps and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from trainer import strategy as strat
from trainer.batch import TrainSample
from trainer.strategy import TorchStrategy


def samples(tok, n: int, prompt_len: int, response_len: int) -> list[TrainSample]:
    gen = torch.Generator().manual_seed(0)
    vocab = len(tok)
    out = []
    for i in range(n):
        p = torch.randint(10, vocab, (prompt_len,), generator=gen).tolist()
        r = torch.randint(10, vocab, (response_len,), generator=gen).tolist()
        out.append(TrainSample(p, r, [-5.0] * response_len, [1] * response_len, float(i % 2), group_id=f"g{i // 8}"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=55)
    ap.add_argument("--response-len", type=int, default=9)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    s = TorchStrategy(args.model, lr=1e-6, micro_batch_size=16)
    batch = samples(s.tokenizer, args.batch, args.prompt_len, args.response_len)
    times: dict[str, list[float]] = {"all positions": [], "from the first trained token": []}
    for _ in range(args.repeats):
        for name in times:
            patch = mock.patch.object(strat, "first_trained_col", lambda b: 0) if name == "all positions" else None
            with patch or mock.patch.object(strat, "first_trained_col", strat.first_trained_col):
                t0 = time.perf_counter()
                s.train_step(batch)
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model {args.model}, batch {args.batch} x ({args.prompt_len} prompt + {args.response_len} response) tokens, "
          f"{args.threads} threads, median of {args.repeats}")
    for k, v in med.items():
        print(f"  {k:30s} {v:7.2f} s/step")
    print(f"  ratio (all / from first trained): {med['all positions'] / med['from the first trained token']:.2f}x")


if __name__ == "__main__":
    main()
