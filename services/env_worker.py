"""The environment service: a consumer group on ``env.requests`` that keeps multi-turn episodes.

The rollout agent loop sends ``EnvReset`` then ``EnvStep`` s (key ``episode_id``, so an episode's
requests reach one worker of the group); each becomes one handler call that answers one
``EnvObservation`` on ``env.responses``, committed once the answer is acknowledged.

* A reset builds the environment of the request's spec and answers ``reset(seed)`` as step 0.
* Step ``k`` applies the action to the episode held at step ``k - 1``; an episode this worker does
  not hold (a restart, a rebalance, an eviction) is **rebuilt**: reset with the step's ``seed``,
  the step's ``history`` replayed, then the action applied (environments are deterministic).
* The same step again gets the same answer, event id included; an older step is out of order.
* Every reset, step and rebuild runs in its own daemon thread bounded by ``env.step_timeout_s``;
  an environment that raises or times out ends its episode as failed with the one-line reason.
* A visual environment's observation images (:func:`envs.base.observation_images`) are written to
  the run's blob store and the answer carries their digests (``EnvObservation.image_hashes``).
* Up to ``EnvSettings.concurrency`` requests at once, two of one episode never together; at most
  ``env.max_episodes`` live episodes are held (the least recently used evicted).

docs/architecture.md, "Services", tells the whole story (idempotence, failures, latency, stop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from blobs import BlobStore, blob_dir_of
from envs.base import observation_images
from envs.latency import draw_latency_s
from runtime.bus import Record
from runtime.runner import Context, Counters, Service, ServiceSettings, derive_event_id, run_service
from runtime.settings import Consume, Delivery, Handling, Subscription
from schemas import events as ev
from schemas.config import RunConfig
from schemas.errors import one_line
from schemas.services import SERVICES
from services import ServiceStart

log = logging.getLogger("rollstream.env")

SPEC = SERVICES["env"]

T = TypeVar("T")

INFO_SCALARS = (str, int, float, bool)


class EnvSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Settings of one environment worker (the ``env`` section of the config says how episodes
    are run: step timeout, simulated latency, episodes kept)."""

    run_id: str
    """The run whose ``env.requests`` this worker answers."""
    config: RunConfig
    """The run config (``env`` section, Kafka settings)."""
    concurrency: int = 64
    """Requests handled at once (episodes advancing at the same time), each reset or step in its own
    thread."""
    shutdown_grace_s: float = 10.0
    """On stop or partition revocation, how long in-flight requests may still run, seconds (those cut
    off are not committed; the next owner answers them by rebuilding the episode)."""
    blob_dir: str = ""
    """The run's blob store (``<run dir>/blobs``), where a visual environment's observation images
    are written; empty: none (an environment that shows images then fails its episode)."""


class EnvFailure(Exception):
    """An episode cannot go on: the one-line reason becomes the failed observation's ``error``."""


@dataclass
class Episode:
    """A live episode held by this worker."""

    spec: ev.EnvSpec
    seed: int
    env: Any
    actions: list[str]
    """Actions applied so far (steps ``1 .. len(actions)``)."""
    last: ev.EnvObservation
    """The answer to the latest request (step ``len(actions)``)."""


@dataclass
class Final:
    """What is kept of an ended episode: its last step's action and answer."""

    action: str | None
    obs: ev.EnvObservation


