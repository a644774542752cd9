"""The local Kafka broker, without Docker: Apache Kafka jars from Maven Central, KRaft, one node.

What this module does (and nothing at import time):

* :func:`ensure_kafka_jars` runs Maven once on ``infra/kafka/pom.xml`` to copy the Apache Kafka
  broker and its runtime dependencies into a per-user cache (``~/.cache/rollstream`` or
  ``$ROLLSTREAM_CACHE``). A marker file written after a complete copy makes later calls return
  at once; editing the pom invalidates it.
* :func:`start_local_kafka` runs one broker+controller JVM on ``127.0.0.1`` whose state lives in
  a "home" directory (``./.rollstream`` or ``$ROLLSTREAM_HOME``)::

      <home>/kafka/state.json        the running broker (pid, ports, ...); absent when stopped
      <home>/kafka/server.properties generated at every start (edits are overwritten)
      <home>/kafka/server.overrides.properties   optional, yours: merged over the generated file
      <home>/kafka/cluster.id        the KRaft cluster id, created on the first start
      <home>/kafka/data/             the Kafka log directory (topics survive restarts)
      <home>/logs/kafka.log          the broker's stdout+stderr (previous start: kafka.log.1)
      <home>/logs/kafka-format.log   output of the one-time storage format

* :func:`stop_local_kafka`, :func:`local_kafka`, :func:`kafka_reachable` and
  :func:`resolve_bootstrap` manage and find it.

Every failure a user can cause or fix is a :class:`StackError` whose message is one line saying
what failed and what to do or which log to read. Every wait is bounded. POSIX only (Linux,
macOS): the broker is detached with ``start_new_session`` and stopped with signals.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = [
    "BOOTSTRAP_ENV",
    "CACHE_ENV",
    "HOME_ENV",
    "KAFKA_VERSION",
    "KafkaProcess",
    "StackError",
    "ensure_kafka_jars",
    "home_dir",
    "jar_cache_dir",
    "kafka_reachable",
    "local_kafka",
    "resolve_bootstrap",
    "start_local_kafka",
    "stop_local_kafka",
]

KAFKA_VERSION = "4.1.1"
"""Apache Kafka version of the local broker; equals ``kafka.version`` in infra/kafka/pom.xml and
the ``apache/kafka`` image tag in compose/docker-compose.yml (tests/test_compose.py checks)."""

BOOTSTRAP_ENV = "ROLLSTREAM_BOOTSTRAP"
"""Environment variable naming the Kafka bootstrap servers (``host:port[,host:port]``)."""
HOME_ENV = "ROLLSTREAM_HOME"
"""Environment variable naming the local stack's state directory."""
CACHE_ENV = "ROLLSTREAM_CACHE"
"""Environment variable naming the per-user download cache (Kafka jars)."""

HOST = "127.0.0.1"
"""The local broker listens on loopback only."""

JVM_OPTS: tuple[str, ...] = (
    "-Xms256m",
    "-Xmx512m",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)
"""JVM flags of the broker: a small heap for laptops and CI (Kafka's own G1 settings)."""

_INFRA_DIR = Path(__file__).resolve().parents[2] / "infra" / "kafka"
_POM = _INFRA_DIR / "pom.xml"
_LOG4J = _INFRA_DIR / "log4j2.yaml"
_MARKER = ".rollstream-complete"
_MVN_TIMEOUT_S = 900.0
_FORMAT_TIMEOUT_S = 120.0
_CACHE_LOCK_WAIT_S = _MVN_TIMEOUT_S + 60.0

# Brokers this process started, so that their exit is reaped (a zombie still "exists" for kill 0).
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


class StackError(RuntimeError):
    """A local-stack problem, as one line for the user (what failed, what to do or which log)."""


