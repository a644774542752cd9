"""The collector tuning of a service process (runtime.gc_tuning), in a child process of its own:
it is process-wide, so the test process keeps CPython's defaults."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import gc
from runtime import gc_tuning

before = gc.get_threshold()
gc_tuning.settle()  # not tuned: nothing happens
gc_tuning.hold_batches(10**6)
assert gc.get_freeze_count() == 0 and gc.get_threshold() == before, (gc.get_freeze_count(), gc.get_threshold())

gc_tuning.tune_process()
frozen = gc.get_freeze_count()
assert frozen > 0, frozen
assert gc.get_threshold() == (gc_tuning.GEN0_THRESHOLD, before[1], before[2]), gc.get_threshold()

gc_tuning.hold_batches(10)  # lower than the tuned threshold: kept
assert gc.get_threshold()[0] == gc_tuning.GEN0_THRESHOLD, gc.get_threshold()
gc_tuning.hold_batches(500_000)  # a service that holds big batches (the recorder)
assert gc.get_threshold() == (500_000, before[1], before[2]), gc.get_threshold()

held = [[i] for i in range(1000)]  # what a start-up makes and keeps (lists: tracked by the collector)
gc_tuning.settle()
assert gc.get_freeze_count() >= frozen + 1000, (gc.get_freeze_count(), frozen)

class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the collector frees it

import weakref
ref = weakref.ref(Node())
assert ref() is not None  # below the young threshold: not collected yet
gc.collect()
assert ref() is None  # made after the freeze: the collector still frees it
print("ok")
"""


def test_a_tuned_process_freezes_its_start_up_and_still_collects_later_cycles() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
