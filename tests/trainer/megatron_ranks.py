"""The rank side of ``tests/trainer/test_megatron.py``: :func:`run` is what each of the two gloo
processes executes (``torch.multiprocessing.spawn``). Rank 0 writes what the test compares into
``out`` (metrics as JSON, HF weight dirs); the test process computes the torch strategy's side.

Scenarios, in one process group of world 2:

* ``tp2``: TP=2. Export before training (HF → Megatron → HF round trip), one ``train_step``,
  export; checkpoint, a second step, restore the checkpoint, export again, the second step again.
* ``dp2``: TP=1, DP=2 (the strategy re-initialises megatron-core's groups), KL loss against a reference model
  (``tp2``'s exported step),
  recomputed old logprobs: one ``train_step``, export, then two supervised warm-up steps.

Every logprob (the warm-up's too) is chunked: rank 0 counts the whole-logits calls (``gathered_logits``).
"""

from __future__ import annotations

import json
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from schemas.config import AlgorithmConfig, RunConfig, TrainConfig
from trainer.batch import TrainSample
from trainer.sft import SFTExample

LR = 1e-3
"""(Adam's first step maps a gradient element at round-off level, |g| ≈ eps = 1e-8, to an update of up
to ``LR``: the weights of two exact-in-math implementations can differ by ~``LR`` × 3e-3 there, so
the test compares whole updates by their norm, tests/floats.py.)"""
GRAD_CLIP = 0.02
"""Below the step's gradient norm: the clip is active."""
MICRO = 3
ALGO = {
    "tp2": AlgorithmConfig(entropy_loss_coef=0.01),
    "dp2": AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1, old_logprobs="recompute"),
}


def config(tp: int, algo: AlgorithmConfig) -> RunConfig:
    train = TrainConfig(strategy="megatron", ranks=2, tensor_parallel=tp, lr=LR, grad_clip=GRAD_CLIP,
                        micro_batch_size=MICRO, dist_timeout_s=60.0)
    return RunConfig(train=train, algorithm=algo)


def samples(n: int = 8, seed: int = 0) -> list[TrainSample]:
    """A fixed batch (as ``tests/trainer/test_strategy.make_samples``): 4 groups of 2."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [1] + [rng.randrange(4, 60) for _ in range(rng.randrange(2, 6))]
        resp = [rng.randrange(4, 60) for _ in range(rng.randrange(1, 7))] + [2]
        out.append(TrainSample(prompt, resp, [-rng.random() * 3 for _ in resp], [1] * len(resp),
                               rng.uniform(-1, 1), f"s{i}", group_id=f"g{i // 2}"))
    return out


def sft_batches() -> list[list[SFTExample]]:
    """Two identical supervised warm-up batches."""
    return [[SFTExample([1, 5, 6, 7], [8, 9, 2]), SFTExample([1, 10, 11], [12, 2])]] * 2


def _save(out: Path, name: str, value: object) -> None:
    if dist.get_rank() == 0:
        (out / f"{name}.json").write_text(json.dumps(value))


def run(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    from megatron.core import parallel_state as ps

    from trainer.megatron.strategy import CausalLMView, MegatronStrategy

    gathered: list[int] = []  # whole-logits calls: none, the logprobs are chunked from the hidden states
    whole = CausalLMView.forward
    CausalLMView.forward = lambda view, *a, **k: (gathered.append(1), whole(view, *a, **k))[1]  # type: ignore[method-assign]
    out = Path(out_dir)
    batch = samples()
    try:
        s = MegatronStrategy(config(2, ALGO["tp2"]), model_dir, device="cpu")
        s.export_weights(out / "tp2_init")
        _save(out, "tp2_step1", s.train_step(batch))
        s.export_weights(out / "tp2_step1")
        s.save_checkpoint(out / "ckpt")
        _save(out, "tp2_step2", s.train_step(batch))
        step = s.load_checkpoint(out / "ckpt")
        s.export_weights(out / "tp2_restored")
        _save(out, "tp2_step2_again", {"step": step, **s.train_step(batch)})

        d = MegatronStrategy(config(1, ALGO["dp2"]), model_dir, device="cpu")
        d.init_reference(out / "tp2_step1")
        _save(out, "dp2_step1", d.train_step(batch))
        d.export_weights(out / "dp2_step1")
        _save(out, "dp2_warmup", d.warmup(sft_batches(), lr=1e-3, grad_clip=0.5))
        _save(out, "gathered_logits", len(gathered))
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
