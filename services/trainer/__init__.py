"""The trainer service (``rollstream service trainer``): :func:`settings_from` and :func:`run`.

The service (:mod:`services.trainer.service`) is composed of its parts, one module each: its
checkpointable state (:mod:`.state`), the groups of undecided samples and every decision about
them (:mod:`.groups`), what earlier instances published (:mod:`.history`), checkpoints and weights
on disk (:mod:`.checkpoint`), the evaluation wiring (:mod:`.evaluation`, over
:mod:`trainer.evaluate`) and the supervised warm-up (:mod:`.warmup`). docs/architecture.md,
"The trainer service", tells the whole story.
"""

from __future__ import annotations

import asyncio

from services import ServiceStart
from services.trainer.service import Trainer, TrainerSettings, service_settings

__all__ = ["Trainer", "TrainerSettings", "run", "service_settings", "settings_from"]


def settings_from(start: ServiceStart) -> TrainerSettings:
    """The trainer's settings in a run (``rollstream service trainer``)."""
    return TrainerSettings(run_id=start.run_id, config=start.config, model_dir=start.model_dir,
                           run_dir=str(start.run_dir))


async def run(settings: TrainerSettings, stop: asyncio.Event | None = None) -> int:
    """Train until the run finished (or until stopped). Returns the last step."""
    return await Trainer(settings).run(stop)
