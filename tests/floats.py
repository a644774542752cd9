"""Float tolerances derived from the quantities compared, so the tests hold on any x86-64 CPU.

Two float32 computations that are equal in exact arithmetic (micro-batched or not, padded or
not, sharded or not) differ by rounding, and the rounding depends on the order of the sums:
SIMD width, BLAS blocking and thread split differ between CPUs (AMD EPYC and Intel Xeon do).
A sum of ``n`` terms rounds by at most about ``n · eps · Σ|terms|``, so a tolerance is
``k · eps · n · magnitude`` with the magnitude and the number of accumulated terms read from
what is compared, never a fixed absolute constant. Checks that are exact by design (a re-run
of the same computation, a copy) stay exact (``torch.equal``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

EPS32 = torch.finfo(torch.float32).eps
"""2⁻²³ ≈ 1.19e-7: the spacing of float32 numbers near 1."""
SAFETY = 4.0
"""Headroom over the first-order bound (cancellation, the few extra roundings of each term)."""


def rounding_tol(magnitude: float, terms: int) -> float:
    """Absolute tolerance between two float32 evaluations, in different orders, of sums of
    ``terms`` terms of size ``magnitude``: ``SAFETY · eps · terms · magnitude``."""
    return SAFETY * EPS32 * terms * magnitude


def assert_close(got: torch.Tensor, want: torch.Tensor, terms: int, magnitude: float | None = None) -> None:
    """Element-wise ``|got − want| ≤ rounding_tol(magnitude, terms)``; ``magnitude`` defaults to
    ``max |want|``, the size of the values compared."""
    want = want.to(got.dtype)
    size = float(want.abs().max()) if magnitude is None and want.numel() else (magnitude or 0.0)
    tol = rounding_tol(size, terms)
    worst = float((got - want).abs().max()) if want.numel() else 0.0
    assert worst <= tol, f"max |got − want| = {worst:.3g} > {tol:.3g} (size {size:.3g}, {terms} terms)"


def gradient_terms(config: Any, lengths: Sequence[int]) -> int:
    """Rounding terms of one weight-gradient element of a decoder-only transformer (``config``: its
    HF config) on a batch of sequences of ``lengths`` tokens: the sum over the batch's positions,
    plus the reductions each position's factors went through on the way (per layer: attention over
    the sequence, dot products of ``hidden_size`` and of ``intermediate_size``; the LM head's over
    ``hidden_size`` and the softmax's over the vocabulary)."""
    per_layer = max(lengths) + 2 * config.hidden_size + config.intermediate_size
    return sum(lengths) + config.num_hidden_layers * per_layer + config.hidden_size + config.vocab_size


def update_tol(before: torch.Tensor, after: torch.Tensor, terms: int) -> float:
    """Tolerance on ``‖a − b‖`` for two optimizer steps of one tensor that are equal in exact
    arithmetic: ``rounding_tol(‖after − before‖, terms) + eps · ‖after‖``.

    Relative to the update, not to the weights: an update (SGD's ``−lr·g``, or Adam's
    ``lr·m̂/(√v̂ + ε)``, whose relative error is at most the gradient's) carries the relative
    rounding error of its gradient (``terms``: :func:`gradient_terms`); then ``before + update``
    rounds to the weights' own float32 spacing (one ulp, at most ``eps·|w|``, per element).
    """
    return rounding_tol(float((after - before).norm()), terms) + EPS32 * float(after.norm())


def assert_same_update(before: Mapping[str, torch.Tensor], a: Mapping[str, torch.Tensor],
                       b: Mapping[str, torch.Tensor], terms: int) -> None:
    """Per tensor, ``‖a − b‖ ≤`` :func:`update_tol`. A norm over the tensor, not a maximum over its
    elements: Adam maps a gradient element at round-off level (``|g| ≈ ε``) to a step of up to
    ``lr``, so single elements can differ by far more than the rest."""
    assert set(a) == set(b) == set(before)
    for k in before:
        diff, tol = float((a[k] - b[k]).norm()), update_tol(before[k], a[k], terms)
        assert diff <= tol, f"{k}: ‖a − b‖ = {diff:.3g} > {tol:.3g} ({terms} terms)"
