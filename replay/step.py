"""``rollstream replay step RUN N``: recompute one training step from the record.

1. The run's config is read from ``runs/<id>/config.yaml``; the step's batch is rebuilt from the
   record: the ``TrainStep`` event of step N lists its samples in training order, and every
   ``ScoredSample`` event is stored whole (``events.payload``), so the batch is exactly what the
   trainer trained on.
2. The state the step started from is restored: the trainer checkpoints the state *before* step
   ``k`` at ``runs/<id>/checkpoints/step_<k>`` (model, optimizer, critic, algorithm state; step 0
   and every ``train.checkpoint_every`` steps). The latest checkpoint ``k <= N`` is loaded, and
   steps ``k .. N-1`` are re-run from their recorded batches (deterministic on CPU), so the
   weights and optimizer state are those step N started from.
3. Step N runs through the same code path as in the run (:meth:`Trainer.train_batch`), and its
   metrics are printed beside the recorded ones. Timing metrics (``perf/*``) are left out.

On CPU with the same torch thread count the numbers match the recorded ones to float round-off
(the test checks 1e-6). Nothing of the run is modified: the replay trains a copy in memory.

A visual run's samples name their images by digest (``image_hashes``); the trainer loads them from
the run's blob store, ``runs/<id>/blobs``, as it did in the run (:mod:`trainer.vlm`). Every image
of the steps to run is looked up before the checkpoint is restored: a missing or corrupt one is a
:class:`ReplayError` naming the sample and the blob.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import store as st
from blobs import BlobError, BlobStore, blob_dir_of
from replay.record import ReplayError, decode_payload
from schemas import events as ev
from schemas.config import RunConfig

__all__ = ["ReplayError", "StepReplay", "check_images", "compare", "recorded_batch", "recorded_steps", "replay_train_step"]


@dataclass
class StepReplay:
    """The outcome of :func:`replay_train_step`."""

    step: int
    from_checkpoint: int
    recorded: dict[str, float]
    replayed: dict[str, float]
    rows: list[tuple[str, float | None, float | None, float | None]] = field(default_factory=list)
    """``(metric, recorded, replayed, |difference|)`` for every metric of either side."""

    @property
    def max_abs_diff(self) -> float:
        diffs = [d for _, _, _, d in self.rows if d is not None]
        return max(diffs) if diffs else 0.0


def _decode(name: str, kind: str, payload: str) -> Any:
    event, _ = decode_payload(name, kind, payload)  # NaN metrics are stored as null: they come back as NaN
    return event


def recorded_steps(client: Any, run_id: str, first: int, last: int) -> dict[int, ev.TrainStep]:
    """The ``TrainStep`` events of steps ``first..last`` from the record."""
    rows = client.query(
        "SELECT payload FROM events WHERE run_id = {r:String} AND kind = 'TrainStep' "
        "AND JSONExtractInt(payload, 'step') BETWEEN {a:Int64} AND {b:Int64} ORDER BY offset",
        parameters={"r": run_id, "a": first, "b": last}).result_rows
    out: dict[int, ev.TrainStep] = {}
    for (payload,) in rows:
        e = _decode("metrics", "TrainStep", payload)
        out[e.step] = e
    return out


def recorded_batch(client: Any, run_id: str, sample_ids: list[str]) -> list[ev.ScoredSample]:
    """The ``ScoredSample`` events of ``sample_ids``, in that order (first record of each id)."""
    rows = client.query(
        "SELECT payload FROM events WHERE run_id = {r:String} AND kind = 'ScoredSample' "
        "AND JSONExtractString(payload, 'generation', 'task', 'sample_id') IN {ids:Array(String)} "
        "ORDER BY topic, partition, offset",
        parameters={"r": run_id, "ids": sample_ids}).result_rows
    by_id: dict[str, ev.ScoredSample] = {}
    for (payload,) in rows:
        s = _decode("scored", "ScoredSample", payload)
        by_id.setdefault(s.generation.task.sample_id, s)
    missing = [sid for sid in sample_ids if sid not in by_id]
    if missing:
        raise ReplayError(f"{len(missing)} samples of the step are not in the record (e.g. {missing[0]})")
    return [by_id[sid] for sid in sample_ids]


def check_images(samples: list[ev.ScoredSample], blobs: BlobStore) -> None:
    """Raise :class:`ReplayError` naming the first sample whose image is missing from ``blobs``."""
    for s in samples:
        task = s.generation.task
        for h in [*task.image_hashes, *s.generation.image_hashes]:
            if not blobs.has(h):
                raise ReplayError(f"sample {task.sample_id}: image {h} is missing from the run's blob store "
                                  f"{blobs.root} (replay step trains on the recorded images)")


def compare(recorded: dict[str, float], replayed: dict[str, float]) -> list[tuple[str, float | None, float | None, float | None]]:
    """``(metric, recorded, replayed, |difference|)`` for every metric of either side but the
    timings (``perf/*``); the difference is ``None`` where a side is missing or not finite."""
    rows = []
    for key in sorted(set(recorded) | set(replayed)):
        if key.startswith("perf/"):
            continue
        a, b = recorded.get(key), replayed.get(key)
        diff = abs(a - b) if a is not None and b is not None and math.isfinite(a) and math.isfinite(b) else None
        rows.append((key, a, b, diff))
    return rows


def replay_train_step(cfg: RunConfig, run_id: str, step: int, *, dsn: str = "", device: str = "cpu",
                      progress: Any = None) -> StepReplay:
    """Recompute step ``step`` of run ``run_id`` (see the module doc)."""
    from launch.prepare import model_dir_of
    from launch.supervisor import run_dir_of, store_dsn_of
    from services.trainer import Trainer, TrainerSettings
    from services.trainer.groups import baseline_ids

    run_dir = run_dir_of(cfg, run_id)
    say = progress or (lambda msg: None)
    if step < 0:
        raise ReplayError(f"step {step}: steps start at 0")
    client = st.connect_reader(dsn or store_dsn_of(cfg, run_id))
    try:
        model_dir = model_dir_of(cfg, run_dir)
        trainer = Trainer(TrainerSettings(run_id=run_id, config=cfg, model_dir=str(model_dir), run_dir=str(run_dir),
                                          device=device))
        ckpts = [k for k in trainer.checkpoints.steps() if k <= step]
        if not ckpts:
            raise ReplayError(f"run {run_id} has no checkpoint at or before step {step} in {run_dir / 'checkpoints'} "
                              "(runs made before per-step checkpoints cannot be replayed)")
        start = ckpts[-1]
        steps = recorded_steps(client, run_id, start, step)
        if step not in steps:
            done = client.query("SELECT count(), max(step) FROM train_steps FINAL WHERE run_id = {r:String}",
                                parameters={"r": run_id}).result_rows
            last = done[0][1] if done and done[0][0] else None
            raise ReplayError(f"run {run_id} has no recorded training step {step}"
                              + (f" (last step: {last})" if last is not None else ""))
        batches = {k: recorded_batch(client, run_id, list(steps[k].sample_ids)) for k in range(start, step + 1)}
        baselines = {k: recorded_batch(client, run_id, ids) if (ids := baseline_ids(steps[k].sample_ids,
                                                                                   trainer.baseline_index)) else []
                     for k in range(start, step + 1)}  # ReMax: the groups' greedy baselines
    finally:
        client.close()
    replayed: dict[str, float] = {}
    try:
        check_images([s for k in batches for s in (*batches[k], *baselines[k])], BlobStore(blob_dir_of(run_dir)))
        say(f"restoring the checkpoint of step {start}")
        trainer.load_checkpoint(start)
        for k in range(start, step + 1):
            say(f"{'re-running' if k < step else 'recomputing'} step {k} ({len(batches[k])} samples)")
            trainer.state.version = steps[k].policy_version
            try:
                replayed = trainer.train_batch(batches[k], baselines[k])
            except BlobError as e:  # a blob that changed since it was checked
                raise ReplayError(f"step {k}: {e}") from None
    finally:
        trainer.close()  # a multi-rank strategy's processes
    recorded = dict(steps[step].metrics)
    return StepReplay(step=step, from_checkpoint=start, recorded=recorded, replayed=replayed,
                      rows=compare(recorded, replayed))
