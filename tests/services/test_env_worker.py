"""services.env_worker against a real Kafka broker: episodes driven through ``env.requests`` /
``env.responses`` as the agent loop will drive them (no fakes but two tiny faulty environments)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

import envs
from envs.base import StepResult
from envs.frozenlake import expert_actions as lake_expert
from envs.latency import draw_latency_s
from envs.registry import ENVS, register_env
from envs.sokoban import expert_actions as sokoban_expert
from runtime.bus import Consumer, Producer
from schemas import events as ev
from schemas.config import EnvWorkersConfig, KafkaSettings, RunConfig, parse_config
from schemas.topics import topic_name
from services.env_worker import EnvSettings, run

pytestmark = pytest.mark.timeout(120)

LAKE = ev.EnvSpec(name="frozenlake", kwargs={"size": 4})
SOKOBAN = ev.EnvSpec(name="sokoban")
HANG = threading.Event()
"""Releases the hanging environment's thread at the end of its test."""


class Raises:
    """Steps fine once, then raises."""

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.turn = 0
        return "ready", {"seed": seed or 0}

    def step(self, action: str) -> StepResult:
        self.turn += 1
        if self.turn >= 2:
            raise RuntimeError("boom\nsecond line")
        return StepResult(f"ok {action}", 0.0, False, False, {"turn": self.turn})


class Hangs(Raises):
    """Hangs on its first step (until the test releases it)."""

    def step(self, action: str) -> StepResult:
        HANG.wait(60)
        return StepResult("late", 0.0, False, False, {})


for _name, _cls in (("test-raises", Raises), ("test-hangs", Hangs)):
    if _name not in ENVS:
        register_env(_name)(lambda prompt="", reference="", _c=_cls: _c())


# --------------------------------------------------------------------------- harness


