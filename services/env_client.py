"""The rollout side of the environment service: an :class:`rollout.agent.EnvClient` over Kafka.

A rollout worker plays its episodes through one :class:`KafkaEnvClient`:

* **Requests.** ``reset`` sends an ``EnvReset`` and ``step`` an ``EnvStep`` to ``env.requests``
  (key ``episode_id``: one environment worker of the group ``rs-env-<run_id>`` holds the episode).
  Every step is self-contained: it carries the episode's ``env`` spec, ``seed`` and the earlier
  actions (``history``), so a worker that does not hold the episode (a restart, a rebalance after
  ``kill -9``) rebuilds it by replaying them (:mod:`services.env_worker`).
* **Answers.** One consumer without a group reads every partition of ``env.responses`` from its
  end as of :meth:`start`, and hands each ``EnvObservation`` to the request waiting for that
  ``(episode_id, step)``; answers nobody waits for (other workers' episodes, duplicates of a
  redelivered request) are skipped. Episode ids are unique per attempt (``<sample_id>@<8 hex>``),
  so an answer to an earlier attempt of the same sample can never be taken for this one's.
* **Time bound.** A request unanswered after ``env.request_timeout_s`` (long enough for a group
  rebalance and a rebuild) gives an error observation: the agent loop ends the episode with
  ``env_error`` and the rollout worker dead-letters the sample with the reason — recorded, never
  lost and never trained on as if the policy had failed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka.errors import KafkaError

from rollout.agent import Observation
from runtime.bus import Consumer
from schemas import events as ev
from schemas.config import KafkaSettings
from schemas.errors import one_line
from schemas.topics import topic_name

log = logging.getLogger("rollstream.rollout")

Send = Callable[[ev.Event, str], Awaitable[object]]
"""``send(event, key)``: publish one event on ``env.requests`` and wait for Kafka's ack."""


def observation_of(msg: ev.EnvObservation) -> Observation:
    """The agent loop's view of an environment worker's answer."""
    return Observation(msg.observation, reward=msg.reward, terminated=msg.terminated, truncated=msg.truncated,
                       info=dict(msg.info), error=msg.error, env_s=msg.env_s, image_hashes=tuple(msg.image_hashes))


class KafkaEnvClient:
    """See the module doc. :meth:`start` before the first request, :meth:`close` at the end."""

    def __init__(self, kafka: KafkaSettings, run_id: str, send: Send, *, timeout_s: float,
                 worker_id: str = "") -> None:
        self.kafka, self.run_id, self._send = kafka, run_id, send
        self.timeout_s, self.worker_id = timeout_s, worker_id
        self._waiting: dict[tuple[str, int], asyncio.Future[ev.EnvObservation]] = {}
        self._episodes: dict[str, tuple[ev.EnvSpec, int]] = {}
        self._consumer: Consumer | None = None
        self._reader: asyncio.Task[None] | None = None
        self.answers = 0
        """Answers handed to a waiting request."""
        self.skipped = 0
        """Answers nobody here waited for."""

    async def start(self, ready_timeout_s: float = 60.0) -> None:
        """Open the answer consumer and fix its start positions (the current ends) before any request."""
        consumer = Consumer(self.kafka, group_id=None, topics=[topic_name(self.run_id, "env.responses")],
                            auto_offset_reset="latest", client_suffix="rollout-env")
        await consumer.start()
        self._consumer = consumer
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ready_timeout_s
        while not consumer.assignment():
            if loop.time() > deadline:
                raise TimeoutError(f"no partitions of env.responses assigned within {ready_timeout_s:g} s")
            await consumer.raw.getmany(timeout_ms=100)
        for tp in consumer.assignment():
            await consumer.raw.position(tp)  # resolves "latest" now: answers sent after this are all seen
        self._reader = asyncio.create_task(self._read())

    async def close(self) -> None:
        """Stop reading; requests still waiting get an error observation. Idempotent."""
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None
        for fut in self._waiting.values():
            if not fut.done():
                fut.cancel()

    @property
    def reader_failed(self) -> BaseException | None:
        """The exception the answer reader died of, if it did."""
        task = self._reader
        if task is None or not task.done() or task.cancelled():
            return None
        return task.exception()

    async def _read(self) -> None:
        assert self._consumer is not None
        while True:
            try:
                recs = await self._consumer.getmany(timeout_ms=500)
            except KafkaError as e:  # an outage: aiokafka reconnects; requests time out if it lasts
                log.warning("rollout %s: reading env.responses failed (%s); retrying", self.worker_id, one_line(e))
                await asyncio.sleep(1.0)
                continue
            for rec in recs:
                msg = rec.event
                if not isinstance(msg, ev.EnvObservation):
                    if rec.error is not None:
                        log.error("rollout %s: undecodable record %s[%d]@%d on env.responses: %s", self.worker_id,
                                  rec.topic, rec.partition, rec.offset, rec.error)
                    continue
                fut = self._waiting.get((msg.episode_id, msg.step))
                if fut is None or fut.done():
                    self.skipped += 1
                    continue
                fut.set_result(msg)
                self.answers += 1

    async def _request(self, event: ev.EnvReset | ev.EnvStep, step: int, what: str) -> Observation:
        key = (event.episode_id, step)
        fut: asyncio.Future[ev.EnvObservation] = asyncio.get_running_loop().create_future()
        self._waiting[key] = fut
        try:
            if self.reader_failed is not None:
                return Observation("", error=f"{what}: the env.responses reader failed: {one_line(self.reader_failed)}")
            await self._send(event, event.episode_id)
            msg = await asyncio.wait_for(fut, self.timeout_s)
        except TimeoutError:
            return Observation("", error=f"timeout: no answer to {what} of episode {event.episode_id} within "
                                         f"{self.timeout_s:g} s (env.request_timeout_s): are environment workers running?")
        finally:
            self._waiting.pop(key, None)
        return observation_of(msg)

    async def reset(self, episode_id: str, env: str, kwargs: dict[str, Any], seed: int) -> Observation:
        spec = ev.EnvSpec(name=env, kwargs=dict(kwargs))
        self._episodes[episode_id] = (spec, seed)
        sample_id = episode_id.partition("@")[0]
        return await self._request(ev.EnvReset(run_id=self.run_id, episode_id=episode_id, sample_id=sample_id,
                                               env=spec, seed=seed), 0, "the reset")

    async def step(self, episode_id: str, step: int, action: str, *, history: list[str],
                   policy_version: int) -> Observation:
        spec, seed = self._episodes[episode_id]
        return await self._request(ev.EnvStep(run_id=self.run_id, episode_id=episode_id, step=step, action=action,
                                              policy_version=policy_version, history=list(history), env=spec,
                                              seed=seed), step, f"step {step}")

    def forget(self, episode_id: str) -> None:
        """Drop what is kept of an ended episode (its spec and seed)."""
        self._episodes.pop(episode_id, None)
