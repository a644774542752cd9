"""A local Kafka cluster on this machine (``rollstream stack up --brokers 3``): N KRaft nodes, each a
combined broker+controller JVM, the N controllers one static quorum (``controller.quorum.voters``).

Each node is a local broker as :mod:`infra.kafka.broker` runs one, in a home of its own (so
:func:`~infra.kafka.broker.local_kafka` and :func:`~infra.kafka.broker.stop_local_kafka` work on a
node)::

    <home>/cluster/cluster.json    the nodes (id, client and controller ports) and the bootstrap
    <home>/cluster/node<i>/        node i's home: kafka/server.properties, kafka/state.json,
                                   kafka/data/, logs/kafka.log (as infra/kafka/home.py describes)

The ports are chosen at the first start and kept (the quorum's voters are static). With 3 or more
nodes every internal topic has 3 replicas and ``min.insync.replicas`` 2, and so do the run's topics
(:class:`runtime.admin.TopicAdmin`). A node is fenced 3 s after its last heartbeat
(``broker.session.timeout.ms``), so a dead leader's partitions move within seconds. Each JVM has a
heap of at most :data:`NODE_HEAP`, more with many partitions (:func:`broker.heap_opts`;
docs/reliability.md measures the cluster's memory).

Nothing happens at import time.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from infra.kafka import broker
from infra.kafka.home import (
    HOST,
    StackError,
    cluster_dir,
    file_lock,
    free_port,
    kafka_dir,
    kafka_log_path,
    new_cluster_id,
    norm_home,
    port_free,
    server_properties,
    state_path,
    write_atomic,
    write_server_properties,
)

NODE_HEAP = "-Xmx512m"
"""Largest heap of one node's JVM with few partitions."""
NODE_JVM_OPTS: tuple[str, ...] = ("-Xms128m", NODE_HEAP, *broker.JVM_OPTS[2:])
"""JVM flags of a cluster node: the single broker's, with a smaller initial heap."""


@dataclass(frozen=True)
class Node:
    """One node of the cluster: its id, ports, home and the running process (None: not running)."""

    node_id: int
    port: int
    controller_port: int
    home: Path
    process: broker.KafkaProcess | None

    @property
    def bootstrap(self) -> str:
        return f"{HOST}:{self.port}"


@dataclass(frozen=True)
class Cluster:
    """The local cluster of a home, as ``<home>/cluster/cluster.json`` records it."""

    nodes: list[Node]

    @property
    def bootstrap(self) -> str:
        """Every node's client address, comma-separated (what clients are given)."""
        return ",".join(n.bootstrap for n in self.nodes)

    @property
    def running(self) -> list[Node]:
        return [n for n in self.nodes if n.process is not None]

    def node(self, node_id: int) -> Node:
        return next(n for n in self.nodes if n.node_id == node_id)


def node_home(home: Path, node_id: int) -> Path:
    """The home of node ``node_id`` (a local broker's home layout)."""
    return cluster_dir(home) / f"node{node_id}"


def node_properties(node_id: int, port: int, controller_port: int, voters: str, data_dir: Path,
                    brokers: int) -> dict[str, str]:
    """server.properties of one node: the single broker's (:func:`infra.kafka.home.server_properties`)
    with its id, the quorum's ``voters`` (``id@host:port,...``), replication ``min(3, brokers)``
    and ``min.insync.replicas`` 2 when there are 3 replicas, and fast failure detection."""
    rf = min(3, brokers)
    isr = "2" if rf >= 3 else "1"
    props = server_properties(port, controller_port, data_dir)
    props.update({
        "node.id": str(node_id),
        "controller.quorum.voters": voters,
        "default.replication.factor": str(rf),
        "min.insync.replicas": isr,
        "offsets.topic.replication.factor": str(rf),
        "transaction.state.log.replication.factor": str(rf),
        "transaction.state.log.min.isr": isr,
        "share.coordinator.state.topic.replication.factor": str(rf),
        "share.coordinator.state.topic.min.isr": isr,
        # a dead node is fenced (its partitions get new leaders) 3 s after its last heartbeat
        "broker.heartbeat.interval.ms": "500",
        "broker.session.timeout.ms": "3000",
        "replica.lag.time.max.ms": "10000",
    })
    return props


def _record_path(home: Path) -> Path:
    return cluster_dir(home) / "cluster.json"


def local_cluster(home: Path) -> Cluster | None:
    """The cluster recorded in ``home`` (running or not: each node's ``process`` says), else None."""
    try:
        data = json.loads(_record_path(home).read_text())
        nodes = [(int(n["node_id"]), int(n["port"]), int(n["controller_port"])) for n in data["nodes"]]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise StackError(f"{_record_path(home)} cannot be read ({e}); remove {cluster_dir(home)} to start over") from None
    return Cluster([Node(i, p, c, node_home(home, i), broker.local_kafka(node_home(home, i))) for i, p, c in nodes])


def running_cluster(home: Path) -> Cluster | None:
    """The cluster of ``home`` when at least one of its nodes runs, else None."""
    cluster = local_cluster(home)
    return cluster if cluster is not None and cluster.running else None


def _plan(home: Path, brokers: int) -> Cluster:
    """The recorded cluster, or a new record of ``brokers`` nodes on free ports."""
    cluster = local_cluster(home)
    if cluster is not None:
        if len(cluster.nodes) != brokers:
            raise StackError(f"the local cluster of {home} has {len(cluster.nodes)} brokers, not {brokers}; start it "
                             f"with --brokers {len(cluster.nodes)}, or remove {cluster_dir(home)} to make a new one")
        return cluster
    taken: set[int] = set()
    nodes = []
    for i in range(1, brokers + 1):
        port = free_port(taken)
        taken.add(port)
        cport = free_port(taken)
        taken.add(cport)
        nodes.append(Node(i, port, cport, node_home(home, i), None))
    cluster_dir(home).mkdir(parents=True, exist_ok=True)
    write_atomic(cluster_dir(home) / "cluster.id", new_cluster_id() + "\n")
    record = {"nodes": [{"node_id": n.node_id, "port": n.port, "controller_port": n.controller_port} for n in nodes]}
    write_atomic(_record_path(home), json.dumps(record, indent=2) + "\n")
    return Cluster(nodes)


