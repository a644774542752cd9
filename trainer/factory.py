"""``make_strategy(cfg)``: the only place that picks a training backend (``trainer.strategy``).

* ``torch``: :class:`trainer.strategy.TorchStrategy`, in the calling process.
* ``fsdp2`` and ``megatron``: :class:`trainer.ranks.MultiRankStrategy` (also for ``train.ranks: 1``,
  so the code path is the same): the calling process is rank 0, it starts ranks ``1 ..
  train.ranks - 1`` itself and every rank runs the backend's local strategy
  (:func:`trainer.ranks.rank_strategy`).

A backend that cannot run with this config, or whose package is not installed, is refused by
:func:`check_strategy` with one line naming the key, the value and what to use instead; the CLI
calls it before anything starts, and :func:`make_strategy` calls it again.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from schemas.config import RunConfig

if TYPE_CHECKING:
    from trainer.strategy import Strategy


def check_strategy(cfg: RunConfig) -> None:
    """Raise :class:`ConfigError` (one line naming the key, the value and what to use instead)
    unless ``train.strategy`` can run here. Cheap: imports no strategy (nor torch). ``megatron``:
    :func:`trainer.megatron.check_megatron` (the extra installed, the features it supports)."""
    if cfg.train.strategy == "megatron":
        from trainer.megatron import check_megatron

        check_megatron(cfg)


def make_strategy(cfg: RunConfig, model_dir: str | Path, *, device: str = "cpu",
                  blob_dir: str | Path | None = None) -> Strategy:
    """The training strategy ``cfg.train.strategy`` names, with the model of ``model_dir`` on ``device``
    (a concrete torch device; ``model.dtype: auto`` resolves for it); ``blob_dir``: the run's blob
    store, where a vision-language policy finds its samples' images. ``fsdp2`` / ``megatron``:
    a :class:`trainer.ranks.MultiRankStrategy` (call its ``close()`` when done: it owns processes)."""
    check_strategy(cfg)
    if cfg.train.strategy == "torch":
        from trainer.strategy import TorchStrategy, strategy_kwargs

        return TorchStrategy(model_dir, **strategy_kwargs(cfg, device), blob_dir=blob_dir)
    from trainer.ranks import MultiRankStrategy

    return MultiRankStrategy(cfg, model_dir, device=device)
