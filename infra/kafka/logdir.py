"""A run's topics read from a broker's log directory, on any machine: ``rollstream runs export-log``
and ``rollstream record RUN --from-log PATH``.

* :func:`export_log` writes an archive (``.tar.xz``, ``.tar.gz`` or ``.tar``) of one run's topics in
  a log directory: its partition directories, plus the directory's ``meta.properties``,
  ``bootstrap.checkpoint`` and KRaft metadata log (``__cluster_metadata-0``), so that the unpacked
  archive is itself a log directory a broker starts on. Index files stay out (a broker rebuilds
  them), and so does every other topic.
* :func:`run_log` finds the log directory in a path (a log directory, a local stack's home, or
  such an archive, unpacked into a temporary directory); :func:`read_partition` reads one partition
  directory's segment files as a ``read_committed`` consumer reads the partition: record batches
  (v2) decoded by aiokafka's own decoder, control batches and aborted transactions left out, no
  further than a transaction still open.

Why segments and not a broker started on the copy: a broker materialises every topic its metadata
log names (a long-lived local stack: about 2,000 partitions, minutes to start on a loaded machine)
and needs Java where the record is built; the segments need neither.

Only a single broker's log directory (``node.id=1``: the local stack's, compose's) is read: a local
cluster's node holds a share of the partitions. Nothing happens at import time.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import struct
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.kafka.home import KAFKA_VERSION, StackError, kafka_dir, read_properties

__all__ = ["ARCHIVE_SUFFIXES", "Exported", "PartitionLog", "archive_mode", "export_log", "find_log_dir", "read_partition", "run_log",
           "run_partitions", "split_partition"]

ARCHIVE_SUFFIXES = {".tar.xz": "w:xz", ".txz": "w:xz", ".tar.gz": "w:gz", ".tgz": "w:gz", ".tar": "w"}
"""Archive names :func:`export_log` writes and ``--from-log`` reads, and their tarfile modes."""

METADATA = "__cluster_metadata-0"
TOP_FILES = ("meta.properties", "bootstrap.checkpoint")
SKIPPED = (".index", ".timeindex", ".deleted", ".cleaned", ".swap", ".lock")
"""File suffixes that do not travel: indexes (rebuilt) and a cleaner's or a deletion's leftovers."""
MANIFEST = "rollstream-export.json"


def find_log_dir(path: Path) -> Path:
    """The Kafka log directory at ``path``: ``path`` itself when it holds ``meta.properties``, else
    ``<path>/kafka/data`` (a local stack's home); :class:`StackError` otherwise."""
    for cand in (path, kafka_dir(path) / "data"):
        if (cand / "meta.properties").is_file():
            node = read_properties(cand / "meta.properties").get("node.id", "")
            if node != "1":
                raise StackError(f"{cand} is the log directory of node {node or '?'} of a cluster (node.id): only a "
                                 "single broker's (node.id=1: `rollstream stack up`, compose) holds all of a run's "
                                 "partitions")
            return cand
    what = "does not exist" if not path.exists() else "is not a Kafka log directory (no meta.properties)"
    raise StackError(f"{path} {what}: name the broker's log directory (log.dirs; a local stack's <home>/kafka/data), "
                     "a local stack's home, or an archive written by `rollstream runs export-log`")


def _partition_re(run_id: str) -> re.Pattern[str]:
    return re.compile(re.escape(f"rs.{run_id}.") + r"[A-Za-z0-9._]+-\d+")


def run_partitions(log_dir: Path, run_id: str) -> list[Path]:
    """The partition directories of ``run_id``'s topics in ``log_dir`` (sorted)."""
    pat = _partition_re(run_id)
    return sorted(p for p in log_dir.iterdir() if p.is_dir() and pat.fullmatch(p.name))


def _runs_there(log_dir: Path) -> list[str]:
    found = {m.group(1) for p in log_dir.iterdir() if (m := re.fullmatch(r"rs\.([A-Za-z0-9_-]+)\.\S+-\d+", p.name))}
    return sorted(found)


def _check_run(log_dir: Path, run_id: str) -> list[Path]:
    """The run's partition directories in ``log_dir``; :class:`StackError` when there is none."""
    parts = run_partitions(log_dir, run_id)
    if not parts:
        runs = _runs_there(log_dir)
        shown = ", ".join(runs[:8]) + (f" (and {len(runs) - 8} more)" if len(runs) > 8 else "")
        raise StackError(f"the Kafka log directory {log_dir} holds no topic of run {run_id}"
                         + (f"; runs there: {shown}" if runs else " (no run's topics at all)"))
    return parts


def _files(log_dir: Path, run_id: str) -> list[str]:
    """Paths (relative to ``log_dir``) of what travels for ``run_id``: the run's partitions first,
    then the top files and the metadata log; :class:`StackError` when the run has no partition there."""
    parts = _check_run(log_dir, run_id)
    out = []
    meta = [log_dir / METADATA] if (log_dir / METADATA).is_dir() else []
    for d in [*parts, *meta]:
        out += [str(f.relative_to(log_dir)) for f in sorted(d.iterdir()) if f.is_file() and not f.name.endswith(SKIPPED)]
    return out + [name for name in TOP_FILES if (log_dir / name).is_file()]


def _copy_files(log_dir: Path, names: list[str], add: Callable[[Path, str], None]) -> list[str]:
    """``add(path, name)`` for each name; the names of files that vanished meanwhile (retention, a
    metadata snapshot's cleanup on a running broker)."""
    gone = []
    for name in names:
        try:
            add(log_dir / name, name)
        except FileNotFoundError:
            gone.append(name)
    return gone


@dataclass(frozen=True)
class Exported:
    """What :func:`export_log` wrote."""

    path: Path
    partitions: int
    files: int
    bytes_in: int
    """Bytes of the files archived."""
    bytes_out: int
    """Bytes of the archive."""


def archive_mode(path: Path) -> str:
    """The tarfile write mode of an archive name; :class:`StackError` for another suffix."""
    mode = next((m for s, m in ARCHIVE_SUFFIXES.items() if path.name.endswith(s)), None)
    if mode is None:
        raise StackError(f"{path}: name the archive with one of {', '.join(ARCHIVE_SUFFIXES)}")
    return mode


def export_log(log_dir: Path, run_id: str, out: Path, tries: int = 3) -> Exported:
    """Write the archive of ``run_id``'s topics in ``log_dir`` to ``out`` (through a temporary file and a
    rename), under one folder ``<run>-kafka-log/`` (itself a log directory ``--from-log`` reads once
    unpacked). A running broker may delete files while they are read: then the archive is written again
    (``tries`` times in all). The run's partitions are read before the metadata log, which therefore
    knows every topic they belong to."""
    mode = archive_mode(out)
    log_dir = find_log_dir(log_dir)
    if out.exists() and not out.is_file():
        raise StackError(f"{out} exists and is not a file")
    out.parent.mkdir(parents=True, exist_ok=True)
    root = f"{run_id}-kafka-log"
    for _ in range(tries):
        names = _files(log_dir, run_id)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        size = 0
        try:
            with tarfile.open(tmp, mode) as tar:  # type: ignore[call-overload]
                def add(path: Path, name: str) -> None:
                    nonlocal size
                    with path.open("rb") as f:
                        info = tar.gettarinfo(fileobj=f, arcname=f"{root}/{name}")
                        info.mode, info.uid, info.gid, info.uname, info.gname = 0o644, 0, 0, "", ""
                        tar.addfile(info, f)
                        size += info.size
                gone = _copy_files(log_dir, names, add)
                manifest = json.dumps({"run_id": run_id, "kafka_version": KAFKA_VERSION, "source": str(log_dir),
                                       "created": time.time(), "files": len(names)}, indent=2).encode()
                info = tarfile.TarInfo(f"{root}/{MANIFEST}")
                info.size, info.mtime = len(manifest), int(time.time())
                tar.addfile(info, io.BytesIO(manifest))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if not gone:
            os.replace(tmp, out)
            parts = {n.split("/")[0] for n in names if n.startswith("rs.")}
            return Exported(out, len(parts), len(names), size, out.stat().st_size)
        tmp.unlink(missing_ok=True)
    raise StackError(f"files of {log_dir} kept vanishing while they were archived ({tries} tries): the broker "
                     "deletes segments (retention); stop it (`rollstream stack down`) and export again")


@dataclass(frozen=True)
class PartitionLog:
    """What a partition's log holds, as a ``read_committed`` consumer would see it."""

    begin: int
    """The first offset on disk (above 0: retention deleted what came before)."""
    end: int
    """The offset read to: the log's end, or the first offset of a transaction still open (the last
    stable offset: a ``read_committed`` consumer reads no further)."""
    messages: list[Any]
    """aiokafka's records (``offset``, ``key``, ``value``, ``timestamp``) of committed and
    non-transactional batches, in offset order; control batches and aborted transactions left out."""
    torn: int = 0
    """Bytes cut at the end of the last segment: a batch being written when the directory was copied
    (the broker's recovery cuts them too)."""


_HEADER = struct.Struct(">qi")  # a record batch's baseOffset and batchLength
_ABORT = 0  # a control record's type (its key: version int16, type int16)


def _batches(part: Path) -> tuple[list[Any], int]:
    """The record batches (aiokafka's) of a partition directory's segments in offset order, and the
    bytes of a torn batch cut from the end of the last segment; :class:`StackError` for a damaged
    batch anywhere else."""
    from aiokafka.record.memory_records import MemoryRecords

    segments = sorted(part.glob("*.log"), key=lambda p: int(p.stem) if p.stem.isdigit() else -1)
    out: list[Any] = []
    for n, seg in enumerate(segments):
        data = seg.read_bytes()
        pos = 0
        while pos + _HEADER.size <= len(data):
            _, length = _HEADER.unpack_from(data, pos)
            end = pos + _HEADER.size + length
            batch = MemoryRecords(data[pos:end]).next_batch() if length > 0 and end <= len(data) else None
            if batch is None or not batch.validate_crc():
                break
            out.append(batch)
            pos = end
        if pos < len(data):
            if n < len(segments) - 1 or not out:
                raise StackError(f"{seg} is damaged at byte {pos} (a record batch cut short or failing its CRC): "
                                 "copy the log directory again, or export the run with `rollstream runs export-log`")
            return out, len(data) - pos
    return out, 0


def read_partition(part: Path) -> PartitionLog:
    """The log of one partition directory read as a ``read_committed`` consumer reads it: a
    transactional batch is kept once its producer's COMMIT marker follows, dropped when an ABORT
    does, and the read stops at the first batch of a transaction with no marker yet."""
    batches, torn = _batches(part)
    fate: dict[int, bool] = {}  # batch index -> committed
    pending: dict[int, list[int]] = {}  # producer id -> its open transaction's batch indexes
    for i, b in enumerate(batches):
        if b.is_control_batch:
            ctl = next(iter(b), None)
            kind = struct.unpack(">hh", ctl.key)[1] if ctl is not None and ctl.key and len(ctl.key) >= 4 else _ABORT
            for j in pending.pop(b.producer_id, []):
                fate[j] = kind != _ABORT
        elif b.is_transactional:
            pending.setdefault(b.producer_id, []).append(i)
    stable = min((j for idx in pending.values() for j in idx), default=len(batches))
    messages = [m for i, b in enumerate(batches[:stable]) if not b.is_control_batch and fate.get(i, True) for m in b]
    begin = batches[0].base_offset if batches else _base_offset(part)
    end = batches[stable].base_offset if stable < len(batches) else batches[-1].next_offset if batches else begin
    return PartitionLog(begin, end, messages, torn)


def _base_offset(part: Path) -> int:
    """The base offset of an empty log (its one segment's name)."""
    bases = [int(p.stem) for p in part.glob("*.log") if p.stem.isdigit()]
    return min(bases, default=0)


def split_partition(name: str) -> tuple[str, int]:
    """``rs.run.tasks-3`` -> ``("rs.run.tasks", 3)``."""
    topic, _, p = name.rpartition("-")
    return topic, int(p)


@contextlib.contextmanager
def run_log(src: Path, run_id: str) -> Iterator[Path]:
    """The Kafka log directory holding ``run_id``'s partitions from ``src``: ``src`` itself (a log
    directory, or a local stack's home) or, for an archive of :func:`export_log`, a temporary
    directory it is unpacked into (deleted on the way out). :class:`StackError` when ``src`` is
    neither, or holds no partition of the run."""
    src = src.expanduser().absolute()
    if not src.exists():
        raise StackError(f"{src} does not exist: name a Kafka log directory or an archive of `rollstream runs export-log`")
    if src.is_dir():
        log_dir = find_log_dir(src)
        _check_run(log_dir, run_id)
        yield log_dir
        return
    archive_mode(src)
    tmp = Path(tempfile.mkdtemp(prefix=f"rollstream-log-{run_id}-"))
    try:
        try:
            with tarfile.open(src, "r:*") as tar:
                tar.extractall(tmp, filter="data")
        except (tarfile.TarError, EOFError):
            raise StackError(f"{src} is not a readable tar archive (.tar.xz, .tar.gz, .tar): name an archive of "
                             "`rollstream runs export-log`") from None
        except OSError as e:
            raise StackError(f"{src} cannot be unpacked into {tmp}: {e}") from None
        tops = [p for p in tmp.iterdir() if p.is_dir()]
        found = tops[0] if len(tops) == 1 and not (tmp / "meta.properties").is_file() else tmp
        try:
            log_dir = find_log_dir(found)
            _check_run(log_dir, run_id)
        except StackError as e:
            msg = str(e).replace(f"the Kafka log directory {found} ", "it ").replace(str(found), "its log directory")
            raise StackError(f"the archive {src}: {msg}") from None
        yield log_dir
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
