"""Read-only queries over a store that another process holds open (the running recorder).

chDB lets one process open a store directory at a time, and during a run that process is the
recorder, so the recorder serves read-only queries to the others:

* :class:`StoreServer` listens on ``127.0.0.1`` (a free port), answers each query on a read-only
  client session of its own under the lock of the recorder's inserts, and writes the endpoint file
  ``<store>.endpoint`` (host, port, token, pid) that readers find it by;
* :func:`check_read_only` admits one SELECT, WITH, SHOW, DESCRIBE, DESC, EXPLAIN or EXISTS
  statement without ``INTO OUTFILE``;
* :class:`RemoteClient` is the readers' side: ``query(sql, parameters=, settings=)`` like a
  clickhouse-connect client, failures as :class:`ServedStoreError` with one line;
* :func:`connect_reader` (``store.connect_reader``) asks the endpoint only while another process
  holds the store and otherwise opens it directly, so a reader never needs to know which route it
  took.

Each message is a 4-byte big-endian length followed by a msgpack map. docs/architecture.md
("Storage: ClickHouse, embedded by default") gives the protocol, the endpoint file and how
read-only is enforced.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import re
import secrets
import socket
import socketserver
import struct
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from schemas.errors import one_line
from store.client import StoreError, apply_ddl, chdb_path, check_dsn, connect, locked_elsewhere

log = logging.getLogger("rollstream.store_server")

HEADER = struct.Struct(">I")
MAX_REQUEST_BYTES = 1 << 20
"""Largest request the server reads (a query and its parameters), bytes."""
MAX_RESPONSE_BYTES = 256 << 20
"""Largest result the server sends; a bigger one is an error that asks for a LIMIT."""
READ_ONLY_KEYWORDS = ("SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXPLAIN", "EXISTS")
# string literals, quoted identifiers and comments: blanked out before the statement is checked
_NOT_CODE = re.compile(r"'(?:[^'\\]|\\.|'')*'|\"(?:[^\"\\]|\\.)*\"|`(?:[^`\\]|\\.)*`|--[^\n]*|#[^\n]*|/\*.*?\*/",
                       re.S)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()
_PLAIN = (int, float, str, bool, type(None), bytes)


class ServedStoreError(RuntimeError):
    """A served query failed or the server could not be reached, as one line."""


def check_read_only(query: str) -> str | None:
    """Why ``query`` is not one read-only statement, or ``None`` when it is.

    Read-only = a single statement (a trailing ``;`` is fine) whose first keyword, after
    comments and opening parentheses, is one of :data:`READ_ONLY_KEYWORDS`, without
    ``INTO OUTFILE`` (which would write a file as the process that runs it). Literals, quoted
    identifiers and comments are ignored, so ``WHERE reason LIKE '%;%'`` is fine.
    """
    code = _NOT_CODE.sub(" ", query).strip()
    first = re.match(r"[\s(]*([A-Za-z]+)", code)
    if first is None or first.group(1).upper() not in READ_ONLY_KEYWORDS:
        return "only read-only queries (" + ", ".join(READ_ONLY_KEYWORDS) + ") are allowed"
    if ";" in code.rstrip().rstrip(";"):
        return "one statement per query (no ';' between statements)"
    if re.search(r"\bINTO\s+OUTFILE\b", code, re.I):
        return "INTO OUTFILE is not allowed in read-only queries"
    return None


def endpoint_path(store_path: str | Path) -> Path:
    """Where the server of the store at ``store_path`` writes its endpoint (``<store>.endpoint``)."""
    p = Path(store_path)
    return p.with_name(p.name + ".endpoint")


class Endpoint(msgspec.Struct, frozen=True, kw_only=True):
    """The content of an endpoint file."""

    host: str
    port: int
    token: str
    pid: int


def read_endpoint(path: Path) -> Endpoint | None:
    """The endpoint in ``path``, or ``None`` when it is missing or unreadable (being written)."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=Endpoint)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def _plain(v: Any) -> Any:
    """``v`` with every value msgpack cannot carry as itself replaced by its ``str()``."""
    if isinstance(v, _PLAIN):
        return v
    if isinstance(v, dict):
        return {(k if isinstance(k, _PLAIN) else str(k)): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return str(v)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv_message(sock: socket.socket, max_bytes: int) -> Any:
    """One length-prefixed msgpack message; ``None`` when the peer closed the connection."""
    head = _recv_exact(sock, HEADER.size)
    if head is None:
        return None
    (n,) = HEADER.unpack(head)
    if n > max_bytes:
        raise ServedStoreError(f"message of {n} bytes exceeds the limit of {max_bytes}")
    body = _recv_exact(sock, n)
    if body is None:
        raise ServedStoreError("connection closed in the middle of a message")
    return _decoder.decode(body)


def send_message(sock: socket.socket, obj: Any) -> None:
    body = _encoder.encode(obj)
    sock.sendall(HEADER.pack(len(body)) + body)


# --------------------------------------------------------------------------- server


class _Handler(socketserver.BaseRequestHandler):
    server: _TCPServer

    def handle(self) -> None:
        owner = self.server.owner
        sock: socket.socket = self.request
        sock.settimeout(owner.idle_timeout_s)
        with owner._conns_lock:
            owner._conns.add(sock)
        try:
            self._serve(owner, sock)
        finally:
            with owner._conns_lock:
                owner._conns.discard(sock)

    def _serve(self, owner: StoreServer, sock: socket.socket) -> None:
        while True:
            try:
                req = recv_message(sock, MAX_REQUEST_BYTES)
            except (OSError, ServedStoreError, msgspec.DecodeError):
                return
            if req is None:
                return
            try:
                body = _encoder.encode(owner.answer(req))
                if len(body) > MAX_RESPONSE_BYTES:
                    body = _encoder.encode({"ok": False, "error": f"result of {len(body)} bytes exceeds the "
                                            f"served limit of {MAX_RESPONSE_BYTES}; add a LIMIT"})
                sock.sendall(HEADER.pack(len(body)) + body)
            except OSError:
                return


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    owner: StoreServer


class StoreServer:
    """Serve read-only queries on the embedded store ``dsn`` (held open by this process) to others.

    :meth:`start` opens a second client on the store for the server alone and makes its session
    ``readonly=2``, binds a free port on ``host``, starts the serving thread and writes the
    endpoint file (replacing a stale one left by a crashed process). ``lock`` is shared with the
    other users of the store in this process (the recorder's inserts): one query or insert at a
    time. :meth:`close` stops serving and removes the endpoint file if it is still this
    server's; it is idempotent and safe when :meth:`start` never ran.
    """

    def __init__(self, dsn: str, lock: threading.Lock, *, host: str = "127.0.0.1",
                 max_execution_s: float = 60.0, idle_timeout_s: float = 300.0) -> None:
        self.dsn = dsn
        self.lock = lock
        self.endpoint = endpoint_path(chdb_path(dsn))
        self.host = host
        self.max_execution_s = max_execution_s
        self.idle_timeout_s = idle_timeout_s
        self.token = secrets.token_hex(16)
        self.served = 0
        self.refused = 0
        self.client: Any = None
        self._server: _TCPServer | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1]) if self._server else 0

    def start(self) -> StoreServer:
        if self.client is None:
            self.client = connect(self.dsn)
            self.client.set_client_setting("readonly", "2")  # this session: no writes, no DDL
        server = _TCPServer((self.host, 0), _Handler, bind_and_activate=True)
        server.owner = self
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="store-server", daemon=True)
        self._thread.start()
        info = Endpoint(host=self.host, port=self.port, token=self.token, pid=os.getpid())
        tmp = self.endpoint.with_name(f".{self.endpoint.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(msgspec.json.encode(info))
        os.replace(tmp, self.endpoint)
        log.info("serving read-only queries on %s:%d (endpoint %s)", self.host, self.port, self.endpoint)
        return self

    def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._conns_lock:  # readers still connected get EOF now, not answers from a closing store
            for sock in self._conns:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        client, self.client = self.client, None
        if client is not None:
            with self.lock, contextlib.suppress(Exception):
                client.close()
        current = read_endpoint(self.endpoint)
        if current is not None and current.token == self.token:
            with contextlib.suppress(FileNotFoundError):
                self.endpoint.unlink()

    def __enter__(self) -> StoreServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def answer(self, req: Any) -> dict[str, Any]:
        """The response to one decoded request (never raises)."""
        if not isinstance(req, dict) or not hmac.compare_digest(str(req.get("token", "")).encode(), self.token.encode()):
            self.refused += 1
            return {"ok": False, "error": "bad or missing token (read it from the endpoint file)"}
        query = req.get("query")
        params = req.get("parameters") or None
        if not isinstance(query, str) or (params is not None and not isinstance(params, dict)):
            self.refused += 1
            return {"ok": False, "error": "bad request: expected a query string and a parameters map"}
        why = check_read_only(query)
        if why is not None:
            self.refused += 1
            return {"ok": False, "error": f"the running recorder serves read-only queries: {why}"}
        query = query.rstrip().rstrip(";")
        asked_raw = req.get("settings")
        asked: dict[str, Any] = asked_raw if isinstance(asked_raw, dict) else {}
        # the session is readonly=2 already (a query may not even restate it); the time cap wins
        settings = {**{k: v for k, v in asked.items() if k != "readonly"},
                    "max_execution_time": self.max_execution_s}
        try:
            with self.lock:
                result = self.client.query(query, parameters=params, settings=settings)
                cols = [str(c) for c in result.column_names]
                types = [getattr(t, "name", str(t)) for t in result.column_types]
                rows = [_plain(list(r)) for r in result.result_rows]
        except Exception as e:  # ClickHouse errors: one line back to the reader
            return {"ok": False, "error": one_line(e, 400, typed=False)}
        self.served += 1
        return {"ok": True, "columns": cols, "types": types, "rows": rows}


# --------------------------------------------------------------------------- client


class RemoteResult:
    """The part of a clickhouse-connect ``QueryResult`` that readers use."""

    def __init__(self, columns: list[str], types: list[str], rows: list[list[Any]]) -> None:
        self.column_names: tuple[str, ...] = tuple(columns)
        self.column_type_names: tuple[str, ...] = tuple(types)
        self.result_rows: list[tuple[Any, ...]] = [tuple(r) for r in rows]

    @property
    def row_count(self) -> int:
        return len(self.result_rows)


class RemoteClient:
    """A read-only stand-in for a clickhouse-connect client that queries through a :class:`StoreServer`.

    It has ``query(sql, parameters=, settings=)`` (what ``rollstream sql`` and the report use);
    failures raise :class:`ServedStoreError` with one line. One connection, reopened on demand.
    """

    served = True

    def __init__(self, endpoint: Endpoint, *, timeout_s: float = 300.0) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None

    def _connect(self) -> socket.socket:
        if self._sock is None:
            try:
                self._sock = socket.create_connection((self.endpoint.host, self.endpoint.port), timeout=5.0)
            except OSError as e:
                raise ServedStoreError(f"cannot reach the store server at {self.endpoint.host}:"
                                       f"{self.endpoint.port}: {one_line(e, 400, typed=False)}") from None
            self._sock.settimeout(self.timeout_s)
        return self._sock

    def query(self, query: str, parameters: dict[str, Any] | None = None,
              settings: dict[str, Any] | None = None) -> RemoteResult:
        sock = self._connect()
        try:
            send_message(sock, {"token": self.endpoint.token, "query": query,
                                "parameters": dict(parameters) if parameters else None,
                                "settings": dict(settings) if settings else None})
            resp = recv_message(sock, MAX_RESPONSE_BYTES + 1024)
        except (OSError, msgspec.DecodeError) as e:
            self.close()
            raise ServedStoreError(f"store server at {self.endpoint.host}:{self.endpoint.port} "
                                   f"failed: {one_line(e, 400, typed=False)}") from None
        if not isinstance(resp, dict):
            self.close()
            raise ServedStoreError("store server closed the connection without an answer")
        if not resp.get("ok"):
            raise ServedStoreError(str(resp.get("error") or "unknown error"))
        return RemoteResult(resp["columns"], resp.get("types", []), resp["rows"])

    def ping(self) -> bool:
        """True when the server answers ``SELECT 1``."""
        try:
            return bool(self.query("SELECT 1").result_rows[0][0] == 1)
        except ServedStoreError:
            return False

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def __repr__(self) -> str:
        return f"RemoteClient({self.endpoint.host}:{self.endpoint.port})"


# --------------------------------------------------------------------------- readers


def connect_reader(dsn: str, *, wait_s: float = 3.0, timeout_s: float = 300.0) -> Any:
    """A client for read-only queries on ``dsn``, wherever the store is open.

    * A server DSN, or an embedded store nobody else holds: :func:`connect` (the caller should
      still only read). An embedded store also gets :func:`apply_ddl`, so the record of a run
      made by an older version has today's tables and views.
    * An embedded store held by another process (a running recorder): a :class:`RemoteClient`
      on the endpoint that process serves. Waits up to ``wait_s`` for the endpoint (a recorder
      writes it a moment after opening the store), then raises :class:`StoreError` "in use by
      another process". ``timeout_s`` bounds each served query, the wait for the recorder's
      lock included.
    """
    if check_dsn(dsn) != "chdb":
        return connect(dsn)
    path = Path(chdb_path(dsn))
    deadline = time.monotonic() + wait_s
    while True:
        if not locked_elsewhere(path):
            try:
                client = connect(dsn)
            except StoreError as e:
                if "in use by another process" not in str(e):
                    raise
                # a recorder opened it just now: ask its server below
            else:
                with contextlib.suppress(Exception):  # bring a store of an older version up to date
                    apply_ddl(client)
                return client
        endpoint = read_endpoint(endpoint_path(path))
        if endpoint is not None:
            client = RemoteClient(endpoint, timeout_s=timeout_s)
            if client.ping():
                return client
            client.close()
        if time.monotonic() >= deadline:
            raise StoreError(
                f"store {path} is in use by another process that serves no queries; "
                "chDB lets one process open a store at a time (read it once that process has exited)"
            )
        time.sleep(0.1)
