"""Simulated latency draws (envs/latency.py)."""

from __future__ import annotations

import statistics

import pytest

from envs.latency import draw_latency_s


@pytest.mark.parametrize(("kind", "sigma"), [("lognormal", 1.0), ("exponential", 1.0), ("pareto", 3.0)])
def test_latency_draws_have_the_configured_mean(kind: str, sigma: float) -> None:
    draws = [draw_latency_s(kind, 0.05, sigma, f"ep{i}/{i % 7}") for i in range(40_000)]
    assert statistics.fmean(draws) == pytest.approx(0.05, rel=0.05)
    assert min(draws) > 0
    if kind == "pareto":
        assert min(draws) >= 0.05 * (sigma - 1) / sigma  # the scale x_m
    # reproducible per key, different across keys
    assert draw_latency_s(kind, 0.05, sigma, "ep1/3") == draw_latency_s(kind, 0.05, sigma, "ep1/3")
    assert draw_latency_s(kind, 0.05, sigma, "ep1/3") != draw_latency_s(kind, 0.05, sigma, "ep1/4")
