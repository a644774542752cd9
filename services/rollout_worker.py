"""The rollout service: a consumer group on ``tasks`` feeding a generation engine.

Every ``RolloutTask`` becomes one handler call that submits one request to the engine and awaits
its completion; up to ``rollout.max_batch`` calls run at once and the engine batches whatever is
in flight (continuous batching). The offset is committed once the ``Generation`` is acknowledged.
A task with impossible values (:func:`schemas.sanity.check_task`) is dead-lettered before it waits
for any weights, like an engine error or a weights timeout, naming its sample and group.

* Multi-turn domains: a task is one episode played by :func:`rollout.agent.run_episode` against
  the environment workers over Kafka (:class:`services.env_client.KafkaEnvClient`); weights are
  swapped between turns, never inside one. An episode the environment failed is dead-lettered.
  A visual environment's observation images are read from the blob store like a task's; one that
  cannot be read or decoded ends the episode, so the sample is dead-lettered with the reason.
* Weights: a background consumer (no group) follows the compacted ``weights`` topic and hot-swaps
  every new ``WeightsPublished`` into the engine; a task starts only once the engine holds a
  version at least as new as its ``policy_version`` (on-policy with ``async_ratio: 0``).
* Visual tasks (``task.image_hashes``): the images are read from the run's blob store and prefilled
  with the prompt by a vision-language engine; a missing, corrupt or undecodable image dead-letters
  the sample with the reason.
* ``rollout.release_between_steps``: once the worker holds no task (its last one done, or the next
  ones waiting for weights) the engine gives back its KV cache, and its weights to host memory if
  asked (:meth:`rollout.engine.TorchEngine.release`); its next step takes them back.
* Every ``Generation`` carries the worker's peak memory so far (:mod:`runtime.memory`).
* ReMax: a group's baseline task (``task.is_baseline``) is generated greedily (argmax tokens, the
  logprobs still at the rollout temperature); it is otherwise an ordinary generation.
* With ``rollout.group_size_redundancy`` a second one follows ``metrics`` for the samples the
  trainer cancelled: they are not started, and an episode stops before its next turn.

docs/architecture.md, "Services", tells more.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
from aiokafka.errors import KafkaError

import envs
from blobs import BlobError, BlobStore, blob_dir_of
from envs.base import episode_ref
from rollout.agent import AgentLimits, SwapLock, Trajectory, run_episode
from rollout.engine import GenerationRequest, TorchEngine
from rollout.factory import make_engine
from rollout.sampling import SamplingParams
from rollout.vlm import ImageInputs
from runtime.bus import Consumer, Record
from runtime.memory import PeakMemory, peak_memory_gib
from runtime.runner import Context, Runner, Service, ServiceSettings, run_service
from runtime.settings import Consume, Handling, Subscription
from schemas import events as ev
from schemas.config import RunConfig
from schemas.devices import resolve_device
from schemas.errors import one_line, to_thread
from schemas.sanity import check_task
from schemas.services import SERVICES
from schemas.topics import topic_name
from services import ServiceStart
from services.env_client import KafkaEnvClient
from weights import node_id, pick_copy
from weights.broadcast import Relay

log = logging.getLogger("rollstream.rollout")

SPEC = SERVICES["rollout"]


class Superseded(Exception):
    """A version's load given up for a newer one (its directory not written yet)."""


class RolloutSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Settings of one rollout worker."""

    run_id: str
    """The run whose ``tasks`` this worker generates."""
    config: RunConfig
    """The run config (rollout section, model dtype, Kafka)."""
    model_dir: str
    """The initial model (HF directory); published weights are swapped in on top."""
    worker_id: str = ""
    """Name in ``Generation.worker_id``; empty = ``<host>-<pid>``."""
    device: str = ""
    """Torch device of the engine; empty = ``rollout.device`` of the config, resolved here."""
    blob_dir: str = ""
    """The run's blob store (``<run dir>/blobs``) a visual task's images are read from. Empty = none
    (a task with images is then dead-lettered)."""
    weights_timeout_s: float = 600.0
    """How long a task may wait for the weights version it needs before failing, seconds. Version 0
    is waited for without a limit: the trainer publishes it after its supervised warm-up, which may
    take longer (the supervisor watches the trainer, and ``run.max_wall_s`` bounds the run)."""


class RolloutWorker(Service):
    name = "rollout"

    def __init__(self, settings: RolloutSettings) -> None:
        self.s = settings
        cfg = settings.config
        device = settings.device or resolve_device(cfg.rollout.device, "rollout.device")
        self.device = device if cfg.rollout.engine == "torch" else "cpu"
        """Where this process holds its model (a server engine's worker holds none: its memory is the host's)."""
        self.peak_memory = PeakMemory(self.device)  # reported with every sample, read twice a second
        self.engine = make_engine(cfg, settings.model_dir, device=device, seed=cfg.run.seed + os.getpid(),
                                  policy_version=-1)
        self.blobs = BlobStore(settings.blob_dir) if settings.blob_dir else None
        self.system_prompts = {d.name: d.system_prompt or cfg.model.system_prompt for d in cfg.data.domains}
        self.worker_id = settings.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                                     top_p=cfg.rollout.top_p, stop=tuple(cfg.rollout.stop))
        self.versions_used: set[int] = set()
        self.domains = {d.name for d in cfg.data.domains}
        self.loaded_event_id = ""
        self._version_changed = asyncio.Condition()
        self._watcher: asyncio.Task[None] | None = None
        self.episodic = set(envs.episodic_domains(cfg))
        """Multi-turn domains: their tasks are episodes."""
        self.limits = AgentLimits(max_turns=cfg.rollout.max_turns, max_tokens_per_turn=cfg.rollout.max_new_tokens,
                                  max_context_tokens=cfg.rollout.max_context_tokens,
                                  history_turns=cfg.rollout.history_turns)
        self.swap_lock = SwapLock()
        self.relay = Relay()
        """Versions sent from the trainer's node (``train.weights_broadcast``)."""
        self.env_client: KafkaEnvClient | None = None
        self.cancelled: set[str] = set()
        """Samples the trainer cancelled (``rollout.group_size_redundancy``): not started, or stopped
        before their next turn."""
        self._canceller: asyncio.Task[None] | None = None
        self.release = cfg.rollout.release_between_steps if isinstance(self.engine, TorchEngine) else "off"
        self._holding = 0
        """Handler calls past their weights wait: generating, or playing an episode."""
        self._releasing: asyncio.Task[bool] | None = None

    async def on_start(self, runner: Runner) -> None:
        if self.episodic:
            async def send(event: ev.Event, key: str) -> object:
                return await runner.send("env.requests", event, key=key)

            self.env_client = KafkaEnvClient(self.s.config.kafka, self.s.run_id, send,
                                             timeout_s=self.s.config.env.request_timeout_s, worker_id=self.worker_id)
            await self.env_client.start()
        self._watcher = asyncio.create_task(self._watch_weights())
        if self.s.config.rollout.group_size_redundancy > 0:
            self._canceller = asyncio.create_task(self._watch_cancellations())

        def ended(task: asyncio.Task[None]) -> None:  # tasks would wait for weights forever: fail instead
            err = None if task.cancelled() else task.exception()
            if err is not None:
                runner.fail(RuntimeError(f"rollout: the weights follower failed: {one_line(err)}"))

        self._watcher.add_done_callback(ended)

    async def on_stop(self, runner: Runner) -> None:
        for task in (self._watcher, self._canceller, self._releasing):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self.env_client is not None:
            await self.env_client.close()
        close = getattr(self.engine, "close", None)  # a server engine's HTTP session
        if close is not None:
            await close()
        if isinstance(self.engine, TorchEngine) and self.engine.prompt_tokens:
            e = self.engine
            log.info("rollout %s: generated %d tokens; of %d prompt tokens admitted, %d (%.0f%%) were not prefilled "
                     "(shared with an identical prompt or a common prefix of the same admission)", self.worker_id,
                     e.tokens_generated, e.prompt_tokens, e.prompt_tokens_reused,
                     100 * e.prompt_tokens_reused / e.prompt_tokens)
        releases = (f"; engine memory released {self.engine.releases} time(s) ({self.release})"
                    if isinstance(self.engine, TorchEngine) and self.release != "off" else "")
        log.info("rollout %s: peak memory %.2f GiB on %s%s", self.worker_id, peak_memory_gib(self.device), self.device,
                 releases)

    async def _watch_weights(self) -> None:
        consumer = Consumer(self.s.config.kafka, group_id=None, topics=[topic_name(self.s.run_id, "weights")],
                            auto_offset_reset="earliest", client_suffix="rollout-weights")
        await consumer.start()
        try:
            latest: ev.WeightsPublished | None = None
            superseded = False

            async def newer(timeout_ms: int = 500) -> bool:
                """Read the topic for ``timeout_ms`` at most: whether a newer version came."""
                nonlocal latest
                before = latest
                try:
                    recs = await consumer.getmany(timeout_ms=timeout_ms)
                except KafkaError as e:  # a broker outage: aiokafka reconnects, ask again
                    log.warning("rollout %s: reading weights failed (%s); retrying", self.worker_id, one_line(e))
                    await asyncio.sleep(1.0)
                    return False
                for rec in recs:
                    if isinstance(rec.event, ev.WeightsPublished):
                        latest = rec.event  # the newest message wins (a resumed trainer may go back)
                    elif rec.error is not None:
                        log.error("rollout %s: undecodable record %s[%d]@%d on weights: %s", self.worker_id,
                                  rec.topic, rec.partition, rec.offset, rec.error)
                return latest is not before

            while True:
                if not superseded:
                    await newer()
                superseded = False
                if latest is None or latest.event_id == self.loaded_event_id:
                    continue
                try:
                    source = await self._load(latest, superseded=lambda: newer(50))
                except Superseded as e:  # its directory not there yet, and a newer version came
                    log.info("rollout %s: %s", self.worker_id, e)
                    superseded = True
                    continue
                except (OSError, RuntimeError, ValueError) as e:
                    # e.g. removed meanwhile (the trainer keeps the newest few versions): a newer
                    # message follows; tasks wait for it
                    log.warning("rollout %s: cannot load weights v%d from %s (%s); waiting for newer ones",
                                self.worker_id, latest.policy_version, latest.uri, one_line(e))
                    self.loaded_event_id = latest.event_id
                    continue
                self.loaded_event_id = latest.event_id
                log.info("rollout %s: now at policy version %d (from %s)", self.worker_id, latest.policy_version, source)
                async with self._version_changed:
                    self._version_changed.notify_all()
        finally:
            await consumer.stop()

    async def _load(self, w: ev.WeightsPublished, superseded: Callable[[], Awaitable[bool]] | None = None) -> str:
        """Swap in ``w`` (between agent turns; receiving or waiting for a copy is not inside the
        swap lock): its shared-memory copy when it is on this node, else (or when that copy is gone
        or refused) its directory, waited for while the trainer writes it (weights.handoff), until
        ``superseded`` (polled meanwhile) says a newer version came: :class:`Superseded`.
        On another node with ``broadcast``, the copy an engine of this node received (or receives
        now: weights.broadcast). Returns which copy: ``shared memory[, received from ...]`` or ``disk``."""
        ref, why = await to_thread(pick_copy, w.uri, w.memory, w.memory_host, w.memory_checksum)
        source = "shared memory"
        if ref == w.uri and w.broadcast and w.memory_host != node_id():  # sent from the trainer's node
            try:
                ref = str(await to_thread(self.relay.fetch, w.broadcast, w.policy_version, w.memory,
                                          w.memory_checksum))
                source = f"shared memory, received from {w.broadcast}"
            except (OSError, RuntimeError, ValueError) as e:
                why = f"receiving them from {w.broadcast} failed: {one_line(e)}"
        if ref != w.uri:
            try:
                async with self.swap_lock.swap():  # between agent turns, never inside one
                    await self.engine.load_weights(ref, w.policy_version)
                return source
            except (OSError, ValueError) as e:  # unlinked or refused after the check
                why = one_line(e)
        if why:
            log.info("rollout %s: weights v%d from disk: %s", self.worker_id, w.policy_version, why)
        # the trainer writes the directory after the event; it may die first: a newer version ends the wait
        deadline = time.monotonic() + (self.s.weights_timeout_s if w.memory else 0.0)
        while not Path(w.uri).is_dir() and time.monotonic() < deadline:
            if superseded is None:
                await asyncio.sleep(0.05)
            elif await superseded():
                raise Superseded(f"weights v{w.policy_version} skipped: its directory {w.uri} is not there, "
                                 "and a newer version was announced")
        async with self.swap_lock.swap():
            await self.engine.load_weights(w.uri, w.policy_version)
        return "disk"

    async def _watch_cancellations(self) -> None:
        """Follow the run's ``metrics`` (no group, from the start) for the trainer's ``cancelled:``
        outcomes of redundant samples."""
        consumer = Consumer(self.s.config.kafka, group_id=None, topics=[topic_name(self.s.run_id, "metrics")],
                            auto_offset_reset="earliest", client_suffix="rollout-cancel",
                            # a busy topic read for a rare message: fewer, fuller fetches
                            fetch_min_bytes=1 << 20)
        await consumer.start()
        try:
            while True:
                try:
                    recs = await consumer.getmany(timeout_ms=500)
                except KafkaError as e:
                    log.warning("rollout %s: reading metrics failed (%s); retrying", self.worker_id, one_line(e))
                    await asyncio.sleep(1.0)
                    continue
                for rec in recs:
                    if isinstance(rec.event, ev.SampleOutcome) and rec.event.reason.startswith("cancelled:"):
                        self.cancelled.add(rec.event.sample_id)
        finally:
            await consumer.stop()

    async def _wait_for_version(self, version: int) -> None:
        """Until the engine holds ``version`` or newer (``TimeoutError`` after ``weights_timeout_s``,
        except for version 0: see the setting)."""
        need = max(0, version)
        if self.engine.policy_version >= need:  # the usual case: no lock, no timer, no task per sample
            return
        self._idle()
        async with self._version_changed:
            await asyncio.wait_for(
                self._version_changed.wait_for(lambda: self.engine.policy_version >= need),
                timeout=self.s.weights_timeout_s if need > 0 else None,
            )

    async def handle(self, rec: Record, ctx: Context) -> None:
        task: ev.RolloutTask = rec.event
        why = check_task(task, self.domains)
        if why is not None:
            raise ValueError(why)
        queued_from = task.ts
        try:
            await self._wait_for_version(task.policy_version)
        except TimeoutError:
            raise RuntimeError(
                f"weights version {task.policy_version} not published within {self.s.weights_timeout_s:g}s"
            ) from None
        if task.sample_id in self.cancelled:
            log.debug("rollout %s: %s was cancelled before it started", self.worker_id, task.sample_id)
            return
        self._holding += 1
        try:
            if task.domain in self.episodic:
                await self._episode(task, ctx)
            else:
                await self._generate(task, ctx, queued_from)
        finally:
            self._holding -= 1
            self._idle()

    def _idle(self) -> None:
        """With ``rollout.release_between_steps``, when this worker holds no task: the engine gives
        back its memory (it declines while a request is there; its next step takes it back)."""
        if self.release == "off" or self._holding or (self._releasing is not None and not self._releasing.done()):
            return
        assert isinstance(self.engine, TorchEngine)
        self._releasing = asyncio.create_task(self.engine.release(weights=self.release == "kv_and_weights"))
        self._releasing.add_done_callback(self._released)

    def _released(self, task: asyncio.Task[bool]) -> None:
        err = None if task.cancelled() else task.exception()
        if err is not None:  # the next step restores whatever was given back; generation goes on
            log.warning("rollout %s: releasing the engine's memory failed: %s", self.worker_id, one_line(err))
        elif not task.cancelled() and task.result():
            log.debug("rollout %s: engine memory released (%s) at version %d", self.worker_id, self.release,
                      self.engine.policy_version)

    async def _generate(self, task: ev.RolloutTask, ctx: Context, queued_from: float) -> None:
        """Generate the task's one response and emit it as a ``Generation``."""
        params = self.params
        if task.max_new_tokens:
            params = dataclasses.replace(params, max_new_tokens=task.max_new_tokens)
        if task.is_baseline:  # ReMax: the group's greedy response (argmax tokens), only its reward is used
            params = dataclasses.replace(params, greedy=True)
        system = task.system_prompt or self.system_prompts.get(task.domain)
        images = await self._images(task) if task.image_hashes else None
        if images is not None:
            assert isinstance(self.engine, TorchEngine)  # _images checked it
            prompt_ids = self.engine.encode(task.prompt, system, images)
        else:
            prompt_ids = self.engine.encode(task.prompt, system)
        req = GenerationRequest(task.sample_id, prompt_ids, params, images=images)
        completion = None
        async for c in self.engine.generate([req]):
            completion = c
        assert completion is not None
        if completion.error:
            raise RuntimeError(f"engine error: {completion.error}")
        self.versions_used.add(completion.policy_version)
        wait_s = max(0.0, time.time() - queued_from - completion.gen_s)
        ctx.emit("generations", ev.Generation(
            run_id=task.run_id, task=task, prompt_ids=completion.prompt_ids, response_ids=completion.token_ids,
            response_text=completion.text, logprobs=completion.logprobs, loss_mask=[1] * len(completion.token_ids),
            finish_reason=completion.finish_reason, policy_version=completion.policy_version,
            policy_version_end=completion.policy_version_end, worker_id=self.worker_id,
            queued_s=wait_s, gen_s=completion.gen_s, peak_memory_gib=self.peak_memory(),
        ), key=task.sample_id)


    async def _images(self, task: ev.RolloutTask) -> ImageInputs:
        """The task's images read from the run's blob store and run through the model's image
        processor; a ``ValueError`` naming the sample and why (missing, corrupt or undecodable blob,
        no blob store, not a vision-language model): the sample is dead-lettered, never lost."""
        if not isinstance(self.engine, TorchEngine) or not self.engine.vlm:
            raise ValueError(f"task {task.sample_id}: has images but this worker's engine is not a vision-language "
                             "model (model.path must be a Qwen2-VL directory, rollout.engine torch)")
        if self.blobs is None:
            raise ValueError(f"task {task.sample_id}: has images but this worker has no blob store")
        try:
            return await self._read_images(list(task.image_hashes))
        except BlobError as e:
            raise ValueError(f"task {task.sample_id}: image unusable: {e}") from None

    async def _read_images(self, hashes: list[str]) -> ImageInputs:
        """The blobs ``hashes`` through the engine's image processor (``BlobError`` naming a missing,
        corrupt or undecodable one; ``ValueError`` without a blob store or a vision-language engine)."""
        store, engine = self.blobs, self.engine
        if store is None or not isinstance(engine, TorchEngine) or not engine.vlm:
            raise ValueError("this rollout worker has no blob store or no vision-language engine")

        def read() -> ImageInputs:
            return engine.image_inputs([store.get(h) for h in hashes], hashes)

        return await to_thread(read)

    async def _episode(self, task: ev.RolloutTask, ctx: Context) -> None:
        """Play the task's episode and emit it as one ``Generation`` (see the module doc)."""
        assert self.env_client is not None
        try:
            ref = episode_ref(task.reference)
        except ValueError as e:
            raise ValueError(f"task {task.sample_id}: {e}") from None
        name, kwargs = (task.env.name, dict(task.env.kwargs)) if task.env is not None else (ref.env, ref.kwargs)
        params = self.params
        if task.max_new_tokens:
            params = dataclasses.replace(params, max_new_tokens=task.max_new_tokens)
        if task.is_baseline:  # ReMax: the group's greedy episode
            params = dataclasses.replace(params, greedy=True)
        limits = dataclasses.replace(self.limits, max_tokens_per_turn=params.max_new_tokens)
        episode_id = f"{task.sample_id}@{uuid.uuid4().hex[:8]}"
        started = time.time()
        try:
            traj = await run_episode(
                self.engine, self.engine.tokenizer, self.env_client, episode_id=episode_id, env=name,
                env_kwargs=kwargs, seed=ref.seed, params=params, limits=limits,
                system_prompt=self.system_prompts.get(task.domain) or "", turn_guard=self.swap_lock.turn,
                cancelled=lambda: task.sample_id in self.cancelled, images=self._read_images)
        finally:
            self.env_client.forget(episode_id)
        if traj.finish == "cancelled":
            log.debug("rollout %s: episode %s cancelled after %d turn(s)", self.worker_id, episode_id, traj.num_turns)
            return
        if traj.finish == "env_error":
            raise RuntimeError(f"episode {episode_id}: environment failed after {traj.num_turns} turn(s): {traj.error}")
        if traj.num_turns == 0:
            raise ValueError(f"episode {episode_id}: the first observation ({len(traj.prompt_ids)} tokens) leaves no "
                             f"room for a turn within rollout.max_context_tokens={self.limits.max_context_tokens} "
                             "(and the model's max_position_embeddings)")
        self.versions_used.update(v for pair in traj.versions for v in pair)
        ctx.emit("generations", generation_of(task, traj, episode_id, self.worker_id,
                                              self.engine.tokenizer, queued_s=max(0.0, started - task.ts),
                                              peak_memory_gib=self.peak_memory()),
                 key=task.sample_id)


