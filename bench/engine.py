"""Generation engine throughput: ``TorchEngine`` against transformers' ``generate()``, side by side
in one run, with this CPU's decode bound.

    .venv/bin/python bench/engine.py [--models tiny,smollm2] [--groups 1,8] [--prompts N] [--max-new-tokens N]
                                     [--max-batch N] [--threads N] [--no-greedy] [--repeats N]

For each model (``tiny``: the main example's shape, freshly initialised, ``arith`` prompts;
``smollm2``: ``models/smollm2-135m-instruct``, skipped with the command that creates it when
absent) and each group size of ``--groups`` (1 = distinct prompts; 8 = every prompt 8 times in a
row, as the feeder issues a GRPO group), the same prompt ids and sampling settings (temperature
1.0, top_p 1.0, no top-k) go through :class:`rollout.engine.TorchEngine` as it ships
(``engine/slots``, or ``engine/hf`` for a model that is not Llama-family), the same engine with
``decoder="hf"`` (distinct prompts only) and ``model.generate()`` on the engine's model. Each is
warmed up, then timed over ``--repeats`` passes in a rotating order; the median pass is reported.

Prints, per model and group size: the share of prompt tokens the engine did not prefill; this
CPU's decode bound at batch ``max_batch`` (matmul FLOP/s, memory bandwidth, FLOPs and bytes per
decode step, and which of them limits); a table of tokens, seconds, tokens/s, each engine's ratio
to ``generate()`` and the share each reached of the decode bound, without and with the prompts'
prefill; then, unless ``--no-greedy``, how many greedy completions all of them agree on.

bench/README.md ("engine.py") defines each number exactly and keeps the measured runs. The
defaults (both models, groups 1 and 8) took 9 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cpu_name

import envs
from rollout.engine import Completion, GenerationRequest, TorchEngine, generate_all
from rollout.model_init import count_parameters, init_tiny_model
from rollout.sampling import SamplingParams
from schemas.config import TinyModelSpec

TINY_SPEC = TinyModelSpec(
    hidden_size=128, num_layers=4, num_heads=4, intermediate_size=384, max_position_embeddings=64
)
"""The main example's model shape (examples/main.yaml ``model.init``)."""
SMOLLM2_DIR = Path("models/smollm2-135m-instruct")
WARMUP_NEW_TOKENS = 8


@dataclass(frozen=True)
class ModelSetup:
    """One model to benchmark and its defaults."""

    name: str
    source: str
    prompts: int
    max_new_tokens: int
    max_batch: int
    repeats: int
    """Timed passes per implementation (the median is reported)."""


SETUPS = {
    "tiny": ModelSetup("tiny", "arith", prompts=2048, max_new_tokens=24, max_batch=256, repeats=5),
    "smollm2": ModelSetup("smollm2", "instruct", prompts=128, max_new_tokens=64, max_batch=64, repeats=1),
}


@dataclass
class Run:
    """One implementation's timed passes over all prompts."""

    impl: str
    mode: str
    outputs: list[list[int]] = field(default_factory=list)
    """Generated token ids per prompt (up to and including the first EOS), of the last pass."""
    passes: list[tuple[int, float]] = field(default_factory=list)
    """(generated tokens, seconds) of each timed pass."""

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def seconds(self) -> float:
        return statistics.median(sec for _, sec in self.passes)

    @property
    def tok_s(self) -> float:
        """The median over the passes of tokens/s."""
        return statistics.median(n / sec for n, sec in self.passes)

    def add(self, outputs: list[list[int]], seconds: float) -> None:
        self.outputs = outputs
        self.passes.append((sum(len(o) for o in outputs), seconds))


# --------------------------------------------------------------------------- the implementations


def engine_pass(engine: TorchEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], float]:
    """One ``generate_all`` over every prompt at once: (token ids per prompt, seconds)."""
    reqs = [GenerationRequest(str(i), x, params) for i, x in enumerate(prompts)]
    t0 = time.perf_counter()
    done: list[Completion] = asyncio.run(generate_all(engine, reqs))
    return [c.token_ids for c in done], time.perf_counter() - t0


def cut_at_eos(row: list[int], eos: set[int]) -> list[int]:
    """``row`` up to and including its first EOS token (all of it when there is none)."""
    for i, tok in enumerate(row):
        if tok in eos:
            return row[: i + 1]
    return row