class EnvWorker(Service):
    name = "env"

    def __init__(self, settings: EnvSettings) -> None:
        import envs  # noqa: F401  (registers the built-in environments)

        self.s = settings
        self.cfg = settings.config.env
        self.episodes: OrderedDict[str, Episode] = OrderedDict()
        """Live episodes, least recently used first."""
        self.ended: OrderedDict[str, Final] = OrderedDict()
        """Final answers of recently ended episodes, oldest first."""
        self.rebuilds = 0
        """Episodes rebuilt from a step's history."""
        self.abandoned_threads = 0
        """Environment calls that timed out (their threads run on, unreferenced)."""
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}
        self.blobs = BlobStore(settings.blob_dir) if settings.blob_dir else None

    # -- the handler

    async def handle(self, rec: Record, ctx: Context) -> None:
        msg = rec.event
        if not isinstance(msg, (ev.EnvReset, ev.EnvStep)):
            raise TypeError(f"env: unexpected {type(msg).__name__} on env.requests")
        async with self._exclusive(msg.episode_id):
            t0 = time.perf_counter()
            obs, fresh = await (self._reset(msg) if isinstance(msg, ev.EnvReset) else self._step(msg))
            if fresh:
                delay = draw_latency_s(self.cfg.latency, self.cfg.latency_mean_s, self.cfg.latency_sigma,
                                       f"{msg.episode_id}/{msg.step if isinstance(msg, ev.EnvStep) else 0}")
                if delay > 0:
                    await asyncio.sleep(delay)
                obs = msgspec.structs.replace(obs, env_s=time.perf_counter() - t0)
                self._record(msg, obs)
        ctx.emit("env.responses", obs, key=msg.episode_id)

    @contextlib.asynccontextmanager
    async def _exclusive(self, episode_id: str) -> AsyncIterator[None]:
        """One request of an episode at a time (FIFO); the lock is dropped when nobody holds or waits."""
        entry = self._locks.get(episode_id)
        if entry is None:
            entry = self._locks[episode_id] = (asyncio.Lock(), [0])
        lock, users = entry
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._locks[episode_id]

    # -- reset and step

    async def _reset(self, msg: ev.EnvReset) -> tuple[ev.EnvObservation, bool]:
        """(answer, fresh): ``fresh`` False for a repeated answer."""
        held = self.episodes.get(msg.episode_id)
        if held is not None and not held.actions and held.spec == msg.env and held.seed == msg.seed:
            return held.last, False  # the same reset again
        self._forget(msg.episode_id)  # a reset starts the episode afresh
        self.ended.pop(msg.episode_id, None)
        try:
            env, (text, info), images = await self._call(
                lambda: self._shown(*_play(msg.env, msg.seed, [], None)), self.cfg.step_timeout_s, "reset")
        except EnvFailure as e:
            return self._failed(msg, 0, str(e)), True
        obs = self._answer(msg, 0, text, info=info, image_hashes=images)
        self._remember(msg.episode_id, Episode(msg.env, msg.seed, env, [], obs))
        return obs, True

    async def _step(self, msg: ev.EnvStep) -> tuple[ev.EnvObservation, bool]:
        eid, k = msg.episode_id, msg.step
        given = len(msg.history) == k - 1  # the step carries the whole history (step 1: none needed)
        ep = self.episodes.get(eid)
        if ep is not None:
            self.episodes.move_to_end(eid)
            at = len(ep.actions)
            if k == at + 1 and (not given or msg.history == ep.actions):
                return await self._advance(eid, ep, msg), True
            if k == at and k >= 1 and msg.action == ep.actions[-1]:
                return ep.last, False  # the same step again
            if k <= at:
                return self._out_of_order(msg, f"episode {eid} is at step {at}"), False
            # the worker holds an older state (the episode went on elsewhere) or another history
        else:
            final = self.ended.get(eid)
            if final is not None:
                if k == final.obs.step and msg.action == final.action:
                    return final.obs, False  # the same (final) step again
                return self._out_of_order(msg, f"episode {eid} ended at step {final.obs.step}", ended=True), False
        why = None if k >= 1 else f"step={k} must be >= 1"
        if why is None and msg.env is None:
            why = "the step names no env spec"
        if why is None and not given:
            why = f"it carries {len(msg.history)} earlier actions, step {k} needs {k - 1}"
        if why is not None:
            self._forget(eid)
            held = "not held by this worker" if ep is None else f"at step {len(ep.actions)} here"
            return self._failed(msg, k, f"cannot rebuild episode {eid} ({held}): {why}"), True
        return await self._rebuild(eid, msg), True

    async def _advance(self, eid: str, ep: Episode, msg: ev.EnvStep) -> ev.EnvObservation:
        env = ep.env
        # not held while the step runs: if it is cut off (stop, partitions revoked) the environment may
        # have moved without the episode's record; the redelivered step then rebuilds it
        self._forget(eid)
        try:
            _, result, images = await self._call(lambda: self._shown(env, env.step(msg.action)),
                                                 self.cfg.step_timeout_s, f"step {msg.step}")
        except EnvFailure as e:
            return self._failed(msg, msg.step, str(e))
        obs = self._answer(msg, msg.step, *_unpack(result), image_hashes=images)
        ep.actions.append(msg.action)
        ep.last = obs
        self._remember(eid, ep)
        return obs

    async def _rebuild(self, eid: str, msg: ev.EnvStep) -> ev.EnvObservation:
        assert msg.env is not None
        spec, history = msg.env, list(msg.history)
        self.rebuilds += 1
        log.info("env: rebuilding episode %s from seed %d and %d actions", eid, msg.seed, len(history))
        try:
            env, result, images = await self._call(lambda: self._shown(*_play(spec, msg.seed, history, msg.action)),
                                                   self.cfg.step_timeout_s * (len(history) + 2),
                                                   f"rebuild to step {msg.step}")
        except EnvFailure as e:
            self._forget(eid)
            return self._failed(msg, msg.step, str(e))
        obs = self._answer(msg, msg.step, *_unpack(result), image_hashes=images)
        self._remember(eid, Episode(spec, msg.seed, env, [*history, msg.action], obs))
        return obs

    # -- running environment code

    async def _call(self, fn: Callable[[], T], timeout_s: float, what: str) -> T:
        """``fn()`` in a daemon thread, bounded by ``timeout_s``; its failure or timeout as :class:`EnvFailure`."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def settle(value: Any, error: BaseException | None) -> None:
            if fut.done():
                return  # timed out or cancelled meanwhile
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(value)

        def target() -> None:
            value: Any = None
            error: BaseException | None = None
            try:
                value = fn()
            except EnvFailure as e:
                error = e
            except Exception as e:
                error = EnvFailure(f"{what}: the environment raised {one_line(e)}")
            except BaseException as e:  # SystemExit & co. from environment code: a failure like any other
                error = EnvFailure(f"{what}: the environment raised {one_line(e)}")
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(settle, value, error)

        threading.Thread(target=target, name=f"env-{what}", daemon=True).start()
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            self.abandoned_threads += 1
            log.warning("env: %s took longer than %g s; environment dropped, thread abandoned (%d so far)",
                        what, timeout_s, self.abandoned_threads)
            raise EnvFailure(f"timeout: {what} took longer than {timeout_s:g} s (env.step_timeout_s); "
                             "the environment was dropped") from None

    def _shown(self, env: Any, result: T) -> tuple[Any, T, list[str]]:
        """``(env, result, digests)``: the images ``env``'s latest observation shows, written to the
        blob store (in the environment's thread); an :class:`EnvFailure` when there is no store."""
        images = observation_images(env)
        if images and self.blobs is None:
            raise EnvFailure("the environment shows images but this environment worker has no blob store")
        return env, result, [self.blobs.put(b) for b in images] if self.blobs is not None else []

    # -- answers and bookkeeping

    def _answer(self, msg: ev.EnvReset | ev.EnvStep, step: int, observation: Any, reward: Any = 0.0,
                terminated: Any = False, truncated: Any = False, info: Any = None,
                error: str = "", failed: bool = False, image_hashes: list[str] | None = None) -> ev.EnvObservation:
        return ev.EnvObservation(
            run_id=msg.run_id, event_id=derive_event_id(msg.event_id, self.name, 0), episode_id=msg.episode_id,
            step=step, observation=str(observation), reward=float(reward), terminated=bool(terminated),
            truncated=bool(truncated), info=_scalars(info), error=error, failed=failed,
            image_hashes=list(image_hashes or []),
        )

    def _failed(self, msg: ev.EnvReset | ev.EnvStep, step: int, error: str) -> ev.EnvObservation:
        log.warning("env: episode %s failed at step %d: %s", msg.episode_id, step, error)
        return self._answer(msg, step, "", terminated=True, error=error, failed=True)

    def _out_of_order(self, msg: ev.EnvStep, state: str, ended: bool = False) -> ev.EnvObservation:
        """An error answer that leaves the episode as it is."""
        log.warning("env: step %d of episode %s out of order: %s", msg.step, msg.episode_id, state)
        return self._answer(msg, msg.step, "", terminated=ended,
                            error=f"out of order: step {msg.step} ({state}); the episode is unchanged")

    def _record(self, msg: ev.EnvReset | ev.EnvStep, obs: ev.EnvObservation) -> None:
        """Keep ``obs`` (with its final ``env_s``) as the episode's answer; forget ended episodes."""
        eid = msg.episode_id
        ep = self.episodes.get(eid)
        if obs.terminated or obs.truncated or obs.failed:
            self._forget(eid)
            self.ended[eid] = Final(msg.action if isinstance(msg, ev.EnvStep) else None, obs)
            self.ended.move_to_end(eid)
            while len(self.ended) > self.cfg.max_episodes:
                self.ended.popitem(last=False)
        elif ep is not None:
            ep.last = obs

    def _remember(self, eid: str, ep: Episode) -> None:
        self.episodes[eid] = ep
        self.episodes.move_to_end(eid)
        while len(self.episodes) > self.cfg.max_episodes:
            old, _ = self.episodes.popitem(last=False)
            log.debug("env: evicted episode %s (held %d)", old, self.cfg.max_episodes)

    def _forget(self, eid: str) -> None:
        self.episodes.pop(eid, None)


def _play(spec: ev.EnvSpec, seed: int, history: list[str], action: str | None) -> tuple[Any, Any]:
    """Build ``spec``, reset it with ``seed``, replay ``history``; then ``(env, reset result)`` when
    ``action`` is None, else ``(env, step(action))``. Runs in a worker thread."""
    import envs

    try:
        env = envs.make_env(spec.name, prompt="", reference="", **spec.kwargs)
    except Exception as e:
        raise EnvFailure(f"cannot build environment {spec.name!r} with {dict(spec.kwargs)}: {one_line(e)}") from None
    try:
        first = env.reset(seed=seed)
    except Exception as e:
        raise EnvFailure(f"reset(seed={seed}): the environment raised {one_line(e)}") from None
    for i, past in enumerate(history, start=1):
        try:
            r = env.step(past)
        except Exception as e:
            raise EnvFailure(f"rebuild: replaying step {i} raised {one_line(e)}") from None
        if r[2] or r[3]:
            raise EnvFailure(f"rebuild: the history ends the episode at step {i} of {len(history)}")
    if action is None:
        return env, first
    return env, env.step(action)


def _unpack(result: Any) -> tuple[Any, Any, Any, Any, Any]:
    """``StepResult`` (or any 5-tuple) as ``(observation, reward, terminated, truncated, info)``."""
    observation, reward, terminated, truncated, info = result
    return observation, reward, terminated, truncated, info


def _scalars(info: Any) -> dict[str, str | int | float | bool]:
    """``info`` as JSON scalars: numpy scalars unwrapped, ``None`` dropped, anything else as text."""
    out: dict[str, str | int | float | bool] = {}
    for k, v in dict(info or {}).items():
        if v is None:
            continue
        if not isinstance(v, INFO_SCALARS) and hasattr(v, "item"):
            with contextlib.suppress(Exception):
                v = v.item()
        out[str(k)] = v if isinstance(v, INFO_SCALARS) else str(v)
    return out


def service_settings(settings: EnvSettings) -> ServiceSettings:
    """The runtime settings of an environment worker (it derives its answers' event ids itself: a
    repeated answer keeps its id)."""
    return ServiceSettings(
        run_id=settings.run_id, kafka=settings.config.kafka, subscription=Subscription.of(SPEC, settings.run_id),
        consume=Consume(batch_max_records=min(settings.concurrency, 256)),
        handling=Handling(max_concurrency=settings.concurrency, shutdown_grace_s=settings.shutdown_grace_s),
        delivery=Delivery(deterministic_output_ids=False),
    )


def settings_from(start: ServiceStart) -> EnvSettings:
    """An environment worker's settings in a run (``rollstream service env``): as many requests at
    once as can be in flight, one per episode and one episode per rollout handler call (a worker may
    own every partition of ``env.requests``: alone, or while the others restart)."""
    cfg = start.config
    return EnvSettings(run_id=start.run_id, config=cfg, concurrency=cfg.rollout.workers * cfg.rollout.max_batch,
                       blob_dir=str(blob_dir_of(start.run_dir)))


async def run(settings: EnvSettings, stop: asyncio.Event | None = None) -> Counters:
    """Answer environment requests until stopped (SIGTERM/SIGINT or ``stop``); the counters."""
    if settings.concurrency < 1:
        raise ValueError(f"EnvSettings.concurrency={settings.concurrency} must be >= 1")
    worker = EnvWorker(settings)
    counters = await run_service(worker, service_settings(settings), stop=stop)
    log.info("env: stopped (%s; %d rebuilds, %d abandoned threads)", counters.as_dict(), worker.rebuilds,
             worker.abandoned_threads)
    return counters
