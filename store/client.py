"""The record store: ClickHouse reached only through clickhouse-connect.

``chdb:///path`` opens the embedded ClickHouse engine (chDB) on disk, in this process;
``http(s)://[user[:pass]@]host:port[/db]`` talks to a ClickHouse server. The SQL is the same.
A server's password comes from the DSN, else from ``$ROLLSTREAM_STORE_PASSWORD``, else from the
file ``$ROLLSTREAM_STORE_PASSWORD_FILE`` names (:func:`store_password`); a DSN's password is shown
as ``***`` in every message (:func:`redact`) and in the run's config and record.

chDB constraints that shape the rest of the system: one process may hold a store directory at a
time (others get :class:`StoreError` "in use"), and one process may open only one chDB directory.
So each run has its own store (``runs/<run_id>/store``) and one process (the recorder) writes it.

While a process holds an embedded store, others read it through that process: the recorder
serves read-only queries (:mod:`store.server`) and
:func:`store.server.connect_reader` goes through it when the store is held elsewhere
(:func:`locked_elsewhere`), or opens the store directly when nobody holds it (a stale endpoint
file of a crashed recorder is ignored).

DDL lives in ``infra/clickhouse/NNN_name.sql``; :func:`apply_ddl` applies every file in order,
idempotently (``CREATE ... IF NOT EXISTS``, ``CREATE OR REPLACE VIEW``, ``ADD COLUMN IF NOT
EXISTS``; a file marked ``-- apply once`` only until its version is recorded), on every open,
and records the applied versions in ``schema_migrations``: a store
made by an older version gets the newer files applied when it is next opened.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from schemas.config import REDACTED, redact_url
from schemas.errors import one_line

STORE_PASSWORD_ENV = "ROLLSTREAM_STORE_PASSWORD"
"""The ClickHouse server's password when the DSN holds none (or ``***``: a redacted config)."""
STORE_PASSWORD_FILE_ENV = "ROLLSTREAM_STORE_PASSWORD_FILE"
"""A file whose first line is that password (when ``$ROLLSTREAM_STORE_PASSWORD`` is unset)."""

_OPENED_HERE: set[str] = set()  # chDB directories this process holds (its own lock is not "in use")
DDL_DIR = Path(__file__).resolve().parents[1] / "infra" / "clickhouse"
APPLY_ONCE = "-- apply once"
"""A DDL file's line that says: do not re-run it once its version is recorded (:func:`apply_ddl`)."""


class StoreError(RuntimeError):
    """A store problem, as one line for the user."""


def default_dsn(runs_dir: str | Path, run_id: str) -> str:
    """The embedded store of one run: ``chdb:///<runs_dir>/<run_id>/store`` (absolute path)."""
    return f"chdb://{(Path(runs_dir) / run_id / 'store').resolve()}"


def check_dsn(dsn: str) -> str:
    """Return the DSN's scheme (``chdb``, ``http``, ``https``) or raise :class:`StoreError`."""
    scheme = urlparse(dsn).scheme
    if scheme == "chdb":
        if not chdb_path(dsn):
            raise StoreError(f"bad store DSN {redact(dsn)!r}: chdb DSNs need a path, e.g. chdb:///tmp/store")
        return scheme
    if scheme in ("http", "https"):
        if not urlparse(dsn).hostname:
            raise StoreError(f"bad store DSN {redact(dsn)!r}: expected http(s)://host:8123")
        return scheme
    raise StoreError(f"bad store DSN {redact(dsn)!r}: use chdb:///path (embedded) or http(s)://host:8123 (server)")


def store_password(dsn: str) -> str | None:
    """The password to use for a server DSN: None when the DSN holds one (it is used as is), else
    ``$ROLLSTREAM_STORE_PASSWORD``, else the first line of the file ``$ROLLSTREAM_STORE_PASSWORD_FILE``
    names, else None (no password). A DSN whose password is ``***`` (copied from a redacted
    config) needs one of them: :class:`StoreError` otherwise."""
    given = urlparse(dsn).password
    if given and unquote(given) != REDACTED:
        return None
    env = os.environ.get(STORE_PASSWORD_ENV, "")
    if env:
        return env
    file = os.environ.get(STORE_PASSWORD_FILE_ENV, "")
    if file:
        try:
            lines = Path(file).expanduser().read_text().splitlines()
        except OSError as e:
            raise StoreError(f"cannot read ${STORE_PASSWORD_FILE_ENV} {file!r}: {e.strerror or e}") from None
        if lines and lines[0]:
            return lines[0]
        raise StoreError(f"${STORE_PASSWORD_FILE_ENV} {file!r} is empty (the password is its first line)")
    if given:
        raise StoreError(
            f"the password of store DSN {redact(dsn)} is redacted (copied from a run's config.yaml or record); "
            f"set ${STORE_PASSWORD_ENV} or ${STORE_PASSWORD_FILE_ENV}, or pass --store with the full DSN"
        )
    return None


