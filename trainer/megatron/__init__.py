"""``train.strategy: megatron``: megatron-core ``GPTModel`` training (tensor + data parallel).

* :mod:`trainer.megatron.strategy`: :class:`~trainer.megatron.strategy.MegatronStrategy`, the
  :class:`trainer.strategy.Strategy` every rank of a multi-rank trainer builds.
* :mod:`trainer.megatron.convert`: HF Llama-family ↔ megatron-core weights (tensor-parallel aware).
* :mod:`trainer.megatron.cpu_shim`: the few patches megatron-core needs to run on the CPU.

This package imports no megatron code: :func:`check_megatron` only looks the package up, so the
factory and the CLI can refuse a config before anything starts.
"""

from __future__ import annotations

import importlib.util

from schemas.config import ConfigError, RunConfig

EXTRA_HINT = "pip install 'rollstream[megatron]' (megatron-core>=0.16.1,<0.17)"
"""What to run when megatron-core is missing."""


def megatron_installed() -> bool:
    """Whether ``megatron.core`` can be imported (looked up, not imported)."""
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):
        return False


def check_megatron(cfg: RunConfig) -> None:
    """Raise :class:`ConfigError` (one line naming the key and what to do instead) when
    ``train.strategy: megatron`` cannot run ``cfg``: megatron-core missing, or a feature this
    strategy does not implement (a critic). Pipeline parallelism has no config key (not
    implemented); LoRA is refused by the config's own checks. Cheap: imports no megatron code."""
    if cfg.train.strategy != "megatron":
        return
    if not megatron_installed():
        raise ConfigError(f"config: train.strategy='megatron' needs the megatron extra: {EXTRA_HINT}")
    if cfg.algorithm.critic != "none":
        raise ConfigError(f"config: algorithm.critic={cfg.algorithm.critic!r} is not supported with "
                          "train.strategy='megatron'; use train.strategy=torch or fsdp2 for a critic "
                          "(adv_estimator gae)")
