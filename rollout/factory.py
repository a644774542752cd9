"""``make_engine(cfg)``: the only place that picks a generation backend (``rollout.engine``).

A backend that is not implemented, or whose package is not installed, is refused by
:func:`check_engine` with one line naming the key, the value and what to use instead; the CLI
calls it before anything starts, and :func:`make_engine` calls it again.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from schemas.config import ConfigError, RunConfig, resolve_dtype

if TYPE_CHECKING:
    from rollout.engine import Engine


NOT_IMPLEMENTED = {
    "vllm": "it will need the vllm extra, pip install 'rollstream[vllm]', and a CUDA GPU",
}
"""Engines the config schema names that this version does not implement, and what they will need."""


def check_engine(cfg: RunConfig) -> None:
    """Raise :class:`ConfigError` (one line naming the key, the value and what to use instead)
    unless ``rollout.engine`` can run here. Cheap: imports no engine."""
    engine = cfg.rollout.engine
    if engine == "torch":
        return
    need = NOT_IMPLEMENTED.get(engine, "")
    raise ConfigError(
        f"config: rollout.engine={engine!r} is not implemented in this version of rollstream"
        + (f" ({need})" if need else "") + "; use rollout.engine=torch (transformers, CPU or GPU)"
    )


def make_engine(
    cfg: RunConfig,
    model_dir: str | Path,
    *,
    device: str = "cpu",
    seed: int = 0,
    policy_version: int = -1,
    max_batch: int | None = None,
) -> Engine:
    """The generation engine ``cfg.rollout.engine`` names, loaded from ``model_dir`` onto ``device`` (a
    concrete torch device; ``model.dtype: auto`` resolves for it), rendering prompts per
    ``model.chat_template`` / ``model.system_prompt``."""
    check_engine(cfg)
    from rollout.engine import TorchEngine

    return TorchEngine(
        model_dir,
        max_batch=max_batch or cfg.rollout.max_batch,
        device=device,
        dtype=resolve_dtype(cfg.model.dtype, device),
        seed=seed,
        policy_version=policy_version,
        chat_template=cfg.model.chat_template,
        system_prompt=cfg.model.system_prompt,
    )
