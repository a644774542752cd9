"""A process's peak memory, as its service reports it (``Generation.peak_memory_gib``, the trainer's
``perf/peak_memory_gib``): on a CUDA device the most torch allocated there at once
(``torch.cuda.max_memory_allocated``), elsewhere the process's peak resident set (``ru_maxrss``).
torch is not imported here: a CUDA device is only asked about in a process that imported it."""

from __future__ import annotations

import resource
import sys

GIB = float(1 << 30)


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far, bytes (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def peak_memory_gib(device: str = "cpu") -> float:
    """Peak memory of this process on ``device`` (a torch device string), GiB: CUDA's peak allocation
    there when ``device`` is a CUDA device, else the peak resident set (module doc)."""
    torch = sys.modules.get("torch")
    if device.startswith("cuda") and torch is not None and torch.cuda.is_available():
        return float(torch.cuda.max_memory_allocated(device)) / GIB
    return peak_rss_bytes() / GIB