@dataclass(frozen=True)
class KafkaProcess:
    """A running local broker, as recorded in ``<home>/kafka/state.json``."""

    bootstrap: str
    """``127.0.0.1:<port>``: what clients connect to."""
    pid: int
    """Process id of the broker JVM (leader of its own session)."""
    port: int
    """Client (PLAINTEXT) port."""
    controller_port: int
    """KRaft controller port (loopback only, not for clients)."""
    data_dir: str
    """Kafka log directory."""
    log_path: str
    """The broker's stdout+stderr."""
    started_at: float
    """Unix time at which the JVM was launched."""


# --------------------------------------------------------------------------- paths


def home_dir(override: str | None = None) -> Path:
    """The local stack's state directory: ``override``, else ``$ROLLSTREAM_HOME``, else
    ``./.rollstream`` (relative to the current directory). Absolute; not created here."""
    raw = override or os.environ.get(HOME_ENV) or ".rollstream"
    return Path(raw).expanduser().absolute()


def jar_cache_dir() -> Path:
    """Where the Kafka jars go: ``$ROLLSTREAM_CACHE`` (else ``~/.cache/rollstream``) then
    ``kafka-<KAFKA_VERSION>/libs``. Not created here."""
    base = os.environ.get(CACHE_ENV) or str(Path.home() / ".cache" / "rollstream")
    return Path(base).expanduser().absolute() / f"kafka-{KAFKA_VERSION}" / "libs"


def _kafka_dir(home: Path) -> Path:
    return home / "kafka"


def _state_path(home: Path) -> Path:
    return _kafka_dir(home) / "state.json"


def _props_path(home: Path) -> Path:
    return _kafka_dir(home) / "server.properties"


def _log_path(home: Path) -> Path:
    return home / "logs" / "kafka.log"


def _norm_home(home: Path | str) -> Path:
    return Path(home).expanduser().absolute()


# --------------------------------------------------------------------------- small helpers


@contextlib.contextmanager
def _file_lock(path: Path, wait_s: float, what: str) -> Iterator[None]:
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


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _tail_lines(path: Path, max_bytes: int = 256 * 1024) -> list[str]:
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


_LOG4J_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d [^\]]*\] ")
_ERROR_LINE = re.compile(r"^\[[^\]]*\] (ERROR|FATAL) ")
_EXC_LINE = re.compile(r"^(Caused by: )?[A-Za-z_$][\w$]*(\.[\w$]+)+(Exception|Error)\b")
_JVM_ERROR = re.compile(r"^(Error: |Exception in thread |Error occurred during initialization)")


def _log_error(path: Path) -> str | None:
    """The last error a log shows, as one line (None if it shows none): the last log4j
    ERROR/FATAL line (timestamp cut) joined with the deepest exception ("Caused by: ...") printed
    under it; else the last JVM-level error or exception line. Cut to 400 characters."""
    lines = _tail_lines(path)
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


def _exit_reason(path: Path) -> str:
    """What a log says about why a process ended: its last error, else its last line."""
    err = _log_error(path)
    if err:
        return err
    last = next((ln.strip() for ln in reversed(_tail_lines(path)) if ln.strip()), "")
    return f"no error logged, last line: {last[:300]}" if last else f"{path} is empty"


