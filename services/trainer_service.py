"""The trainer service: the only barrier of a run.

It runs on :mod:`runtime.runner` as a batch service in consumer group
``rs-trainer-<run_id>`` on ``scored``, ``dlq`` and ``control``, with ``commit="by_service"``:
the runtime commits nothing; the trainer commits the positions saved in each checkpoint.

Start (``on_start``, fresh run): greedy eval of the initial model (split ``init``), supervised
warm-up (``train.warmup_sft_steps``, ``Strategy.warmup``), the reference model (only when a KL
term is on) and the critic (only for ``gae``), a checkpoint of step 0, export weights as version
0, publish ``WeightsPublished(0)``, greedy eval (the RL start, split ``heldout``); an evaluation
already on the record (an earlier instance died before its checkpoint of step 0) is not published
again. Without a warm-up both are the same weights: one evaluation, after the weights are
published (so rollout starts at once), is published under both splits.

Resume (a checkpoint exists): the latest checkpoint restores the model, optimizer, RNG, step,
buffer, decided and dead-lettered ids and positions, and ``on_assigned`` seeks every partition to
its saved position. The run's topics may hold more than the checkpoint knows — an earlier
instance trained, decided and evaluated after it, up to its crash — so the trainer first reads
that history (:mod:`services.trainer_history`) and never decides anything twice:

* every step on the record after the checkpoint is *re-run* from its recorded batch (the
  ``TrainStep``'s sample ids, in training order; the samples are read again from the saved
  positions and wait in :attr:`~services.trainer_core.TrainerCore.pool`), which brings the model
  back to where the earlier instance left it; no second ``TrainStep`` or outcome is published
  (the record keeps one row per step: the first instance's), only outcomes the earlier instance
  did not get out;
* samples decided after the checkpoint (filtered, dropped, closed) stay decided;
* evaluations, the trainer's ``Drain`` and a user's ``Drain`` on the record hold;
* once caught up, the weights of the current version are published unless the newest
  ``WeightsPublished`` already is them (rollout workers follow the newest message on the
  compacted ``weights`` topic; a new version is announced only after its ``TrainStep`` is
  acknowledged, so the newest weights are never ahead of the recorded steps).

Per poll (``handle_batch``, then ``on_tick`` when the poll was empty):

1. a ``ScoredSample`` joins the buffer of its group (:class:`services.trainer_buffer.GroupBuffer`)
   unless it was decided already; one with impossible values (:func:`schemas.sanity.check_scored`:
   a non-finite reward, response / logprobs / loss-mask lengths that disagree, an impossible
   group) is rejected: dead-lettered with the reason, and its sample ends as ``dead_letter``;
2. a ``DeadLetter`` naming a sample not decided yet ends that sample (no outcome from the
   trainer: the dead letter is its terminal record): it leaves the buffer and counts as a dead
   member of its group;
3. a group is complete when every member arrived or was dead-lettered
   (:func:`trainer.batch.group_complete`); a complete group with fewer than 2 members, or one
   that ``algorithm.dynamic_filter`` rejects, is recorded as ``filtered`` at once
   (:func:`trainer.batch.group_reject_reason`) and leaves the buffer;
4. when complete groups hold ``train.batch_size`` samples (:func:`trainer.batch.select_groups`,
   arrival order), :func:`trainer.batch.assemble` drops samples older than ``max_staleness``
   versions (``dropped_stale``; a group left with fewer than 2 members is ``filtered``) and one
   optimizer step runs (:meth:`Trainer.train_batch`: advantages, masks and the loss the
   ``algorithm`` section configures);
5. the weights are exported (``runs/<id>/weights/v<version>``); ``TrainStep`` (every metric and
   the batch's sample ids in training order) and one ``SampleOutcome(trained)`` per sample are
   sent, then, once acknowledged, ``WeightsPublished(version+1)``;
6. every ``eval_every`` steps: greedy eval -> ``EvalResult``; every ``checkpoint_every`` steps:
   a checkpoint of the state before the next step (``checkpoints/step_<k>``), after every output
   so far is acknowledged, then its positions are committed. ``replay step`` restarts
   from these.

After ``train.steps`` steps it publishes ``Drain("training complete")``. A ``Drain`` it did not
publish (``rollstream stop``) ends training early: no step starts after it (the one under way
finishes), then the final eval, a checkpoint and its own ``Drain("trainer stopped after k of N
steps: <reason>")``. Either way samples that still arrive are recorded as ``filtered`` ("run
finished"), and it exits when the feeder publishes ``RunFinished``. An
undecodable ``scored`` record is dead-lettered by the runtime (``control`` is only observed: the
feeder dead-letters its bad records).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from pathlib import Path

import torch

from runtime.bus import Record, TopicPartition, next_offsets
from runtime.runner import BatchContext, BatchService, Runner, ServiceSettings
from runtime.settings import Consume, Delivery, Handling, Subscription
from schemas import events as ev
from schemas.sanity import check_scored
from services.trainer_core import TrainerCore, TrainerSettings
from services.trainer_history import STOPPED_PREFIX, TRAINING_COMPLETE, History, is_own_drain, read_history
from trainer.batch import assemble, group_reject_reason, samples_from_scored, select_groups

log = logging.getLogger("rollstream.trainer")

__all__ = ["Trainer", "TrainerSettings", "run"]


class Trainer(TrainerCore, BatchService):
    """The trainer service (see the module doc)."""

    name = "trainer"

    def __init__(self, settings: TrainerSettings) -> None:
        super().__init__(settings)
        self.drained = False
        self.finished = False
        self.stop_reason = ""
        """Why to stop before ``train.steps`` (a ``Drain`` this trainer did not publish); empty: train on."""
        self.runner: Runner | None = None
        self.history = History()
        """What earlier instances of this run's trainer published (read on a resume)."""
        self.replay: dict[int, list[str]] = {}
        """Steps an earlier instance trained after the checkpoint resumed from: step -> batch ids."""
        self.replay_ids: set[str] = set()
        self.replayed = 0
        """Steps re-run from their recorded batch by this instance."""
        self._evaluated: set[int] = set()

    def service_settings(self) -> ServiceSettings:
        """How the trainer runs on :mod:`runtime.runner` (see the module doc)."""
        return ServiceSettings(
            run_id=self.s.run_id, kafka=self.cfg.kafka,
            subscription=Subscription(group_id=f"rs-trainer-{self.s.run_id}", topics=["scored", "dlq", "control"],
                                      observed_topics=["control"]),
            consume=Consume(batch_max_records=500, poll_timeout_s=self.s.poll_timeout_s, max_poll_interval_s=1800.0),
            handling=Handling(shutdown_grace_s=300.0),  # a training step under way at a stop finishes (its state is not cancellable)
            delivery=Delivery(commit="by_service"),
        )

    # ----------------------------------------------------------------- hooks

    async def on_start(self, runner: Runner) -> None:
        self.runner = runner
        self.history = await read_history(self.cfg.kafka, self.s.run_id)
        if self.load_checkpoint():
            self.resume_from(self.history)
            log.info("resumed from the checkpoint of step %d; %d later step(s) on the record to re-run from their "
                     "batches", self.strategy.step, len(self.replay))
            if not self.replay and (weights := await self.weights_if_behind()) is not None:
                await runner.send("weights", weights, key="latest")
            return
        due = [split for split in ("init", "heldout") if (split, 0) not in self.history.evals]
        warm = self.cfg.train.warmup_sft_steps > 0
        if warm and "init" in due:  # the model before the warm-up changes it
            await runner.send("metrics", await self.eval_event("init"), key="0")
            due.remove("init")
        losses = await asyncio.to_thread(self.warm_up)
        if losses:
            log.info("warm-up: %d steps, loss %.3f -> %.3f", len(losses), losses[0], losses[-1])
        await asyncio.to_thread(self.setup_algorithm_models, True)
        await asyncio.to_thread(self.save_checkpoint)  # step 0: what replay starts from
        await runner.send("weights", await self.weights_event(), key="latest")  # rollout starts now
        if due:  # without a warm-up "init" and "heldout" are the same weights: evaluated once
            first = await self.eval_event(due[0])
            await runner.send("metrics", first, *[
                ev.EvalResult(run_id=first.run_id, step=0, policy_version=first.policy_version, split=split,
                              metrics=first.metrics) for split in due[1:]], key="0")
        self._evaluated.add(0)

    def resume_from(self, history: History) -> None:
        """After :meth:`load_checkpoint`: take in what earlier instances published after that
        checkpoint. Steps on the record are re-run from their batches (:meth:`_replay`; their
        samples wait in :attr:`pool`); samples decided meanwhile stay decided; a user ``Drain``
        or ``RunFinished`` on the record still holds."""
        self.history = history
        self.replay = history.steps_from(self.strategy.step)
        self.replay_ids = {sid for ids in self.replay.values() for sid in ids}
        decided = {sid for sid in history.outcomes if sid not in self.replay_ids}
        for s in self.buffer.remove(self.replay_ids | decided):
            if s.generation.task.sample_id in self.replay_ids:
                self.pool[s.generation.task.sample_id] = s
        self.buffer.decided |= decided
        if history.user_drain is not None:
            self.stop_reason = history.user_drain.reason or "drained"
        elif history.trainer_drained and self.strategy.step + len(self.replay) < self.cfg.train.steps:
            self.stop_reason = "drained before the restart"
        self.finished = history.finished

    async def weights_if_behind(self) -> ev.WeightsPublished | None:
        """The ``WeightsPublished`` of the current version (exported now) unless the newest one
        on the topic already is it (rollout workers follow the newest message)."""
        w = self.history.weights
        if w is not None and w.policy_version == self.version and Path(w.uri).is_dir():
            return None
        return await self.weights_event()

    async def on_assigned(self, runner: Runner, tps: set[TopicPartition]) -> None:
        """Continue exactly at the trainer's own positions (the checkpoint's after a resume)."""
        for tp in tps:
            if tp in self.positions:
                runner.consumer.seek(tp, self.positions[tp])

    async def handle_batch(self, records: list[Record], ctx: BatchContext) -> None:
        """Take in the poll's scored samples, dead letters and control events, then train as far
        as complete groups allow."""
        self.positions.update(next_offsets(ctx.polled))
        for letter in ctx.dead_letters:  # undecodable scored records the runtime dead-lettered
            self.buffer.dead_letter(letter.sample_id, letter.group_id)
        for rec in records:
            event = rec.event
            if isinstance(event, ev.ScoredSample):
                why = check_scored(event)
                if why is None:
                    if event.generation.task.sample_id in self.replay_ids:
                        self.pool.setdefault(event.generation.task.sample_id, event)
                    elif self.buffer.add(event):
                        self.cancel_surplus(event.generation.task.group_id, ctx)
                else:
                    ctx.reject(rec, why)
                    self.buffer.dead_letter(event.generation.task.sample_id, event.generation.task.group_id)
            elif isinstance(event, ev.DeadLetter):
                if event.sample_id in self.replay_ids:
                    continue  # trained at a recorded step: that stands
                if self.buffer.dead_letter(event.sample_id, event.group_id):
                    log.info("sample %s dead-lettered by %s (%s): its group completes without it",
                             event.sample_id, event.service, event.error)
            elif isinstance(event, ev.RunFinished):
                self.finished = True
            elif isinstance(event, ev.Drain) and not is_own_drain(event.reason) and not self.stop_reason:
                self.stop_reason = event.reason or "drained"
                log.info("drain (%s): no new step after step %d; final eval, checkpoint, then done",
                         self.stop_reason, self.strategy.step)
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
        cfg = self.cfg
        if self.drained:
            self._close_leftovers(ctx)
            return
        if self.replay:
            await self._replay(ctx)
            if self.replay:
                return  # the samples of a recorded step are still being read
        self._filter_complete_groups(ctx)
        while not self.stop_reason and self.strategy.step < cfg.train.steps and (
                gids := select_groups(self.buffer.groups, self.buffer.complete_ids(), cfg.train.batch_size)) is not None:
            await self.train_once(gids, ctx)
            await self._after_step(ctx)
        if self.strategy.step >= cfg.train.steps or self.stop_reason:
            await self._finish(ctx)

    async def _after_step(self, ctx: BatchContext, replaying: bool = False) -> None:
        """The evaluation and checkpoint due after a step (an evaluation already on the record is
        not repeated)."""
        cfg, step = self.cfg, self.strategy.step
        if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < cfg.train.steps:
            await self._evaluate(ctx, export=replaying)
        if cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0:
            await self._checkpoint(ctx)

    async def _evaluate(self, ctx: BatchContext, export: bool = False) -> None:
        step = self.strategy.step
        if step in self._evaluated or ("heldout", step) in self.history.evals:
            return
        if export:  # re-run steps publish no weights: the evaluation reads this version's from disk
            await asyncio.to_thread(self.strategy.export_weights, self._weights_dir(self.version))
        ctx.emit("metrics", await self.eval_event("heldout"), key=str(step))
        self._evaluated.add(step)

    async def _finish(self, ctx: BatchContext) -> None:
        """After the last step (or a user ``Drain``): final evaluation, checkpoint, ``Drain``,
        leftovers closed as "run finished". What the record already has is not repeated."""
        step = self.strategy.step
        await self._evaluate(ctx)
        if self.checkpoints()[-1:] != [step]:
            await self._checkpoint(ctx)
        if not self.history.trainer_drained:
            reason = (TRAINING_COMPLETE if step >= self.cfg.train.steps and not self.stop_reason
                      else f"{STOPPED_PREFIX} after {step} of {self.cfg.train.steps} steps: {self.stop_reason}")
            ctx.emit("control", ev.Drain(run_id=self.s.run_id, reason=reason))
        self.drained = True
        self._close_leftovers(ctx)

    async def _replay(self, ctx: BatchContext) -> None:
        """Re-run the recorded steps whose samples are all here, in order, from their batches
        (the ``TrainStep``'s sample ids, in training order): the model comes back to where the
        earlier instance left it. Nothing of these steps is published again (only outcomes the
        earlier instance did not get out); once caught up, the current weights are published
        unless the topic's newest already are them."""
        while (ids := self.replay.get(self.strategy.step)) is not None and all(i in self.pool for i in ids):
            step = self.strategy.step
            recorded = self.history.steps[step]
            if recorded.policy_version != self.version:
                log.warning("step %d trained version %d on the record, re-run at version %d", step,
                            recorded.policy_version, self.version)
            batch = [self.pool.pop(i) for i in ids]
            await asyncio.to_thread(self.train_batch, batch)
            outcomes = [self.outcome(s, "trained", step=step) for s in batch]
            self.version += 1
            for o in outcomes:
                if o.sample_id not in self.history.outcomes:
                    ctx.emit("metrics", o, key=str(step))
            del self.replay[step]
            self.replay_ids.difference_update(ids)
            self.replayed += 1
            await self._after_step(ctx, replaying=True)
        if self.replay and min(self.replay) < self.strategy.step:  # cannot happen: steps are contiguous
            log.error("recorded steps %s are behind step %d; ignored", sorted(self.replay), self.strategy.step)
            self.replay.clear()
        if not self.replay:
            for s in self.pool.values():  # not in any recorded batch any more: an ordinary sample
                if self.buffer.add(s):
                    self.cancel_surplus(s.generation.task.group_id, ctx)
            self.pool.clear()
            self.replay_ids.clear()
            log.info("caught up with the record at step %d (%d step(s) re-run)", self.strategy.step, self.replayed)
            if (weights := await self.weights_if_behind()) is not None:
                ctx.emit("weights", weights, key="latest")

    def cancel_surplus(self, group_id: str, ctx: BatchContext) -> None:
        """``rollout.group_size_redundancy``: once ``group_size`` members of a redundant group arrived,
        keep those (arrival order) and cancel the rest: a surplus member already here, and every member
        not arrived, dead-lettered or decided yet, gets ``filtered`` with a ``cancelled:`` reason (the
        feeder frees their slots; rollout workers stop their episodes before the next turn; a late
        arrival is then a decided sample and ignored)."""
        members = self.buffer.groups.get(group_id)
        if not members:
            return
        task = members[0].generation.task
        if not task.redundancy or len(members) < task.group_size:
            return
        reason = (f"cancelled: {task.group_size} of the group's {task.group_size + task.redundancy} samples finished "
                  f"first (rollout.group_size_redundancy={task.redundancy})")
        surplus = members[task.group_size:]
        del members[task.group_size:]
        for s in surplus:
            ctx.emit("metrics", self.outcome(s, "filtered", reason), key=group_id)
        kept = {s.generation.task.sample_id for s in members} | self.buffer.dead.get(group_id, set())
        for index in range(task.group_size + task.redundancy):
            sid = ev.sample_id_of(group_id, index)
            if sid in kept or sid in self.buffer.decided:
                continue
            self.buffer.decide(sid)
            ctx.emit("metrics", ev.SampleOutcome(run_id=self.s.run_id, sample_id=sid, group_id=group_id,
                                                 status="filtered", reason=reason, trained_version=self.version),
                     key=group_id)

    def outcome(self, s: ev.ScoredSample, status: ev.SampleStatus, reason: str = "", step: int = -1) -> ev.SampleOutcome:
        self.buffer.decide(s.generation.task.sample_id)
        return ev.SampleOutcome(
            run_id=self.s.run_id, sample_id=s.generation.task.sample_id, group_id=s.generation.task.group_id,
            status=status, reason=reason, policy_version=s.generation.policy_version,
            trained_version=self.version, step=step,
        )

    def train_batch(self, batch: list[ev.ScoredSample]) -> dict[str, float]:
        """One optimizer step on an assembled batch (no Kafka): every metric of the step.

        ``replay step`` calls this on a batch rebuilt from the record after restoring the
        checkpoint the step started from, so it must depend only on the batch and that state.
        """
        t0 = time.perf_counter()
        metrics = self.strategy.train_step(samples_from_scored(batch))
        metrics["perf/step_s"] = time.perf_counter() - t0
        rewards = torch.tensor([s.reward for s in batch])
        gaps = [self.version - s.generation.policy_version for s in batch]
        metrics["rollout/reward_mean"] = float(rewards.mean())
        metrics["rollout/reward_std"] = float(rewards.std()) if len(batch) > 1 else 0.0
        metrics["rollout/response_len_mean"] = float(sum(len(s.generation.response_ids) for s in batch) / len(batch))
        metrics["rollout/staleness_mean"] = float(sum(gaps) / len(batch))
        metrics["offpolicy/version_gap_max"] = float(max(gaps))
        metrics["perf/train_tokens_per_s"] = metrics.get("train/tokens", 0.0) / max(1e-9, metrics["perf/step_s"])
        return metrics

    async def train_once(self, group_ids: list[str], ctx: BatchContext) -> dict[str, float]:
        """Assemble the batch of these groups, train one step, send its outputs (acknowledged)."""
        cfg = self.cfg
        dead = {gid: self.buffer.dead_count(gid) for gid in group_ids}
        batch, rejected = assemble(self.buffer.take(group_ids), self.version, cfg.train.max_staleness,
                                   cfg.algorithm, dead=dead)
        step = self.strategy.step
        outcomes = [self.outcome(r.sample, r.status, r.reason) for r in rejected]
        metrics: dict[str, float] = {}
        weights: ev.WeightsPublished | None = None
        if batch:
            hist = Counter(self.version - smp.generation.policy_version for smp in batch)
            metrics = await asyncio.to_thread(self.train_batch, batch)
            outcomes += [self.outcome(s, "trained", step=step) for s in batch]
            trained_version = self.version
            self.version += 1
            weights = await self.weights_event()
            ctx.emit("metrics", ev.TrainStep(
                run_id=self.s.run_id, step=step, policy_version=trained_version, metrics=metrics,
                sample_ids=[s.generation.task.sample_id for s in batch], staleness_hist=dict(hist),
            ), key=str(step))
        for o in outcomes:
            ctx.emit("metrics", o, key=str(step))
        await ctx.flush()
        if weights is not None:
            # after the step's record: a new version is never announced before its TrainStep, so
            # a trainer resuming from an older checkpoint re-runs every step behind the newest weights
            ctx.emit("weights", weights, key="latest")
            await ctx.flush()
        return metrics

    def _filter_complete_groups(self, ctx: BatchContext) -> None:
        """Reject complete groups that cannot be trained as soon as they complete (fewer than 2
        members, or ``algorithm.dynamic_filter``): recorded as ``filtered``, out of the buffer,
        so only kept groups count towards the next batch (the feeder issues replacements)."""
        algo = self.cfg.algorithm if self.cfg.algorithm.dynamic_filter != "none" else None
        for gid in [g for g in self.buffer.groups if g not in self.buffer.kept and self.buffer.complete(g)]:
            reason = group_reject_reason(self.buffer.groups[gid], algo, self.buffer.dead_count(gid))
            if reason is None:
                self.buffer.kept.add(gid)
                continue
            for members in self.buffer.take([gid]):
                for s in members:
                    ctx.emit("metrics", self.outcome(s, "filtered", reason), key=gid)

    def _close_leftovers(self, ctx: BatchContext) -> None:
        for s in self.buffer.take_all():
            ctx.emit("metrics", self.outcome(s, "filtered", "run finished: arrived after the last step"))

    async def _checkpoint(self, ctx: BatchContext) -> None:
        """Checkpoint once every output so far is acknowledged, then commit its positions."""
        await ctx.flush()
        await asyncio.to_thread(self.save_checkpoint)
        if self.runner is not None:
            await self.runner.commit(dict(self.positions))

    # ----------------------------------------------------------------- running

    async def run(self, stop: asyncio.Event | None = None) -> int:
        """Train until the run finished (or until stopped); the last step. The training backend is
        closed on the way out (a multi-rank strategy's processes)."""
        try:
            await Runner(self, self.service_settings(), stop).run()
        finally:
            await asyncio.to_thread(self.close)
        return self.strategy.step


async def run(settings: TrainerSettings, stop: asyncio.Event | None = None) -> int:
    """Train until the run finished (or until stopped). Returns the last step."""
    return await Trainer(settings).run(stop)
