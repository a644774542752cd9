"""A process's peak memory, as its service reports it (``Generation.peak_memory_gib``, the trainer's
``perf/peak_memory_gib``): on a CUDA device the most torch allocated there at once
(``torch.cuda.max_memory_allocated``), elsewhere the process's peak resident set (``ru_maxrss``).
torch is not imported here: a CUDA device is only asked about in a process that imported it."""

from __future__ import annotations

import math
import resource
import sys
import time
from collections.abc import Callable

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


class PeakMemory:
    """:func:`peak_memory_gib` of ``device``, read at most every ``max_age_s``: a rollout worker
    reports it with every sample, and one ``getrusage`` call per sample was 3% of its CPU at 4,000
    samples/s (``bench/pipeline_ceiling.py``). The value only grows, so a cached one is at most
    ``max_age_s`` late."""

    def __init__(self, device: str = "cpu", max_age_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.device, self.max_age_s, self.clock = device, max_age_s, clock
        self._value, self._read_at = 0.0, -math.inf

    def __call__(self) -> float:
        now = self.clock()
        if now - self._read_at >= self.max_age_s:
            self._value, self._read_at = peak_memory_gib(self.device), now
        return self._value