def _java() -> str:
    """Path of ``java``: ``$JAVA_HOME/bin/java`` if that exists, else ``java`` on PATH."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").is_file():
        return str(Path(java_home) / "bin" / "java")
    found = shutil.which("java")
    if not found:
        raise StackError(
            "java not found (needed to run the local Kafka broker); install a JDK 17 or newer "
            "(e.g. `apt-get install openjdk-17-jre-headless`) or set JAVA_HOME"
        )
    return found


# --------------------------------------------------------------------------- jars


def _pom_digest() -> str:
    return hashlib.sha256(_POM.read_bytes()).hexdigest()


def _read_marker(libs: Path) -> dict[str, object] | None:
    try:
        data = json.loads((libs / _MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def ensure_kafka_jars(progress: Callable[[str], None] | None = None) -> Path:
    """Return the directory holding the Kafka broker's jars, resolving them first if needed.

    Fast path (no subprocess): the marker file in :func:`jar_cache_dir` exists and records the
    current pom's SHA-256 (or the pom is not available and the marker's Kafka version matches).
    Otherwise runs ``mvn dependency:copy-dependencies`` into a temporary sibling directory (output
    in ``<cache>/kafka-<version>/mvn.log``), writes the marker, and swaps it into place, under a
    file lock so that concurrent callers resolve once. Raises :class:`StackError` if ``mvn`` is
    missing, Maven fails or runs past 15 minutes, or the pom cannot be found.
    """
    libs = jar_cache_dir()
    pom_present = _POM.is_file()

    def ready() -> bool:
        marker = _read_marker(libs)
        if marker is None or marker.get("kafka_version") != KAFKA_VERSION:
            return False
        return not pom_present or marker.get("pom_sha256") == _pom_digest()

    if ready():
        return libs
    if not pom_present:
        raise StackError(
            f"{_POM} not found, so the Kafka jars cannot be resolved; run rollstream from a source "
            "checkout (pip install -e .) or point --bootstrap / ROLLSTREAM_BOOTSTRAP at a broker"
        )
    mvn = shutil.which("mvn")
    if not mvn:
        raise StackError(
            "mvn (Apache Maven) not found; it is needed once to fetch the Kafka jars from Maven Central: "
            "install it (e.g. `apt-get install maven`) or point --bootstrap / ROLLSTREAM_BOOTSTRAP at a broker"
        )
    root = libs.parent
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / ".lock", _CACHE_LOCK_WAIT_S, "fetching the Kafka jars"):
        if ready():  # another process finished while we waited
            return libs
        if progress:
            progress(f"fetching Apache Kafka {KAFKA_VERSION} jars from Maven Central into {root} (once)")
        tmp = root / f"libs.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        log = root / "mvn.log"
        cmd = [
            mvn, "-B", "-ntp", "-Dstyle.color=never", "-f", str(_POM),
            "dependency:copy-dependencies", f"-DoutputDirectory={tmp}", "-DincludeScope=runtime",
        ]  # fmt: skip
        try:
            with log.open("wb") as out:
                rc = subprocess.run(
                    cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    cwd=root, timeout=_MVN_TIMEOUT_S, check=False,
                ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            shutil.rmtree(tmp, ignore_errors=True)
            raise StackError(
                f"Maven ran past {_MVN_TIMEOUT_S:.0f} s fetching the Kafka jars (network?); see {log}"
            ) from None
        jars = sorted(tmp.glob("*.jar")) if tmp.is_dir() else []
        if rc != 0 or not any(j.name.startswith("kafka_2.13-") for j in jars):
            shutil.rmtree(tmp, ignore_errors=True)
            errors = [
                ln.strip().removeprefix("[ERROR]").strip()
                for ln in _tail_lines(log)
                if ln.startswith("[ERROR]") and ln.strip() != "[ERROR]"
            ]
            why = errors[0] if errors else f"exit code {rc}"
            raise StackError(f"Maven could not fetch the Kafka jars: {why[:300]}; full output: {log}")
        marker = {"kafka_version": KAFKA_VERSION, "pom_sha256": _pom_digest(), "jars": len(jars)}
        (tmp / _MARKER).write_text(json.dumps(marker))
        old = root / f"libs.old-{os.getpid()}"
        if libs.exists():
            os.replace(libs, old)
        os.replace(tmp, libs)
        shutil.rmtree(old, ignore_errors=True)
        if progress:
            progress(f"Kafka jars ready in {libs} ({len(jars)} jars)")
    return libs


# --------------------------------------------------------------------------- processes


def _pid_alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie does not count; children of this process are reaped)."""
    if pid <= 0:
        return False
    child = _CHILDREN.get(pid)
    if child is not None:
        if child.poll() is None:
            return True
        _CHILDREN.pop(pid, None)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _cmdline(pid: int) -> list[str] | None:
    """The process's argv, from /proc (Linux) or ``ps`` (macOS); None if unknown."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        return [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]
    except OSError:
        pass
    try:
        out = subprocess.run(
            ["ps", "-o", "command=", "-p", str(pid)], capture_output=True, timeout=5, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = out.stdout.decode("utf-8", "replace").strip()
    return text.split() if out.returncode == 0 and text else None


def _is_our_broker(pid: int, home: Path) -> bool:
    """True if ``pid`` runs and is ``kafka.Kafka`` with this home's server.properties (guards
    against a recycled pid); if the command line cannot be read, a live pid is trusted."""
    if not _pid_alive(pid):
        return False
    argv = _cmdline(pid)
    if argv is None:
        return True
    return "kafka.Kafka" in argv and str(_props_path(home)) in argv


def local_kafka(home: Path) -> KafkaProcess | None:
    """The broker recorded in ``<home>/kafka/state.json`` if its process is alive (and is that
    broker), else None; a stale or unreadable state file is removed. Does not probe the port."""
    home = _norm_home(home)
    path = _state_path(home)
    try:
        data = json.loads(path.read_text())
        proc = KafkaProcess(**data)
        valid = isinstance(proc.pid, int) and isinstance(proc.bootstrap, str)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError):
        valid = False
    if valid and _is_our_broker(proc.pid, home):
        return proc
    with contextlib.suppress(OSError):
        path.unlink()
    return None


def _port_free(port: int) -> bool:
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


def _free_port(exclude: set[int]) -> int:
    """A port the OS says is free on 127.0.0.1, not in ``exclude``."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((HOST, 0))
            port = int(s.getsockname()[1])
        if port not in exclude:
            return port
    raise StackError("could not find a free TCP port on 127.0.0.1")


