"""A process's peak memory: its peak resident set on the CPU, in bytes (Linux reports KiB)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from runtime import memory
from runtime.memory import GIB, PeakMemory, peak_memory_gib, peak_rss_bytes


def resident_bytes() -> int:
    """This process's resident set now (``VmRSS`` of /proc/self/status), bytes."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux only)")
def test_the_peak_is_at_least_what_is_resident_now_and_never_drops() -> None:
    block = bytearray(64 << 20)
    block[::4096] = b"\1" * len(range(0, len(block), 4096))  # every page written: resident
    now = resident_bytes()
    assert now >= 64 << 20
    peak = peak_rss_bytes()
    # in bytes (a KiB count would be 1024 times smaller); the kernel updates the high-water mark from
    # per-thread counters lazily, so it may trail what is resident by a few pages
    assert peak >= 0.9 * now
    del block
    assert peak_rss_bytes() >= peak  # a high-water mark
    assert peak_memory_gib("cpu") == pytest.approx(peak_rss_bytes() / GIB, rel=0.01)


def test_a_cuda_device_is_asked_only_in_a_process_that_imported_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without torch imported a CUDA device string falls back to the peak resident set."""
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert peak_memory_gib("cuda:0") == pytest.approx(peak_rss_bytes() / GIB, rel=0.01)


def test_peak_memory_reads_again_only_after_max_age(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[float] = []
    clock = [100.0]

    def fake_peak(device: str = "cpu") -> float:
        reads.append(clock[0])
        return float(len(reads))

    monkeypatch.setattr(memory, "peak_memory_gib", fake_peak)
    peak = PeakMemory("cpu", max_age_s=0.5, clock=lambda: clock[0])
    assert peak() == 1.0  # the first call reads
    clock[0] += 0.49
    assert peak() == 1.0 and len(reads) == 1  # cached
    clock[0] += 0.01
    assert peak() == 2.0 and reads == [100.0, 100.5]  # max_age_s passed: read again
