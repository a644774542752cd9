"""Which copy of a published weight version an engine reads: memory on the trainer's node, else disk.

A ``WeightsPublished`` event names the version's directory (``uri``) and, with the memory handoff,
a shared-memory segment (``memory``) on the node ``memory_host`` with its checksum. An engine on
that node reads the segment when it is there and sealed with that checksum (:func:`pick_copy`), an
engine on another node the copy received there (``broadcast``, :mod:`weights.broadcast`); an
engine that finds neither reads the directory, which the trainer may still be writing after the
announcement: :func:`wait_for_dir` waits for its rename (the rollout worker waits in a loop of its own,
which a newer version's announcement ends: a trainer killed before writing a directory never does).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import weights.shm as shm
from weights.shm import SegmentError, check_segment, node_id

log = logging.getLogger("rollstream.weights")

__all__ = ["pick_copy", "wait_for_dir"]


def pick_copy(uri: str, memory: str = "", memory_host: str = "", checksum: str = "",
              root: Path | None = None) -> tuple[str, str]:
    """``(path, why)``: the segment ``memory`` when it is on this node and passes
    :func:`weights.shm.check_segment` (``why`` empty); on another node, the copy of it that an
    engine of this node received into ``root`` (``/dev/shm``; :mod:`weights.broadcast`); else
    ``uri`` and why not a segment (empty when there is none)."""
    if not memory:
        return uri, ""
    if memory_host != node_id():
        relayed = (shm.SHM_DIR if root is None else root) / Path(memory).name
        try:
            return str(check_segment(relayed, checksum).path), ""
        except (OSError, SegmentError):
            return uri, f"the memory copy is on {memory_host}, this is {node_id()}"
    try:
        check_segment(memory, checksum)
    except FileNotFoundError:
        return uri, f"the memory copy {memory} is gone"
    except (OSError, SegmentError) as e:
        return uri, str(e)
    return memory, ""


def wait_for_dir(path: str | Path, timeout_s: float, poll_s: float = 0.05) -> bool:
    """Whether the directory ``path`` exists within ``timeout_s`` seconds (0: look once)."""
    p, deadline = Path(path), time.monotonic() + timeout_s
    while not p.is_dir():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True