def _read_properties(path: Path) -> dict[str, str]:
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


def _previous_ports(home: Path) -> tuple[int | None, int | None]:
    """Client and controller ports of the last start in this home (from server.properties)."""
    listeners = _read_properties(_props_path(home)).get("listeners", "")
    ports: dict[str, int] = {}
    for item in listeners.split(","):
        m = re.fullmatch(r"\s*(\w+)://[^:]*:(\d+)\s*", item)
        if m:
            ports[m.group(1)] = int(m.group(2))
    return ports.get("PLAINTEXT"), ports.get("CONTROLLER")


def _server_properties(port: int, controller_port: int, data_dir: Path) -> dict[str, str]:
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


def _write_server_properties(home: Path, props: dict[str, str]) -> Path:
    overrides_path = _kafka_dir(home) / "server.overrides.properties"
    overrides = _read_properties(overrides_path)
    merged = {**props, **overrides}
    lines = [
        "# Generated by rollstream (services/stack.py) at every start; edits here are lost.",
        f"# Put your own settings in {overrides_path.name} next to this file.",
        *(f"{k}={v.replace(chr(92), chr(92) * 2)}" for k, v in merged.items()),
    ]
    path = _props_path(home)
    _write_atomic(path, "\n".join(lines) + "\n")
    return path


def _new_cluster_id() -> str:
    """A KRaft cluster id as Kafka makes them: 16 random bytes, URL-safe base64, no padding."""
    while True:
        cid = base64.urlsafe_b64encode(os.urandom(16)).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


def _log4j_opts() -> list[str]:
    return [f"-Dlog4j2.configurationFile={_LOG4J}"] if _LOG4J.is_file() else []


