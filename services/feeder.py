"""The feeder: turns task sources into ``RolloutTask`` events, with a bounded number in flight.

It runs as a batch service without a consumer group (:data:`schemas.services.SERVICES`): on
every start it reads the run's topics from the beginning, :meth:`Feeder.observe` rebuilds its
state from them, and once caught up with their ends it acts in ``on_tick``, after every poll:

* each prompt becomes ``rollout.group_size`` (plus ``rollout.group_size_redundancy``) tasks
  sharing a ``group_id`` (``g000000``...; sample ids ``<group_id>/<index>``); group ``k`` draws
  its domain and prompt from ``Random(f"{seed}/{k}")``, so a restarted feeder goes on with the
  same sequence (and first completes a group an earlier instance did not finish sending);
* a visual task's images (``Problem.images``) are written to the run's blob store and the tasks
  carry their digests (``RolloutTask.image_hashes``);
* at most ``RunConfig.max_inflight`` samples are outstanding (until their ``SampleOutcome`` or
  ``DeadLetter``), and new groups go out only once the weights of every step seen are published;
* after a ``Drain`` it stops issuing; once every issued sample has an outcome (or
  ``drain_timeout_s`` closed the rest as ``filtered``) it publishes ``RunFinished`` and exits.

docs/architecture.md, "Services", tells the whole story.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time

import msgspec

import envs
from blobs import BlobStore, blob_dir_of
from envs.base import episode_ref
from runtime.bus import Record
from runtime.reading import behind
from runtime.runner import BatchContext, BatchService, Runner, ServiceSettings
from runtime.settings import Consume, Subscription
from schemas import events as ev
from schemas.config import RunConfig, redacted_dict
from schemas.services import SERVICES
from services import ServiceStart

log = logging.getLogger("rollstream.feeder")

SPEC = SERVICES["feeder"]


class FeederSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Settings of the feeder (one per run)."""

    run_id: str
    """The run to feed."""
    config: RunConfig
    """The run config (data, rollout, train sections are used)."""
    poll_timeout_s: float = 0.2
    """Longest wait for new events per poll, seconds."""
    drain_timeout_s: float = 120.0
    """After ``Drain``, how long to wait for outstanding samples before closing them, seconds."""
    catch_up_timeout_s: float = 30.0
    """At start, the longest wait to read the run's topics to their ends before acting anyway,
    seconds."""
    blob_dir: str = ""
    """The run's blob store (``<run dir>/blobs``): a visual task's images are written there and the
    task carries their digests. Empty = none (a task with images is then an error)."""


