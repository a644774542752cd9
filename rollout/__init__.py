"""rollstream: rollout — generation engines behind one ``Engine`` protocol, sampling, weight
hot-swap, and the tiny-model initialiser.

Names are imported lazily (``rollout.TorchEngine`` loads torch/transformers on first use), so
``import rollout`` stays cheap for the CLI.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Engine": "rollout.engine",
    "TorchEngine": "rollout.engine",
    "GenerationRequest": "rollout.engine",
    "Completion": "rollout.engine",
    "generate_all": "rollout.engine",
    "make_engine": "rollout.factory",
    "check_engine": "rollout.factory",
    "SamplingParams": "rollout.sampling",
    "init_tiny_model": "rollout.model_init",
    "load_model": "rollout.model_init",
    "load_tokenizer": "rollout.model_init",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rollout' has no attribute {name!r}")