def _format_storage(home: Path, java: str, libs: Path, data_dir: Path, deadline: float) -> None:
    """Format the KRaft storage once (kept cluster id in ``<home>/kafka/cluster.id``)."""
    if (data_dir / "meta.properties").is_file():
        return
    id_path = _kafka_dir(home) / "cluster.id"
    cluster_id = id_path.read_text().strip() if id_path.is_file() else ""
    if not cluster_id:
        cluster_id = _new_cluster_id()
        _write_atomic(id_path, cluster_id + "\n")
    data_dir.mkdir(parents=True, exist_ok=True)
    log = home / "logs" / "kafka-format.log"
    cmd = [
        java, "-Xmx256m", *_log4j_opts(), "-cp", f"{libs}/*", "kafka.tools.StorageTool",
        "format", "--ignore-formatted", "-t", cluster_id, "-c", str(_props_path(home)),
    ]  # fmt: skip
    limit = max(1.0, min(_FORMAT_TIMEOUT_S, deadline - time.monotonic()))
    try:
        with log.open("wb") as out:
            rc = subprocess.run(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=_kafka_dir(home), timeout=limit, check=False,
            ).returncode  # fmt: skip
    except subprocess.TimeoutExpired:
        raise StackError(f"formatting Kafka storage ran past {limit:.0f} s; see {log}") from None
    if rc != 0:
        raise StackError(f"formatting Kafka storage in {data_dir} failed: {_exit_reason(log)}; see {log}")


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _pid_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def _terminate(pid: int, timeout_s: float) -> None:
    """SIGTERM, wait up to ``timeout_s``, then SIGKILL and wait up to 10 s more."""
    _kill(pid, signal.SIGTERM)
    if not _wait_gone(pid, timeout_s):
        _kill(pid, signal.SIGKILL)
        _wait_gone(pid, 10.0)


