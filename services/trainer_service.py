"""The trainer service: the only barrier of a run.

It runs on :mod:`services.kafka.runtime` as a batch service in consumer group
``rs-trainer-<run_id>`` on ``scored``, ``dlq`` and ``control``, with ``commit="by_service"``:
the runtime commits nothing; the trainer commits the positions saved in each checkpoint.

Start (``on_start``, fresh run): greedy eval of the initial model (split ``init``), supervised
warm-up (``train.warmup_sft_steps``, ``Strategy.warmup``), the reference model (only when a KL
term is on) and the critic (only for ``gae``), a checkpoint of step 0, export weights as version
0, publish ``WeightsPublished(0)``, greedy eval (the RL start). Resume: the latest checkpoint
restores the model, optimizer, RNG, step, buffer, decided and dead-lettered ids and positions;
the trainer re-publishes the weights of that step (rollout workers follow the newest message on
the compacted ``weights`` topic, not only higher versions) and ``on_assigned`` seeks every
partition to its saved position, so nothing between the checkpoint and a crash is lost or
trained twice.

Per poll (``handle_batch``, then ``on_tick`` when the poll was empty):

1. a ``ScoredSample`` joins the buffer of its group (:class:`services.trainer_buffer.GroupBuffer`)
   unless it was decided already; one with impossible values (:func:`services.sanity.check_scored`:
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
5. the weights are exported (``runs/<id>/weights/v<version>``) and ``WeightsPublished(version+1)``,
   ``TrainStep`` (every metric and the batch's sample ids in training order) and one
   ``SampleOutcome(trained)`` per sample are sent;
6. every ``eval_every`` steps: greedy eval -> ``EvalResult``; every ``checkpoint_every`` steps:
   a checkpoint of the state before the next step (``checkpoints/step_<k>``), after every output
   so far is acknowledged, then its positions are committed. ``replay step`` restarts
   from these.

After ``train.steps`` steps it publishes ``Drain``; samples that still arrive are recorded as
``filtered`` ("run finished"); it exits when the feeder publishes ``RunFinished``. An
undecodable ``scored`` record is dead-lettered by the runtime (``control`` is only observed: the
feeder dead-letters its bad records).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import torch

from schemas import events as ev
from services.kafka.bus import Record, TopicPartition, next_offsets
from services.kafka.runtime import BatchContext, BatchService, Runner, ServiceSettings
from services.sanity import check_scored
from services.trainer_core import TrainerCore, TrainerSettings
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
        self.runner: Runner | None = None

    def service_settings(self) -> ServiceSettings:
        """How the trainer runs on :mod:`services.kafka.runtime` (see the module doc)."""
        return ServiceSettings(
            group_id=f"rs-trainer-{self.s.run_id}", run_id=self.s.run_id, topics=["scored", "dlq", "control"],
            observed_topics=["control"], kafka=self.cfg.kafka, commit="by_service", batch_max_records=500,
            poll_timeout_s=self.s.poll_timeout_s, max_poll_interval_s=1800.0,
            shutdown_grace_s=300.0,  # a training step under way at a stop finishes (its state is not cancellable)
        )

    # ----------------------------------------------------------------- hooks

    async def on_start(self, runner: Runner) -> None:
        self.runner = runner
        if self.load_checkpoint():
            log.info("resumed from checkpoint at step %d", self.strategy.step)
            await runner.send("weights", await self.weights_event(), key="latest")
            return
        await runner.send("metrics", await self.eval_event("init"), key="0")
        losses = await asyncio.to_thread(self.warm_up)
        if losses:
            log.info("warm-up: %d steps, loss %.3f -> %.3f", len(losses), losses[0], losses[-1])
        await asyncio.to_thread(self.setup_algorithm_models, True)
        await asyncio.to_thread(self.save_checkpoint)  # step 0: what replay starts from
        await runner.send("weights", await self.weights_event(), key="latest")
        await runner.send("metrics", await self.eval_event("heldout"), key="0")

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
                    self.buffer.add(event)
                else:
                    ctx.reject(rec, why)
                    self.buffer.dead_letter(event.generation.task.sample_id, event.generation.task.group_id)
            elif isinstance(event, ev.DeadLetter):
                if self.buffer.dead_letter(event.sample_id, event.group_id):
                    log.info("sample %s dead-lettered by %s (%s): its group completes without it",
                             event.sample_id, event.service, event.error)
            elif isinstance(event, ev.RunFinished):
                self.finished = True
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
        self._filter_complete_groups(ctx)
        while self.strategy.step < cfg.train.steps and (
                gids := select_groups(self.buffer.groups, self.buffer.complete_ids(), cfg.train.batch_size)) is not None:
            await self.train_once(gids, ctx)
            step = self.strategy.step
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < cfg.train.steps:
                ctx.emit("metrics", await self.eval_event("heldout"), key=str(step))
            if cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0:
                await self._checkpoint(ctx)
        if self.strategy.step >= cfg.train.steps:
            ctx.emit("metrics", await self.eval_event("heldout"), key=str(self.strategy.step))
            await self._checkpoint(ctx)
            ctx.emit("control", ev.Drain(run_id=self.s.run_id, reason="training complete"))
            self.drained = True
            self._close_leftovers(ctx)

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
        if batch:
            hist = Counter(self.version - smp.generation.policy_version for smp in batch)
            metrics = await asyncio.to_thread(self.train_batch, batch)
            outcomes += [self.outcome(s, "trained", step=step) for s in batch]
            trained_version = self.version
            self.version += 1
            ctx.emit("weights", await self.weights_event(), key="latest")
            ctx.emit("metrics", ev.TrainStep(
                run_id=self.s.run_id, step=step, policy_version=trained_version, metrics=metrics,
                sample_ids=[s.generation.task.sample_id for s in batch], staleness_hist=dict(hist),
            ), key=str(step))
        for o in outcomes:
            ctx.emit("metrics", o, key=str(step))
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
        """Train until the run finished (or until stopped); the last step."""
        await Runner(self, self.service_settings(), stop).run()
        return self.strategy.step


async def run(settings: TrainerSettings, stop: asyncio.Event | None = None) -> int:
    """Train until the run finished (or until stopped). Returns the last step."""
    return await Trainer(settings).run(stop)
