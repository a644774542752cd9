"""rollstream: trainer — algorithms as pure tensor functions, batch assembly, training strategies
behind one ``Strategy`` protocol, checkpoints and weight export, the supervised warm-up, evaluation.

Names are imported lazily (``trainer.TorchStrategy`` loads torch/transformers on first use).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "grpo_advantages": "trainer.advantages",
    "masked_mean": "trainer.losses",
    "entropy_from_logits": "trainer.losses",
    **{
        name: "trainer.advantages"
        for name in (
            "dr_grpo_advantages",
            "rloo_advantages",
            "reinforce_plus_plus_advantages",
            "gae_advantages",
            "raft_mask",
            "raft_advantages",
            "step_reinforce_returns",
            "gigpo_advantages",
            "whiten",
            "clip_rewards",
            "scale_shift",
            "normalize_rewards",
        )
    },
    **{
        name: "trainer.losses"
        for name in (
            "aggregate",
            "ppo_loss",
            "gspo_loss",
            "topr_loss",
            "cispo_loss",
            "pg_loss",
            "value_loss",
            "entropy_loss",
            "kl_penalty",
            "kl_loss",
            "tis_weights",
            "masked_is",
        )
    },
    **{
        name: "trainer.algorithm"
        for name in ("AlgoState", "compute_advantages", "data_masks", "loss_weights", "off_policy",
                     "policy_loss", "sample_advantages", "group_filter_reason")
    },
    "ValueModel": "trainer.strategy",
    "TrainSample": "trainer.batch",
    "TokenBatch": "trainer.batch",
    "collate": "trainer.batch",
    "samples_from_scored": "trainer.batch",
    "Strategy": "trainer.strategy",
    "TorchStrategy": "trainer.strategy",
    "make_strategy": "trainer.factory",
    "check_strategy": "trainer.factory",
    "SFTExample": "trainer.sft",
    "evaluate": "trainer.evaluate",
    "sft_warmup": "trainer.sft",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
