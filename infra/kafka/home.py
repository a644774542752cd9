"""The local stack's files: its home directory, locks and atomic writes, the broker's
server.properties, and the errors its logs show.

Layout of a home (``./.rollstream`` or ``$ROLLSTREAM_HOME``; see :mod:`infra.kafka.broker`)::

    <home>/kafka/state.json        the running broker (pid, ports, ...); absent when stopped
    <home>/kafka/server.properties generated at every start (edits are overwritten)
    <home>/kafka/server.overrides.properties   optional, yours: merged over the generated file
    <home>/kafka/cluster.id        the KRaft cluster id, created on the first start
    <home>/kafka/tls/, scram.json, *.password   a SASL_SSL stack's certificates and SCRAM users
                                   (:mod:`infra.kafka.local_security`)
    <home>/kafka/data/             the Kafka log directory (topics survive restarts)
    <home>/logs/kafka.log          the broker's stdout+stderr (previous start: kafka.log.1)
    <home>/logs/kafka-format.log   output of the one-time storage format
    <home>/cluster/                a local cluster (`stack up --brokers N`): cluster.json, and
                                   node<i>/, each node's home laid out as above
                                   (:mod:`infra.kafka.cluster`)

Nothing happens at import time.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import os
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "HOME_ENV",
    "HOST",
    "KAFKA_VERSION",
    "StackError",
    "cluster_dir",
    "exit_reason",
    "file_lock",
    "free_port",
    "home_dir",
    "kafka_dir",
    "kafka_log_path",
    "log_error",
    "new_cluster_id",
    "node_homes",
    "norm_home",
    "port_free",
    "previous_ports",
    "props_path",
    "read_properties",
    "server_properties",
    "state_path",
    "tail_lines",
    "write_atomic",
    "write_server_properties",
]

KAFKA_VERSION = "4.1.1"
"""Apache Kafka version of the local broker; equals ``kafka.version`` in infra/kafka/pom.xml and
the ``apache/kafka`` image tag in compose/docker-compose.yml (tests/test_compose.py checks)."""

HOME_ENV = "ROLLSTREAM_HOME"
"""Environment variable naming the local stack's state directory."""

HOST = "127.0.0.1"
"""The local broker listens on loopback only."""


class StackError(RuntimeError):
    """A local-stack problem, as one line for the user (what failed, what to do or which log)."""


# --------------------------------------------------------------------------- paths


def home_dir(override: str | None = None) -> Path:
    """The local stack's state directory: ``override``, else ``$ROLLSTREAM_HOME``, else
    ``./.rollstream`` (relative to the current directory). Absolute; not created here."""
    raw = override or os.environ.get(HOME_ENV) or ".rollstream"
    return Path(raw).expanduser().absolute()


def kafka_dir(home: Path) -> Path:
    """``<home>/kafka``: the broker's config, state and data."""
    return home / "kafka"


def state_path(home: Path) -> Path:
    """``<home>/kafka/state.json``: the running broker (absent when stopped)."""
    return kafka_dir(home) / "state.json"


def props_path(home: Path) -> Path:
    """``<home>/kafka/server.properties``: generated at every start."""
    return kafka_dir(home) / "server.properties"


def kafka_log_path(home: Path) -> Path:
    """``<home>/logs/kafka.log``: the broker's stdout+stderr."""
    return home / "logs" / "kafka.log"


def cluster_dir(home: Path) -> Path:
    """``<home>/cluster``: the local cluster's record and its nodes' homes."""
    return norm_home(home) / "cluster"


def node_homes(home: Path) -> list[Path]:
    """The homes of the local cluster's nodes that exist (``<home>/cluster/node<i>``), by node id."""
    found = [p for p in cluster_dir(home).glob("node*") if p.name[4:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[4:]))


def norm_home(home: Path | str) -> Path:
    """``home`` as an absolute path (``~`` expanded)."""
    return Path(home).expanduser().absolute()


# --------------------------------------------------------------------------- files


@contextlib.contextmanager
def file_lock(path: Path, wait_s: float, what: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if needed), waiting at most ``wait_s``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by children (O_CLOEXEC)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise StackError(
                        f"another rollstream process is busy with {what} (lock {path} held for "
                        f"{wait_s:.0f} s); wait for it to finish and try again"
                    ) from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str, mode: int | None = None) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (readers never see half);
    ``mode``: the file's permissions (e.g. ``0o600`` for a file holding a secret)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    if mode is not None:
        os.chmod(tmp, mode)
    os.replace(tmp, path)


