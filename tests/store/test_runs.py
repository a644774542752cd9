"""Where a run's record is: the latest run with a record (what a bare ``rollstream sql`` reads)."""

from __future__ import annotations

import os
from pathlib import Path

from store.runs import has_record, latest_recorded_run


def make(runs: Path, rid: str, mtime: float, *, store: bool = False, config: str = "{}\n") -> None:
    (runs / rid).mkdir(parents=True)
    (runs / rid / "config.yaml").write_text(config)
    os.utime(runs / rid / "config.yaml", (mtime, mtime))
    if store:
        (runs / rid / "store" / "metadata").mkdir(parents=True)


def test_the_latest_run_with_a_record(tmp_path: Path) -> None:
    assert latest_recorded_run(tmp_path) is None
    make(tmp_path, "old", 1000.0, store=True)
    make(tmp_path, "older", 500.0, store=True)
    make(tmp_path, "new-no-store", 3000.0)
    make(tmp_path, "new-empty-store", 2500.0)
    (tmp_path / "new-empty-store" / "store").mkdir()  # created, never opened: no record
    assert latest_recorded_run(tmp_path) == "old"
    make(tmp_path, "on-a-server", 2000.0, config="store:\n  dsn: http://ch.example:8123\n")
    assert has_record(tmp_path, "on-a-server") and latest_recorded_run(tmp_path) == "on-a-server"
    assert not has_record(tmp_path, "new-no-store") and not has_record(tmp_path, "nope")
