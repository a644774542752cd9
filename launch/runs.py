"""The runs of a runs directory, from their files: what each is (:func:`run_row`, :func:`list_runs`),
its logs (:func:`log_files`, :func:`follow`), the models it kept (:func:`kept_models`,
:func:`export_model`), deleting it (:func:`remove_run`, :func:`delete_topics`) and the command that
resumes it (:func:`resume_command`). For ``rollstream runs``, ``logs``, ``export`` and ``resume``;
docs/runs.md tells what a run directory holds.

A run's state, from its files: ``running`` (its supervisor is alive), ``finished`` (it wrote
``summary.json`` after ``train.steps`` steps), ``stopped`` (a summary after fewer: a drain or the
wall limit), ``failed`` (a service failed past its restarts), ``interrupted`` (it ended before it
finished: Ctrl-C, or its supervisor was killed; ``rollstream resume`` goes on), ``prepared``
(``--prepare-only``, or services started one by one: no supervisor state).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from launch.state import pid_alive, read_state
from store.runs import FINAL_DIR

DEFAULT_RUNS_DIR = "runs"
"""Where runs live unless ``run.runs_dir`` / ``--runs-dir`` says otherwise."""
SUMMARY = "summary.json"


class RunFilesError(RuntimeError):
    """A run, step or directory that is not there (or is in the way); one line for the user."""


def resume_command(run_id: str, runs_dir: str | Path = DEFAULT_RUNS_DIR) -> str:
    """``rollstream resume RUN``, with ``--runs-dir`` when the run is not in ``./runs``."""
    default = Path(DEFAULT_RUNS_DIR).resolve()
    where = "" if Path(runs_dir).resolve() == default else f" --runs-dir {runs_dir}"
    return f"rollstream resume {run_id}{where}"


def _json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _config(run_dir: Path) -> dict[str, Any]:
    """The run's ``config.yaml`` as plain data (``{}`` when it cannot be read)."""
    try:
        data = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def disk_bytes(path: Path) -> int:
    """Bytes of the files below ``path`` (``du -sb``; links not followed)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def live_services(state: dict[str, Any] | None) -> dict[str, int]:
    """Service label -> pid of the run's service processes still alive (per ``supervisor.json``)."""
    services = (state or {}).get("services") or {}
    return {label: int(s["pid"]) for label, s in services.items() if isinstance(s, dict) and pid_alive(s.get("pid"))}


@dataclass
class RunRow:
    """One run, as ``rollstream runs list`` shows it."""

    run_id: str
    name: str
    state: str
    step: int | None
    """Training steps done (the summary's, else the supervisor's last count)."""
    steps: int | None
    """``train.steps`` of its config."""
    accuracy: float | None
    """Final held-out accuracy (finished runs)."""
    wall_s: float | None
    """Wall time: the summary's, else from the supervisor's start to its last update."""
    disk_bytes: int
    started: float
    """Unix time it started (its config's mtime when there is no supervisor state)."""
    final_model: str | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def state_of(run_dir: Path, state: dict[str, Any] | None = None, summary: dict[str, Any] | None = None) -> str:
    """The run's state (see the module doc)."""
    state = state if state is not None else read_state(run_dir)
    summary = summary if summary is not None else _json(run_dir / SUMMARY)
    if summary is not None:
        total = ((summary.get("config") or {}).get("train") or {}).get("steps")
        return "stopped" if isinstance(total, int) and int(summary.get("steps") or 0) < total else "finished"
    if state is None:
        return "prepared"
    if pid_alive(state.get("supervisor_pid")):
        return "running"
    return "failed" if state.get("phase") == "failed" else "interrupted"


def run_row(run_dir: Path, *, disk: bool = True) -> RunRow:
    """What ``run_dir`` holds about its run (``disk``: measure its size, which walks every file)."""
    cfg, state, summary = _config(run_dir), read_state(run_dir), _json(run_dir / SUMMARY)
    progress = (state or {}).get("progress") or {}
    steps = ((cfg.get("train") or {}).get("steps"))
    if summary is not None:
        step: int | None = int(summary.get("steps") or 0)
        final = ((summary.get("eval") or {}).get("final") or {}).get("accuracy")
        wall = summary.get("wall_s")
    else:
        step, final = progress.get("step"), None
        t0, t1 = (state or {}).get("started_at"), (state or {}).get("updated_at")
        wall = (t1 - t0) if isinstance(t0, (int, float)) and isinstance(t1, (int, float)) else None
    try:
        started = float((state or {}).get("started_at") or (run_dir / "config.yaml").stat().st_mtime)
    except OSError:
        started = 0.0
    final_dir = run_dir / FINAL_DIR
    return RunRow(
        run_id=run_dir.name, name=str((cfg.get("run") or {}).get("name") or ""), state=state_of(run_dir, state, summary),
        step=step, steps=steps if isinstance(steps, int) else None,
        accuracy=float(final) if isinstance(final, (int, float)) else None,
        wall_s=float(wall) if isinstance(wall, (int, float)) else None,
        disk_bytes=disk_bytes(run_dir) if disk else 0, started=started,
        final_model=str(final_dir) if final_dir.is_dir() else None)


def list_runs(runs_dir: Path) -> list[RunRow]:
    """Every run of ``runs_dir`` (a folder with a ``config.yaml``), oldest first."""
    if not runs_dir.is_dir():
        return []
    rows = [run_row(d) for d in runs_dir.iterdir() if d.is_dir() and (d / "config.yaml").is_file()]
    return sorted(rows, key=lambda r: (r.started, r.run_id))