@torch.inference_mode()
def hf_generate(model: Any, prompts: list[list[int]], batch: int, max_new_tokens: int, greedy: bool,
                pad_id: int, eos: set[int]) -> list[list[int]]:
    """``model.generate()`` over ``prompts`` in left-padded chunks of ``batch``; generated ids per prompt."""
    sampling: dict[str, Any] = {"do_sample": False} if greedy else {
        "do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0}
    out: list[list[int]] = []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk], device=model.device)  # (b, P)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=model.device)  # (b, P)
        seqs = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                              pad_token_id=pad_id, eos_token_id=sorted(eos), **sampling)  # (b, P + T)
        out += [cut_at_eos(row, eos) for row in seqs[:, width:].tolist()]
    return out


def generate_pass(engine: TorchEngine, prompts: list[list[int]], batch: int, max_new_tokens: int,
                  greedy: bool, seed: int) -> tuple[list[list[int]], float]:
    """``model.generate()`` over every prompt (seeded): (token ids per prompt, seconds)."""
    pad = engine.tokenizer.pad_token_id
    pad_id = int(pad) if pad is not None else min(engine.eos_ids)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    outputs = hf_generate(engine.model, prompts, batch, max_new_tokens, greedy, pad_id, engine.eos_ids)
    return outputs, time.perf_counter() - t0


# --------------------------------------------------------------------------- the CPU's bound


def best_seconds(fn: Callable[[], object], repeats: int = 5, min_s: float = 0.05) -> float:
    """Seconds per call of ``fn``: best over ``repeats`` loops of at least ``min_s`` each."""
    fn()
    t0 = time.perf_counter()
    fn()
    per = max(time.perf_counter() - t0, 1e-7)
    n = max(1, int(min_s / per))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def matmul_flops(m: int, k: int, n: int) -> float:
    """Float32 FLOP/s of ``(m, k) @ (k, n)``."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    return 2 * m * k * n / best_seconds(lambda: torch.matmul(a, b))


def bandwidth(mib: int = 256) -> tuple[float, float]:
    """Bytes/s of a ``sum`` over (read) and a ``copy_`` of (read + write) a ``mib`` MiB float32 tensor."""
    x = torch.rand(mib * 2**20 // 4)
    y = torch.empty_like(x)
    nbytes = x.numel() * 4
    return nbytes / best_seconds(x.sum), 2 * nbytes / best_seconds(lambda: y.copy_(x))


@dataclass(frozen=True)
class Bound:
    """This CPU's decode-step bound for one model at one batch size."""

    batch: int
    flop_s: float
    """Matmul FLOP/s at the decode shape ``(batch, hidden) @ (hidden, intermediate)``."""
    prefill_flop_s: float
    """Matmul FLOP/s at the prefill shape ``(batch × prompt length, hidden) @ (hidden, intermediate)``."""
    read_bytes_s: float
    copy_bytes_s: float
    linear_params: int
    kv_len: float
    flops_step: float
    bytes_step: float
    prefill_flops_token: float

    @property
    def flop_tok_s(self) -> float:
        return self.batch * self.flop_s / self.flops_step

    @property
    def bw_tok_s(self) -> float:
        return self.batch * self.read_bytes_s / self.bytes_step

    @property
    def tok_s(self) -> float:
        return min(self.flop_tok_s, self.bw_tok_s)

    @property
    def limit(self) -> str:
        return "compute (matmul FLOP/s)" if self.flop_tok_s < self.bw_tok_s else "memory bandwidth"

    def with_prefill_tok_s(self, generated: int, prompt_tokens: int) -> float:
        """Generated tokens/s bound of a whole run: its prompts' prefill at the prefill FLOP/s,
        then its generated tokens at the decode bound."""
        seconds = prompt_tokens * self.prefill_flops_token / self.prefill_flop_s + generated / self.tok_s
        return generated / seconds


def decode_bound(model: Any, batch: int, prompt_len: float, kv_len: float) -> Bound:
    """The decode-step tokens/s bound of ``model`` at ``batch`` rows and mean KV length ``kv_len``
    (and the prefill cost per prompt token at mean prompt length ``prompt_len``)."""
    cfg = model.config
    layers, heads = cfg.num_hidden_layers, cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    linears = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)}
    p = sum(linears.values())
    attention = 4 * layers * heads * head_dim  # FLOPs per token per position attended (QK^T and AV)
    read, copy = bandwidth()
    flop_s = matmul_flops(batch, cfg.hidden_size, cfg.intermediate_size)
    prefill_rows = min(4096, max(batch, round(batch * prompt_len)))
    prefill_flop_s = max(flop_s, matmul_flops(prefill_rows, cfg.hidden_size, cfg.intermediate_size))
    flops_step = batch * (2 * p + attention * kv_len)
    bytes_step = 4 * p + batch * layers * 2 * kv_heads * head_dim * kv_len * 4
    prefill_flops_token = 2 * p + attention * prompt_len / 2
    return Bound(batch, flop_s, prefill_flop_s, read, copy, p, kv_len, flops_step, bytes_step,
                 prefill_flops_token)


