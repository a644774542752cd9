"""Weight sets in shared memory: the same-node handoff from the trainer to its engines.

A segment is one file in ``/dev/shm`` (a tmpfs: memory, no disk) holding a whole weight state:
a 128-byte header, a JSON manifest (name, dtype, shape, byte offset of every tensor; tied names
as aliases of the tensor they share) and the raw tensor bytes, each 64-byte aligned.

* :func:`write_segment` reserves the whole size first (``posix_fallocate``: a full ``/dev/shm`` is
  an ``OSError`` here, never a ``SIGBUS`` later), copies every tensor straight into the mapping
  (one copy, also from a GPU), writes the seal last and renames the temporary ``.NAME.tmp-PID``
  into place. A killed writer leaves a temporary file that no reader opens, never a segment.
* :func:`read_segment` maps a segment read-only and returns tensors that *view* it (no copy; never
  write to them: that is a segfault): the engine's
  in-place swap (:func:`weights.copy_weights_`) is then the only copy. Before that it checks the
  magic, the seal, the file size and the manifest's sha256 (the segment's checksum, which the
  ``WeightsPublished`` event carries too); anything else is one :class:`SegmentError` line.
  The bytes themselves are not hashed: hashing costs as much as the copy, and the seal-then-rename
  order already means a segment under its final name was written whole.
* :func:`prune_segments` keeps the newest :data:`KEEP_SEGMENTS` versions of a run;
  :func:`remove_segments` removes all of a run's (run end, ``rollstream runs rm``). A reader
  that mapped a segment keeps it until it lets go, even once it is unlinked.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import secrets
import socket
import struct
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["KEEP_SEGMENTS", "SHM_DIR", "Segment", "SegmentError", "check_segment", "is_segment", "new_segment_path",
           "node_id", "open_reserved", "prune_received", "prune_segments", "read_segment", "remove_segments", "segment_prefix",
           "write_segment"]

SHM_DIR = Path("/dev/shm")
"""Where segments live (Linux's shared-memory tmpfs); the functions' default ``root``."""
KEEP_SEGMENTS = 2
"""Versions of a run kept in shared memory: the newest and the one before (an engine may still be
copying it); weight directories keep 3 (``services.trainer.checkpoint``)."""
MAGIC = b"RSWSEG01"
SEAL = b"SEALED!!"
HEADER = struct.Struct("<8s8sQQQ32s")  # magic, seal, manifest bytes, data offset, total bytes, manifest sha256
HEADER_BYTES = 128
ALIGN = 64
POPULATE = getattr(mmap, "MAP_POPULATE", 0)
"""Map every page at once (Linux), not one fault per page on first touch."""
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool)}


class SegmentError(ValueError):
    """A segment that must not be applied (unsealed, truncated, not a segment, another checksum)."""


@dataclass(frozen=True)
class Segment:
    """A sealed segment: its path, checksum (sha256 of its manifest, hex) and size in bytes."""

    path: Path
    checksum: str
    num_bytes: int


def node_id() -> str:
    """This machine's name, as ``WeightsPublished.memory_host`` records it."""
    return socket.gethostname()


def segment_prefix(run_dir: str | Path) -> str:
    """The name prefix of a run's segments: its folder name and a hash of its absolute path (two
    runs of the same id in different ``runs_dir`` never share segments)."""
    p = Path(run_dir).resolve()
    return f"rollstream-{p.name}-{hashlib.sha256(str(p).encode()).hexdigest()[:8]}"


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _plan(state: Mapping[str, torch.Tensor]) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
    """The tensors to store (tied names once, the first name) and the other names' aliases."""
    first: dict[tuple[object, ...], str] = {}
    unique: list[tuple[str, torch.Tensor]] = []
    aliases: dict[str, str] = {}
    for name, t in state.items():
        if str(t.dtype).removeprefix("torch.") not in DTYPES:
            raise TypeError(f"tensor {name}: dtype {t.dtype} cannot go into a weights segment")
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        if t.numel() and key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
            unique.append((name, t))
    return unique, aliases


def _byte_view(buf: torch.Tensor, offset: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """``buf[offset:]`` (a flat uint8 tensor) seen as a tensor of ``dtype`` and ``shape``."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return buf[offset:offset + nbytes].view(dtype).view(shape)


def write_segment(path: str | Path, state: Mapping[str, torch.Tensor], *, seal: bool = True) -> Segment:
    """Write ``state`` as a sealed segment at ``path`` (see the module doc). ``seal=False`` stops
    before the seal and the rename (what a killed writer leaves; for tests). ``OSError`` when the
    shared memory is too small (nothing is left behind then)."""
    final = Path(path)
    unique, aliases = _plan(state)
    entries: list[tuple[str, str, list[int], int]] = []
    offset = 0
    for name, t in unique:
        entries.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), offset))
        offset = _align(offset + t.numel() * t.element_size())
    manifest = json.dumps({"tensors": entries, "aliases": aliases, "nonce": secrets.token_hex(8)}).encode()
    data_offset = _align(HEADER_BYTES + len(manifest))
    total = max(data_offset + offset, data_offset + 1)
    digest = hashlib.sha256(manifest).digest()
    tmp, fd = open_reserved(final, total)
    try:
        with mmap.mmap(fd, total, flags=mmap.MAP_SHARED | POPULATE) as mm:
            mm[:HEADER_BYTES] = HEADER.pack(MAGIC, b"\0" * 8, len(manifest), data_offset, total, digest).ljust(
                HEADER_BYTES, b"\0")
            mm[HEADER_BYTES:HEADER_BYTES + len(manifest)] = manifest
            buf = torch.frombuffer(mm, dtype=torch.uint8)
            with torch.no_grad():
                for (_, t), (_, _, shape, off) in zip(unique, entries, strict=True):
                    _byte_view(buf, data_offset + off, t.dtype, shape).copy_(t.detach())
            del buf  # the mapping closes only once no tensor views it
            if seal:
                mm[8:16] = SEAL
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    if seal:
        os.replace(tmp, final)
    return Segment(final, digest.hex(), total)


def open_reserved(final: Path, size: int) -> tuple[Path, int]:
    """``(temporary path, fd)``: the file ``.NAME.tmp-PID`` beside ``final``, ``size`` bytes of it
    reserved at once (``posix_fallocate``: a full ``/dev/shm`` is an ``OSError`` line here, never
    a ``SIGBUS`` on a later write; nothing is left behind then). Rename it to ``final`` once
    written and sealed."""
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, f"no room for {size / 2**20:.0f} MiB of weights in {final.parent} "
                               f"({os.strerror(e.errno or 0)})") from None
    return tmp, fd


def _header(mm: mmap.mmap | bytes, size: int, where: Path) -> tuple[bytes, int, str]:
    """The manifest, data offset and checksum of a segment's mapped bytes, checked."""
    if size < HEADER_BYTES or bytes(mm[:8]) != MAGIC:
        raise SegmentError(f"{where} is not a weights segment")
    _, seal, n_manifest, data_offset, total, digest = HEADER.unpack(bytes(mm[:HEADER.size]))
    if seal != SEAL:
        raise SegmentError(f"weights segment {where} is not sealed (its writer did not finish): not applied")
    if total != size or HEADER_BYTES + n_manifest > data_offset or data_offset > total:
        raise SegmentError(f"weights segment {where} has {size} bytes, its header says {total}: not applied")
    manifest = bytes(mm[HEADER_BYTES:HEADER_BYTES + n_manifest])
    if hashlib.sha256(manifest).digest() != digest:
        raise SegmentError(f"weights segment {where}: its manifest does not match its checksum: not applied")
    return manifest, data_offset, digest.hex()


def is_segment(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts like a segment (sealed or not)."""
    p = Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(8) == MAGIC


def check_segment(path: str | Path, checksum: str = "") -> Segment:
    """The segment at ``path`` after the checks of :func:`read_segment` (its header only: cheap);
    ``checksum`` (non-empty) must be its checksum. ``OSError`` when it is gone."""
    p = Path(path)
    with p.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(HEADER_BYTES)
        _, _, n_manifest, _, _, _ = HEADER.unpack(head[:HEADER.size]) if len(head) >= HEADER.size else (0,) * 6
        head += f.read(int(n_manifest))
    _, _, digest = _header(head, size, p)
    if checksum and digest != checksum:
        raise SegmentError(f"weights segment {p} has checksum {digest[:12]}..., expected {checksum[:12]}...: "
                           "not applied")
    return Segment(p, digest, size)


def read_segment(path: str | Path, checksum: str = "") -> dict[str, torch.Tensor]:
    """The state of the segment at ``path``: CPU tensors viewing the shared memory (no copy; the
    mapping lives as long as they do). Tied names are the same tensor. Refuses (``SegmentError``)
    an unsealed, truncated or foreign file, or one whose checksum is not ``checksum``."""
    p = Path(path)
    with p.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < HEADER_BYTES:
            raise SegmentError(f"{p} is not a weights segment")
        mm = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | POPULATE, prot=mmap.PROT_READ)
    manifest, data_offset, digest = _header(mm, size, p)
    if checksum and digest != checksum:
        raise SegmentError(f"weights segment {p} has checksum {digest[:12]}..., expected {checksum[:12]}...: "
                           "not applied")
    m = json.loads(manifest)
    with warnings.catch_warnings():  # read-only memory: the tensors are only ever copied from
        warnings.filterwarnings("ignore", "The given buffer is not writable")
        buf = torch.frombuffer(mm, dtype=torch.uint8)
    state = {name: _byte_view(buf, data_offset + off, DTYPES[dtype], shape) for name, dtype, shape, off in m["tensors"]}
    for name, target in m["aliases"].items():
        state[name] = state[target]
    return state


_VERSION = re.compile(r"-v(\d+)-[0-9a-f]+$")


def _segments(prefix: str, root: Path) -> list[tuple[int, Path]]:
    """The sealed segments of ``prefix`` under ``root`` with their version, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.glob(f"{prefix}-v*") if (m := _VERSION.search(p.name))]
    return sorted(found)


def prune_segments(prefix: str, keep: int = KEEP_SEGMENTS, root: Path | None = None) -> list[Path]:
    """Unlink all but the newest ``keep`` versions of ``prefix`` (several segments of one version:
    the newest written stays), and temporary files of writers no longer running. The removed paths."""
    root = SHM_DIR if root is None else root
    found = _segments(prefix, root)
    by_version: dict[int, list[Path]] = {}
    for version, p in found:
        by_version.setdefault(version, []).append(p)
    kept = sorted(by_version)[-keep:] if keep > 0 else []
    doomed = [p for v, ps in by_version.items() for p in ps if v not in kept]
    for v in kept:
        ps = sorted(by_version[v], key=lambda q: q.stat().st_mtime_ns)
        doomed += ps[:-1]
    return _unlink(doomed + _orphans(prefix, root))


def prune_received(prefix: str, newest: Path, keep: int = KEEP_SEGMENTS, root: Path | None = None) -> list[Path]:
    """Like :func:`prune_segments` for the copies an engine received from another node
    (:mod:`weights.broadcast`), by age, not version (a new run of the same id starts again at
    version 0): ``newest`` and the most recently written others stay, ``keep`` in all."""
    root = SHM_DIR if root is None else root
    others = sorted((p for _, p in _segments(prefix, root) if p != newest), key=lambda q: q.stat().st_mtime_ns)
    return _unlink(others[:max(0, len(others) - (keep - 1))] + _orphans(prefix, root))


def _orphans(prefix: str, root: Path) -> list[Path]:
    """Temporary files of ``prefix``'s writers that are no longer running."""
    found = []
    for tmp in root.glob(f".{prefix}-v*.tmp-*") if root.is_dir() else []:
        pid = tmp.name.rsplit("-", 1)[-1]
        if not (pid.isdigit() and _alive(int(pid))):
            found.append(tmp)
    return found


def _unlink(paths: list[Path]) -> list[Path]:
    for p in paths:
        p.unlink(missing_ok=True)
    return paths


def remove_segments(prefix: str, root: Path | None = None) -> int:
    """Unlink every segment (and temporary file, and the lock of :mod:`weights.broadcast`) of
    ``prefix``; the bytes freed."""
    root = SHM_DIR if root is None else root
    freed = 0
    if not root.is_dir():
        return 0
    for p in [*root.glob(f"{prefix}-v*"), *root.glob(f".{prefix}-v*.tmp-*"), *root.glob(f".{prefix}.lock")]:
        try:
            freed += p.stat().st_size
            p.unlink()
        except FileNotFoundError:
            pass
    return freed


def new_segment_path(prefix: str, version: int, root: Path | None = None) -> Path:
    """A fresh path for version ``version`` of ``prefix`` (a random suffix: never an older one's)."""
    return (SHM_DIR if root is None else root) / f"{prefix}-v{version:05d}-{secrets.token_hex(4)}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
