"""CPU shim for megatron-core 0.16: the only CUDA assumptions the ``GPTModel`` path hits on CPU.

megatron-core calls ``torch.cuda.current_device()`` when it allocates buffers (RoPE frequencies,
communication buffers) and keeps its model-parallel RNG states with the CUDA RNG functions.
:func:`apply` points both at the CPU:

* ``torch.cuda.current_device`` returns ``torch.device("cpu")``;
* ``torch.cuda.get_rng_state`` / ``torch.cuda.manual_seed`` and megatron's
  ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` use the CPU generator.

It patches process-wide, so :class:`~trainer.megatron.strategy.MegatronStrategy` applies it
only when its device is the CPU (never in a process that uses CUDA). Idempotent.
"""

from __future__ import annotations

from typing import Any

import torch

_applied = False


def apply() -> None:
    """Patch ``torch.cuda`` and megatron-core's RNG helpers for CPU use (see the module doc)."""
    global _applied
    if _applied:
        return
    from megatron.core.tensor_parallel import random as mrandom

    def current_device() -> Any:
        return torch.device("cpu")

    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return torch.get_rng_state()

    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    torch.cuda.current_device = current_device  # type: ignore[assignment]
    torch.cuda.get_rng_state = get_rng_state  # type: ignore[assignment]
    torch.cuda.manual_seed = manual_seed  # type: ignore[assignment]
    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    _applied = True