def remove_run(run_dir: Path) -> int:
    """Delete the run's directory; the bytes freed. A running run (its supervisor or a service
    alive) is refused with :class:`RunFilesError`."""
    state = read_state(run_dir)
    if pid_alive((state or {}).get("supervisor_pid")):
        raise RunFilesError(f"run {run_dir.name} is running (supervisor pid {state and state.get('supervisor_pid')}); "
                            f"stop it first: rollstream stop {run_dir.name}")
    alive = live_services(state)
    if alive:
        pids = ", ".join(f"{label} (pid {pid})" for label, pid in alive.items())
        raise RunFilesError(f"run {run_dir.name} still has running services: {pids}; stop them first")
    from weights.shm import remove_segments, segment_prefix  # here: weights imports torch

    size = disk_bytes(run_dir) + remove_segments(segment_prefix(run_dir))  # and its shared-memory weights
    shutil.rmtree(run_dir)
    return size


async def delete_topics(kafka: Any, bootstrap: str, run_id: str) -> list[str]:
    """Delete the run's topics on the broker; the names deleted."""
    from runtime.bus import TopicAdmin

    async with TopicAdmin(kafka, bootstrap) as admin:
        return await admin.delete_run_topics(run_id)


# --------------------------------------------------------------------------- logs


def log_files(run_dir: Path) -> dict[str, Path]:
    """Label (``trainer``, ``rollout0``, ``cli``...) -> log file of the run, by name."""
    logs = run_dir / "logs"
    return {p.stem: p for p in sorted(logs.glob("*.log"))} if logs.is_dir() else {}


def follow(paths: dict[str, Path], write: Callable[[str], None], *, until: Callable[[], bool],
           last_lines: int | None = None, poll_s: float = 0.5) -> None:
    """Write the lines of each log (from its start, or its last ``last_lines``) and then those
    appended to it, prefixed ``[label]`` when there are several, until ``until()`` is true (it is
    asked before each read: true at once prints what is there and returns). A truncated or
    replaced file is read again from its start."""
    offsets = {label: tail_offset(p, last_lines) for label, p in paths.items()}
    rest = {label: b"" for label in paths}

    def emit(label: str, line: bytes) -> None:
        text = line.decode("utf-8", "replace")
        write(f"[{label}] {text}" if len(paths) > 1 else text)

    def drain() -> None:
        for label, p in paths.items():
            try:
                with p.open("rb") as fh:
                    if os.fstat(fh.fileno()).st_size < offsets[label]:
                        offsets[label], rest[label] = 0, b""
                    fh.seek(offsets[label])
                    data = fh.read()
            except OSError:
                continue
            offsets[label] += len(data)
            *lines, rest[label] = (rest[label] + data).split(b"\n")
            for line in lines:
                emit(label, line)

    while True:
        done = until()
        drain()
        if done:
            for label, tail in rest.items():  # a last line without its newline
                if tail:
                    emit(label, tail)
            return
        time.sleep(poll_s)


def tail_offset(path: Path, lines: int | None) -> int:
    """Byte offset in ``path`` where its last ``lines`` lines start (0: all of it for ``None``)."""
    if lines is None:
        return 0
    try:
        data = path.read_bytes()
    except OSError:
        return 0
    if lines == 0:
        return len(data)
    pos = len(data) - data.endswith(b"\n")
    for _ in range(lines):
        pos = data.rfind(b"\n", 0, pos)
        if pos < 0:
            return 0
    return pos + 1


# --------------------------------------------------------------------------- models


def kept_models(run_dir: Path) -> dict[int, Path]:
    """Step -> a plain Hugging Face model directory of the policy after that many training steps,
    for every one still on disk: the published weights ``weights/v<k>`` (the last 3), else the
    model of checkpoint ``checkpoints/step_<k>`` (a LoRA checkpoint's model is the base without
    its adapters: not the policy, left out)."""
    found: dict[int, Path] = {}
    ckpts = run_dir / "checkpoints"
    for d in sorted(ckpts.glob("step_*")) if ckpts.is_dir() else []:
        model = d / "model"
        if d.name[5:].isdigit() and (model / "config.json").is_file() and not (d / "adapter.safetensors").exists():
            found[int(d.name[5:])] = model
    weights = run_dir / "weights"
    for d in sorted(weights.glob("v*")) if weights.is_dir() else []:
        if d.name[1:].isdigit() and (d / "config.json").is_file() and any(d.glob("*.safetensors")):
            found[int(d.name[1:])] = d
    return dict(sorted(found.items()))


def export_model(run_dir: Path, step: int | None, dest: Path) -> tuple[int, Path]:
    """Copy the model of ``step`` (default: the final model, else the last kept step) to ``dest``
    as a plain Hugging Face directory with its tokenizer; ``(step, source)``. ``dest`` must not
    exist or be empty. :class:`RunFilesError` names the steps kept when ``step`` is not."""
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise RunFilesError(f"{dest} exists and is not empty; give a new or empty directory")
    kept = kept_models(run_dir)
    final = run_dir / FINAL_DIR
    if step is None:
        if (final / "config.json").is_file():
            summary = _json(run_dir / SUMMARY) or {}
            source, step = final, int(summary.get("steps") or max(kept, default=0))
        elif kept:
            step = max(kept)
            source = kept[step]
        else:
            raise RunFilesError(f"run {run_dir.name} has no model to export yet (no final/, weights/ or checkpoints/)")
    elif step in kept:
        source = kept[step]
    else:
        listed = ", ".join(map(str, kept)) or "none"
        raise RunFilesError(f"step {step} of run {run_dir.name} is not kept; kept steps: {listed} "
                            "(docs/runs.md: which are kept)")
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    if dest.exists():
        dest.rmdir()  # empty (checked above)
    os.replace(tmp, dest)
    return step, source
