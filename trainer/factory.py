"""``make_strategy(cfg)``: the only place that picks a training backend (``trainer.strategy``).

A backend that is not implemented, or whose package is not installed, is refused by
:func:`check_strategy` with one line naming the key, the value and what to use instead; the CLI
calls it before anything starts, and :func:`make_strategy` calls it again.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from schemas.config import ConfigError, RunConfig, resolve_dtype

if TYPE_CHECKING:
    from trainer.strategy import Strategy


NOT_IMPLEMENTED = {
    "fsdp2": "it will need only torch, already installed",
    "megatron": "it will need the megatron extra, pip install 'rollstream[megatron]' for megatron-core, and CUDA GPUs",
}
"""Strategies the config schema names that this version does not implement, and what they will need."""


def check_strategy(cfg: RunConfig) -> None:
    """Raise :class:`ConfigError` (one line naming the key, the value and what to use instead)
    unless ``train.strategy`` can run here. Cheap: imports no strategy."""
    strategy = cfg.train.strategy
    if strategy == "torch":
        return
    need = NOT_IMPLEMENTED.get(strategy, "")
    raise ConfigError(
        f"config: train.strategy={strategy!r} is not implemented in this version of rollstream"
        + (f" ({need})" if need else "") + "; use train.strategy=torch (single process, CPU or one GPU)"
    )


def make_strategy(cfg: RunConfig, model_dir: str | Path, *, device: str = "cpu") -> Strategy:
    """The training strategy ``cfg.train.strategy`` names, with the model of ``model_dir`` on ``device``
    (a concrete torch device; ``model.dtype: auto`` resolves for it)."""
    check_strategy(cfg)
    from trainer.strategy import TorchStrategy

    return TorchStrategy(
        model_dir, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, grad_clip=cfg.train.grad_clip,
        micro_batch_size=cfg.train.micro_batch_size, temperature=cfg.rollout.temperature,
        algo=cfg.algorithm, max_len=cfg.rollout.max_new_tokens, dtype=resolve_dtype(cfg.model.dtype, device),
        total_steps=cfg.train.steps, min_lr_ratio=cfg.train.min_lr_ratio,
        device=device,
        lora_rank=cfg.train.lora_rank, lora_alpha=cfg.train.lora_alpha, lora_dropout=cfg.train.lora_dropout,
        lora_target_modules=cfg.train.lora_target_modules,
    )
