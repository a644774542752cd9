"""``make_strategy(cfg)``: the only place that picks a training backend (``trainer.strategy``).

A backend that is not implemented, or whose package is not installed, is refused by
:func:`check_strategy` with one line naming the key, the value and what to use instead; the CLI
calls it before anything starts, and :func:`make_strategy` calls it again.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from schemas.config import ConfigError, RunConfig

if TYPE_CHECKING:
    from trainer.strategy import Strategy


def check_strategy(cfg: RunConfig) -> None:
    """Raise :class:`ConfigError` (one line) unless ``train.strategy`` can run here."""
    strategy = cfg.train.strategy
    if strategy == "torch":
        return
    raise ConfigError(
        f"train.strategy={strategy!r} is not implemented in this version of rollstream; use train.strategy=torch"
    )


def make_strategy(cfg: RunConfig, model_dir: str | Path, *, device: str = "cpu") -> Strategy:
    """The training strategy ``cfg.train.strategy`` names, with the model of ``model_dir``."""
    check_strategy(cfg)
    from trainer.strategy import TorchStrategy

    return TorchStrategy(
        model_dir, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, grad_clip=cfg.train.grad_clip,
        micro_batch_size=cfg.train.micro_batch_size, temperature=cfg.rollout.temperature,
        algo=cfg.algorithm, max_len=cfg.rollout.max_new_tokens, dtype=cfg.model.dtype,
        total_steps=cfg.train.steps, min_lr_ratio=cfg.train.min_lr_ratio,
        device=device,
    )
