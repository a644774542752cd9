"""rollstream's scheduling policy with no overhead: a discrete-event simulation of a streaming run.

``bench/async_speedup.py`` prints, beside the ideal bound of a streaming mode
(``rollout.async_ratio`` k), the **policy's bound**: what rollstream's own scheduling reaches when
every message, poll and process switch is free. :func:`simulate_run` replays docs/architecture.md's
rules for ``steps`` train steps of ``B`` samples:

* the feeder keeps at most ``B (1 + k)`` samples outstanding and issues whole groups, stamped with
  the newest weights version, as soon as the bound allows;
* a sample stops being outstanding only when the train step that took its group ends (trained or
  dropped as stale): a scored sample waiting in the trainer's buffer still holds its slot;
* the trainer takes complete groups in arrival order, ``B`` samples a step, one step at a time,
  and drops the samples more than k versions old;
* generating ``n`` samples costs ``G n / B`` seconds and a step with its weight swap ``T``, on one
  serial CPU; rewards take their latency (:func:`router_draws`: a run's own draws, or
  :func:`lognormal`: fresh ones) and no CPU.

It returns when each step ended and how many samples were issued and dropped as stale;
:func:`simulate` averages many runs with fresh draws. ``release="complete"`` frees a slot when its
group's last reward is in instead (the ideal bound's assumption, not what rollstream does).
bench/README.md ("async_speedup.py") explains both bounds and what the simulation leaves out.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Group:
    index: int
    """Issue order: group ``g<index>`` of the run."""
    version: int
    """The weights version its tasks were stamped with."""
    scored: int = 0


Latency = Callable[[int, int], float]
"""A sample's reward latency in seconds, given its group's index and its index in the group."""


def lognormal(mean_s: float, sigma: float, rng: random.Random) -> Latency:
    """Fresh latency draws from the distribution ``envs.latency.draw_latency_s("lognormal",
    ...)`` draws from: mean ``mean_s``, log-space standard deviation ``sigma``."""
    mu = math.log(mean_s) - sigma * sigma / 2
    return lambda _group, _member: rng.lognormvariate(mu, sigma)


@dataclass
class SimRun:
    """One simulated run."""

    ends: list[float]
    """When each train step ended, seconds from the first issue."""
    issued: int
    """Samples issued."""
    stale: int
    """Samples a step took and dropped as stale (more than k versions old)."""


def router_draws(mean_s: float, sigma: float) -> Latency:
    """The latencies that the reward router of a run draws (``reward.latency: lognormal``): keyed
    by sample id (``g<group:06d>/<member>``, the feeder's numbering), the same in every run."""
    from envs.latency import draw_latency_s

    return lambda g, j: draw_latency_s("lognormal", mean_s, sigma, f"g{g:06d}/{j}")


def simulate_run(k: int, steps: int, gen_s: float, train_s: float, latency: Latency,
                 batch: int = 64, group: int = 8, release: str = "trained") -> SimRun:
    """One run of ``steps`` train steps under the policy (module doc).

    ``gen_s`` (G): seconds to generate ``batch`` samples; ``train_s`` (T): one train step with
    the weight swap; ``latency(group, member)``: a sample's reward latency in seconds.
    ``release``: when a sample stops holding its slot: ``trained`` (rollstream: when the step that
    took it ends) or ``complete`` (a variant that is not implemented: when its group's last reward
    is in, as the ideal bound assumes; the trainer still drops what is too old)."""
    if release not in ("trained", "complete"):
        raise ValueError(f"release={release!r} must be 'trained' or 'complete'")
    if k < 0 or steps < 1 or batch < group or batch % group:
        raise ValueError(f"k={k} must be >= 0, steps={steps} >= 1, batch={batch} a multiple of group={group}")
    cap = batch * (1 + k)
    events: list[tuple[float, int, str, object]] = []  # (time, sequence, kind, payload)
    seq = 0
    cpu_free = 0.0
    version = outstanding = issued = stale = 0
    training = False
    groups: list[_Group] = []  # issued, in issue (= arrival) order, until a step takes them
    ends: list[float] = []

    def push(t: float, kind: str, payload: object) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, payload))
        seq += 1

    def cpu(now: float, seconds: float) -> float:
        nonlocal cpu_free
        cpu_free = max(now, cpu_free) + seconds
        return cpu_free

    def issue(now: float) -> None:
        nonlocal outstanding, issued
        n = (cap - outstanding) // group
        if n <= 0 or len(ends) >= steps:
            return
        new = [_Group(issued // group + i, version) for i in range(n)]
        groups.extend(new)
        outstanding += n * group
        issued += n * group
        push(cpu(now, gen_s * n * group / batch), "generated", new)

    def train(now: float) -> None:
        nonlocal training, stale
        if training:
            return
        taken: list[_Group] = []
        for g in groups:
            if g.scored == group:
                taken.append(g)
                if len(taken) * group >= batch:
                    break
        if len(taken) * group < batch:
            return
        for g in taken:  # every taken sample, trained or dropped, gets its outcome when the step ends
            groups.remove(g)
            stale += group if version - g.version > k else 0
        training = True
        push(cpu(now, train_s), "trained", len(taken) * group)

    issue(0.0)
    while events and len(ends) < steps:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "generated":
            for g in payload:  # type: ignore[attr-defined]
                for member in range(group):
                    push(now + latency(g.index, member), "scored", g)
        elif kind == "scored":
            g = payload
            assert isinstance(g, _Group)
            g.scored += 1
            if g.scored == group:
                if release == "complete":
                    outstanding -= group
                    issue(now)
                train(now)
        else:  # trained: outcomes published, then the new weights
            assert isinstance(payload, int)
            outstanding -= payload if release == "trained" else 0
            version += 1
            training = False
            ends.append(now)
            issue(now)
            train(now)
    return SimRun(ends, issued, stale)


@dataclass(frozen=True)
class PolicyBound:
    """The policy's expectations over many simulated runs."""

    step_s: float
    """Seconds per step, measured as ``bench/async_speedup.py`` measures a run: first to last step
    ended, over ``steps - 1``."""
    stale_fraction: float
    """Of the issued samples, the fraction dropped as stale."""


def simulate(k: int, steps: int, gen_s: float, train_s: float, mean_s: float, sigma: float,
             trials: int = 300, batch: int = 64, group: int = 8, seed: int = 0, release: str = "trained"
             ) -> PolicyBound:
    """:func:`simulate_run` ``trials`` times with lognormal reward latencies (mean ``mean_s``,
    log-space sigma ``sigma``); the means over the runs."""
    if steps < 2:
        raise ValueError("steps must be >= 2 (a step time is measured between the first and the last step)")
    draw = lognormal(mean_s, sigma, random.Random(seed))
    runs = [simulate_run(k, steps, gen_s, train_s, draw, batch, group, release) for _ in range(trials)]
    return PolicyBound(statistics.mean((r.ends[-1] - r.ends[0]) / (len(r.ends) - 1) for r in runs),
                       statistics.mean(r.stale / r.issued for r in runs))
