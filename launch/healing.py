"""How the local supervisor heals a run: which exits are expected, when to restart, when to give up.

Pure logic, no processes: :class:`ServiceSlot` is what the supervisor knows about one service
(its state, pid, restarts, last exit code and last error line), :class:`Healer` decides what an
exit means.

* A service that runs until told to stop (``lifecycle="until_stopped"`` in
  :data:`schemas.services.SERVICES`: rollout, env, reward, judge): any exit of its while the run
  is going is unexpected (a crash, a signal, or exit 0 after someone sent it SIGTERM).
* A service that finishes by itself (``lifecycle="finishes"``: feeder, trainer, recorder) exits 0
  by design once the run has finished (``RunFinished``). An exit 0 of its is held for
  ``finish_grace_s``: when the supervisor sees ``RunFinished`` meanwhile it was the end of the
  run, else it was unexpected. Any other exit code is unexpected at once.
* An unexpected exit is restarted after a backoff (``restart_backoff_s``, doubling with each
  restart of that service, capped at ``restart_backoff_max_s``) while the service has had fewer
  than ``max_restarts`` restarts; past that the run fails with one line naming the service, its
  exit code and the last error line of its log.
"""

from __future__ import annotations

import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from schemas.services import SERVICES

State = Literal["starting", "running", "restarting", "exited", "stopped", "failed"]
"""``running``: the process is up; ``restarting``: it ended unexpectedly and waits for its
backoff; ``exited``: it ended by itself (the run finished, or an exit 0 still being judged);
``stopped``: the supervisor stopped it; ``failed``: it ended unexpectedly past the bound."""
Verdict = Literal["expected", "hold", "restart", "fail"]


def service_of(label: str) -> str:
    """``rollout0`` -> ``rollout`` (labels of several workers carry their index)."""
    return label.rstrip("0123456789")


def finishes(service: str) -> bool:
    """Whether ``service`` exits 0 by itself once the run has finished (its ``lifecycle``)."""
    spec = SERVICES.get(service)
    return spec is not None and spec.lifecycle == "finishes"


def describe_exit(code: int | None) -> str:
    """``exited with code 1`` / ``killed by SIGKILL (exit code -9)``."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name} (exit code {code})"
    return f"exited with code {code}"


_LOG_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d[,.]\d+ (\d+ )?")
_ERROR_WORDS = ("error", "traceback", "exception", "critical", "fatal")


def _log_lines(path: Path, max_bytes: int, last_process_only: bool = False) -> list[str]:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return []
    lines = text.splitlines()
    if last_process_only:
        marks = [i for i, ln in enumerate(lines) if ln.startswith(RESTART_MARK)]
        lines = lines[marks[-1] + 1:] if marks else lines
    return [_LOG_PREFIX.sub("", ln).strip() for ln in lines if ln.strip() and not ln.startswith(RESTART_MARK)]


def last_error_line(path: Path, max_bytes: int = 256 << 10, last_process_only: bool = False) -> str:
    """The last line of a log that mentions an error ('' if none), without its timestamp and
    pid; only the last ``max_bytes`` of the file are read. ``last_process_only``: only the lines
    after the last :data:`RESTART_MARK`, i.e. those of the service's latest process (so that an
    error of an earlier process is never given as the reason a later one ended)."""
    lines = _log_lines(path, max_bytes, last_process_only)
    errors = [ln for ln in lines if any(w in ln.lower() for w in _ERROR_WORDS)]
    return errors[-1][:300] if errors else ""


def last_log_line(path: Path, max_bytes: int = 256 << 10) -> str:
    """The last line of a log that mentions an error, else its last line ('' if none)."""
    return last_error_line(path, max_bytes) or (_log_lines(path, max_bytes) or [""])[-1][:300]


RESTART_MARK = "--- rollstream run:"
"""Lines the supervisor writes into a service's log between two of its processes."""


def mark_log(path: Path, text: str) -> None:
    """Append a :data:`RESTART_MARK` line: the lines after it are a new process's."""
    with open(path, "a") as fh:
        fh.write(f"{RESTART_MARK} {text} ---\n")