def chdb_path(dsn: str) -> str:
    """Filesystem path of a ``chdb://`` DSN."""
    u = urlparse(dsn)
    return (u.netloc + u.path) if u.netloc else u.path


def connect(dsn: str, *, connect_timeout_s: float = 10.0) -> Any:
    """A clickhouse-connect client for ``dsn``, or :class:`StoreError` with one clear line."""
    import clickhouse_connect  # heavy import, kept out of module import time

    scheme = check_dsn(dsn)
    if scheme == "chdb":
        path = Path(chdb_path(dsn))
        path.mkdir(parents=True, exist_ok=True)
        if locked_elsewhere(path):
            raise StoreError(
                f"store {path} is in use by another process (a running recorder?); "
                "chDB lets one process open a store at a time"
            )
        try:
            client = clickhouse_connect.get_client(dsn=f"chdb://{path}")
            _OPENED_HERE.add(str(path))
            return client
        except Exception as e:  # chdb raises ProgrammingError / RuntimeError with long texts
            text = str(e)
            if "Cannot lock file" in text or "already running" in text:
                raise StoreError(
                    f"store {path} is in use by another process (a running recorder?); "
                    "chDB lets one process open a store at a time"
                ) from None
            if "already initialized with path" in text:
                raise StoreError(
                    f"this process already opened another embedded store; cannot open {path} too"
                ) from None
            raise StoreError(f"cannot open embedded store {path}: {one_line(text, 300)}") from None
    password = store_password(dsn)
    extra: dict[str, Any] = {} if password is None else {"password": password}
    try:
        return clickhouse_connect.get_client(
            dsn=dsn, connect_timeout=connect_timeout_s, send_receive_timeout=max(30.0, connect_timeout_s), **extra
        )
    except Exception as e:
        secrets = [p for p in (password, urlparse(dsn).password) if p]
        raise StoreError(f"cannot reach ClickHouse at {redact(dsn)}: {_scrub(one_line(str(e), 300), secrets)}") from None


def locked_elsewhere(path: str | Path) -> bool:
    """True if another process holds the embedded store at ``path`` (ClickHouse's lock on
    ``<path>/status``); a store this process opened is not "elsewhere"."""
    return str(path) not in _OPENED_HERE and _locked_by_other_process(Path(path))


def _locked_by_other_process(path: Path) -> bool:
    """True if some process other than this one holds ClickHouse's lock on ``<path>/status``."""
    import fcntl

    status = path / "status"
    if not status.exists():
        return False
    with open(status, "rb") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
    return False


def ddl_files(ddl_dir: Path = DDL_DIR) -> list[tuple[int, Path]]:
    """``(version, path)`` of every ``NNN_name.sql`` in order."""
    out = []
    for p in sorted(ddl_dir.glob("*.sql")):
        m = re.match(r"^(\d+)_", p.name)
        if m:
            out.append((int(m.group(1)), p))
    return out


def split_statements(sql: str) -> list[str]:
    """Split a DDL file on ``;`` at line ends, dropping ``--`` comment lines."""
    lines = [ln for ln in sql.splitlines() if not ln.strip().startswith("--")]
    return [s.strip() for s in re.split(r";\s*(?:\n|$)", "\n".join(lines)) if s.strip()]


def apply_ddl(client: Any, ddl_dir: Path = DDL_DIR) -> list[int]:
    """Apply every DDL file (idempotent). Returns the versions newly recorded as applied. A file
    with a line ``-- apply once`` is skipped once its version is recorded (ALTERs that would
    rewrite table metadata at each open)."""
    client.command(
        "CREATE TABLE IF NOT EXISTS schema_migrations "
        "(version UInt32, name String, applied_at DateTime64(6) DEFAULT now64(6)) "
        "ENGINE = ReplacingMergeTree ORDER BY version"
    )
    done = {int(r[0]) for r in client.query("SELECT version FROM schema_migrations FINAL").result_rows}
    new = []
    for version, path in ddl_files(ddl_dir):
        text = path.read_text()
        if version in done and APPLY_ONCE in text.splitlines():
            continue
        for stmt in split_statements(text):
            client.command(stmt)  # IF NOT EXISTS / OR REPLACE / ADD COLUMN IF NOT EXISTS: re-running is harmless
        if version not in done:
            client.insert("schema_migrations", [[version, path.name]], column_names=["version", "name"])
            new.append(version)
    return new


def ping(client: Any) -> bool:
    """True when the store answers ``SELECT 1``."""
    try:
        return bool(client.query("SELECT 1").result_rows[0][0] == 1)
    except Exception:
        return False


def redact(dsn: str) -> str:
    """``dsn`` with its password shown as ``***`` (for messages and logs)."""
    return redact_url(dsn)


_redact = redact  # the earlier private name


def _scrub(text: str, secrets: list[str]) -> str:
    """``text`` (a client's error) with URL passwords and each of ``secrets`` shown as ``***``."""
    text = redact_url(text)
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    return text
