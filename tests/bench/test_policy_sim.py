"""bench/policy_sim.py: the simulated scheduling policy against cases worked out by hand."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from envs.latency import draw_latency_s

# bench/ is a directory of scripts, not a package: load the module from its file (putting bench/ on
# sys.path would let its script names shadow other modules for the rest of the test session)
_spec = importlib.util.spec_from_file_location("bench_policy_sim", Path(__file__).resolve().parents[2] / "bench" / "policy_sim.py")
assert _spec is not None and _spec.loader is not None
policy_sim = sys.modules["bench_policy_sim"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(policy_sim)
router_draws, simulate, simulate_run = policy_sim.router_draws, policy_sim.simulate, policy_sim.simulate_run


def test_on_policy_steps_take_generation_the_slowest_reward_and_training() -> None:
    # k = 0: one batch in flight; each step is G + max L + T, sync's bound
    run = simulate_run(0, 4, gen_s=0.5, train_s=0.25, latency=lambda g, j: 2.0 if j == 3 else 1.0)
    assert run.ends == pytest.approx([2.75, 5.5, 8.25, 11.0])
    assert (run.issued, run.stale) == (4 * 64, 0)


def test_with_free_compute_k_ratios_overlap_1_plus_k_batches() -> None:
    # G = T = 0 and a constant latency: twice the batch in flight trains two steps per latency (Little's law)
    run = simulate_run(1, 6, 0.0, 0.0, lambda g, j: 1.0)
    assert run.ends == pytest.approx([1.0, 1.0, 2.0, 2.0, 3.0, 3.0])
    assert run.stale == 0


def test_compute_is_serial_between_generation_and_training() -> None:
    # k = 1, latency 0: generation (G per batch) and training (T) share one CPU, so a step costs G + T
    run = simulate_run(1, 5, gen_s=0.3, train_s=0.2, latency=lambda g, j: 0.0)
    steps = [b - a for a, b in zip(run.ends, run.ends[1:], strict=False)]
    assert sum(steps) / len(steps) == pytest.approx(0.5)


def test_a_slow_group_is_dropped_as_stale_and_holds_its_slot_until_then() -> None:
    # batch 16 = 2 groups, k = 1: group 0 takes 10 s, the others 1 s. The later groups train in
    # arrival order without it; when it completes, the trainer is far past its version: 8 stale samples.
    run = simulate_run(1, 12, 0.0, 0.0, lambda g, j: 10.0 if g == 0 else 1.0, batch=16)
    assert run.stale == 8
    # it held one of the 4 slots (groups) for 10 s: 3 groups in flight, one step per second, not two
    assert run.ends[:9] == pytest.approx([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])


def test_releasing_slots_at_group_completion_trades_step_time_for_staleness() -> None:
    held = simulate(1, 12, 0.13, 0.09, mean_s=1.0, sigma=0.5, trials=200)
    early = simulate(1, 12, 0.13, 0.09, mean_s=1.0, sigma=0.5, trials=200, release="complete")
    assert early.step_s < held.step_s
    assert early.stale_fraction > 2 * held.stale_fraction > 0


def test_router_draws_are_the_reward_routers() -> None:
    draw = router_draws(1.0, 1.5)
    assert draw(3, 5) == draw_latency_s("lognormal", 1.0, 1.5, "g000003/5")


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of group"):
        simulate_run(1, 2, 0.0, 0.0, lambda g, j: 1.0, batch=12, group=8)
    with pytest.raises(ValueError, match="release="):
        simulate_run(1, 2, 0.0, 0.0, lambda g, j: 1.0, release="never")
    with pytest.raises(ValueError, match="steps must be >= 2"):
        simulate(1, 1, 0.0, 0.0, 1.0, 0.5)