def tail_lines(path: Path, max_bytes: int = 256 * 1024) -> list[str]:
    """The last ``max_bytes`` of a text file as lines ([] if it cannot be read)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return []
    return data.decode("utf-8", "replace").splitlines()


# --------------------------------------------------------------------------- ports and ids


def port_free(port: int) -> bool:
    """True if nothing listens on ``127.0.0.1:port`` and it can be bound (as Kafka will)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        if s.connect_ex((HOST, port)) == 0:
            return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the JVM does
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port(exclude: set[int]) -> int:
    """A port the OS says is free on 127.0.0.1, not in ``exclude``."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((HOST, 0))
            port = int(s.getsockname()[1])
        if port not in exclude:
            return port
    raise StackError("could not find a free TCP port on 127.0.0.1")


def new_cluster_id() -> str:
    """A KRaft cluster id as Kafka makes them: 16 random bytes, URL-safe base64, no padding."""
    while True:
        cid = base64.urlsafe_b64encode(os.urandom(16)).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


# --------------------------------------------------------------------------- logs


_LOG4J_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d [^\]]*\] ")
_ERROR_LINE = re.compile(r"^\[[^\]]*\] (ERROR|FATAL) ")
_EXC_LINE = re.compile(r"^(Caused by: )?[A-Za-z_$][\w$]*(\.[\w$]+)+(Exception|Error)\b")
_JVM_ERROR = re.compile(r"^(Error: |Exception in thread |Error occurred during initialization)")


def log_error(path: Path) -> str | None:
    """The last error a log shows, as one line (None if it shows none): the last log4j
    ERROR/FATAL line (timestamp cut) joined with the deepest exception ("Caused by: ...") printed
    under it; else the last JVM-level error or exception line. Cut to 400 characters."""
    lines = tail_lines(path)
    idx = next((i for i in range(len(lines) - 1, -1, -1) if _ERROR_LINE.match(lines[i])), None)
    if idx is not None:
        head = _LOG4J_LINE.sub("", lines[idx]).strip()
        cause = ""
        for line in lines[idx + 1 :]:
            if _LOG4J_LINE.match(line):
                break
            s = line.strip()
            if _EXC_LINE.match(s):
                cause = s.removeprefix("Caused by: ")
        msg = f"{head} — {cause}" if cause else head
    else:
        cand = [s.strip() for s in lines if _JVM_ERROR.match(s.strip()) or _EXC_LINE.match(s.strip())]
        if not cand:
            return None
        msg = cand[-1]
    if any("UnsupportedClassVersionError" in line for line in lines[-200:]):
        msg = f"Kafka {KAFKA_VERSION} needs Java 17 or newer ({msg})"
    return msg if len(msg) <= 400 else msg[:397] + "..."


def exit_reason(path: Path) -> str:
    """What a log says about why a process ended: its last error, else its last line."""
    err = log_error(path)
    if err:
        return err
    last = next((ln.strip() for ln in reversed(tail_lines(path)) if ln.strip()), "")
    return f"no error logged, last line: {last[:300]}" if last else f"{path} is empty"


# --------------------------------------------------------------------------- server.properties


def read_properties(path: Path) -> dict[str, str]:
    """``key=value`` lines of a Java properties file (comments and blanks skipped; no escapes)."""
    out: dict[str, str] = {}
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        s = line.strip()
        if not s or s[0] in "#!":
            continue
        key, sep, value = s.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


def previous_ports(home: Path) -> tuple[int | None, int | None]:
    """Client (PLAINTEXT or SASL_SSL) and controller ports of the last start in this home (from
    server.properties)."""
    listeners = read_properties(props_path(home)).get("listeners", "")
    ports: dict[str, int] = {}
    for item in listeners.split(","):
        m = re.fullmatch(r"\s*(\w+)://[^:]*:(\d+)\s*", item)
        if m:
            ports[m.group(1)] = int(m.group(2))
    return ports.get("PLAINTEXT") or ports.get("SASL_SSL"), ports.get("CONTROLLER")


def server_properties(port: int, controller_port: int, data_dir: Path) -> dict[str, str]:
    """The broker config: KRaft combined broker+controller, loopback only, replication 1,
    small thread pools and buffers, topics created explicitly (auto-create off)."""
    return {
        # KRaft, single node acting as broker and controller
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@{HOST}:{controller_port}",
        "listeners": f"PLAINTEXT://{HOST}:{port},CONTROLLER://{HOST}:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://{HOST}:{port}",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "inter.broker.listener.name": "PLAINTEXT",
        "log.dirs": str(data_dir),
        # Topics are created by rollstream with their partitions and cleanup policy
        # (schemas.topics); auto-creation would silently make e.g. a non-compacted `weights`.
        "auto.create.topics.enable": "false",
        "num.partitions": "1",
        "default.replication.factor": "1",
        "min.insync.replicas": "1",
        # internal topics on one node
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "8",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": "8",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "share.coordinator.state.topic.num.partitions": "8",
        "group.initial.rebalance.delay.ms": "0",
        # a small machine: fewer threads, a small log-cleaner buffer (default 128 MiB of heap)
        "num.network.threads": "2",
        "num.io.threads": "4",
        "background.threads": "4",
        "num.recovery.threads.per.data.dir": "1",
        "num.replica.fetchers": "1",
        "log.cleaner.threads": "1",
        "log.cleaner.dedupe.buffer.size": str(16 * 1024 * 1024),
    }


def write_server_properties(home: Path, props: dict[str, str]) -> Path:
    """Write ``props`` with ``server.overrides.properties`` merged over them to the home's
    server.properties (readable by its owner only when it holds a password: a SASL_SSL stack's
    JAAS line and keystore password); returns its path."""
    overrides_path = kafka_dir(home) / "server.overrides.properties"
    overrides = read_properties(overrides_path)
    merged = {**props, **overrides}
    lines = [
        "# Generated by rollstream (infra/kafka/home.py) at every start; edits here are lost.",
        f"# Put your own settings in {overrides_path.name} next to this file.",
        *(f"{k}={v.replace(chr(92), chr(92) * 2)}" for k, v in merged.items()),
    ]
    path = props_path(home)
    secret = any("password" in k or k.endswith("jaas.config") for k in merged)
    write_atomic(path, "\n".join(lines) + "\n", 0o600 if secret else None)
    return path
