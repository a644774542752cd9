"""launch.status: the store line read from the recorder's ``recorder_store.json``."""

from __future__ import annotations

from pathlib import Path

from launch.status import store_line
from store.outage import OUTAGE_FILE, StoreOutage, write_outage


def test_the_store_line_names_an_ongoing_outage_and_then_the_catch_up(tmp_path: Path) -> None:
    assert store_line(tmp_path, 0.0) == ""  # the recorder published nothing: no line
    write_outage(str(tmp_path / OUTAGE_FILE), StoreOutage(down_since=1000.0, attempts=3, behind=17,
                                                           last_error="Connection refused"))
    assert store_line(tmp_path, 1042.0).startswith("store: unreachable for 42 s (recorder retrying, 3 attempts; 17 ")
    write_outage(str(tmp_path / OUTAGE_FILE), StoreOutage(outages=1, last_outage_s=60.4))
    assert store_line(tmp_path, 2000.0) == "store: up (caught up after 1 outage(s), the last 60 s)"


def test_an_unreadable_store_file_gives_no_line(tmp_path: Path) -> None:
    (tmp_path / OUTAGE_FILE).write_text("{not json")
    assert store_line(tmp_path, 0.0) == ""
