"""store.outage, unit: which insert errors are the store down, the backoff, the batch token, the
status line."""

from __future__ import annotations

from typing import Any

from clickhouse_connect.driver.exceptions import DatabaseError, OperationalError, ProgrammingError

import store as st
from store.outage import StoreOutage, backoff_s, batch_token, describe_outage, is_transient
from tests.services.test_recorder import CHDB_DISK_ERROR


def _disk_error() -> Exception:
    return DatabaseError(CHDB_DISK_ERROR, code=1001, name="STD_EXCEPTION")


def test_only_connection_timeout_and_io_errors_count_as_the_store_down() -> None:
    down = [ConnectionRefusedError(111, "Connection refused"), TimeoutError("timed out"), _disk_error(),
            OperationalError("Error HTTPConnectionPool(host='127.0.0.1', port=1): Max retries exceeded executing "
                             "HTTP request attempt 1 (http://127.0.0.1:1)"),
            DatabaseError("Code: 243. DB::Exception: Cannot reserve 1.00 MiB, not enough space. (NOT_ENOUGH_SPACE)",
                          code=243),
            DatabaseError("Received ClickHouse exception, code: 210, server response: Code: 210. DB::NetException: "
                          "Connection reset by peer. (NETWORK_ERROR)")]  # the code only in the text
    bugs = [ProgrammingError("Unrecognized column 'zz' in table events"),
            ValueError("invalid literal for int() with base 10: 'x'"), TypeError("'NoneType' object is not iterable"),
            DatabaseError("Code: 60. DB::Exception: Table default.nope does not exist. (UNKNOWN_TABLE)", code=60),
            OperationalError("HTTP driver received HTTP status 404 ... (UNKNOWN_TABLE)", code=60),  # retried by the client
            DatabaseError("Code: 1001. DB::Exception: std::bad_cast (STD_EXCEPTION)", code=1001),
            st.StoreError("bad store DSN 'x'")]
    assert [is_transient(e) for e in down] == [True] * len(down)
    assert [is_transient(e) for e in bugs] == [False] * len(bugs)


def test_backoff_doubles_up_to_its_cap() -> None:
    assert [backoff_s(n, 1.0, 5.0) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_the_batch_token_names_the_batch_by_its_offsets() -> None:
    def row(offset: int, index: int = 0, payload: str = "{}") -> list[Any]:
        return ["rs.t.tasks", 0, offset, "t", "tasks", "RolloutTask", None, "e", 0.0, 0, payload, index]

    batch: dict[str, list[list[Any]]] = {"events": [row(1), row(2)], "sample_tasks": [["t", "s1"]]}
    assert batch_token(batch) == batch_token({"events": [row(1), row(2)], "sample_tasks": [["t", "s1"]]})
    assert batch_token(batch) == batch_token({"events": [row(1, payload="x"), row(2)]})  # offsets, not contents
    assert len({batch_token(batch), batch_token({"events": [row(1), row(3)]}),
                batch_token({"events": [row(1), row(2, 1)]}), batch_token({"recorder_lag": [[1.0]]})}) == 4


def test_status_line_of_an_ongoing_outage() -> None:
    line = describe_outage(StoreOutage(down_since=100.0, attempts=7, behind=42, last_error="Connection refused"), 142.4)
    assert line == "store: unreachable for 42 s (recorder retrying, 7 attempts; 42 events behind): Connection refused"