def start_local_kafka(
    home: Path,
    port: int | None = None,
    timeout_s: float = 90,
    progress: Callable[[str], None] | None = None,
) -> tuple[KafkaProcess, bool]:
    """Start the local broker of ``home`` unless it already runs; return ``(process, started)``.

    * Already running (state file names a live broker that answers): ``(it, False)``; asking for
      a different ``port`` then is a :class:`StackError` (stop it first).
    * Otherwise: resolves the jars (:func:`ensure_kafka_jars`, not counted in ``timeout_s``),
      takes ``port`` (StackError if it is in use) or the port of the previous start if free or
      any free port, writes server.properties, formats the storage on the first start, launches
      the JVM detached (own session; stdout+stderr to ``<home>/logs/kafka.log``, the previous
      log kept as ``kafka.log.1``), waits until a metadata request lists the broker, writes the
      state file and returns ``(process, True)``.
    * If the JVM exits or does not answer within ``timeout_s`` (or the wait is interrupted), the
      JVM is stopped and a StackError names the log file and its last error line.
    """
    home = _norm_home(home)
    if port is not None and not 0 < port < 65536:
        raise StackError(f"port {port} is not a TCP port (1-65535)")
    libs = ensure_kafka_jars(progress)
    java = _java()
    kdir = _kafka_dir(home)
    kdir.mkdir(parents=True, exist_ok=True)
    (home / "logs").mkdir(parents=True, exist_ok=True)
    with _file_lock(kdir / ".lock", 120.0, f"the local Kafka in {home}"):
        running = local_kafka(home)
        if running is not None:
            if port is not None and port != running.port:
                raise StackError(
                    f"the local Kafka of {home} already runs on {running.bootstrap} (pid {running.pid}); "
                    f"stop it (`rollstream stack down`) before moving it to port {port}"
                )
            if kafka_reachable(running.bootstrap, timeout_s=10):
                return running, False
            raise StackError(
                f"the local Kafka of {home} (pid {running.pid}) runs but does not answer on "
                f"{running.bootstrap}; read {running.log_path} or restart it (`rollstream stack down`, then up)"
            )

        prev_port, prev_cport = _previous_ports(home)
        if port is not None:
            if not _port_free(port):
                raise StackError(
                    f"port {port} on {HOST} is already in use by another program; choose another "
                    "port (--port) or leave it out to use a free one"
                )
        elif prev_port and _port_free(prev_port):
            port = prev_port
        else:
            port = _free_port(set())
        if prev_cport and prev_cport != port and _port_free(prev_cport):
            cport = prev_cport
        else:
            cport = _free_port({port})

        data_dir = kdir / "data"
        _write_server_properties(home, _server_properties(port, cport, data_dir))
        deadline = time.monotonic() + timeout_s
        if not (data_dir / "meta.properties").is_file() and progress:
            progress(f"formatting Kafka storage in {data_dir}")
        _format_storage(home, java, libs, data_dir, deadline)

        log_path = _log_path(home)
        if log_path.exists():
            os.replace(log_path, log_path.with_name("kafka.log.1"))
        bootstrap = f"{HOST}:{port}"
        if progress:
            progress(f"starting Kafka {KAFKA_VERSION} on {bootstrap} (log: {log_path})")
        cmd = [
            java, *JVM_OPTS, *_log4j_opts(), f"-Dkafka.logs.dir={home / 'logs'}",
            "-cp", f"{libs}/*", "kafka.Kafka", str(_props_path(home)),
        ]  # fmt: skip
        started_at = time.time()
        with log_path.open("ab") as out:
            child = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=kdir, start_new_session=True, close_fds=True,
            )  # fmt: skip
        _CHILDREN[child.pid] = child
        try:
            while True:
                rc = child.poll()
                if rc is not None:
                    _CHILDREN.pop(child.pid, None)
                    raise StackError(
                        f"local Kafka exited during startup (exit code {rc}): "
                        f"{_exit_reason(log_path)}; full log: {log_path}"
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    _terminate(child.pid, 10.0)
                    raise StackError(
                        f"local Kafka did not answer on {bootstrap} within {timeout_s:.0f} s and was stopped; "
                        f"{_log_error(log_path) or 'no error in the log'}; full log: {log_path}"
                    )
                if kafka_reachable(bootstrap, timeout_s=min(2.0, remaining)):
                    break
                time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
        except BaseException:
            if _pid_alive(child.pid):
                _terminate(child.pid, 10.0)
            raise
        proc = KafkaProcess(
            bootstrap=bootstrap,
            pid=child.pid,
            port=port,
            controller_port=cport,
            data_dir=str(data_dir),
            log_path=str(log_path),
            started_at=started_at,
        )
        _write_atomic(_state_path(home), json.dumps(asdict(proc), indent=2) + "\n")
        if progress:
            progress(f"Kafka {KAFKA_VERSION} is up on {bootstrap} (pid {child.pid})")
        return proc, True


def stop_local_kafka(home: Path, timeout_s: float = 30) -> bool:
    """Stop the local broker of ``home``: SIGTERM (Kafka shuts down cleanly), SIGKILL if it is
    still running after ``timeout_s``; remove the state file. Also stops a broker of this home
    that no state file records (Linux). Data and logs are kept. Returns True if a broker was
    running, False if there was none (idempotent)."""
    home = _norm_home(home)
    kdir = _kafka_dir(home)
    if not kdir.is_dir():
        return False
    with _file_lock(kdir / ".lock", max(timeout_s, 10.0), f"the local Kafka in {home}"):
        proc = local_kafka(home)
        pids = {proc.pid} if proc is not None else set()
        pids.update(_unrecorded_brokers(home))
        for pid in pids:
            _terminate(pid, timeout_s)
            _CHILDREN.pop(pid, None)
        with contextlib.suppress(OSError):
            _state_path(home).unlink()
        return bool(pids)


def _unrecorded_brokers(home: Path) -> list[int]:
    """Brokers of this home that no state file records (their starter died between launching
    and recording them), found by command line in /proc; [] where there is no /proc."""
    needle = str(_props_path(home))
    found: list[int] = []
    proc_dir = Path("/proc")
    if not proc_dir.is_dir():
        return found
    for entry in proc_dir.iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                argv = (entry / "cmdline").read_bytes().decode("utf-8", "replace").split("\0")
            except OSError:
                continue
            if "kafka.Kafka" in argv and needle in argv and _pid_alive(int(entry.name)):
                found.append(int(entry.name))
    return found


# --------------------------------------------------------------------------- probing


def resolve_bootstrap(explicit: str | None, home: Path | None = None) -> str | None:
    """Kafka bootstrap servers to use: ``explicit`` if given, else ``$ROLLSTREAM_BOOTSTRAP``,
    else the running local broker of ``home`` (default :func:`home_dir`), else None."""
    if explicit:
        return explicit
    env = os.environ.get(BOOTSTRAP_ENV, "").strip()
    if env:
        return env
    proc = local_kafka(home if home is not None else home_dir())
    return proc.bootstrap if proc else None


def _split_hostport(item: str) -> tuple[str, int] | None:
    s = item.strip()
    if "://" in s:
        s = s.split("://", 1)[1]
    host, sep, port_s = s.rpartition(":")
    if not sep or not port_s.isdigit():
        return None
    host = host.strip("[]") or "localhost"
    return host, int(port_s)


def _metadata_request(correlation_id: int) -> bytes:
    """Kafka Metadata v8 request (header v1) for no topics: the broker answers with its list of
    live (registered, unfenced) brokers. Supported by Kafka 2.3 and newer."""
    client_id = b"rollstream-probe"
    body = struct.pack(">hhih", 3, 8, correlation_id, len(client_id)) + client_id
    body += struct.pack(">ibbb", 0, 0, 0, 0)  # topics=[] (not null: null = all), no auto-create, no ACL ops
    return struct.pack(">i", len(body)) + body


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        sock.settimeout(remaining)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return bytes(buf)


def _resolve(host: str, port: int, deadline: float) -> tuple[socket.AddressFamily, tuple[str, int]] | None:
    """First TCP address of ``host:port``; the DNS lookup runs in a daemon thread so that a slow
    resolver cannot hold the caller past ``deadline`` (None then, or when it does not resolve)."""
    result: list[tuple[socket.AddressFamily, tuple[str, int]]] = []

    def lookup() -> None:
        with contextlib.suppress(OSError, UnicodeError):
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            if infos:
                family, _, _, _, sockaddr = infos[0]
                result.append((family, (str(sockaddr[0]), int(sockaddr[1]))))

    try:
        ipaddress.ip_address(host)
        lookup()  # a literal address: no DNS
    except ValueError:
        worker = threading.Thread(target=lookup, name="rollstream-dns", daemon=True)
        worker.start()
        worker.join(max(0.0, deadline - time.monotonic()))
    return result[0] if result else None


def _probe(host: str, port: int, deadline: float) -> bool:
    """One Metadata round trip; True if the response lists at least one broker."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return False
    addr = _resolve(host, port, deadline)
    if addr is None:
        return False
    family, sockaddr = addr
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            sock.connect(sockaddr)
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            sock.sendall(_metadata_request(0x5253))
            size = struct.unpack(">i", _recv_exact(sock, 4, deadline))[0]
            if not 12 <= size <= 64 * 1024 * 1024:
                return False
            resp = _recv_exact(sock, size, deadline)
    except (OSError, TimeoutError, ConnectionError):
        return False
    correlation_id, _throttle, n_brokers = struct.unpack_from(">iii", resp, 0)
    return correlation_id == 0x5253 and n_brokers >= 1


def kafka_reachable(bootstrap: str, timeout_s: float = 5.0) -> bool:
    """True if a Kafka broker at ``bootstrap`` (``host:port[,host:port]``) answers a Metadata
    request listing at least one live broker, i.e. it is ready for clients. Plain TCP (PLAINTEXT
    listeners only; a TLS/SASL listener reads as unreachable). Tries each address in turn and
    returns within ``timeout_s`` (plus DNS resolution time) in every case."""
    deadline = time.monotonic() + max(0.0, timeout_s)
    for item in bootstrap.split(","):
        hp = _split_hostport(item)
        if hp is None:
            continue
        if _probe(hp[0], hp[1], deadline):
            return True
        if time.monotonic() >= deadline:
            break
    return False
