"""The trainer service: the only barrier of a run.

Start (fresh run): greedy eval of the initial model (split ``init``), supervised warm-up
(``train.warmup_sft_steps``), the reference model (only when a KL term is on) and the critic
(only for ``gae``), a checkpoint of step 0, export weights as version 0, publish
``WeightsPublished(0)``, greedy eval (the RL start). Then, per step:

1. consume ``scored`` (manual commits) into a buffer of groups, ignoring samples already decided;
   a group that ``algorithm.dynamic_filter`` rejects is recorded as ``filtered`` as soon as it is
   complete and leaves the buffer;
2. when complete groups hold ``train.batch_size`` samples, take them in arrival order, drop the
   samples older than ``max_staleness`` versions (``SampleOutcome(dropped_stale)``; a group left
   with fewer than 2 members is ``filtered``), and run one optimizer step
   (:meth:`Trainer.train_batch`: advantages, masks and the loss the ``algorithm`` section
   configures, :class:`trainer.TorchStrategy`);
3. export the weights (``runs/<id>/weights/v<version>``), publish ``WeightsPublished(version+1)``,
   ``TrainStep`` with every metric and the batch's sample ids in training order, one
   ``SampleOutcome(trained)`` per sample;
4. every ``eval_every`` steps: greedy eval on the held-out set -> ``EvalResult``;
   every ``checkpoint_every`` steps: checkpoint the state before the next step
   (``checkpoints/step_<k>``: model, optimizer, critic, algorithm state, RNG, the undecided buffer
   and the consumer positions) and commit those positions to Kafka. ``replay --train-step``
   restarts from these.

After ``train.steps`` steps it publishes ``Drain``; samples that still arrive are recorded as
``filtered`` ("run finished"); it exits when the feeder publishes ``RunFinished``.

Restart: the latest checkpoint restores the model, optimizer, RNG, step, buffer and positions,
and the trainer re-publishes the weights of that step; the rollout workers load it (they follow
the newest message on the compacted ``weights`` topic, not only higher versions).
"""

from __future__ import annotations

import asyncio
import logging
import random
import shutil
import time
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import msgspec
import torch

import envs
from rollout.engine import GenerationRequest
from rollout.factory import make_engine
from rollout.model_init import encode_prompt
from rollout.sampling import SamplingParams
from schemas import events as ev
from schemas.config import AlgorithmConfig, RunConfig
from schemas.topics import topic_name
from services.kafka.bus import Consumer, Producer, TopicPartition
from trainer.algorithm import group_filter_reason
from trainer.batch import samples_from_scored
from trainer.factory import make_strategy
from trainer.sft import SFTExample, sft_warmup

log = logging.getLogger("rollstream.trainer")


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
    device: str = "cpu"
    """Torch device."""
    poll_timeout_s: float = 0.2
    """Longest wait for scored samples per poll, seconds."""
    eval_batch: int = 64
    """Concurrent sequences of the greedy evaluation engine."""


def ready_groups(groups: OrderedDict[str, list[ev.ScoredSample]], batch_size: int) -> list[str] | None:
    """The first complete groups (arrival order) holding at least ``batch_size`` samples, or
    ``None`` while there are not enough. A group is complete when it has ``group_size`` members."""
    chosen, count = [], 0
    for gid, members in groups.items():
        if len(members) >= members[0].generation.task.group_size:
            chosen.append(gid)
            count += len(members)
            if count >= batch_size:
                return chosen
    return None


