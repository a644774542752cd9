"""Faults of a 3-broker Kafka cluster (``rollstream stack up --brokers 3``: KRaft, every node broker
and controller, the run's topics with 3 replicas and ``min.insync.replicas`` 2) during a short
``rollstream run`` (the harness of ``tests/e2e/faults.py``; the cluster is this module's own, in a
temporary home, stopped at the end).

* ``kill -9`` of the broker that leads most of ``generations``' partitions, while the reward
  router is mid-transaction (samples are flowing), started again 5 s later: the partitions get new
  leaders, the run completes with the invariants (nothing lost, trained twice or recorded twice,
  every step once). This one runs in CI (``make test``).

The other cluster faults of :data:`FAULTS` (marker ``bench``: ``make test-bench``, not in ``make test``;
``bench/reliability.py`` runs them all as
scenarios ``cluster-<name>``): ``kill -9`` of the trainer group's coordinator, of the reward
router's transaction coordinator, one broker frozen with SIGSTOP for 30 s (a gray failure), a
rolling restart of the 3 brokers, the whole cluster killed and started again.
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
BROKERS = 3
LONGER = {"rolling": 150, "leader": 120}  # runs that must outlast their fault (40 steps ended within the leader's 5 s down and its restart)
"""Steps of the runs whose fault outlasts a 4-step run. A rolling restart waits for each broker to
be back in sync (3 minutes on the loaded 2-core machine, 06:45:06 to 06:48:00 on 2026-11-28) while
training goes on at about 1.5 s a step: a 20-step run finished during it (recovery not measured).
Its recovery counts from the last broker back, so the run must still be training then."""


def overrides(steps: int) -> list[str]:
    return [*SHORT, f"train.steps={steps}", f"train.checkpoint_every={max(2, steps // 10)}"]


@pytest.fixture(scope="module")
def cluster_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A 3-broker cluster of this module only (its home): stopped at the end, also on failure."""
    from infra.kafka import cluster as kc

    home = tmp_path_factory.mktemp("kafka-cluster")
    try:
        kc.start_cluster(home, BROKERS)
        yield home
    finally:
        kc.stop_cluster(home, timeout_s=5)  # a temporary cluster: no need to wait out a clean shutdown


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
"""A fault: ``(cluster home, bootstrap, run id) -> the time its recovery counts from``: the kill
of a broker the cluster can do without (it is started again later), or the end of an outage (the
frozen broker resumed, the last broker of a rolling restart back, the whole cluster back)."""


def kill_generations_leader(home: Path, bootstrap: str, run_id: str, down_s: float = 5.0) -> float:
    """``kill -9`` of the broker leading most of ``generations``' partitions; started again after ``down_s``."""
    from schemas.topics import topic_name

    victim = main_leader(bootstrap, topic_name(run_id, "generations"))
    t = signal_node(home, victim, signal.SIGKILL)
    time.sleep(down_s)
    restart_nodes(home, [victim])
    return t


def coordinator(bootstrap: str, key: str, kind: int) -> int:
    """The broker coordinating group ``key`` (``kind`` 0) or transactional id ``key`` (``kind`` 1)."""
    return int(asyncio.run(_admin(bootstrap, lambda a: a.find_coordinator(key, kind))))


def kill_coordinator(service: str, kind: int, down_s: float = 5.0) -> Fault:
    """``kill -9`` of the group (``kind`` 0) or transaction (``kind`` 1) coordinator of ``service``'s
    group id (the reward router's transactional id is its group id); started again after ``down_s``."""
    from schemas.services import SERVICES

    def fault(home: Path, bootstrap: str, run_id: str) -> float:
        victim = coordinator(bootstrap, SERVICES[service].group_id(run_id), kind)
        t = signal_node(home, victim, signal.SIGKILL)
        time.sleep(down_s)
        restart_nodes(home, [victim])
        return t

    return fault


def freeze_generations_leader(home: Path, bootstrap: str, run_id: str, frozen_s: float = 30.0) -> float:
    """SIGSTOP of the broker leading most of ``generations``' partitions for ``frozen_s``, then
    SIGCONT: a gray failure (its sockets stay open, nothing answers); it is fenced and rejoins."""
    from schemas.topics import topic_name

    victim = main_leader(bootstrap, topic_name(run_id, "generations"))
    signal_node(home, victim, signal.SIGSTOP)
    try:
        time.sleep(frozen_s)
    finally:
        resumed = signal_node(home, victim, signal.SIGCONT)
    return resumed


def rolling_restart(home: Path, bootstrap: str, run_id: str) -> float:
    """Each broker in turn stopped (SIGTERM: a controlled shutdown) and started again, the next
    one once it answers and every partition of the run's topics has its 3 replicas in sync."""
    from infra.kafka import broker
    from infra.kafka.cluster import node_home
    from schemas.topics import topic_name

    t = 0.0
    for node_id in range(1, BROKERS + 1):
        broker.stop_local_kafka(node_home(home, node_id))
        restart_nodes(home, [node_id])
        deadline = time.monotonic() + 120
        while any(len(p["isr"]) < BROKERS for p in partitions_of(bootstrap, topic_name(run_id, "generations"))):
            assert time.monotonic() < deadline, f"broker {node_id} not back in sync within 120 s"
            time.sleep(0.5)
        t = time.time()
    return t


def kill_whole_cluster(home: Path, bootstrap: str, run_id: str, down_s: float = 10.0) -> float:
    """``kill -9`` of every broker at once; all started again after ``down_s``."""
    for node_id in range(1, BROKERS + 1):
        signal_node(home, node_id, signal.SIGKILL)
    time.sleep(down_s)
    return restart_nodes(home, list(range(1, BROKERS + 1)))