class Agent:
    """Sends requests on ``env.requests`` and collects the answers of ``env.responses``."""

    def __init__(self, run_id: str, producer: Producer, consumer: Consumer) -> None:
        self.run_id = run_id
        self.producer = producer
        self.consumer = consumer
        self.answers: dict[tuple[str, int], list[ev.EnvObservation]] = defaultdict(list)
        self.arrival: list[tuple[str, int]] = []

    async def send(self, event: ev.Event) -> None:
        await self.producer.send_and_wait(topic_name(self.run_id, "env.requests"), event)

    async def reset(self, eid: str, spec: ev.EnvSpec, seed: int) -> None:
        await self.send(ev.EnvReset(run_id=self.run_id, episode_id=eid, sample_id=f"s-{eid}", env=spec, seed=seed))

    def step(self, eid: str, k: int, action: str, history: list[str] | None = None, spec: ev.EnvSpec | None = None,
             seed: int = 0) -> ev.EnvStep:
        return ev.EnvStep(run_id=self.run_id, episode_id=eid, step=k, action=action, history=history or [],
                          env=spec, seed=seed)

    async def wait(self, eid: str, k: int, n: int = 1, timeout_s: float = 30.0) -> ev.EnvObservation:
        """The ``n``-th answer to step ``k`` of ``eid``."""
        deadline = time.monotonic() + timeout_s
        while len(self.answers[(eid, k)]) < n:
            assert time.monotonic() < deadline, f"no answer {n} to step {k} of {eid}; got {dict(self.answers)}"
            await self.poll()
        return self.answers[(eid, k)][n - 1]

    async def poll(self) -> None:
        for rec in await self.consumer.getmany(timeout_ms=200):
            assert rec.error is None, rec.error
            obs = rec.event
            assert isinstance(obs, ev.EnvObservation) and rec.key == obs.episode_id.encode()
            self.answers[(obs.episode_id, obs.step)].append(obs)
            self.arrival.append((obs.episode_id, obs.step))

    async def drain(self, seconds: float) -> None:
        """Collect whatever else arrives within ``seconds``."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            await self.poll()


@contextlib.asynccontextmanager
async def env_service(kafka: KafkaSettings, run_id: str, blob_dir: str = "", **env: Any
                      ) -> AsyncIterator[asyncio.Task[Any]]:
    """The env worker (``services.env_worker.run``) in this process until the block ends."""
    cfg = RunConfig(kafka=kafka, env=EnvWorkersConfig(**env))
    stop = asyncio.Event()
    job = asyncio.create_task(run(EnvSettings(run_id=run_id, config=cfg, concurrency=16, shutdown_grace_s=2.0,
                                              blob_dir=blob_dir), stop))
    try:
        yield job
        assert not job.done(), f"the worker ended early: {job.exception() if not job.cancelled() else 'cancelled'}"
    finally:
        stop.set()
        await asyncio.wait_for(job, timeout=30)


@contextlib.asynccontextmanager
async def agent(kafka: KafkaSettings, run_id: str) -> AsyncIterator[Agent]:
    async with Producer(kafka) as producer, Consumer(
        kafka, group_id=None, topics=[topic_name(run_id, "env.responses")], auto_offset_reset="earliest"
    ) as consumer:
        yield Agent(run_id, producer, consumer)


def local_play(spec: ev.EnvSpec, seed: int, actions: list[str]) -> tuple[str, StepResult | None]:
    """What the environment itself says: (first observation, result of the last action)."""
    env = envs.make_env(spec.name, prompt="", reference="", **spec.kwargs)
    first, _ = env.reset(seed=seed)
    last = None
    for a in actions:
        last = env.step(a)
    return first, last


async def play(a: Agent, eid: str, spec: ev.EnvSpec, seed: int, actions: list[str]) -> list[ev.EnvObservation]:
    """Reset, then every action (each step self-contained), waiting for each answer."""
    await a.reset(eid, spec, seed)
    out = [await a.wait(eid, 0)]
    for k, action in enumerate(actions, start=1):
        await a.send(a.step(eid, k, action, actions[: k - 1], spec, seed))
        out.append(await a.wait(eid, k))
    return out


# --------------------------------------------------------------------------- simulated latency


def test_latency_none_and_config_checks() -> None:
    assert draw_latency_s("none", 1.0, 1.0, "x") == 0.0
    with pytest.raises(ValueError, match="tail index"):
        draw_latency_s("pareto", 1.0, 1.0, "x")
    for text, key in (("env: {workers: 0}", "env.workers"), ("env: {request_timeout_s: 0}", "env.request_timeout_s"), ("env: {step_timeout_s: 0}", "env.step_timeout_s"),
                      ("env: {latency: pareto, latency_mean_s: 0.1, latency_sigma: 1.0}", "env.latency_sigma"),
                      ("env: {latency: lognormal}", "env.latency"), ("env: {max_episodes: 0}", "env.max_episodes"),
                      ("env: {latency: gamma}", "env.latency")):
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            parse_config(text, [])
    assert parse_config("env: {latency: exponential, latency_mean_s: 0.01}", []).env.latency == "exponential"


# --------------------------------------------------------------------------- episodes over Kafka


async def test_frozenlake_expert_reaches_the_goal(kafka: KafkaSettings, run_id: str, topics: list[str]) -> None:
    seed = 11
    actions = lake_expert(seed, size=4)
    assert actions
    async with env_service(kafka, run_id, latency="exponential", latency_mean_s=0.01), agent(kafka, run_id) as a:
        obs = await play(a, "lake", LAKE, seed, actions)
        await a.drain(0.5)
    first, last = local_play(LAKE, seed, actions)
    assert obs[0].step == 0 and obs[0].observation == first and obs[0].info["seed"] == seed
    for o in obs[:-1]:
        assert not (o.terminated or o.truncated or o.failed or o.error) and o.reward == 0.0
    goal = obs[-1]
    assert goal.step == len(actions) and goal.reward == 1.0 and goal.terminated and not goal.failed
    assert goal.info["success"] is True and "reached the goal" in goal.observation
    assert last is not None and goal.observation == last.observation
    assert all(o.env_s > 0 for o in obs)  # env time plus the simulated latency
    assert all(len(a.answers[(o.episode_id, o.step)]) == 1 for o in obs)  # one answer per request


async def test_a_visual_environments_images_go_to_the_blob_store(kafka: KafkaSettings, run_id: str,
                                                                  topics: list[str], tmp_path: Path) -> None:
    """frozenlake_pixels over Kafka: every answer names its frame's digest, the frame is in the blob
    store, and a worker that rebuilds the episode from a step's history names the same frame."""
    from blobs import BlobStore, sha256_hex
    from envs.base import observation_images

    spec = ev.EnvSpec(name="frozenlake_pixels", kwargs={"size": 4, "cell_px": 14, "frames": "every"})
    actions = lake_expert(11, size=4)[:2]
    async with env_service(kafka, run_id, blob_dir=str(tmp_path / "blobs")), agent(kafka, run_id) as a:
        obs = await play(a, "see", spec, 11, actions)
        await a.send(a.step("again", 2, actions[1], actions[:1], spec, 11))  # not held: rebuilt
        rebuilt = await a.wait("again", 2)
    env = envs.make_env(spec.name, prompt="", reference="", **spec.kwargs)
    env.reset(seed=11)
    frames = [observation_images(env)[0]]
    for action in actions:
        env.step(action)
        frames.append(observation_images(env)[0])
    assert [o.image_hashes for o in obs] == [[sha256_hex(f)] for f in frames] and len(set(frames)) == 3
    assert rebuilt.image_hashes == obs[-1].image_hashes and not rebuilt.error
    store = BlobStore(tmp_path / "blobs")
    assert [store.get(o.image_hashes[0]) for o in obs] == frames