def assemble(
    groups: list[list[ev.ScoredSample]], version: int, max_staleness: int, algo: AlgorithmConfig | None = None
) -> tuple[list[ev.ScoredSample], list[tuple[ev.ScoredSample, ev.SampleStatus, str]]]:
    """Apply the staleness rule and the dynamic filter to complete groups: ``(batch, rejected)``.

    A sample is stale when ``version − policy_version > max_staleness`` (``dropped_stale``). A
    group left with fewer than 2 members has no group baseline: its survivors are ``filtered``, and
    so is a group that ``algorithm.dynamic_filter`` rejects (with the filter's reason).
    """
    batch: list[ev.ScoredSample] = []
    rejected: list[tuple[ev.ScoredSample, ev.SampleStatus, str]] = []
    for members in groups:
        fresh = []
        for smp in members:
            gap = version - smp.generation.policy_version
            if gap > max_staleness:
                rejected.append((smp, "dropped_stale", f"stale: gap {gap} > {max_staleness}"))
            else:
                fresh.append(smp)
        reason = group_filter_reason(algo, [s.reward for s in fresh]) if algo is not None else None
        if len(fresh) < 2:
            rejected += [(smp, "filtered", "group too small after the staleness filter") for smp in fresh]
        elif reason is not None:
            rejected += [(smp, "filtered", reason) for smp in fresh]
        else:
            batch += fresh
    return batch, rejected


class _Ckpt(msgspec.Struct):
    step: int
    version: int
    positions: dict[str, int]
    """``topic:partition`` -> next offset to read."""
    buffer: list[ev.ScoredSample]
    decided: list[str]