FAULTS: dict[str, tuple[str, Fault]] = {
    "leader": ("`kill -9` of the broker leading `generations` (mid-transaction), back after 5 s",
               kill_generations_leader),
    "group-coordinator": ("`kill -9` of the trainer group's coordinator, back after 5 s",
                          kill_coordinator("trainer", 0)),
    "txn-coordinator": ("`kill -9` of the reward router's transaction coordinator, back after 5 s",
                        kill_coordinator("reward", 1)),
    "freeze": ("SIGSTOP of the `generations` leader for 30 s (gray failure), then SIGCONT",
               freeze_generations_leader),
    "rolling": ("rolling restart of the 3 brokers (SIGTERM, start, in sync, next)", rolling_restart),
    "whole": ("`kill -9` of all 3 brokers at once, started again after 10 s", kill_whole_cluster),
}
"""name -> (label in docs/reliability.md, fault): the cluster faults of ``bench/reliability.py``."""


# --------------------------------------------------------------------------- one run


def cluster_fault_run(runs: Path, home: Path, fault: Fault, label: str) -> FaultResult:
    """One short run (:data:`STEPS` steps, :data:`LONGER` ones for the faults named there) on the
    cluster of ``home`` with ``fault`` struck after its first step; asserts the run completes with
    the invariants and its topics have 3 replicas, ``min.insync.replicas`` 2."""
    from infra.kafka.cluster import local_cluster
    from schemas.topics import topic_name

    steps = LONGER.get(label, STEPS)
    cluster = local_cluster(home)
    assert cluster is not None and len(cluster.running) == BROKERS, cluster
    bootstrap = cluster.bootstrap
    env = {k: v for k, v in os.environ.items() if k != "ROLLSTREAM_BOOTSTRAP"}
    run_id = f"e2e-cluster-{label}-{uuid.uuid4().hex[:6]}"
    t0 = time.time()
    with Watch(bootstrap, run_id) as watch:
        run = RunProc(runs, run_id, overrides(steps), env, bootstrap=bootstrap)
        watch.wait(lambda s: s.done_steps >= 1, 300, "1 step", run)
        parts = partitions_of(bootstrap, topic_name(run_id, "generations"))
        assert all(len(p["replicas"]) == BROKERS for p in parts), parts
        assert watch.seen.finished is None and watch.seen.done_steps < steps, f"struck too late: {watch.seen}"
        struck = fault(home, bootstrap, run_id)
        after_fault = watch.seen.done_steps
        code = run.wait(360 + 5 * steps)
        recovery = recovery_after(watch, struck)
    assert code == 0, run.output()
    assert after_fault < steps, f"the run trained its last step during the fault: lengthen it (LONGER): {watch.seen}"
    env["ROLLSTREAM_BOOTSTRAP"] = bootstrap
    inv = invariants(runs, run_id, env)
    check_invariants(inv, steps)
    configs = asyncio.run(_topic_config(bootstrap, topic_name(run_id, "scored")))
    assert configs.get("min.insync.replicas") == "2", configs
    return FaultResult(inv, recovery, time.time() - t0)


async def _topic_config(bootstrap: str, topic: str) -> dict[str, str]:
    from runtime.admin import TopicAdmin
    from schemas.config import KafkaSettings

    async with TopicAdmin(KafkaSettings(), bootstrap) as admin:
        return await admin.topic_config(topic)


@pytest.mark.bench
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", [n for n in FAULTS if n != "leader"])
def test_a_cluster_fault_mid_run(tmp_path: Path, cluster_home: Path, name: str) -> None:
    label, fault = FAULTS[name]
    res = cluster_fault_run(tmp_path / "runs", cluster_home, fault, name)
    assert res.recovery_s is not None and res.invariants["trained"] > 0, res
    print(f"{label}: recovery {res.recovery_s:.1f} s, wall {res.wall_s:.0f} s, {res.invariants['issued']} issued")


@pytest.mark.timeout(600)
def test_kill_9_of_the_generations_leader_mid_transaction(tmp_path: Path, cluster_home: Path) -> None:
    res = cluster_fault_run(tmp_path / "runs", cluster_home, kill_generations_leader, "leader")
    assert res.recovery_s is not None and res.invariants["trained"] > 0, res
    print(f"kill -9 of the generations leader: recovery {res.recovery_s:.1f} s, wall {res.wall_s:.0f} s, "
          f"{res.invariants['issued']} samples issued, 0 lost")


# --------------------------------------------------------------------------- the chaos soak, short


@pytest.mark.timeout(300)
def test_a_3_fault_chaos_soak(tmp_path: Path, cluster_home: Path) -> None:
    """``bench/chaos.py``'s soak cut to 3 faults close together (here, to share this module's
    cluster), the quick ones (a broker fault's restart of a JVM is the test above): seed 1 draws
    the feeder and the recorder killed at once, then the reward router; each recovered before the
    next, the invariants at the end."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("bench_chaos", Path(__file__).resolve().parents[2] / "bench" / "chaos.py")
    assert spec is not None and spec.loader is not None
    chaos = sys.modules["bench_chaos"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(chaos)
    res = chaos.soak(tmp_path / "runs", cluster_home, minutes=None, faults=3, interval_s=0.5,
                     pool=["feeder", "reward", "recorder"], pair_p=0.5, seed=1, first_after_steps=1,
                     recovery_timeout_s=120)
    print(chaos.summary(res))
    assert [s.faults for s in res.strikes] == [["feeder", "recorder"], ["reward"]], res.strikes
    assert res.error is None and (res.injected, res.survived) == (3, 3), res
    inv = res.invariants
    assert inv["trained"] > 0 and inv["steps_distinct"] > 1, inv
    assert (inv["lost"], inv["trained_twice"], inv["two_outcomes"], inv["duplicate_rows"]) == (0, 0, 0, 0), inv
