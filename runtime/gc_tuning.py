"""The cyclic garbage collector of a service process, tuned for a stream of short-lived events.

A service process holds a large, long-lived heap (torch, transformers, aiokafka, the model) and
makes tens of thousands of short-lived objects a second (records, events, tasks, futures). With
CPython's default thresholds the collector ran about 100 times a second, and each older-generation
pass walked the whole long-lived heap: 7-39% of a service's CPU in ``bench/pipeline_ceiling.py``
(``gc.callbacks`` timing). :func:`tune_process` therefore

* moves what the process holds after its imports, and again after its start-up
  (:func:`settle`, called by :class:`runtime.runner.Runner` once ``on_start`` returned), into the
  permanent generation (``gc.freeze``), which collections skip;
* raises the young-generation threshold to :data:`GEN0_THRESHOLD` allocations.

A service that holds a whole poll of decoded events at once (the recorder: thousands of events,
each a few lists and structs, alive until their insert returns) would still pass that threshold
several times per poll, and each pass walks what the poll holds. :func:`hold_batches` raises such
a process's threshold above its largest batch, so its objects are freed by reference counting
before a collection comes.

Objects freed by reference counting (nearly all of a service's) are freed as before; only garbage
in reference cycles waits a little longer. It is process-wide, so only the service entry point
(``rollstream service``) calls :func:`tune_process`; a library user or a test process that never
calls it keeps the defaults, and :func:`settle` then does nothing.
"""

from __future__ import annotations

import gc

__all__ = ["GEN0_THRESHOLD", "hold_batches", "settle", "tune_process"]

GEN0_THRESHOLD = 20_000
"""Allocations (net of frees) between young-generation collections (CPython's default: 700)."""

_tuned = False


def tune_process() -> None:
    """Tune this process's collector for a service (see the module doc)."""
    global _tuned
    _tuned = True
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
    gc.collect()
    gc.freeze()


def settle() -> None:
    """After a tuned service's start-up: freeze what it holds now (a no-op when not tuned)."""
    if _tuned:
        gc.collect()
        gc.freeze()


def hold_batches(allocations: int) -> None:
    """In a tuned service process, raise the young-generation threshold to ``allocations`` (more
    than one batch of the service holds): garbage in reference cycles waits up to that many net
    allocations. A no-op when not tuned, or when the threshold is higher already."""
    gen0, gen1, gen2 = gc.get_threshold()
    if _tuned and allocations > gen0:
        gc.set_threshold(allocations, gen1, gen2)
