"""The service handlers, one module each (the table of services: :data:`schemas.services.SERVICES`).

Every handler module has the same entry: ``settings_from(start)`` builds its settings from a
:class:`ServiceStart`, ``service_settings(settings)`` says how it runs on the runtime (its
subscription is the table's), and ``run(settings, stop)`` runs it until the run finished or it is
told to stop. ``rollstream service NAME`` calls the first and the last (docs/architecture.md,
"Services").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from schemas.config import RunConfig

__all__ = ["ServiceStart"]


@dataclass(frozen=True)
class ServiceStart:
    """What a service process knows when it starts."""

    config: RunConfig
    """The run's config (as ``rollstream service`` resolved it: store, bootstrap, runs dir)."""
    run_id: str
    """The run."""
    run_dir: Path
    """The run's folder (config, model, weights, checkpoints, logs)."""
    model_dir: str
    """The run's initial model (a Hugging Face directory)."""
    label: str = ""
    """This process's label (``judge0``...; ``ROLLSTREAM_SERVICE_LABEL``); empty = the service name."""