def _prepare(home: Path, cluster: Cluster, node: Node, java: str, libs: Path, deadline: float) -> None:
    """Write node ``node``'s server.properties and format its storage once (the cluster's id)."""
    for p in (node.port, node.controller_port):
        if not port_free(p):
            raise StackError(f"port {p} of broker {node.node_id} of the local cluster is in use by another program; "
                             f"stop it, or remove {cluster_dir(home)} to make a cluster on other ports")
    nh = node.home
    kafka_dir(nh).mkdir(parents=True, exist_ok=True)
    (nh / "logs").mkdir(parents=True, exist_ok=True)
    cluster_id = (cluster_dir(home) / "cluster.id").read_text()
    write_atomic(kafka_dir(nh) / "cluster.id", cluster_id)
    voters = ",".join(f"{n.node_id}@{HOST}:{n.controller_port}" for n in cluster.nodes)
    data_dir = kafka_dir(nh) / "data"
    write_server_properties(nh, node_properties(node.node_id, node.port, node.controller_port, voters, data_dir,
                                                len(cluster.nodes)))
    broker._format_storage(nh, java, libs, data_dir, deadline, [])


def _record_node(node: Node, child: subprocess.Popen[bytes], started_at: float) -> broker.KafkaProcess:
    proc = broker.KafkaProcess(bootstrap=node.bootstrap, pid=child.pid, port=node.port,
                               controller_port=node.controller_port, data_dir=str(kafka_dir(node.home) / "data"),
                               log_path=str(kafka_log_path(node.home)), started_at=started_at)
    write_atomic(state_path(node.home), json.dumps(asdict(proc), indent=2) + "\n")
    return proc


def start_cluster(home: Path, brokers: int = 3, timeout_s: float = 120,
                  progress: Callable[[str], None] | None = None,
                  only: list[int] | None = None) -> tuple[Cluster, list[int]]:
    """Start the nodes of the local cluster of ``home`` that do not run (``only``: just these node
    ids); return the cluster and the ids started. The first start picks free ports and formats
    every node's storage with one cluster id. The JVMs are launched together (a controller alone
    has no quorum), then each must answer a metadata request within ``timeout_s``; a node that
    does not is stopped and a :class:`StackError` names its log. A single local broker running in
    the same home is refused (stop it first)."""
    home = norm_home(home)
    if not 1 <= brokers <= 9:
        raise StackError(f"--brokers {brokers}: from 1 to 9")
    single = broker.local_kafka(home)
    if single is not None:
        raise StackError(f"the single local Kafka of {home} runs on {single.bootstrap}; stop it (`rollstream stack "
                         "down`) before starting a cluster")
    libs = broker.ensure_kafka_jars(progress)
    java = broker._java(progress)
    cluster_dir(home).mkdir(parents=True, exist_ok=True)
    with file_lock(cluster_dir(home) / ".lock", 120.0, f"the local Kafka cluster in {home}"):
        cluster = _plan(home, brokers)
        todo = [n for n in cluster.nodes if n.process is None and (only is None or n.node_id in only)]
        deadline = time.monotonic() + timeout_s
        launched: list[tuple[Node, subprocess.Popen[bytes], float]] = []
        try:
            if todo:  # the storage formats (a JVM each) at once
                with ThreadPoolExecutor(len(todo)) as pool:
                    list(pool.map(lambda n: _prepare(home, cluster, n, java, libs, deadline), todo))
            for node in todo:
                if progress:
                    progress(f"starting broker {node.node_id} of {len(cluster.nodes)} on {node.bootstrap}")
                child, started_at = broker.launch_jvm(node.home, java, libs, NODE_JVM_OPTS)
                launched.append((node, child, started_at))
            for node, child, started_at in launched:
                broker.await_ready(child, node.bootstrap, kafka_log_path(node.home), deadline, timeout_s)
                _record_node(node, child, started_at)
        except BaseException:
            for _, child, _ in launched:
                if broker._pid_alive(child.pid):
                    broker._terminate(child.pid, 10.0)
            raise
    now = local_cluster(home)
    if now is None:
        raise StackError(f"{_record_path(home)} vanished while the cluster started")
    return now, [n.node_id for n, _, _ in launched]


def stop_cluster(home: Path, timeout_s: float = 30) -> list[int]:
    """Stop every node of the local cluster of ``home`` (SIGTERM, SIGKILL after ``timeout_s``), all
    at once (a node stopping alone waits for the quorum); data and logs are kept. Returns the ids
    of the nodes that were running."""
    cluster = local_cluster(home)
    if cluster is None:
        return []
    with ThreadPoolExecutor(len(cluster.nodes)) as pool:
        stopped = list(pool.map(lambda n: broker.stop_local_kafka(n.home, timeout_s), cluster.nodes))
    return [n.node_id for n, was in zip(cluster.nodes, stopped, strict=True) if was]


def describe(cluster: Cluster) -> list[str]:
    """One line per node: id, address, pid or ``stopped``, log."""
    lines = []
    for n in cluster.nodes:
        state = f"pid {n.process.pid}" if n.process else "stopped"
        lines.append(f"broker {n.node_id}: {n.bootstrap} (controller {HOST}:{n.controller_port}) {state}, "
                     f"log {kafka_log_path(n.home)}")
    return lines