@dataclass
class ServiceSlot:
    """One service of the run as the supervisor sees it (one per process it keeps alive)."""

    label: str
    """A service's name, with its index when it has several processes (``rollout0``, ``rollout1``...)."""
    log_path: Path
    state: State = "starting"
    pid: int = 0
    restarts: int = 0
    """Restarts so far."""
    last_exit_code: int | None = None
    last_error: str = ""
    """The last error line of its log when it last ended."""
    started_at: float = 0.0
    """Unix time its current process started."""
    exited_at: float = 0.0
    """Monotonic time its last process ended."""
    restart_at: float = 0.0
    """Monotonic time of the scheduled restart (state ``restarting``)."""
    backoff_s: float = 0.0
    """The wait before the scheduled (or last) restart."""
    reason: str = ""
    """One line: how its last process ended."""

    @property
    def service(self) -> str:
        return service_of(self.label)

    def as_dict(self) -> dict[str, Any]:
        """What ``supervisor.json`` holds about the service."""
        return {
            "state": self.state, "pid": self.pid, "restarts": self.restarts, "last_exit_code": self.last_exit_code,
            "last_error": self.last_error, "reason": self.reason, "log": str(self.log_path),
            "started_at": self.started_at or None,
        }


@dataclass
class Healer:
    """Decides what a service's exit means (see the module doc)."""

    max_restarts: int = 3
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    finish_grace_s: float = 10.0
    """How long an exit 0 of a finishing service waits for ``RunFinished`` before it counts as
    unexpected, seconds."""
    clock: Any = field(default=time.monotonic, repr=False)

    def backoff(self, restarts_done: int) -> float:
        """The wait before restart number ``restarts_done + 1``: 1, 2, 4 ... times
        ``backoff_s``, at most ``backoff_max_s``."""
        return min(self.backoff_max_s, self.backoff_s * 2.0 ** min(restarts_done, 30))

    def verdict(self, slot: ServiceSlot, code: int, run_finished: bool) -> Verdict:
        """What the exit (``code``) of ``slot``'s process means now."""
        if run_finished:
            return "expected"
        if code == 0 and finishes(slot.service):
            return "hold"
        return "restart" if slot.restarts < self.max_restarts else "fail"

    def on_exit(self, slot: ServiceSlot, code: int, last_error: str, run_finished: bool) -> Verdict:
        """Record that ``slot``'s process ended with ``code`` and move the slot on: ``exited``
        (expected, or held), ``restarting`` (restart due at ``slot.restart_at``) or ``failed``."""
        now = self.clock()
        slot.last_exit_code, slot.last_error, slot.exited_at = code, last_error, now
        slot.reason = describe_exit(code) + (f": {last_error}" if last_error else "")
        v = self.verdict(slot, code, run_finished)
        self._apply(slot, v, now)
        return v

    def recheck(self, slot: ServiceSlot, run_finished: bool) -> Verdict | None:
        """A held exit 0 (state ``exited``, not finished): ``expected`` once the run finished,
        restart or fail once ``finish_grace_s`` passed without it; ``None``: keep waiting."""
        if slot.state != "exited" or slot.last_exit_code != 0:
            return None
        if run_finished:
            return "expected"
        now = self.clock()
        if now - slot.exited_at < self.finish_grace_s:
            return None
        v: Verdict = "restart" if slot.restarts < self.max_restarts else "fail"
        slot.reason = f"exited with code 0 although the run had not finished ({self.finish_grace_s:g} s later)"
        self._apply(slot, v, now)
        return v

    def _apply(self, slot: ServiceSlot, v: Verdict, now: float) -> None:
        if v == "restart":
            slot.state, slot.backoff_s = "restarting", self.backoff(slot.restarts)
            slot.restart_at = now + slot.backoff_s
        elif v == "fail":
            slot.state = "failed"
        else:
            slot.state = "exited"

    def due(self, slot: ServiceSlot) -> bool:
        """Whether ``slot``'s scheduled restart is due."""
        return slot.state == "restarting" and self.clock() >= slot.restart_at

    def failure_line(self, slot: ServiceSlot) -> str:
        """The run's one error line when ``slot`` failed for good."""
        where = f" (log: {slot.log_path})"
        tried = (f"after {slot.restarts} restart{'s' if slot.restarts != 1 else ''} (run.max_restarts="
                 f"{self.max_restarts})")
        tail = "" if slot.last_error else last_log_line(slot.log_path)
        err = f": {slot.last_error}" if slot.last_error else (f"; its log ends: {tail}" if tail else "")
        code = slot.last_exit_code
        how = "exited with code 0 although the run had not finished" if code == 0 else describe_exit(code)
        return f"service {slot.label} {how} {tried}{err}{where}"
