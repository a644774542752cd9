"""bench/chaos.py: a 3-fault soak (the CI version of the 60-minute one) on a 3-broker cluster of
its own, and how faults are drawn."""

from __future__ import annotations

import importlib.util
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# bench/ is a directory of scripts, not a package: load the module from its file (see test_policy_sim.py)
_spec = importlib.util.spec_from_file_location("bench_chaos", Path(__file__).resolve().parents[2] / "bench" / "chaos.py")
assert _spec is not None and _spec.loader is not None
chaos = sys.modules["bench_chaos"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(chaos)

CI_POOL = ["rollout", "reward", "trainer", "recorder", "leader"]
"""The quick faults (the broker one is down 5 s): seed 3 draws the `generations` leader killed with
the recorder killed during it, then a rollout kill."""


def test_faults_are_drawn_from_the_pool_never_two_broker_faults_at_once() -> None:
    rng = random.Random(0)
    pool = [*chaos.SERVICES, *chaos.BROKER_FAULTS]
    draws = [chaos.draw(rng, pool, 0.5) for _ in range(400)]
    assert {n for d in draws for n in d} == set(pool)
    assert all(len(set(d)) == len(d) and sum(n not in chaos.SERVICES for n in d) <= 1 for d in draws)
    assert 0.35 < sum(len(d) == 2 for d in draws) / len(draws) < 0.65
    assert "whole" not in chaos.DEFAULT_POOL  # its open exactly-once defect keeps it out by default


@pytest.fixture
def cluster_home(tmp_path: Path) -> Iterator[Path]:
    from infra.kafka import cluster as kc

    home = tmp_path / "kafka-cluster"
    try:
        kc.start_cluster(home, 3)
        yield home
    finally:
        kc.stop_cluster(home, timeout_s=5)


@pytest.mark.timeout(300)
def test_a_3_fault_soak_keeps_the_invariants(tmp_path: Path, cluster_home: Path) -> None:
    res = chaos.soak(tmp_path / "runs", cluster_home, minutes=None, faults=3, interval_s=0.5, pool=CI_POOL,
                     pair_p=0.5, seed=3, first_after_steps=1, recovery_timeout_s=120)
    print(chaos.summary(res))
    assert [s.faults for s in res.strikes] == [["leader", "recorder"], ["rollout"]], res.strikes
    assert res.error is None, res.error
    assert (res.injected, res.survived) == (3, 3), res
    inv = res.invariants
    assert inv["trained"] > 0 and inv["steps_distinct"] > 1, inv
    assert (inv["lost"], inv["trained_twice"], inv["two_outcomes"], inv["duplicate_rows"]) == (0, 0, 0, 0), inv
    assert res.ok
