"""Simulated per-request latency (benchmarks): the environment workers (``env.latency``) and the reward
router (``reward.latency``) delay each answer by a reproducible draw from a long-tailed distribution."""

from __future__ import annotations

import hashlib
import math
import random


def draw_latency_s(kind: str, mean_s: float, sigma: float, key: str) -> float:
    """A simulated latency in seconds with mean ``mean_s``, drawn reproducibly from ``key``.

    * ``lognormal``: ``exp(mu + sigma * Z)`` with ``mu = ln(mean_s) - sigma² / 2`` (so the mean is
      ``exp(mu + sigma² / 2) = mean_s``; ``sigma`` is the log-space standard deviation).
    * ``exponential``: rate ``1 / mean_s`` (``sigma`` unused).
    * ``pareto``: the classic Pareto with tail index ``alpha = sigma > 1`` and scale
      ``x_m = mean_s * (alpha - 1) / alpha`` (values ``>= x_m``; mean ``alpha * x_m / (alpha - 1) =
      mean_s``; the variance is finite only for ``alpha > 2``).
    * ``none`` (or ``mean_s <= 0``): 0.

    ``key`` (the worker uses ``<episode_id>/<step>``) seeds the draw through a stable hash, so a run
    replays the same delays.
    """
    if kind == "none" or mean_s <= 0:
        return 0.0
    rng = random.Random(int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big"))
    if kind == "lognormal":
        return rng.lognormvariate(math.log(mean_s) - sigma * sigma / 2, sigma)
    if kind == "exponential":
        return rng.expovariate(1.0 / mean_s)
    if kind == "pareto":
        if sigma <= 1:
            raise ValueError(f"pareto latency needs a tail index > 1 (a finite mean), got {sigma:g}")
        return mean_s * (sigma - 1) / sigma * rng.paretovariate(sigma)
    raise ValueError(f"unknown latency distribution {kind!r}")
