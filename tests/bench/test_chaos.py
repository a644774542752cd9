"""bench/chaos.py: how the faults of the soak are drawn. The soak itself, cut to 3 faults, runs in
CI as ``tests/e2e/test_cluster_faults.py::test_a_3_fault_chaos_soak`` (on that module's cluster)."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

# bench/ is a directory of scripts, not a package: load the module from its file (see test_policy_sim.py)
_spec = importlib.util.spec_from_file_location("bench_chaos", Path(__file__).resolve().parents[2] / "bench" / "chaos.py")
assert _spec is not None and _spec.loader is not None
chaos = sys.modules["bench_chaos"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(chaos)


def test_faults_are_drawn_from_the_pool_never_two_broker_faults_at_once() -> None:
    rng = random.Random(0)
    pool = [*chaos.SERVICES, *chaos.BROKER_FAULTS]
    draws = [chaos.draw(rng, pool, 0.5) for _ in range(400)]
    assert {n for d in draws for n in d} == set(pool)
    assert all(len(set(d)) == len(d) and sum(n not in chaos.SERVICES for n in d) <= 1 for d in draws)
    assert 0.35 < sum(len(d) == 2 for d in draws) / len(draws) < 0.65
    assert [chaos.draw(random.Random(0), ["trainer"], 1.0)] == [["trainer"]]  # no second service to pair with


def test_the_whole_cluster_kill_is_out_of_the_default_pool() -> None:
    # its open exactly-once defect (docs/reliability.md): only `--pool ...,whole` draws it
    assert "whole" not in chaos.DEFAULT_POOL and "whole" in chaos.CLUSTER_FAULTS
    assert chaos.parse_pool("trainer, whole") == ["trainer", "whole"]


def test_the_store_outage_is_out_of_the_default_pool_and_pairs_with_a_service_kill() -> None:
    # it needs the store plugin in the run's environment: only `--pool ...,store-down` draws it
    assert "store-down" not in chaos.DEFAULT_POOL and chaos.parse_pool("store-down,recorder") == ["store-down", "recorder"]
    draws = [chaos.draw(random.Random(i), ["store-down", "recorder", "trainer"], 1.0) for i in range(50)]
    assert all(sum(n == "store-down" for n in d) <= 1 and set(d) <= {"store-down", "recorder", "trainer"} for d in draws)
