"""Advantage estimators and policy losses by name: the tables behind ``algorithm.adv_estimator``
and ``algorithm.pg_variant``.

* :func:`advantage_estimator` registers ``fn(cfg, x: EstimatorInput) -> Estimate`` under a name,
  with how the estimator takes the KL (per token or per sample) and its default normalisation;
* :func:`policy_loss` registers ``fn(cfg, logprobs, old_logprobs, advantages, mask, max_len) ->
  (loss, metrics)`` under a name.
* :func:`selective_policy_loss` registers a loss whose few special tokens are chosen over the
  whole batch before micro-batching (Clip-Cov, KL-Cov), with its choosing function.

The built-in ones are in :mod:`trainer.algorithm` (registered when it is imported), each a short
adapter from the config to a pure function of :mod:`trainer.advantages` / :mod:`trainer.losses`.
The names equal the config's ``Literal`` choices exactly (a test checks it). How to add one:
docs/architecture.md, "Algorithms".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from schemas.config import AlgorithmConfig, NormType


@dataclass(frozen=True)
class EstimatorInput:
    """What an estimator sees of one batch (``B`` samples, ``T`` target positions)."""

    r: torch.Tensor
    """(B,) rewards after shaping, the per-sample KL (outcome estimators) and normalisation."""
    group_ids: torch.Tensor
    """(B,) integer group of each sample (samples of one prompt share it)."""
    mask: torch.Tensor
    """(B, T) float, 1 on trained tokens."""
    kl: torch.Tensor | None = None
    """(B, T) per-token KL(π ‖ π_ref) when ``add_token_level_kl`` is on, else None."""
    kl_coef: float = 0.0
    """β of ``add_token_level_kl`` (0 when it is off)."""
    values: torch.Tensor | None = None
    """(B, T) the critic's values, when there is a critic."""
    step_rewards: list[tuple[float, ...]] | None = None
    """Per sample: one reward per agent turn (multi-turn), or empty."""
    state_hashes: list[tuple[str, ...]] | None = None
    """Per sample: the environment state each agent turn acted from (GiGPO's anchors), or empty."""
    baselines: torch.Tensor | None = None
    """(B,) ReMax: the reward of each sample's greedy group baseline, shaped as ``r`` (clip, scale,
    shift), else None."""


@dataclass(frozen=True)
class Estimate:
    """An estimator's result: advantages (B, T) (0 on masked positions), returns (B, T) or None."""

    advantages: torch.Tensor
    returns: torch.Tensor | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)


EstimatorFn = Callable[[AlgorithmConfig, EstimatorInput], Estimate]
PolicyLossFn = Callable[
    [AlgorithmConfig, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int | None],
    tuple[torch.Tensor, dict[str, float]],
]


@dataclass(frozen=True)
class Estimator:
    """A registered advantage estimator."""

    fn: EstimatorFn
    token_level: bool
    """The KL enters each token's reward (``−β·kl_t``), not the sample's (``r − β·Σ_t kl_t``)."""
    norm: tuple[NormType, NormType]
    """``(norm_mean_type, norm_std_type)`` when the config leaves them unset."""


ESTIMATORS: dict[str, Estimator] = {}
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def advantage_estimator(
    name: str, *, token_level: bool = False, norm: tuple[NormType, NormType] = ("none", "none")
) -> Callable[[EstimatorFn], EstimatorFn]:
    """Register the decorated function as ``algorithm.adv_estimator: <name>``."""

    def register(fn: EstimatorFn) -> EstimatorFn:
        _add(ESTIMATORS, "advantage estimator", name, Estimator(fn, token_level, norm))
        return fn

    return register


def policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register the decorated function as ``algorithm.pg_variant: <name>``."""

    def register(fn: PolicyLossFn) -> PolicyLossFn:
        _add(POLICY_LOSSES, "policy loss", name, fn)
        return fn

    return register


def estimator(name: str) -> Estimator:
    """The estimator registered as ``name``."""
    return _get(ESTIMATORS, "advantage estimator", name)


def loss(name: str) -> PolicyLossFn:
    """The policy loss registered as ``name``."""
    return _get(POLICY_LOSSES, "policy loss", name)


T = TypeVar("T")


def _add(table: dict[str, T], what: str, name: str, entry: T) -> None:
    if name in table:
        raise ValueError(f"{what} {name!r} is registered twice")
    table[name] = entry


def _get(table: dict[str, T], what: str, name: str) -> T:
    if name not in table:
        raise ValueError(f"unknown {what} {name!r} (registered: {', '.join(sorted(table))})")
    return table[name]


# --------------------------------------------------------------------------- losses that select tokens over the batch

TokenSelectFn = Callable[
    [AlgorithmConfig, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator], torch.Tensor
]
"""``fn(cfg, logprobs, old_logprobs, advantages, mask, generator) -> select`` (B, T) float 0/1."""
SelectiveLossFn = Callable[
    [AlgorithmConfig, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int | None, torch.Tensor],
    tuple[torch.Tensor, dict[str, float]],
]


@dataclass(frozen=True)
class SelectiveLoss:
    """A policy loss that treats some tokens differently, chosen over the whole batch (Clip-Cov,
    KL-Cov): ``select`` runs once per step on the whole batch (before micro-batching, so the choice
    does not depend on how the batch is split) and ``loss`` gets its result as last argument."""

    select: TokenSelectFn
    loss: SelectiveLossFn


SELECTIVE_LOSSES: dict[str, SelectiveLoss] = {}


def selective_policy_loss(name: str, select: TokenSelectFn) -> Callable[[SelectiveLossFn], SelectiveLossFn]:
    """Register the decorated ``fn(cfg, logprobs, old_logprobs, advantages, mask, max_len, select)``
    with its token choice ``select`` as ``algorithm.pg_variant: <name>``. Its plain entry in
    :data:`POLICY_LOSSES` chooses over the tensors it is given (generator seed 0)."""

    def register(fn: SelectiveLossFn) -> SelectiveLossFn:
        _add(SELECTIVE_LOSSES, "policy loss", name, SelectiveLoss(select, fn))

        def whole_batch(
            cfg: AlgorithmConfig,
            logprobs: torch.Tensor,
            old_logprobs: torch.Tensor,
            advantages: torch.Tensor,
            mask: torch.Tensor,
            max_len: int | None,
        ) -> tuple[torch.Tensor, dict[str, float]]:
            chosen = select(
                cfg, logprobs.detach(), old_logprobs, advantages, mask, torch.Generator().manual_seed(0)
            )
            return fn(cfg, logprobs, old_logprobs, advantages, mask, max_len, chosen)

        _add(POLICY_LOSSES, "policy loss", name, whole_batch)
        return fn

    return register


def selective(name: str) -> SelectiveLoss | None:
    """The token choice and loss of ``name`` when it is a selective loss, else ``None``."""
    return SELECTIVE_LOSSES.get(name)