@pytest.mark.parametrize("max_episodes", [1024, 1], ids=["held", "evicted-each-step"])
async def test_two_episodes_interleaved(kafka: KafkaSettings, run_id: str, topics: list[str],
                                        max_episodes: int) -> None:
    """FrozenLake and Sokoban advance step by step side by side; with max_episodes=1 each step finds
    its episode evicted by the other one and rebuilds it from the step's history."""
    lake_seed, box_seed = 5, 3
    lake, box = lake_expert(lake_seed, size=4), sokoban_expert(box_seed)
    async with env_service(kafka, run_id, max_episodes=max_episodes), agent(kafka, run_id) as a:
        await a.reset("lake", LAKE, lake_seed)
        await a.reset("box", SOKOBAN, box_seed)
        await a.wait("lake", 0)
        await a.wait("box", 0)
        for k in range(1, max(len(lake), len(box)) + 1):
            for eid, spec, seed, acts in (("lake", LAKE, lake_seed, lake), ("box", SOKOBAN, box_seed, box)):
                if k <= len(acts):
                    await a.send(a.step(eid, k, acts[k - 1], acts[: k - 1], spec, seed))
            for eid, acts in (("lake", lake), ("box", box)):
                if k <= len(acts):
                    await a.wait(eid, k)
        await a.drain(0.5)
    for eid, spec, seed, acts in (("lake", LAKE, lake_seed, lake), ("box", SOKOBAN, box_seed, box)):
        got = [a.answers[(eid, k)] for k in range(len(acts) + 1)]
        assert all(len(g) == 1 for g in got), got
        for k in range(1, len(acts) + 1):
            _, want = local_play(spec, seed, acts[:k])
            assert want is not None and got[k][0].observation == want.observation, (eid, k)
            assert got[k][0].reward == pytest.approx(want.reward) and not got[k][0].error
        end = got[-1][0]
        assert end.terminated and end.info["success"] is True and not end.failed
    box_return = sum(a.answers[("box", k)][0].reward for k in range(1, len(box) + 1))
    assert box_return == pytest.approx(1.1)  # solve_reward + box_reward * boxes