class Trainer:
    def __init__(self, settings: TrainerSettings) -> None:
        self.s = settings
        cfg = self.cfg = settings.config
        torch.manual_seed(cfg.run.seed)
        random.seed(cfg.run.seed)
        self.run_dir = Path(settings.run_dir)
        self.strategy = make_strategy(cfg, settings.model_dir, device=settings.device)
        self.tokenizer = self.strategy.tokenizer
        self.eval_engine = make_engine(cfg, settings.model_dir, max_batch=settings.eval_batch,
                                       device=settings.device, seed=cfg.run.seed, policy_version=0)
        self.sources = [envs.make_source(d.source, **d.kwargs) for d in cfg.data.domains]
        self.heldout = [
            (d, src.heldout(cfg.data.heldout_size), d.verifier or src.default_verifier)
            for d, src in zip(cfg.data.domains, self.sources, strict=True)
        ]
        self.version = 0
        self.groups: OrderedDict[str, list[ev.ScoredSample]] = OrderedDict()
        self.decided: set[str] = set()
        self.positions: dict[TopicPartition, int] = {}
        self._kept_groups: set[str] = set()
        self.last_eval: dict[str, float] = {}
        self._tokens_t0 = time.monotonic()

    # ----------------------------------------------------------------- evaluation

    async def evaluate(self, split: str) -> dict[str, float]:
        """Greedy accuracy on the held-out problems of every domain (``eval/accuracy`` overall,
        ``eval/<domain>/accuracy`` per domain, ``eval/response_len``)."""
        weights = self._weights_dir(self.version)
        if weights.exists():  # before the warm-up there are none yet: the initial model is evaluated
            await self.eval_engine.load_weights(weights, self.version)
        params = SamplingParams(max_new_tokens=self.cfg.rollout.max_new_tokens, greedy=True)
        metrics: dict[str, float] = {}
        correct = total = length = 0
        for domain, problems, verifier in self.heldout:
            reqs = [GenerationRequest(p.prompt_id, self.eval_engine.encode(p.prompt), params) for p in problems]
            by_id = {p.prompt_id: p for p in problems}
            ok = 0
            async for c in self.eval_engine.generate(reqs):
                res = envs.run_verifier(verifier, c.text, by_id[c.request_id].reference, isolation="inline")
                ok += int(res.correct)
                length += len(c.token_ids)
            metrics[f"eval/{domain.name}/accuracy"] = ok / max(1, len(problems))
            correct += ok
            total += len(problems)
        metrics["eval/accuracy"] = correct / max(1, total)
        metrics["eval/response_len"] = length / max(1, total)
        self.last_eval = metrics
        return metrics

    # ----------------------------------------------------------------- warm-up

    def warm_up(self) -> list[float]:
        cfg = self.cfg
        if cfg.train.warmup_sft_steps <= 0:
            return []
        rng = random.Random(f"{cfg.run.seed}/warmup")
        tok = self.tokenizer
        weights = [d.ratio for d in cfg.data.domains]

        def batches() -> Any:
            for _ in range(cfg.train.warmup_sft_steps):
                out = []
                for _ in range(cfg.train.warmup_batch_size):
                    src = self.sources[rng.choices(range(len(self.sources)), weights=weights)[0]]
                    p = src.sample(rng)
                    demo = src.demonstration(p, rng)
                    target = [*tok(demo, add_special_tokens=False)["input_ids"], tok.eos_token_id]
                    out.append(SFTExample(encode_prompt(tok, p.prompt), target))
                yield out

        losses = sft_warmup(self.strategy.model, batches(), lr=cfg.train.warmup_lr, pad_id=self.strategy.pad_id,
                            grad_clip=cfg.train.grad_clip)
        self.strategy.model.train()
        return losses

    # ----------------------------------------------------------------- weights

    def _weights_dir(self, version: int) -> Path:
        return self.run_dir / "weights" / f"v{version:05d}"

    async def publish_weights(self, producer: Producer) -> None:
        path, checksum = await asyncio.to_thread(self.strategy.export_weights, self._weights_dir(self.version))
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        await producer.send_and_wait(topic_name(self.s.run_id, "weights"), ev.WeightsPublished(
            run_id=self.s.run_id, policy_version=self.version, step=self.strategy.step, uri=str(path),
            checksum=checksum, num_bytes=size,
        ), key="latest")
        old = self._weights_dir(self.version - 3)  # keep a few versions for slow readers
        if self.version >= 3 and old.exists():
            shutil.rmtree(old, ignore_errors=True)

    # ----------------------------------------------------------------- checkpoints

    def _ckpt_root(self) -> Path:
        return self.run_dir / "checkpoints"

    def checkpoint_dir(self, step: int) -> Path:
        """Where the checkpoint of the state *before* training step ``step`` lives."""
        return self._ckpt_root() / f"step_{step:06d}"

    def checkpoints(self) -> list[int]:
        """Steps that have a complete checkpoint, ascending."""
        root = self._ckpt_root()
        if not root.exists():
            return []
        return sorted(int(p.name[5:]) for p in root.glob("step_*")
                      if p.name[5:].isdigit() and (p / "stream_state.msgpack").exists())

    def save_checkpoint(self) -> Path:
        """Checkpoint the state before step ``strategy.step``: model, optimizer, critic, algorithm
        state, RNG, the undecided buffer and the consumer positions. Older checkpoints beyond
        ``train.keep_checkpoints`` are removed (step 0, the RL start, is always kept)."""
        path = self.checkpoint_dir(self.strategy.step)
        self.strategy.save_checkpoint(path)
        meta = _Ckpt(step=self.strategy.step, version=self.version,
                     positions={f"{tp.topic}:{tp.partition}": o for tp, o in self.positions.items()},
                     buffer=[s for g in self.groups.values() for s in g], decided=sorted(self.decided))
        (path / "stream_state.msgpack").write_bytes(msgspec.msgpack.encode(meta))
        keep = self.cfg.train.keep_checkpoints
        if keep > 0:
            for old in [st for st in self.checkpoints() if st != 0][:-keep]:
                shutil.rmtree(self.checkpoint_dir(old), ignore_errors=True)
        return path

    def load_checkpoint(self, step: int | None = None) -> bool:
        """Restore the latest checkpoint (or the one of ``step``); False when there is none."""
        steps = self.checkpoints()
        if step is None and not steps:
            return False
        path = self.checkpoint_dir(steps[-1] if step is None else step)
        if not (path / "stream_state.msgpack").exists():
            raise FileNotFoundError(f"no checkpoint at {path}")
        self.setup_algorithm_models(fresh=False)
        self.strategy.load_checkpoint(path)
        meta = msgspec.msgpack.decode((path / "stream_state.msgpack").read_bytes(), type=_Ckpt)
        self.version = meta.version
        self.decided = set(meta.decided)
        self.groups.clear()
        for s in meta.buffer:
            self.groups.setdefault(s.generation.task.group_id, []).append(s)
        self.positions.clear()
        for key, off in meta.positions.items():
            topic, _, part = key.rpartition(":")
            self.positions[TopicPartition(topic, int(part))] = off
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

    # ----------------------------------------------------------------- batches

    def add(self, sample: ev.ScoredSample) -> None:
        sid = sample.generation.task.sample_id
        if sid in self.decided:
            return
        group = self.groups.setdefault(sample.generation.task.group_id, [])
        if any(s.generation.task.sample_id == sid for s in group):
            return  # redelivered duplicate
        group.append(sample)

    def ready_groups(self) -> list[str] | None:
        """Group ids of the next batch (complete groups, arrival order), or None if not enough."""
        return ready_groups(self.groups, self.cfg.train.batch_size)

    def outcome(self, s: ev.ScoredSample, status: ev.SampleStatus, reason: str = "", step: int = -1) -> ev.SampleOutcome:
        self.decided.add(s.generation.task.sample_id)
        return ev.SampleOutcome(
            run_id=self.s.run_id, sample_id=s.generation.task.sample_id, group_id=s.generation.task.group_id,
            status=status, reason=reason, policy_version=s.generation.policy_version,
            trained_version=self.version, step=step,
        )

    def train_batch(self, batch: list[ev.ScoredSample]) -> dict[str, float]:
        """One optimizer step on an assembled batch (no Kafka): every metric of the step.

        ``replay --train-step`` calls this on a batch rebuilt from the record after restoring the
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

    async def train_once(self, group_ids: list[str], producer: Producer) -> dict[str, float]:
        cfg = self.cfg
        outcomes: list[ev.SampleOutcome] = []
        self._kept_groups.difference_update(group_ids)
        batch, rejected = assemble(
            [self.groups.pop(gid) for gid in group_ids], self.version, cfg.train.max_staleness, cfg.algorithm)
        outcomes += [self.outcome(smp, status, reason) for smp, status, reason in rejected]
        hist = Counter(self.version - smp.generation.policy_version for smp in batch)
        metrics: dict[str, float] = {}
        step = self.strategy.step
        if batch:
            metrics = await asyncio.to_thread(self.train_batch, batch)
            outcomes += [self.outcome(s, "trained", step=step) for s in batch]
            trained_version = self.version
            self.version += 1
            await self.publish_weights(producer)
            await producer.send_and_wait(topic_name(self.s.run_id, "metrics"), ev.TrainStep(
                run_id=self.s.run_id, step=step, policy_version=trained_version, metrics=metrics,
                sample_ids=[s.generation.task.sample_id for s in batch], staleness_hist=dict(hist),
            ), key=str(step))
        metrics_topic = topic_name(self.s.run_id, "metrics")
        futs = [await producer.send(metrics_topic, o, key=str(step)) for o in outcomes]
        for f in futs:
            await f
        return metrics

    async def publish_eval(self, producer: Producer, split: str) -> None:
        metrics = await self.evaluate(split)
        await producer.send_and_wait(topic_name(self.s.run_id, "metrics"), ev.EvalResult(
            run_id=self.s.run_id, step=self.strategy.step, policy_version=self.version, split=split, metrics=metrics,
        ), key=str(self.strategy.step))
        log.info("eval %s step %d: accuracy %.3f", split, self.strategy.step, metrics["eval/accuracy"])

    # ----------------------------------------------------------------- main loop

    async def run(self, stop: asyncio.Event | None = None) -> int:
        stop = stop or asyncio.Event()
        cfg, run_id = self.cfg, self.s.run_id
        producer = Producer(cfg.kafka, client_suffix="trainer")
        consumer = Consumer(cfg.kafka, group_id=f"rs-trainer-{run_id}",
                            topics=[topic_name(run_id, "scored"), topic_name(run_id, "control")],
                            auto_offset_reset="earliest", client_suffix="trainer", max_poll_interval_ms=1_800_000)
        await producer.start()
        await consumer.start()
        try:
            resumed = self.load_checkpoint()
            if resumed:
                log.info("resumed from checkpoint at step %d", self.strategy.step)
                await self.publish_weights(producer)
            else:
                await self.publish_eval(producer, "init")
                losses = await asyncio.to_thread(self.warm_up)
                if losses:
                    log.info("warm-up: %d steps, loss %.3f -> %.3f", len(losses), losses[0], losses[-1])
                await asyncio.to_thread(self.setup_algorithm_models, True)
                await asyncio.to_thread(self.save_checkpoint)  # step 0: what replay starts from
                await self.publish_weights(producer)
                await self.publish_eval(producer, "heldout")
            await self._seek(consumer)
            drained = finished = False
            while not stop.is_set() and not finished:
                for rec in await consumer.getmany(timeout_ms=int(self.s.poll_timeout_s * 1000), max_records=500):
                    self.positions[rec.tp] = rec.offset + 1
                    if isinstance(rec.event, ev.RunFinished):
                        finished = True
                    elif isinstance(rec.event, ev.ScoredSample):
                        self.add(rec.event)
                if drained:
                    await self._close_leftovers(producer)
                    continue
                await self._filter_complete_groups(producer)
                while (groups := self.ready_groups()) is not None and self.strategy.step < cfg.train.steps:
                    await self.train_once(groups, producer)
                    step = self.strategy.step
                    if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < cfg.train.steps:
                        await self.publish_eval(producer, "heldout")
                    if cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0:
                        await self._checkpoint(consumer)
                if self.strategy.step >= cfg.train.steps and not drained:
                    await self.publish_eval(producer, "heldout")
                    await self._checkpoint(consumer)
                    await producer.send_and_wait(topic_name(run_id, "control"),
                                                 ev.Drain(run_id=run_id, reason="training complete"))
                    drained = True
                    await self._close_leftovers(producer)
        finally:
            await consumer.stop()
            await producer.stop()
        return self.strategy.step

    async def _filter_complete_groups(self, producer: Producer) -> None:
        """Apply ``algorithm.dynamic_filter`` to groups as soon as they are complete: a rejected
        group is recorded as ``filtered`` and leaves the buffer, so only kept groups count towards
        the next batch (the feeder issues replacements; the batch still fills)."""
        if self.cfg.algorithm.dynamic_filter == "none":
            return
        rejected: list[ev.SampleOutcome] = []
        for gid in list(self.groups):
            members = self.groups[gid]
            if gid in self._kept_groups or len(members) < members[0].generation.task.group_size:
                continue
            reason = group_filter_reason(self.cfg.algorithm, [s.reward for s in members])
            if reason is None:
                self._kept_groups.add(gid)
            else:
                rejected += [self.outcome(s, "filtered", reason) for s in self.groups.pop(gid)]
        topic = topic_name(self.s.run_id, "metrics")
        futs = [await producer.send(topic, o, key=o.group_id) for o in rejected]
        for f in futs:
            await f

    async def _close_leftovers(self, producer: Producer) -> None:
        leftovers = [s for g in self.groups.values() for s in g]
        self.groups.clear()
        topic = topic_name(self.s.run_id, "metrics")
        futs = [await producer.send(topic, self.outcome(s, "filtered", "run finished: arrived after the last step"))
                for s in leftovers]
        for f in futs:
            await f

    async def _checkpoint(self, consumer: Consumer) -> None:
        await asyncio.to_thread(self.save_checkpoint)
        await consumer.commit(dict(self.positions))

    async def _seek(self, consumer: Consumer) -> None:
        """After a resume, continue exactly at the checkpoint's positions."""
        if not self.positions:
            return
        deadline = time.monotonic() + 30
        while not consumer.assignment() and time.monotonic() < deadline:
            await consumer.getmany(timeout_ms=200, max_records=1)  # joins the group; records re-read below
        for tp, off in self.positions.items():
            if tp in consumer.assignment():
                consumer.seek(tp, off)


async def run(settings: TrainerSettings, stop: asyncio.Event | None = None) -> int:
    """Train until the run finished (or until stopped). Returns the last step."""
    return await Trainer(settings).run(stop)
