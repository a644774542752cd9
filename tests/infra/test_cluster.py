"""The local Kafka cluster's record and node settings (infra.kafka.cluster), without JVMs: the
cluster itself runs in tests/e2e/test_cluster_faults.py (started, a broker killed and restarted,
stopped)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.kafka import cluster as kc
from infra.kafka.home import StackError, read_properties, server_properties


def test_node_properties_make_a_quorum_with_three_replicas() -> None:
    voters = "1@127.0.0.1:9101,2@127.0.0.1:9102,3@127.0.0.1:9103"
    props = kc.node_properties(2, 9002, 9102, voters, Path("/d"), brokers=3)
    base = server_properties(9002, 9102, Path("/d"))
    assert props["node.id"] == "2" and props["controller.quorum.voters"] == voters
    assert props["listeners"] == base["listeners"] and props["process.roles"] == "broker,controller"
    for key in ("default.replication.factor", "offsets.topic.replication.factor",
                "transaction.state.log.replication.factor"):
        assert props[key] == "3", key
    assert props["min.insync.replicas"] == props["transaction.state.log.min.isr"] == "2"
    two = kc.node_properties(1, 9001, 9101, voters, Path("/d"), brokers=2)
    assert two["default.replication.factor"] == "2" and two["min.insync.replicas"] == "1"


def test_the_first_plan_records_free_distinct_ports_and_keeps_them(tmp_path: Path) -> None:
    plan = kc._plan(tmp_path, 3)
    ports = [p for n in plan.nodes for p in (n.port, n.controller_port)]
    assert [n.node_id for n in plan.nodes] == [1, 2, 3] and len(set(ports)) == 6
    assert plan.bootstrap == ",".join(f"127.0.0.1:{n.port}" for n in plan.nodes)
    assert (kc.cluster_dir(tmp_path) / "cluster.id").read_text().strip()
    again = kc.local_cluster(tmp_path)
    assert again is not None and [(n.port, n.controller_port) for n in again.nodes] == \
        [(n.port, n.controller_port) for n in plan.nodes]
    assert again.running == [] and kc.describe(again)[0].endswith(
        f"stopped, log {kc.node_home(tmp_path, 1) / 'logs' / 'kafka.log'}")
    with pytest.raises(StackError, match="has 3 brokers, not 5; start it with --brokers 3"):
        kc._plan(tmp_path, 5)
    assert kc.stop_cluster(tmp_path) == []  # none of them runs


def test_a_node_gets_its_own_home_and_the_cluster_id(tmp_path: Path) -> None:
    plan = kc._plan(tmp_path, 3)
    node = plan.node(3)
    node.home.joinpath("kafka").mkdir(parents=True)
    kc.write_server_properties(node.home, kc.node_properties(3, node.port, node.controller_port, "v", Path("/d"), 3))
    props = read_properties(node.home / "kafka" / "server.properties")
    assert props["node.id"] == "3" and node.home == tmp_path.absolute() / "cluster" / "node3"


def test_an_unreadable_record_and_a_bad_count_are_one_line(tmp_path: Path) -> None:
    assert kc.local_cluster(tmp_path) is None and kc.running_cluster(tmp_path) is None
    kc.cluster_dir(tmp_path).mkdir(parents=True)
    (kc.cluster_dir(tmp_path) / "cluster.json").write_text(json.dumps({"nodes": [{"node_id": 1}]}))
    with pytest.raises(StackError, match=r"cluster\.json cannot be read") as err:
        kc.local_cluster(tmp_path)
    assert "\n" not in str(err.value) and "to start over" in str(err.value)
    with pytest.raises(StackError, match="--brokers 0: from 1 to 9"):
        kc.start_cluster(tmp_path / "other", 0)
