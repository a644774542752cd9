"""How many torch threads each service process gets (``run.torch_threads``).

Every service is its own process, and torch starts one OpenMP thread per core in each one by
default: on a machine the services share, a rollout worker and a trainer that both run matmuls then
fight over the cores, and OpenMP's busy-waiting makes that far slower than splitting the cores
(main example, 2 cores, 30 steps: 134 s with torch's default threads, 94 s with 1 thread each).
On-policy (``rollout.async_ratio`` 0) the trainer and the generating processes take turns, so the
trainer gets every core (main example at ``async_ratio`` 0, 2 cores, 30 steps, alternating runs:
1.18 and 1.13 s per step with 2 threads each against 1.28 and 1.22 s with 1).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from launch.healing import service_of
from schemas.config import RunConfig
from schemas.services import SERVICES, value_at


def runs_model(label: str) -> bool:
    """Whether the process ``label`` runs a model (:attr:`ServiceSpec.runs_model`; the others get one thread)."""
    spec = SERVICES.get(service_of(label))
    return spec is not None and spec.runs_model


def torch_threads(cfg: RunConfig, labels: Sequence[str], *, cores: int | None = None,
                  ray: bool = False) -> dict[str, int]:
    """``{label: threads}`` for the run's processes (see ``run.torch_threads``): a set value for every
    model process, else (auto) the cores divided among the model processes (with ``async_ratio`` 0:
    every core for the trainer, the cores divided among the others), or under Ray the process's
    own ``placement.<service>.cpus``; 1 for the others."""
    models = [label for label in labels if runs_model(label)]
    n = cores or os.cpu_count() or 1
    share = cfg.run.torch_threads or max(1, n // max(1, len(models)))
    # on-policy (async_ratio 0): the trainer computes only while the rollout workers and judges wait
    # for its weights, and they only while it waits for their samples, so it gets every core
    alternate = cfg.rollout.async_ratio == 0 and not cfg.run.torch_threads
    generators = [label for label in models if service_of(label) != "trainer"]
    out = {}
    for label in labels:
        if not runs_model(label):
            out[label] = 1
        elif ray and not cfg.run.torch_threads:
            out[label] = max(1, int(value_at(cfg, SERVICES[service_of(label)].placement_key).cpus))
        elif alternate:
            out[label] = n if service_of(label) == "trainer" else max(1, n // max(1, len(generators)))
        else:
            out[label] = share
    return out