def generation_of(task: ev.RolloutTask, traj: Trajectory, episode_id: str, worker_id: str, tokenizer: Any,
                  queued_s: float, peak_memory_gib: float = 0.0) -> ev.Generation:
    """A played episode as the ``Generation`` the reward router and trainer read."""
    n = traj.num_turns
    # the state each turn acted from: the observation before it (the reset's for turn 1)
    hashes = [str(traj.infos[i].get("state_hash", "")) if i < len(traj.infos) else "" for i in range(n)]
    finish: ev.FinishReason = "length" if traj.finish == "context" or traj.last_finish_reason == "length" else "stop"
    return ev.Generation(
        run_id=task.run_id, task=task, prompt_ids=traj.prompt_ids, response_ids=traj.response_ids,
        response_text=str(tokenizer.decode(traj.response_ids)),
        logprobs=traj.logprobs, loss_mask=traj.loss_mask, finish_reason=finish,
        policy_version=traj.versions[0][0], policy_version_end=traj.versions[-1][1], worker_id=worker_id,
        queued_s=queued_s, gen_s=traj.gen_s, env_s=traj.env_s, num_turns=n, episode_id=episode_id,
        step_rewards=list(traj.step_rewards), turn_versions=[a for a, _ in traj.versions], state_hashes=hashes,
        env_finish=traj.finish, env_error=traj.error, success=traj.success,
        segment_starts=list(traj.segment_starts), peak_memory_gib=peak_memory_gib,
        image_hashes=list(traj.image_hashes), segment_image_hashes=[list(seg) for seg in traj.segment_image_hashes],
    )


def service_settings(settings: RolloutSettings) -> ServiceSettings:
    """The runtime settings of a rollout worker: ``rollout.max_batch`` handler calls at once."""
    cfg = settings.config
    return ServiceSettings(
        run_id=settings.run_id, kafka=cfg.kafka, subscription=Subscription.of(SPEC, settings.run_id),
        consume=Consume(batch_max_records=cfg.rollout.max_batch, max_poll_interval_s=900.0),
        handling=Handling(max_concurrency=cfg.rollout.max_batch, shutdown_grace_s=30.0),
    )


def settings_from(start: ServiceStart) -> RolloutSettings:
    """A rollout worker's settings in a run (``rollstream service rollout``)."""
    return RolloutSettings(run_id=start.run_id, config=start.config, model_dir=start.model_dir,
                           blob_dir=str(blob_dir_of(start.run_dir)))


async def run(settings: RolloutSettings, stop: asyncio.Event | None = None) -> object:
    """Generate until stopped (SIGTERM/SIGINT or ``stop``)."""
    if not Path(settings.model_dir).is_dir():
        raise FileNotFoundError(settings.model_dir)
    return await run_service(RolloutWorker(settings), service_settings(settings), stop=stop)