# --------------------------------------------------------------------------- one model


def prompt_texts(source_name: str, n: int, seed: int = 0) -> list[str]:
    src = envs.make_source(source_name)
    rng = random.Random(seed)
    return [src.sample(rng).prompt for _ in range(n)]


def grouped(prompts: list[list[int]], group: int) -> list[list[int]]:
    """The first ``len(prompts) // group`` prompts, each ``group`` times in a row (as the feeder issues
    a GRPO group's tasks), so that the run keeps ``len(prompts)`` rows."""
    return [p for p in prompts[: len(prompts) // group] for _ in range(group)]


def bench_model(setup: ModelSetup, model_dir: Path, a: argparse.Namespace, group: int) -> None:
    repeats = a.repeats or setup.repeats
    engine = TorchEngine(model_dir, max_batch=setup.max_batch, seed=a.seed)
    # the same engine, the same weights (loaded from the same directory), with transformers' forward
    # and DynamicCache instead of the slot decoder; with distinct prompts only (it shares no prompt
    # work, so the groups' rows would add minutes and nothing new)
    hf_engine = TorchEngine(model_dir, max_batch=setup.max_batch, seed=a.seed, decoder="hf") if group == 1 else None
    prompts = grouped([engine.encode(t) for t in prompt_texts(setup.source, setup.prompts, a.seed)], group)
    batch = min(setup.max_batch, len(prompts))
    lens = [len(p) for p in prompts]
    if max(lens) + setup.max_new_tokens > engine.max_positions:
        raise SystemExit(f"{setup.name}: prompts of up to {max(lens)} tokens + {setup.max_new_tokens} new tokens "
                         f"exceed the model's {engine.max_positions} positions; lower --max-new-tokens")
    kind = "distinct prompts" if group == 1 else f"{len(prompts) // group} prompts x {group} (GRPO groups)"
    print(f"\n== {setup.name}, {kind}: {model_dir} ({count_parameters(engine.model) / 1e6:.2f}M parameters, "
          f"chat template {'yes' if engine.chat else 'no'}); {len(prompts)} '{setup.source}' prompts "
          f"of {min(lens)}-{max(lens)} tokens (mean {statistics.mean(lens):.1f}); "
          f"max_new_tokens {setup.max_new_tokens}; batch {batch} (engine max_batch = generate() chunk)",
          flush=True)

    modes = [("sampled", False)] + ([] if a.no_greedy else [("greedy", True)])
    runs: list[list[Run]] = []  # per mode: the engine, engine/hf when it runs, generate() last
    for mode, greedy in modes:
        params = SamplingParams(max_new_tokens=setup.max_new_tokens, temperature=1.0, top_p=1.0, greedy=greedy)
        warm = replace(params, max_new_tokens=min(WARMUP_NEW_TOKENS, params.max_new_tokens))
        impls: list[tuple[Run, Callable[[], tuple[list[list[int]], float]]]] = [
            (Run(f"engine/{engine.decoder}", mode), functools.partial(engine_pass, engine, prompts, params))]
        if hf_engine is not None:
            impls.append((Run("engine/hf", mode), functools.partial(engine_pass, hf_engine, prompts, params)))
            engine_pass(hf_engine, prompts[:batch], warm)
        impls.append((Run("generate()", mode), functools.partial(
            generate_pass, engine, prompts, batch, setup.max_new_tokens, greedy, a.seed)))
        engine_pass(engine, prompts[:batch], warm)  # warm-ups: one full batch, a few tokens
        generate_pass(engine, prompts[:batch], batch, warm.max_new_tokens, greedy, a.seed)
        for rep in range(repeats):  # the order rotates, so that a slow spell of the machine is shared
            turn = rep % len(impls)
            for run, timed in impls[turn:] + impls[:turn]:
                run.add(*timed())
                print(f"  {mode:7} {run.impl:12} pass {rep + 1}: {run.passes[-1][0]:6d} tokens in "
                      f"{run.passes[-1][1]:7.2f} s", flush=True)
        runs.append([run for run, _ in impls])
    print(f"engine/{engine.decoder}: {engine.prompt_tokens_reused / max(1, engine.prompt_tokens):.1%} of its admitted "
          f"prompt tokens were not prefilled (shared with an identical prompt or a common prefix of their admission)")

    gen_mean = statistics.mean(len(o) for o in runs[0][0].outputs)
    cfg = engine.model.config
    bound = decode_bound(engine.model, batch, statistics.mean(lens), statistics.mean(lens) + gen_mean / 2)
    print(f"bound at batch {batch}: matmul {bound.flop_s / 1e9:.1f} GFLOP/s at ({batch}x{cfg.hidden_size} @ "
          f"{cfg.hidden_size}x{cfg.intermediate_size}), {bound.prefill_flop_s / 1e9:.1f} for prefill; "
          f"memory read {bound.read_bytes_s / 1e9:.1f} GB/s (copy {bound.copy_bytes_s / 1e9:.1f} GB/s)")
    print(f"  per decode step: {bound.flops_step / 1e9:.3f} GFLOP, {bound.bytes_step / 1e6:.1f} MB "
          f"({bound.linear_params / 1e6:.2f}M linear weights, mean KV length {bound.kv_len:.1f}) -> "
          f"FLOP-bound {bound.flop_tok_s:,.0f} tok/s, bandwidth-bound {bound.bw_tok_s:,.0f} tok/s; "
          f"limit: {bound.limit}, {bound.tok_s:,.0f} tok/s")
    print(f"  with the prefill of the {sum(lens)} prompt tokens at {bound.prefill_flops_token / 1e6:.2f} "
          f"MFLOP each: {bound.with_prefill_tok_s(runs[0][0].tokens, sum(lens)):,.0f} generated tok/s")

    header = (f"{'model':8} {'group':>5} {'mode':7} {'impl':12} {'tokens':>7} {'mean len':>8} {'seconds':>8} "
              f"{'tok/s':>8} {'engine ÷ gen':>12} {'of decode bound':>15} {'of bound w/ prefill':>19}")
    print(header)
    print("-" * len(header))
    for mode_runs in runs:
        hf = mode_runs[-1]
        for r in mode_runs:
            ratio = f"{r.tok_s / hf.tok_s:11.2f}x" if r is not hf else ""
            print(f"{setup.name:8} {group:5d} {r.mode:7} {r.impl:12} {r.tokens:7d} {r.tokens / len(r.outputs):8.1f} "
                  f"{r.seconds:8.2f} {r.tok_s:8,.0f} {ratio:>12} {r.tok_s / bound.tok_s:15.1%} "
                  f"{r.tok_s / bound.with_prefill_tok_s(r.tokens, sum(lens)):19.1%}")
    for mode_runs in runs:
        if mode_runs[0].mode == "greedy":
            same = sum(len(set(map(tuple, outs))) == 1 for outs in zip(*(r.outputs for r in mode_runs), strict=True))
            print(f"greedy: identical completions from all {len(mode_runs)} for {same}/{len(prompts)} prompts")


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per model (default: per model)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: per model")
    ap.add_argument("--max-batch", type=int, default=None, help="engine slots = generate() chunk (default: per model)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch intra-op threads")
    ap.add_argument("--no-greedy", action="store_true", help="skip the greedy rows")
    ap.add_argument("--groups", default="1,8",
                    help="comma-separated group sizes: each run repeats every prompt this many times in a row "
                         "(1 = distinct prompts; 8 = the examples' GRPO group_size)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed passes per implementation, the median reported (default: tiny 5, smollm2 1)")
    a = ap.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(a.threads)
    import transformers

    names = [m.strip() for m in a.models.split(",") if m.strip()]
    try:
        groups = [int(g) for g in a.groups.split(",") if g.strip()]
    except ValueError:
        raise SystemExit(f"--groups {a.groups!r}: give comma-separated whole numbers, e.g. 1,8") from None
    if not groups or min(groups) < 1:
        raise SystemExit(f"--groups {a.groups!r}: give group sizes of at least 1, e.g. 1,8")
    unknown = set(names) - set(SETUPS)
    if unknown:
        raise SystemExit(f"unknown models {sorted(unknown)}; choose from {sorted(SETUPS)}")
    print(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; {cpu_name()}, {os.cpu_count()} cores, "
          f"torch threads {torch.get_num_threads()}; Python {platform.python_version()}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}; float32, CPU; sampling T=1.0 top_p=1.0 (no top-k)")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            base = SETUPS[name]
            setup = ModelSetup(name, base.source, a.prompts or base.prompts,
                               a.max_new_tokens or base.max_new_tokens, a.max_batch or base.max_batch, base.repeats)
            if max(groups) > setup.prompts:
                raise SystemExit(f"--groups: a group of {max(groups)} is more than the {setup.prompts} prompts of {name}")
            if name == "tiny":
                model_dir = init_tiny_model(Path(tmp) / "tiny", TINY_SPEC, seed=a.seed)
            else:
                model_dir = SMOLLM2_DIR
                if not (model_dir / "config.json").is_file():
                    print(f"\n== smollm2: skipped, {model_dir} is not a model directory; create it with "
                          f"`rollstream init-model {model_dir} --from smollm2-135m-instruct`")
                    continue
            for group in groups:
                bench_model(setup, model_dir, a, group)


if __name__ == "__main__":
    main()