async def test_failing_and_hanging_envs_end_their_episodes_and_the_worker_goes_on(
    kafka: KafkaSettings, run_id: str, topics: list[str]
) -> None:
    HANG.clear()
    try:
        async with env_service(kafka, run_id, step_timeout_s=2.0) as job, agent(kafka, run_id) as a:
            # raises on its second step
            await a.reset("bad", ev.EnvSpec(name="test-raises"), 1)
            assert not (await a.wait("bad", 0)).failed
            await a.send(a.step("bad", 1, "x"))
            assert (await a.wait("bad", 1)).observation == "ok x"
            await a.send(a.step("bad", 2, "y"))
            boom = await a.wait("bad", 2)
            assert boom.failed and boom.terminated and "RuntimeError: boom" in boom.error
            assert "second line" not in boom.error
            # cannot even be built
            await a.reset("unknown", ev.EnvSpec(name="no-such-env"), 0)
            await a.reset("badkw", ev.EnvSpec(name="frozenlake", kwargs={"size": 99}), 0)
            unknown, badkw = await a.wait("unknown", 0), await a.wait("badkw", 0)
            assert unknown.failed and unknown.terminated and "unknown environment 'no-such-env'" in unknown.error
            assert badkw.failed and "size=99" in badkw.error
            # hangs: a timeout ends it, while another episode goes on meanwhile
            await a.reset("hang", ev.EnvSpec(name="test-hangs"), 0)
            await a.wait("hang", 0)
            t0 = time.monotonic()
            await a.send(a.step("hang", 1, "x"))
            await a.reset("other", LAKE, 2)
            other = await a.wait("other", 0)
            hung = await a.wait("hang", 1)
            assert time.monotonic() - t0 >= 1.9
            assert a.arrival.index(("other", 0)) < a.arrival.index(("hang", 1))  # no barrier across episodes
            assert hung.failed and hung.terminated and hung.error.startswith("timeout: ") and hung.env_s >= 1.9
            # the dropped episode is not held any more: its next step (no history) fails explicitly
            await a.send(a.step("hang", 2, "y"))
            after = await a.wait("hang", 2)
            assert after.error and not after.observation
            # and the worker goes on
            actions = lake_expert(2, size=4)
            await a.send(a.step("other", 1, actions[0]))
            assert not (await a.wait("other", 1)).error and not other.failed
            assert not job.done()
        counters = job.result()
        assert counters.failed == 0 and counters.dead_lettered == 0  # every failure was answered, not dead-lettered
    finally:
        HANG.set()


async def test_restarted_worker_rebuilds_from_history(kafka: KafkaSettings, run_id: str, topics: list[str]) -> None:
    """A worker that never saw an episode rebuilds it from the step's seed and history and goes on;
    the committed requests are not answered again by the new worker."""
    seed = 7
    actions = lake_expert(seed, size=4)
    assert len(actions) >= 3
    async with agent(kafka, run_id) as a:
        async with env_service(kafka, run_id):
            await play(a, "ep", LAKE, seed, actions[:2])
        async with env_service(kafka, run_id):  # a fresh worker of the same group: holds nothing
            await a.send(a.step("ep", 3, actions[2], actions[:2], LAKE, seed))
            rebuilt = await a.wait("ep", 3)
            for k in range(4, len(actions) + 1):  # held again: later steps need no history
                await a.send(a.step("ep", k, actions[k - 1]))
                await a.wait("ep", k)
            # no history, no spec, never seen: failed with the reason
            await a.send(a.step("ghost", 2, "left"))
            ghost = await a.wait("ghost", 2)
            # a history of the wrong length cannot be replayed
            await a.send(a.step("ghost2", 3, "left", ["down"], LAKE, seed))
            ghost2 = await a.wait("ghost2", 3)
            await a.drain(1.5)  # any answer to a redelivered request would have arrived by now
    _, want = local_play(LAKE, seed, actions[:3])
    assert want is not None and rebuilt.observation == want.observation and not rebuilt.error
    assert rebuilt.info["turn"] == 3
    goal = a.answers[("ep", len(actions))][0]
    assert goal.terminated and goal.reward == 1.0 and goal.info["success"] is True
    assert all(len(a.answers[("ep", k)]) == 1 for k in range(len(actions) + 1))
    assert ghost.failed and ghost.terminated and "cannot rebuild episode ghost (not held by this worker)" in ghost.error
    assert ghost2.failed and "carries 1 earlier actions, step 3 needs 2" in ghost2.error


