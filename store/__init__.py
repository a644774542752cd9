"""The store: ClickHouse reached only through clickhouse-connect.

* :mod:`store.client` — DSNs, connecting (embedded chDB or a server), versioned DDL.
* :mod:`store.server` — the read-only query server a recorder runs over its embedded
  store, the client other processes use to reach it, and :func:`connect_reader`, which takes
  whichever route works.
* :mod:`store.rows` — how events become rows of the typed tables.

The client functions are re-exported here (``import store as st; st.connect(dsn)``).
"""

from store.client import (
    DDL_DIR,
    StoreError,
    apply_ddl,
    chdb_path,
    check_dsn,
    connect,
    ddl_files,
    default_dsn,
    ping,
    split_statements,
)
from store.server import connect_reader

__all__ = [
    "DDL_DIR",
    "StoreError",
    "apply_ddl",
    "chdb_path",
    "check_dsn",
    "connect",
    "connect_reader",
    "ddl_files",
    "default_dsn",
    "ping",
    "split_statements",
]
