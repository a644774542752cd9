"""What the run's topics say the trainer already did: read once when a trainer resumes.

A trainer that restarts from a checkpoint older than its last step (it checkpoints every
``train.checkpoint_every`` steps; a crash can come at any point) finds on the topics what the
earlier instance decided after that checkpoint: the ``TrainStep`` of each step it trained (with
the batch's sample ids in training order), every ``SampleOutcome``, the evaluations, its own
``Drain`` (``origin="trainer"``) and the newest ``WeightsPublished``. :class:`History` keeps exactly
that, and :func:`read_history` reads it from ``metrics``, ``control`` and ``weights`` (from the
beginning to the ends they had when the read started). :class:`Replay` is the part of it a resumed
trainer still has to re-run: the recorded steps from its checkpoint on, and their batches' ids.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import msgspec

from runtime.bus import BusError, Consumer, TopicPartition
from runtime.reading import ReadTimeout, read_to_end
from schemas import events as ev
from schemas.config import KafkaSettings
from schemas.topics import split_value, topic_name
from services.trainer.groups import baseline_ids

log = logging.getLogger("rollstream.trainer")

__all__ = ["History", "Replay", "read_history"]


@dataclass
class History:
    """What an earlier trainer instance of the run published (see the module doc)."""

    steps: dict[int, ev.TrainStep] = field(default_factory=dict)
    """Step -> its ``TrainStep`` (the first one when a step appears twice)."""
    outcomes: dict[str, ev.SampleOutcome] = field(default_factory=dict)
    """Sample id -> its first ``SampleOutcome`` (from the trainer or the feeder)."""
    evals: set[tuple[str, int]] = field(default_factory=set)
    """``(split, step)`` of every ``EvalResult``."""
    trainer_drained: bool = False
    """A trainer published its ``Drain``."""
    user_drain: ev.Drain | None = None
    """The first ``Drain`` a trainer did not publish (``rollstream stop``, the wall limit)."""
    finished: bool = False
    """``RunFinished`` is on ``control``."""
    weights: ev.WeightsPublished | None = None
    """The newest ``WeightsPublished`` (what rollout workers hold)."""

    def observe(self, event: object) -> None:
        if isinstance(event, ev.TrainStep):
            self.steps.setdefault(event.step, event)
        elif isinstance(event, ev.SampleOutcome):
            self.outcomes.setdefault(event.sample_id, event)
        elif isinstance(event, ev.EvalResult):
            self.evals.add((event.split, event.step))
        elif isinstance(event, ev.Drain):
            if event.origin == "trainer":
                self.trainer_drained = True
            elif self.user_drain is None:
                self.user_drain = event
        elif isinstance(event, ev.RunFinished):
            self.finished = True
        elif isinstance(event, ev.WeightsPublished):
            self.weights = event

    def steps_from(self, step: int) -> dict[int, list[str]]:
        """Step -> batch sample ids of the recorded steps at or after ``step`` (contiguous: a
        gap ends them, as a trainer never skips a step)."""
        out: dict[int, list[str]] = {}
        while step in self.steps:
            out[step] = list(self.steps[step].sample_ids)
            step += 1
        return out


@dataclass
class Replay:
    """The recorded steps a resumed trainer re-runs from their batches, in order."""

    steps: dict[int, list[str]] = field(default_factory=dict)
    """Step -> its batch's sample ids in training order (steps not re-run yet)."""
    ids: set[str] = field(default_factory=set)
    """Every sample id of those batches and of their ReMax baselines (their samples wait in the
    state's ``pool``)."""
    baselines: dict[int, list[str]] = field(default_factory=dict)
    """Step -> the ReMax baseline ids of its batch's groups (empty without ReMax): the step's
    re-run needs their rewards."""
    done: int = 0
    """Steps re-run so far by this instance."""

    @classmethod
    def of(cls, history: History, step: int, baseline_index: int = -1) -> Replay:
        """The steps on the record from ``step`` on (:meth:`History.steps_from`); ``baseline_index``:
        the ReMax baseline's index in every group (``-1``: none)."""
        steps = history.steps_from(step)
        baselines = {k: baseline_ids(ids, baseline_index) for k, ids in steps.items()}
        return cls(steps, {sid for k, ids in steps.items() for sid in ids + baselines[k]}, baselines)

    def __bool__(self) -> bool:
        """Steps are left to re-run."""
        return bool(self.steps)

    def finish(self, step: int) -> None:
        """Step ``step`` was re-run."""
        self.ids.difference_update(self.steps.pop(step) + self.baselines.pop(step, []))
        self.done += 1

    def clear(self) -> None:
        self.steps.clear()
        self.ids.clear()
        self.baselines.clear()


async def read_history(kafka: KafkaSettings, run_id: str, timeout_s: float = 120.0) -> History:
    """The :class:`History` of ``run_id``: its ``metrics``, ``control`` and ``weights`` topics
    read from the beginning to the end offsets they had when the read started. Raises
    :class:`BusError` when that takes longer than ``timeout_s``."""
    names = [topic_name(run_id, n) for n in ("metrics", "control", "weights")]
    history = History()
    async with Consumer(kafka, group_id=None, topics=names, auto_offset_reset="earliest",
                        client_suffix="trainer-history") as consumer:

        def take(tp: TopicPartition, record: Any) -> None:
            try:
                parts = split_value(record.value) or [record.value]
            except msgspec.DecodeError:
                return
            for value in parts:  # every event of a batched record
                event, _ = consumer.decode(tp.topic, value)
                if event is not None:
                    history.observe(event)

        try:
            await read_to_end(consumer.raw, take, timeout_s=timeout_s, poll_ms=200, max_records=10_000,
                              what=f"the history of run {run_id}")
        except ReadTimeout as e:
            raise BusError(f"trainer: {e}") from None
    return history