async def test_duplicate_step_gets_the_same_answer(kafka: KafkaSettings, run_id: str, topics: list[str]) -> None:
    seed = 4
    actions = lake_expert(seed, size=4)
    assert len(actions) >= 3
    # simulated latency keeps the first request in flight while the second arrives
    async with env_service(kafka, run_id, latency="exponential", latency_mean_s=0.2), agent(kafka, run_id) as a:
        await a.reset("ep", LAKE, seed)
        await a.wait("ep", 0)
        # step 1 twice back to back (an agent's retry: a new request, same step and action): the
        # second waits for the first (never the same episode twice at once) and gets its answer
        await a.send(a.step("ep", 1, actions[0], [], LAKE, seed))
        await a.send(a.step("ep", 1, actions[0], [], LAKE, seed))
        again = await a.wait("ep", 1, n=2)
        # the same step with another action, and a step from the past: errors, the episode unchanged
        await a.send(a.step("ep", 1, "nonsense", [], LAKE, seed))
        conflict = await a.wait("ep", 1, n=3)
        await a.send(a.step("ep", 2, actions[1], actions[:1], LAKE, seed))
        second = await a.wait("ep", 2)
        await a.send(a.step("ep", 1, actions[0], [], LAKE, seed))
        stale = await a.wait("ep", 1, n=4)
        await a.send(a.step("ep", 3, actions[2], actions[:2], LAKE, seed))
        third = await a.wait("ep", 3)
        # the reset again, after the episode moved on: a fresh episode
        await a.reset("ep", LAKE, seed)
        restarted = await a.wait("ep", 0, n=2)
    first = a.answers[("ep", 1)][0]
    assert again == first  # same answer, same event id: the record keeps it once
    assert conflict.error.startswith("out of order: step 1") and not conflict.failed and not conflict.terminated
    assert stale.error.startswith("out of order: step 1") and not stale.failed
    assert not second.error and not third.error
    _, want = local_play(LAKE, seed, actions[:3])
    assert want is not None and third.observation == want.observation
    assert restarted.observation == a.answers[("ep", 0)][0].observation and not restarted.error


def test_cli_service_env_answers_and_stops_on_sigterm(bootstrap: str, tmp_path: Path) -> None:
    """`rollstream service env --run ID` with a prepared run folder: answers a reset, exits 0 on SIGTERM."""
    import uuid

    from runtime.bus import TopicAdmin

    rid = f"env-{uuid.uuid4().hex[:8]}"
    runs = tmp_path / "runs"
    (runs / rid).mkdir(parents=True)
    (runs / rid / "config.yaml").write_text("env: {step_timeout_s: 5.0, max_episodes: 8}\n")
    kafka = KafkaSettings(bootstrap=bootstrap)

    async def drive() -> ev.EnvObservation:
        async with TopicAdmin(kafka) as admin:
            await admin.ensure_run_topics(rid)
        async with agent(kafka, rid) as a:
            await a.reset("cli", LAKE, 1)
            return await a.wait("cli", 0, timeout_s=90)

    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap, ROLLSTREAM_HOME=str(tmp_path / "home"))
    log = tmp_path / "env.log"
    with log.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "service", "env", "--run", rid,
                                 "--runs-dir", str(runs)], env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        obs = asyncio.run(drive())
        assert obs.observation == local_play(LAKE, 1, [])[0] and not obs.error
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

        async def cleanup() -> None:
            async with TopicAdmin(kafka) as admin:
                await admin.delete_run_topics(rid)

        asyncio.run(cleanup())


def test_step_events_stay_self_contained() -> None:
    """The fields a rebuild needs survive the wire (and an old step without them decodes)."""
    step = ev.EnvStep(run_id="r", episode_id="e", step=3, action="up", history=["left", "down"], env=LAKE, seed=9)
    dec = msgspec.msgpack.Decoder(ev.EnvRequestEvent)
    assert dec.decode(msgspec.msgpack.encode(step)) == step
    old = {k: v for k, v in msgspec.to_builtins(step).items() if k not in ("history", "env", "seed")}
    assert dec.decode(msgspec.msgpack.encode(old)) == msgspec.structs.replace(step, history=[], env=None, seed=0)