class Feeder(BatchService):
    """The feeder service and its state; :meth:`run` drives it."""

    name = "feeder"

    def __init__(self, settings: FeederSettings) -> None:
        self.s = settings
        self.cfg = settings.config
        self.sources = [envs.make_source(d.source, **d.kwargs) for d in self.cfg.data.domains]
        self.blobs = BlobStore(settings.blob_dir) if settings.blob_dir else None
        self.issued: dict[str, str] = {}  # sample_id -> group_id
        self.groups: set[str] = set()
        self.members: dict[str, set[int]] = {}
        """Group id -> indices of its tasks on ``tasks`` (a feeder killed while sending a group
        leaves it short: the next instance sends the rest, :meth:`short_groups`)."""
        self.next_index = 0
        """Index of the next group (one past the highest issued)."""
        self.baseline = int(self.cfg.algorithm.adv_estimator == "remax")
        """1 when every group gets a greedy baseline task (ReMax), else 0."""
        self.stopped_by = ""
        """Reason of the first ``Drain`` a trainer did not publish (``rollstream stop``)."""
        self.done: set[str] = set()
        self._closed = 0
        """How many sample ids are both in ``issued`` and ``done`` (kept as events come in, so
        :attr:`outstanding` costs nothing however long the run)."""
        self.version = 0
        self.steps_seen = 0
        self.draining = False
        self.drain_started = 0.0
        self.finished = False
        self.issued_now = 0
        """Tasks this instance issued."""
        self._caught_up = False
        self._catch_up_deadline = 0.0

    @property
    def outstanding(self) -> int:
        """Issued samples without a terminal event yet."""
        return len(self.issued) - self._closed

    # -- events in

    def observe(self, event: ev.Event) -> None:
        """Update state from one event of the run."""
        if isinstance(event, ev.RolloutTask):
            if event.sample_id not in self.issued:
                self._closed += event.sample_id in self.done
            self.issued[event.sample_id] = event.group_id
            self.groups.add(event.group_id)
            self.members.setdefault(event.group_id, set()).add(event.index)
            if (k := ev.group_number(event.group_id)) is not None:
                self.next_index = max(self.next_index, k + 1)
        elif isinstance(event, ev.SampleOutcome):
            self._close(event.sample_id)
            if event.status == "trained" and event.step >= 0:
                self.steps_seen = max(self.steps_seen, event.step + 1)
        elif isinstance(event, ev.DeadLetter) and event.sample_id:
            self._close(event.sample_id)
        elif isinstance(event, ev.WeightsPublished):
            self.version = max(self.version, event.policy_version)
        elif isinstance(event, ev.Drain):
            if not self.draining:
                self.draining, self.drain_started = True, time.monotonic()
                if event.origin != "trainer":
                    self.stopped_by = event.reason or "drained"
        elif isinstance(event, ev.RunFinished):
            self.finished = True

    def _close(self, sample_id: str) -> None:
        if sample_id not in self.done:
            self.done.add(sample_id)
            self._closed += sample_id in self.issued

    # -- events out

    @property
    def group_width(self) -> int:
        """Tasks per group: ``group_size`` plus the redundant ones, plus ReMax's greedy baseline."""
        return self.cfg.rollout.group_size + self.cfg.rollout.group_size_redundancy + self.baseline

    def next_group(self) -> list[ev.RolloutTask]:
        """The tasks of the next group (deterministic in the group's index)."""
        return self.group_tasks(self.next_index)

    def group_tasks(self, k: int) -> list[ev.RolloutTask]:
        """The tasks of group ``k`` (deterministic in ``k``; stamped with the current version)."""
        rng = random.Random(f"{self.cfg.run.seed}/{k}")
        domains = self.cfg.data.domains
        i = rng.choices(range(len(domains)), weights=[d.ratio for d in domains])[0]
        problem = self.sources[i].sample(rng)
        group_id = ev.group_id_of(k)
        n, r = self.cfg.rollout.group_size, self.cfg.rollout.group_size_redundancy
        baseline = n + r if self.baseline else -1  # ReMax: one more task, greedy, its reward the group's baseline
        env = episode_spec(problem.reference) if envs.is_episodic(domains[i].source) else None
        hashes = self.store_images(problem.images)
        return [
            ev.RolloutTask(
                run_id=self.s.run_id, sample_id=ev.sample_id_of(group_id, j), group_id=group_id, index=j, group_size=n,
                prompt_id=problem.prompt_id, domain=domains[i].name, prompt=problem.prompt,
                reference=problem.reference, policy_version=self.version, env=env, redundancy=r,
                system_prompt=problem.system_prompt, baseline_index=baseline, image_hashes=hashes,
            )
            for j in range(n + r + self.baseline)
        ]

    def store_images(self, images: tuple[bytes, ...]) -> list[str]:
        """Write a problem's images to the run's blob store (once each); their digests."""
        if not images:
            return []
        if self.blobs is None:
            raise RuntimeError("feeder: a task has images but the feeder has no blob store (blob_dir)")
        return [self.blobs.put(data) for data in images]

    def short_groups(self) -> list[ev.RolloutTask]:
        """The tasks missing from groups only partly on ``tasks`` (a feeder killed mid-send)."""
        n = self.group_width
        out: list[ev.RolloutTask] = []
        for gid, have in sorted(self.members.items()):
            if len(have) < n and (k := ev.group_number(gid)) is not None:
                out += [t for t in self.group_tasks(k) if t.index not in have]
        return out

    def can_issue(self, pending: int = 0) -> bool:
        """Whether one more group may go out, with ``pending`` tasks about to be sent already."""
        return (
            not self.draining
            and not self.finished
            and self.version >= self.steps_seen
            and self.steps_seen < self.cfg.train.steps  # the last step's samples are out already
            and self.outstanding + pending + self.group_width
            <= self.cfg.max_inflight
        )

    # -- the service

    def service_settings(self) -> ServiceSettings:
        """How the feeder runs on :mod:`runtime.runner` (:func:`service_settings`)."""
        return service_settings(self.s)

    async def on_start(self, runner: Runner) -> None:
        self._catch_up_deadline = time.monotonic() + self.s.catch_up_timeout_s

    async def handle_batch(self, records: list[Record], ctx: BatchContext) -> None:
        """Follow the run: every event updates the state (:meth:`observe`)."""
        for rec in records:
            self.observe(rec.event)

    async def on_tick(self, runner: Runner) -> None:
        """After every poll: once caught up with the run's history, publish ``RunStarted`` (fresh
        run), issue the groups the bounds allow, and after ``Drain`` finish the run."""
        if not self._caught_up:
            self._caught_up = await self._at_end(runner)
            if not self._caught_up:
                return
            if not self.groups:
                await runner.send("control", ev.RunStarted(run_id=self.s.run_id,
                                                           config_json=json.dumps(redacted_dict(self.cfg))))
            elif not self.draining and not self.finished and (missing := self.short_groups()):
                log.warning("feeder: %d task(s) of groups an earlier feeder did not finish sending; sending them",
                            len(missing))
                await runner.send("tasks", *missing)
                for t in missing:
                    self.observe(t)
                self.issued_now += len(missing)
        # every group the bounds allow, then one send (one wait for acks); the state takes them in
        # only once Kafka has them: a send that fails (an outage: on_tick runs again) leaves none
        batch: list[ev.RolloutTask] = []
        while self.can_issue(pending=len(batch)):
            batch += self.group_tasks(self.next_index + len(batch) // self.group_width)
        if batch:
            await runner.send("tasks", *batch)
            for t in batch:
                self.observe(t)
            self.issued_now += len(batch)
        if self.draining and not self.finished:
            await self._maybe_finish(runner)
        if self.finished:
            runner.stop.set()

    async def _at_end(self, runner: Runner) -> bool:
        """True once a poll came back empty with every assigned partition read to its end (or
        ``catch_up_timeout_s`` passed): the state then reflects the run's history."""
        if time.monotonic() > self._catch_up_deadline:
            log.warning("feeder: not caught up with the run's topics after %.0f s; going on",
                        self.s.catch_up_timeout_s)
            return True
        assigned = runner.consumer.assignment()
        if runner.last_polled or not assigned:
            return False
        left = await behind(runner.consumer.raw, assigned)
        return len(left) == len(assigned) and not any(left.values())

    async def run(self, stop: asyncio.Event | None = None) -> int:
        """Feed until the run finished (or until stopped); the tasks this instance issued."""
        await Runner(self, self.service_settings(), stop).run()
        return self.issued_now

    async def _maybe_finish(self, runner: Runner) -> None:
        run_id = self.s.run_id
        missing = [sid for sid in self.issued if sid not in self.done]
        if missing and time.monotonic() - self.drain_started < self.s.drain_timeout_s:
            return
        for sid in missing:
            log.warning("feeder: sample %s has no outcome %.0f s after drain", sid, self.s.drain_timeout_s)
            out = ev.SampleOutcome(run_id=run_id, sample_id=sid, group_id=self.issued[sid], status="filtered",
                                   reason=f"drain timeout: no outcome {self.s.drain_timeout_s:g}s after the last step",
                                   trained_version=self.version)
            await runner.send("metrics", out)
            self.done.add(sid)
        # "stopped": someone drained the run (rollstream stop) before its last step
        await runner.send("control", ev.RunFinished(run_id=run_id, status="stopped" if self.stopped_by else "completed"))
        self.finished = True


def episode_spec(reference: str) -> ev.EnvSpec:
    """The environment of a multi-turn problem, from its reference (``{"env", "seed", "kwargs"}`` as
    JSON, :class:`envs.gym_text.EpisodeSource`); the seed stays in the reference."""
    ref = episode_ref(reference)
    return ev.EnvSpec(name=ref.env, kwargs=ref.kwargs)


def service_settings(s: FeederSettings) -> ServiceSettings:
    """How the feeder runs on :mod:`runtime.runner`: what its :data:`SPEC` subscribes (no consumer
    group: it reads the run's topics from the beginning on every start and commits nothing;
    ``tasks`` is only observed: the rollout group dead-letters its bad records), one batch handler
    call per poll."""
    return ServiceSettings(
        run_id=s.run_id, kafka=s.config.kafka, subscription=Subscription.of(SPEC, s.run_id),
        consume=Consume(poll_timeout_s=s.poll_timeout_s, batch_max_records=1000),
    )


def settings_from(start: ServiceStart) -> FeederSettings:
    """The feeder's settings in a run (``rollstream service feeder``)."""
    return FeederSettings(run_id=start.run_id, config=start.config, blob_dir=str(blob_dir_of(start.run_dir)))


async def run(settings: FeederSettings, stop: asyncio.Event | None = None) -> int:
    """Feed the run until it finished (or until stopped). Returns tasks issued by this instance."""
    issued = await Feeder(settings).run(stop)
    log.info("feeder: issued %d tasks", issued)
    return issued
