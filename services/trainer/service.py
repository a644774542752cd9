"""The trainer service: the only barrier of a run (docs/architecture.md, "The trainer service").

:class:`Trainer` runs on :mod:`runtime.runner` as a batch service in its group on ``scored``,
``dlq`` and ``control`` (:data:`schemas.services.SERVICES`) and commits the positions each
checkpoint saved. It is composed of its parts, each a field:

* ``strategy``: the training backend (:func:`trainer.factory.make_strategy`);
* ``state``: the checkpointable :class:`~services.trainer.state.TrainerState`;
* ``groups``: the undecided samples and every decision about them (:mod:`services.trainer.groups`);
* ``evaluation``: the evaluation engine and held-out problems (:mod:`services.trainer.evaluation`);
* ``checkpoints``: checkpoints and weights on disk (:mod:`services.trainer.checkpoint`);
* ``history`` and ``replay``: what earlier instances published, and the recorded steps a resumed
  trainer re-runs (:mod:`services.trainer.history`).

Per poll the service takes in scored samples, dead letters and control events, trains while
complete groups fill a batch (outputs acknowledged, then the new weights announced), evaluates and
checkpoints when due, and at the end (``train.steps``, or another's ``Drain``) evaluates, exports the
final model (``runs/<id>/final``), checkpoints and publishes its own ``Drain(origin="trainer")``; it exits when the feeder publishes ``RunFinished``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec
import torch

from blobs import blob_dir_of
from runtime.bus import Record, TopicPartition, next_offsets
from runtime.memory import peak_memory_gib
from runtime.runner import BatchContext, BatchService, Runner, ServiceSettings
from runtime.settings import Consume, Delivery, Handling, Subscription
from schemas import events as ev
from schemas.config import RunConfig
from schemas.devices import resolve_device
from schemas.errors import to_thread
from schemas.sanity import check_scored
from schemas.services import SERVICES
from services.trainer.checkpoint import Checkpoints, export_final, weights_dir
from services.trainer.evaluation import Evaluation
from services.trainer.groups import BASELINE_REASON, Groups
from services.trainer.history import History, Replay, read_history
from services.trainer.publish import WeightsPublisher, resolve_handoff, weight_sender
from services.trainer.state import TrainerState, position_key
from services.trainer.warmup import warm_up
from trainer.batch import samples_from_scored
from trainer.factory import make_strategy

log = logging.getLogger("rollstream.trainer")

SPEC = SERVICES["trainer"]

__all__ = ["STOPPED_PREFIX", "TRAINING_COMPLETE", "Trainer", "TrainerSettings", "service_settings"]

TRAINING_COMPLETE = "training complete"
"""Reason of the trainer's ``Drain`` after its last step."""
STOPPED_PREFIX = "trainer stopped"
"""Start of the reason of the trainer's ``Drain`` when it stopped early (someone drained the run)."""


class TrainerSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Settings of the trainer (one per run)."""

    run_id: str
    """The run to train."""
    config: RunConfig
    """The run config (train, algorithm, rollout.temperature, data for eval)."""
    model_dir: str
    """Initial model (HF directory)."""
    run_dir: str
    """The run directory: weights/, checkpoints/ go below it."""
    device: str = ""
    """Torch device; empty = ``train.device`` of the config, resolved here."""
    poll_timeout_s: float = 0.2
    """Longest wait for scored samples per poll, seconds."""
    eval_batch: int = 64
    """Concurrent sequences of the evaluation engine."""


class Trainer(BatchService):
    """The trainer service (see the module doc)."""

    name = "trainer"

    def __init__(self, settings: TrainerSettings) -> None:
        self.s = settings
        cfg = self.cfg = settings.config
        torch.manual_seed(cfg.run.seed)
        random.seed(cfg.run.seed)
        self.run_dir = Path(settings.run_dir)
        device = settings.device or resolve_device(cfg.train.device, "train.device")
        self.device = device
        self.strategy = make_strategy(cfg, settings.model_dir, device=device, blob_dir=blob_dir_of(self.run_dir))
        # the evaluation runs a local torch engine whatever rollout.engine is
        self.evaluation = Evaluation(cfg, settings.model_dir, device=device, max_batch=settings.eval_batch,
                                     blob_dir=blob_dir_of(self.run_dir))
        self.checkpoints = Checkpoints(self.run_dir, cfg.train.keep_checkpoints)
        self.publisher = WeightsPublisher(settings.run_id, self.run_dir, resolve_handoff(cfg), sender=weight_sender(cfg))
        self.state = TrainerState()
        self.groups = Groups(self.state, cfg.algorithm, settings.run_id)
        r = cfg.rollout
        self.baseline_index = r.group_size + r.group_size_redundancy if cfg.algorithm.adv_estimator == "remax" else -1
        """The ReMax baseline's index in every group (``-1``: none; the feeder's rule)."""
        self.history = History()
        """What earlier instances of this run's trainer published (read on a resume)."""
        self.replay = Replay()
        self.runner: Runner | None = None
        self.drained = False
        self.finished = False
        self.stop_reason = ""
        """Why to stop before ``train.steps`` (a ``Drain`` this trainer did not publish); empty: train on."""
        self._evaluated: set[int] = set()

    def service_settings(self) -> ServiceSettings:
        """How the trainer runs on :mod:`runtime.runner` (:func:`service_settings`)."""
        return service_settings(self.s)

    def close(self) -> None:
        """Release what the training backend holds (a multi-rank strategy's processes) and the
        shared-memory weights this process published; idempotent."""
        self.publisher.close()
        close = getattr(self.strategy, "close", None)
        if close is not None:
            close()

    # ----------------------------------------------------------------- state on disk

    def save_checkpoint(self) -> Path:
        """Checkpoint the strategy and the whole state (before step ``state.step``)."""
        return self.checkpoints.save(self.strategy, self.state)

    def load_checkpoint(self, step: int | None = None) -> bool:
        """Restore the latest checkpoint (or the one of ``step``); False when there is none."""
        path = self.checkpoints.find(step)
        if path is None:
            return False
        self.setup_algorithm_models(fresh=False)
        self.state = self.checkpoints.load(path, self.strategy)
        self.groups = Groups(self.state, self.cfg.algorithm, self.s.run_id)
        return True

    def setup_algorithm_models(self, fresh: bool) -> None:
        """Load the reference model (only when a KL term is on) and create the critic (only for
        ``gae``). Fresh: the reference is the current policy (the RL start, after the warm-up),
        exported once to ``<run>/reference``; on resume it is read back from there."""
        algo = self.cfg.algorithm
        if algo.uses_reference:
            ref_dir = self.run_dir / "reference"
            if fresh:
                self.strategy.export_weights(ref_dir)
            self.strategy.init_reference(ref_dir)
        if fresh and algo.critic != "none":
            self.strategy.init_critic()

    async def weights_event(self) -> ev.WeightsPublished:
        """Export the weights of ``state.version`` and describe them (by disk or memory:
        :mod:`services.trainer.publish`)."""
        return await self.publisher.publish(self.strategy, self.state.version, self.state.step)

    async def weights_if_behind(self) -> ev.WeightsPublished | None:
        """The ``WeightsPublished`` of the current version (exported now) unless the newest one
        on the topic already is it (rollout workers follow the newest message)."""
        w = self.history.weights
        if w is not None and w.policy_version == self.state.version and Path(w.uri).is_dir():
            return None
        return await self.weights_event()

    async def eval_event(self, split: str) -> ev.EvalResult:
        """An evaluation of the current version as the ``EvalResult`` to publish (with the greedy
        answers to a few held-out problems)."""
        version = self.state.version
        answers: list[ev.EvalAnswer] = []
        metrics = await self.evaluation.run(self.publisher.local_ref(version), version, answers)
        return ev.EvalResult(run_id=self.s.run_id, step=self.state.step, policy_version=version, split=split,
                             metrics=metrics, answers=answers)

    # ----------------------------------------------------------------- hooks

    async def on_start(self, runner: Runner) -> None:
        """Resume from the latest checkpoint, or start: the initial eval, the warm-up, step 0."""
        self.runner = runner
        self.history = await read_history(self.cfg.kafka, self.s.run_id)
        if self.load_checkpoint():
            self.resume_from(self.history)
            log.info("resumed from the checkpoint of step %d; %d later step(s) on the record to re-run from their "
                     "batches", self.state.step, len(self.replay.steps))
            if not self.replay and (weights := await self.weights_if_behind()) is not None:
                await runner.send("weights", weights, key="latest")
            return
        due = [split for split in ("init", "heldout") if (split, 0) not in self.history.evals]
        if self.cfg.train.warmup_sft_steps > 0 and "init" in due:  # the model before the warm-up changes it
            await runner.send("metrics", await self.eval_event("init"), key="0")
            due.remove("init")
        e = self.evaluation  # the warm-up draws from its sources and renders prompts as its engine does
        losses = await to_thread(warm_up, self.strategy, self.cfg, e.sources, e.engine.chat, e.limits)
        if losses:
            log.info("warm-up: %d steps, loss %.3f -> %.3f", len(losses), losses[0], losses[-1])
        await to_thread(self.setup_algorithm_models, True)
        await to_thread(self.save_checkpoint)  # step 0: what replay starts from
        await runner.send("weights", await self.weights_event(), key="latest")  # rollout starts now
        if due:  # without a warm-up "init" and "heldout" are the same weights: evaluated once
            first = await self.eval_event(due[0])
            await runner.send("metrics", first, *[
                ev.EvalResult(run_id=first.run_id, step=0, policy_version=first.policy_version, split=split,
                              metrics=first.metrics, answers=first.answers) for split in due[1:]], key="0")
        self._evaluated.add(0)

    def resume_from(self, history: History) -> None:
        """After :meth:`load_checkpoint`: take in what earlier instances published after that
        checkpoint. Steps on the record are re-run from their batches (their samples wait in the
        state's ``pool``); samples decided meanwhile stay decided; a user ``Drain`` or
        ``RunFinished`` on the record still holds."""
        self.history = history
        st = self.state
        for s in st.pool.values():  # an earlier re-run's: sorted out again below, with the buffer
            self.groups.add(s)
        self.replay = Replay.of(history, st.step, self.baseline_index)
        decided = {sid for sid in history.outcomes if sid not in self.replay.ids}
        waiting = self.groups.remove(self.replay.ids | decided)
        st.pool = {s.generation.task.sample_id: s for s in waiting if s.generation.task.sample_id in self.replay.ids}
        st.decided |= decided
        if history.user_drain is not None:
            self.stop_reason = history.user_drain.reason or "drained"
        elif history.trainer_drained and st.step + len(self.replay.steps) < self.cfg.train.steps:
            self.stop_reason = "drained before the restart"
        self.finished = history.finished

    async def on_assigned(self, runner: Runner, tps: set[TopicPartition]) -> None:
        """Continue exactly at the trainer's own positions (the checkpoint's after a resume)."""
        for tp in tps:
            if (offset := self.state.positions.get(position_key(tp.topic, tp.partition))) is not None:
                runner.consumer.seek(tp, offset)

    async def handle_batch(self, records: list[Record], ctx: BatchContext) -> None:
        """Take in the poll's scored samples, dead letters and control events, then train as far
        as complete groups allow."""
        self.state.positions.update({position_key(tp.topic, tp.partition): off
                                     for tp, off in next_offsets(ctx.polled).items()})
        for letter in ctx.dead_letters:  # undecodable scored records the runtime dead-lettered
            self.groups.dead_letter(letter.sample_id, letter.group_id)
        for rec in records:
            event = rec.event
            if isinstance(event, ev.ScoredSample):
                task = event.generation.task
                why = check_scored(event)
                if why is not None:
                    ctx.reject(rec, why)
                    self.groups.dead_letter(task.sample_id, task.group_id)
                elif task.sample_id in self.replay.ids:
                    self.state.pool.setdefault(task.sample_id, event)
                elif self.groups.add(event):
                    self._emit_by_group(ctx, self.groups.cancel_surplus(task.group_id))
            elif isinstance(event, ev.DeadLetter):
                if event.sample_id in self.replay.ids:
                    continue  # trained at a recorded step: that stands
                if self.groups.dead_letter(event.sample_id, event.group_id):
                    log.info("sample %s dead-lettered by %s (%s): its group completes without it",
                             event.sample_id, event.service, event.error)
            elif isinstance(event, ev.RunFinished):
                self.finished = True
            elif isinstance(event, ev.Drain) and event.origin != "trainer" and not self.stop_reason:
                self.stop_reason = event.reason or "drained"
                log.info("drain (%s): no new step after step %d; final eval, checkpoint, then done",
                         self.stop_reason, self.state.step)
        await self.advance(ctx)

    async def on_tick(self, runner: Runner) -> None:
        if self.finished:
            runner.stop.set()
        elif not runner.last_polled:  # e.g. a resumed buffer that already fills a batch
            ctx = BatchContext(runner, [])
            await self.advance(ctx)
            await ctx.flush()

    # ----------------------------------------------------------------- steps

    async def advance(self, ctx: BatchContext) -> None:
        """Filter complete groups, train while complete groups fill a batch, drain at the end."""
        train = self.cfg.train
        if self.drained:
            self._emit(ctx, self.groups.close_all("run finished: arrived after the last step"))
            return
        if self.replay:
            await self._replay(ctx)
            if self.replay:
                return  # the samples of a recorded step are still being read
        self._emit_by_group(ctx, self.groups.filter_complete())
        while not self.stop_reason and self.state.step < train.steps and (
                gids := self.groups.next_batch(train.batch_size)) is not None:
            await self.train_once(gids, ctx)
            await self._after_step(ctx)
        if self.state.step >= train.steps or self.stop_reason:
            await self._finish(ctx)

    def train_batch(self, batch: list[ev.ScoredSample],
                    baselines: Sequence[ev.ScoredSample] = ()) -> dict[str, float]:
        """One optimizer step on an assembled batch (no Kafka): every metric of the step.
        ``baselines``: the ReMax baselines of its groups (their rewards only; never trained).

        ``replay step`` calls this on a batch rebuilt from the record after restoring the
        checkpoint the step started from, so it must depend only on the batch and that state.
        """
        t0 = time.perf_counter()
        metrics = self.strategy.train_step(samples_from_scored(batch, baselines))
        self.state.step = self.strategy.step
        metrics["perf/step_s"] = time.perf_counter() - t0
        rewards = torch.tensor([s.reward for s in batch])
        gaps = [self.state.version - s.generation.policy_version for s in batch]
        metrics["rollout/reward_mean"] = float(rewards.mean())
        metrics["rollout/reward_std"] = float(rewards.std()) if len(batch) > 1 else 0.0
        metrics["rollout/response_len_mean"] = float(sum(len(s.generation.response_ids) for s in batch) / len(batch))
        metrics["rollout/staleness_mean"] = float(sum(gaps) / len(batch))
        metrics["offpolicy/version_gap_max"] = float(max(gaps))
        metrics["perf/train_tokens_per_s"] = metrics.get("train/tokens", 0.0) / max(1e-9, metrics["perf/step_s"])
        # peak memory per process (runtime.memory): this trainer's, and the highest its batch's rollout workers reported
        metrics["perf/peak_memory_gib"] = peak_memory_gib(self.device)
        metrics["perf/rollout_peak_memory_gib"] = max((s.generation.peak_memory_gib for s in batch), default=0.0)
        return metrics

    async def train_once(self, group_ids: list[str], ctx: BatchContext) -> dict[str, float]:
        """Assemble the batch of these groups, train one step, send its outputs (acknowledged)."""
        st = self.state
        step = st.step
        batch, baselines, outcomes = self.groups.assemble(group_ids, self.cfg.train.max_staleness)
        metrics: dict[str, float] = {}
        weights: ev.WeightsPublished | None = None
        if batch:
            hist = Counter(st.version - smp.generation.policy_version for smp in batch)
            metrics = await to_thread(self.train_batch, batch, baselines)
            if self.cfg.rollout.release_between_steps != "off" and self.device.startswith("cuda"):
                torch.cuda.empty_cache()  # the step's freed blocks back to the driver: the engine on this GPU takes them
            outcomes += [self.groups.outcome(s, "trained", step=step) for s in batch]
            trained_version = st.version
            st.version += 1
            ctx.emit("metrics", ev.TrainStep(
                run_id=self.s.run_id, step=step, policy_version=trained_version, metrics=metrics,
                sample_ids=[s.generation.task.sample_id for s in batch], staleness_hist=dict(hist),
            ), key=str(step))
        self._emit(ctx, outcomes, key=str(step))
        # the step's record goes out while its weights export (a thread): both done before the announcement
        sent = asyncio.ensure_future(ctx.flush())
        try:
            if batch:
                weights = await self.weights_event()
        finally:
            await sent
        if weights is not None:
            # after the step's record: a new version is never announced before its TrainStep, so
            # a trainer resuming from an older checkpoint re-runs every step behind the newest weights
            ctx.emit("weights", weights, key="latest")
            await ctx.flush()
        return metrics

    async def _replay(self, ctx: BatchContext) -> None:
        """Re-run the recorded steps whose samples are all here, in order, from their batches
        (the ``TrainStep``'s sample ids, in training order): the model comes back to where the
        earlier instance left it. Nothing of these steps is published again (only outcomes the
        earlier instance did not get out); once caught up, the current weights are published
        unless the topic's newest already are them."""
        st = self.state
        while (ids := self.replay.steps.get(st.step)) is not None and all(
                i in st.pool for i in ids + self.replay.baselines.get(st.step, [])):
            step = st.step
            recorded = self.history.steps[step]
            if recorded.policy_version != st.version:
                log.warning("step %d trained version %d on the record, re-run at version %d", step,
                            recorded.policy_version, st.version)
            batch = [st.pool.pop(i) for i in ids]
            baselines = [st.pool.pop(i) for i in self.replay.baselines.get(step, [])]
            await to_thread(self.train_batch, batch, baselines)
            outcomes = [self.groups.outcome(s, "trained", step=step) for s in batch]
            outcomes += [self.groups.outcome(b, "filtered", BASELINE_REASON) for b in baselines]
            st.version += 1
            self._emit(ctx, [o for o in outcomes if o.sample_id not in self.history.outcomes], key=str(step))
            self.replay.finish(step)
            await self._after_step(ctx, replaying=True)
        if self.replay and min(self.replay.steps) < st.step:  # cannot happen: steps are contiguous
            log.error("recorded steps %s are behind step %d; ignored", sorted(self.replay.steps), st.step)
            self.replay.clear()
        if not self.replay:
            leftovers, st.pool = list(st.pool.values()), {}
            for s in leftovers:  # not in any recorded batch any more: an ordinary sample
                if self.groups.add(s):
                    self._emit_by_group(ctx, self.groups.cancel_surplus(s.generation.task.group_id))
            self.replay.clear()
            log.info("caught up with the record at step %d (%d step(s) re-run)", st.step, self.replay.done)
            if (weights := await self.weights_if_behind()) is not None:
                ctx.emit("weights", weights, key="latest")

    async def _after_step(self, ctx: BatchContext, replaying: bool = False) -> None:
        """The evaluation and checkpoint due after a step (an evaluation already on the record is
        not repeated)."""
        train, step = self.cfg.train, self.state.step
        if train.eval_every and step % train.eval_every == 0 and step < train.steps:
            await self._evaluate(ctx, export=replaying)
        if train.checkpoint_every and step % train.checkpoint_every == 0:
            await self._checkpoint(ctx)

    async def _evaluate(self, ctx: BatchContext, export: bool = False) -> None:
        step = self.state.step
        if step in self._evaluated or ("heldout", step) in self.history.evals:
            return
        if export:  # re-run steps publish no weights: the evaluation reads this version's from disk
            await to_thread(self.strategy.export_weights, weights_dir(self.run_dir, self.state.version))
        ctx.emit("metrics", await self.eval_event("heldout"), key=str(step))
        self._evaluated.add(step)

    async def _checkpoint(self, ctx: BatchContext) -> None:
        """Checkpoint once every output so far is acknowledged, then commit its positions."""
        await ctx.flush()
        await to_thread(self.save_checkpoint)
        if self.runner is not None:
            positions = {}
            for key, offset in self.state.positions.items():
                topic, _, partition = key.rpartition(":")
                positions[TopicPartition(topic, int(partition))] = offset
            await self.runner.commit(positions)

    async def _finish(self, ctx: BatchContext) -> None:
        """After the last step (or another's ``Drain``): final evaluation, final model, checkpoint, ``Drain``,
        leftovers closed as "run finished". What the record already has is not repeated."""
        step, steps = self.state.step, self.cfg.train.steps
        await self._evaluate(ctx)
        await self.publisher.settle()  # the last version's directory is on disk before the run ends
        final = await to_thread(export_final, self.strategy, self.run_dir)
        log.info("final model (policy version %d, after %d steps): %s", self.state.version, step, final)
        if self.checkpoints.steps()[-1:] != [step]:
            await self._checkpoint(ctx)
        if not self.history.trainer_drained:
            reason = (TRAINING_COMPLETE if step >= steps and not self.stop_reason
                      else f"{STOPPED_PREFIX} after {step} of {steps} steps: {self.stop_reason}")
            ctx.emit("control", ev.Drain(run_id=self.s.run_id, reason=reason, origin="trainer"))
        self.drained = True
        self._emit(ctx, self.groups.close_all("run finished: arrived after the last step"))

    @staticmethod
    def _emit(ctx: BatchContext, outcomes: Iterable[ev.SampleOutcome], key: str | None = None) -> None:
        for o in outcomes:
            ctx.emit("metrics", o, key=key)

    @staticmethod
    def _emit_by_group(ctx: BatchContext, outcomes: Iterable[ev.SampleOutcome]) -> None:
        for o in outcomes:
            ctx.emit("metrics", o, key=o.group_id)

    # ----------------------------------------------------------------- running

    async def run(self, stop: asyncio.Event | None = None) -> int:
        """Train until the run finished (or until stopped); the last step. The training backend is
        closed on the way out (a multi-rank strategy's processes)."""
        try:
            await Runner(self, self.service_settings(), stop).run()
        finally:
            await to_thread(self.close)
        return self.state.step


def service_settings(s: TrainerSettings) -> ServiceSettings:
    """How the trainer runs on :mod:`runtime.runner`: what its :data:`SPEC` subscribes (``control``
    only observed), one batch handler call per poll, and the commits its own (the positions each
    checkpoint saved)."""
    return ServiceSettings(
        run_id=s.run_id, kafka=s.config.kafka, subscription=Subscription.of(SPEC, s.run_id),
        consume=Consume(batch_max_records=500, poll_timeout_s=s.poll_timeout_s, max_poll_interval_s=1800.0),
        handling=Handling(shutdown_grace_s=300.0),  # a training step under way at a stop finishes (its state is not cancellable)
        delivery=Delivery(commit="by_service"),
    )
