"""Faults of a 3-broker Kafka cluster (``rollstream stack up --brokers 3``: KRaft, every node broker
and controller, the run's topics with 3 replicas and ``min.insync.replicas`` 2) during a short
``rollstream run`` (the harness of ``tests/e2e/faults.py``; the cluster is this module's own, in a
temporary home, stopped at the end).

* ``kill -9`` of the broker that leads most of ``generations``' partitions, while the reward
  router is mid-transaction (samples are flowing), started again 5 s later: the partitions get new
  leaders, the run completes with the invariants (nothing lost, trained twice or recorded twice,
  every step once). This one runs in CI (not ``slow``).

``bench/reliability.py`` runs the other cluster faults with the same harness
(:func:`cluster_fault_run` with another fault).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.faults import SHORT, FaultResult, RunProc, Watch, check_invariants, invariants, recovery_after

STEPS = 4
OVERRIDES = [*SHORT, f"train.steps={STEPS}", "train.checkpoint_every=2"]
BROKERS = 3


@pytest.fixture(scope="module")
def cluster_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A 3-broker cluster of this module only (its home): stopped at the end, also on failure."""
    from infra.kafka import cluster as kc

    home = tmp_path_factory.mktemp("kafka-cluster")
    try:
        kc.start_cluster(home, BROKERS)
        yield home
    finally:
        kc.stop_cluster(home)


# --------------------------------------------------------------------------- what the cluster says


async def _admin(bootstrap: str, ask: Callable[[Any], Any]) -> Any:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    await admin.start()
    try:
        return await ask(admin)
    finally:
        await admin.close()


def partitions_of(bootstrap: str, topic: str) -> list[dict[str, Any]]:
    """``topic``'s partitions as the cluster describes them (``leader``, ``replicas``, ``isr``)."""
    found = asyncio.run(_admin(bootstrap, lambda a: a.describe_topics([topic])))
    return list(found[0]["partitions"])


def main_leader(bootstrap: str, topic: str) -> int:
    """The broker that leads the most partitions of ``topic``."""
    leaders = [p["leader"] for p in partitions_of(bootstrap, topic)]
    return max(set(leaders), key=leaders.count)


# --------------------------------------------------------------------------- faults


def signal_node(home: Path, node_id: int, sig: int) -> float:
    """Send ``sig`` to node ``node_id``'s JVM; for SIGKILL wait until it is gone. The wall time."""
    from infra.kafka import broker
    from infra.kafka.cluster import node_home

    proc = broker.local_kafka(node_home(home, node_id))
    assert proc is not None, f"broker {node_id} of {home} does not run"
    t = time.time()
    os.kill(proc.pid, sig)
    if sig == signal.SIGKILL:
        deadline = time.monotonic() + 15
        while broker.local_kafka(node_home(home, node_id)) is not None:  # reaps it and forgets it
            assert time.monotonic() < deadline, f"broker {node_id} still alive after SIGKILL"
            time.sleep(0.1)
    return t


def restart_nodes(home: Path, node_ids: list[int]) -> float:
    """Start the given (stopped) nodes again and wait until they answer; the wall time they did."""
    from infra.kafka import cluster as kc

    _, started = kc.start_cluster(home, BROKERS, only=node_ids)
    assert sorted(started) == sorted(node_ids), (started, node_ids)
    return time.time()


Fault = Callable[[Path, str, str], float]
"""A fault: ``(cluster home, bootstrap, run id) -> when it struck`` (its recovery counts from there)."""


def kill_generations_leader(home: Path, bootstrap: str, run_id: str, down_s: float = 5.0) -> float:
    """``kill -9`` of the broker leading most of ``generations``' partitions; started again after ``down_s``."""
    from schemas.topics import topic_name

    victim = main_leader(bootstrap, topic_name(run_id, "generations"))
    t = signal_node(home, victim, signal.SIGKILL)
    time.sleep(down_s)
    restart_nodes(home, [victim])
    return t


# --------------------------------------------------------------------------- one run


def cluster_fault_run(runs: Path, home: Path, fault: Fault, label: str) -> FaultResult:
    """One short run on the cluster of ``home`` with ``fault`` struck after its first step; asserts
    the run completes with the invariants and its topics have 3 replicas, ``min.insync.replicas`` 2."""
    from infra.kafka.cluster import local_cluster
    from schemas.topics import topic_name

    cluster = local_cluster(home)
    assert cluster is not None and len(cluster.running) == BROKERS, cluster
    bootstrap = cluster.bootstrap
    env = {k: v for k, v in os.environ.items() if k != "ROLLSTREAM_BOOTSTRAP"}
    run_id = f"e2e-cluster-{label}-{uuid.uuid4().hex[:6]}"
    t0 = time.time()
    with Watch(bootstrap, run_id) as watch:
        run = RunProc(runs, run_id, OVERRIDES, env, bootstrap=bootstrap)
        watch.wait(lambda s: s.done_steps >= 1, 300, "1 step", run)
        parts = partitions_of(bootstrap, topic_name(run_id, "generations"))
        assert all(len(p["replicas"]) == BROKERS for p in parts), parts
        assert watch.seen.finished is None and watch.seen.done_steps < STEPS, f"struck too late: {watch.seen}"
        struck = fault(home, bootstrap, run_id)
        code = run.wait(360)
        recovery = recovery_after(watch, struck)
    assert code == 0, run.output()
    env["ROLLSTREAM_BOOTSTRAP"] = bootstrap
    inv = invariants(runs, run_id, env)
    check_invariants(inv, STEPS)
    configs = asyncio.run(_topic_config(bootstrap, topic_name(run_id, "scored")))
    assert configs.get("min.insync.replicas") == "2", configs
    return FaultResult(inv, recovery, time.time() - t0)


async def _topic_config(bootstrap: str, topic: str) -> dict[str, str]:
    from runtime.admin import TopicAdmin
    from schemas.config import KafkaSettings

    async with TopicAdmin(KafkaSettings(), bootstrap) as admin:
        return await admin.topic_config(topic)


@pytest.mark.timeout(420)
def test_kill_9_of_the_generations_leader_mid_transaction(tmp_path: Path, cluster_home: Path) -> None:
    res = cluster_fault_run(tmp_path / "runs", cluster_home, kill_generations_leader, "leader")
    assert res.recovery_s is not None and res.invariants["trained"] > 0, res
    print(f"kill -9 of the generations leader: recovery {res.recovery_s:.1f} s, wall {res.wall_s:.0f} s, "
          f"{res.invariants['issued']} samples issued, 0 lost")
