"""``runs/<run_id>/supervisor.json``: what ``rollstream run`` knows about its services, for
``rollstream status`` in another terminal (during the run and after it).

The supervisor rewrites it atomically (a temporary file renamed over it) every few seconds and
on every change. Its fields:

* ``run_id``, ``supervisor_pid``, ``host``, ``bootstrap`` (the Kafka the run uses), ``phase``
  (``starting``, ``running``, ``finishing``, ``finished``, ``failed``, ``interrupted``),
  ``error`` (the run's one error line when it failed), ``started_at`` / ``updated_at`` (unix);
* ``progress``: ``step``, ``steps``, ``policy_version``, ``last_progress_at`` (unix time of the
  last training step or weights version seen, ``null`` before the first), ``draining`` (the
  reason of a ``Drain`` seen, else ``""``);
* ``services``: per service label (``recorder``, ``feeder``, ``reward``, ``rollout`` or
  ``rollout0``..., ``trainer``): ``state`` (``starting``, ``running``, ``restarting``,
  ``exited``, ``stopped``, ``failed``), ``pid``, ``restarts``, ``last_exit_code``,
  ``last_error`` (the last error line of its log when it last ended), ``reason``, ``log``,
  ``started_at``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

STATE_FILE = "supervisor.json"
VERSION = 1


def state_path(run_dir: Path) -> Path:
    return run_dir / STATE_FILE


def write_state(run_dir: Path, state: dict[str, Any]) -> Path:
    """Write ``state`` to ``run_dir/supervisor.json`` atomically (readers see the old or the new
    file, never a part of one)."""
    path = state_path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".supervisor.", suffix=".json.tmp", dir=run_dir)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump({"version": VERSION, **state}, fh, indent=1, default=str)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_state(run_dir: Path) -> dict[str, Any] | None:
    """The state file of a run, ``None`` when there is none (a run started service by service)
    or it cannot be read."""
    try:
        data = json.loads(state_path(run_dir).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def pid_alive(pid: int | None) -> bool:
    """Whether a process with this id runs on this host (a zombie counts as gone)."""
    if not pid or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: trust kill(0)
    return stat.rsplit(")", 1)[-1].split()[:1] != ["Z"]
