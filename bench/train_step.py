"""Peak memory and s/step of one ``TorchStrategy.train_step`` on the CPU, before and after the
chunked logprobs and packing, side by side in one run.

    .venv/bin/python bench/train_step.py [--model DIR] [--batch 8] [--micro 4] [--prompt-len 96]
                                         [--response-len 32] [--response-len-max 96] [--steps 3]
                                         [--threads 2] [--variants whole,chunked,packed]
                                         [--strategy torch|fsdp2]

``--strategy fsdp2``: the same through ``FSDP2Strategy`` on one rank (``train.ranks: 1``, a
world-1 gloo group in the process): its root unit's forward, the chunked head after it.

Without ``--model`` the model is SmolLM2-135M's shape with random weights (``bench/gpu.py``'s
``smollm2-shape``: 30 layers, hidden 576, vocabulary 49,152, tied embeddings). The batch: ``--batch``
samples of ``--prompt-len`` random prompt tokens and ``--response-len .. --response-len-max``
response tokens (uniform, fixed seed), every response token trained, GRPO groups of 8. Variants:

* ``whole``: today's path before issue 41: whole logits ``(b, l - k0, V)`` in fp32 and their
  log-softmax (from the first trained column on), micro-batches of ``--micro`` padded samples;
* ``chunked``: token logprobs and entropy from the hidden states ``train.logprob_chunk_tokens``
  positions at a time (recomputed in backward), the same padded micro-batches;
* ``packed``: chunked, and micro-batches sized by tokens (``train.micro_batch_tokens`` = ``--micro``
  times the mean sample length) packed into one sequence without padding.

Each variant runs in a process of its own (``--steps`` steps, the first one builds AdamW's state):
it reports its peak resident memory (``ru_maxrss``: everything torch's CPU allocator took, weights
and AdamW state included), the resident memory before the first step, and the median s/step of
the steps after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/gpu.py

import torch

from trainer.batch import TrainSample

VARIANTS = ("whole", "chunked", "packed")


def samples(n: int, prompt_len: int, lo: int, hi: int, vocab: int) -> list[TrainSample]:
    """``n`` samples of random tokens: ``prompt_len`` prompt, ``lo..hi`` response tokens, rewards ±1."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        r_len = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        p = [1, *torch.randint(4, vocab, (prompt_len - 1,), generator=gen).tolist()]
        r = torch.randint(4, vocab, (r_len,), generator=gen).tolist()
        out.append(TrainSample(p, r, [-3.0] * r_len, [1] * r_len, float(i % 3 == 0), f"s{i}", group_id=f"g{i // 8}"))
    return out


def rss_mib() -> float:
    """Current resident memory of this process (MiB)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def one(a: argparse.Namespace) -> dict[str, float]:
    """One variant in this process: its step times and memory."""
    from trainer.strategy import TorchStrategy

    torch.set_num_threads(a.threads)
    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    data = samples(a.batch, a.prompt_len, a.response_len, a.response_len_max, vocab)
    mean_len = sum(len(s.prompt_ids) + len(s.response_ids) for s in data) / len(data)
    kw: dict[str, int] = {"micro_batch_tokens": round(a.micro * mean_len)} if a.one == "packed" else {}
    s: Any
    if a.strategy == "fsdp2":
        from schemas.config import parse_config
        from trainer.factory import make_strategy

        sizing = f"train.micro_batch_tokens={kw['micro_batch_tokens']}" if kw else f"train.micro_batch_size={a.micro}"
        os.environ["OMP_NUM_THREADS"] = str(a.threads)  # the multi-rank driver's thread budget
        s = make_strategy(parse_config("", ["train.strategy=fsdp2", "train.ranks=1", "train.lr=1e-6", sizing]), a.model)
        s.local.chunked_head = a.one != "whole"
    else:
        s = TorchStrategy(a.model, lr=1e-6, micro_batch_size=a.micro, **kw)
        s.chunked_head = a.one != "whole"
    before = rss_mib()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        s.train_step(data)
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    if a.strategy == "fsdp2":
        s.close()
    return {"peak_rss_mib": peak, "rss_before_step_mib": before, "step_s": statistics.median(times[1:] or times),
            "first_step_s": times[0], "tokens": float(sum(len(x.prompt_ids) + len(x.response_ids) for x in data))}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default="", help="an HF model dir (default: SmolLM2-135M's shape, random weights)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4, help="samples per micro-batch (packed: that many mean samples' tokens)")
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--response-len", type=int, default=32)
    ap.add_argument("--response-len-max", type=int, default=96)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--strategy", choices=("torch", "fsdp2"), default="torch")
    ap.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model
        if not model:
            from gpu import make_models

            model = str(make_models(Path(tmp), ["smollm2-shape"])["smollm2-shape"])
        rows = {}
        for v in a.variants.split(","):
            cmd = [sys.executable, __file__, "--one", v, "--model", model] + [
                f"--{k.replace('_', '-')}={getattr(a, k)}" for k in
                ("batch", "micro", "prompt_len", "response_len", "response_len_max", "steps", "threads", "strategy")]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"error: variant {v} failed: {proc.stderr.strip().splitlines()[-1:]}")
            rows[v] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"model {a.model or 'SmolLM2-135M shape (random weights)'}, batch {a.batch} x ({a.prompt_len} prompt + "
          f"{a.response_len}..{a.response_len_max} response) tokens = {rows[next(iter(rows))]['tokens']:.0f}, "
          f"micro-batch {a.micro}, {a.threads} threads, median of steps 2..{a.steps}, strategy {a.strategy}")
    print(f"  {'variant':10s} {'peak RSS MiB':>13s} {'RSS before step':>16s} {'step peak - before':>19s} {'s/step':>8s}")
    for v, r in rows.items():
        print(f"  {v:10s} {r['peak_rss_mib']:13.0f} {r['rss_before_step_mib']:16.0f} "
              f"{r['peak_rss_mib'] - r['rss_before_step_mib']:19.0f} {r['step_s']:8.2f}")
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
