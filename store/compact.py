"""Compacting an embedded (chDB) store: delete from disk the parts that merges made obsolete.

ClickHouse writes each insert as a new part of a table and merges parts in the background; a part
merged into a bigger one becomes *outdated* and stays on disk until a cleanup thread deletes it.
In the embedded engine it deletes few or none of them before the process ends, so a run's record
kept most parts it was ever made of: 3 to 9 times its active data after the main example
(docs/analytics.md, "Disk", gives the bytes).

:func:`drop_outdated_parts` deletes them: merges are paused (so no part becomes outdated
meanwhile), the outdated parts are read from ``system.parts`` and their directories removed, and
merges resume. Outdated parts are never read by a query (their rows are in the part that covers
them), and a store opened later finds only the active ones. Nothing is merged or deduplicated here
(``OPTIMIZE ... FINAL`` would collapse the duplicate rows the reliability checks look for).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

OUTDATED_PARTS = (
    "SELECT path, bytes_on_disk FROM system.parts WHERE database = currentDatabase() AND _state = 'Outdated'"
)


def drop_outdated_parts(client: Any, store_path: str | Path) -> tuple[int, int]:
    """Delete the outdated parts of every table of the chDB store at ``store_path`` that ``client``
    holds open; returns ``(parts, bytes)`` deleted. A part directory outside ``store_path`` is
    never touched."""
    root = Path(store_path).resolve()
    client.command("SYSTEM STOP MERGES")
    try:
        parts = n_bytes = 0
        for path, size in client.query(OUTDATED_PARTS).result_rows:
            part = Path(path).resolve()
            if root not in part.parents or not part.is_dir():
                continue
            shutil.rmtree(part, ignore_errors=True)
            parts, n_bytes = parts + 1, n_bytes + int(size)
        return parts, n_bytes
    finally:
        client.command("SYSTEM START MERGES")
