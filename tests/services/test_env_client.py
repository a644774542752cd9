"""The rollout side of the environment service against a real broker: the agent loop plays episodes
through :class:`services.env_client.KafkaEnvClient` and an environment worker (``services.env_worker``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from envs.frozenlake import expert_actions
from rollout.agent import AgentLimits, Observation, run_episode
from rollout.engine import TorchEngine
from rollout.sampling import SamplingParams
from runtime.bus import Producer
from schemas import events as ev
from schemas.config import KafkaSettings
from schemas.topics import topic_name
from services.env_client import KafkaEnvClient
from tests.rollout.test_agent import SPEC
from tests.services.test_env_worker import env_service

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny chat model whose context holds a whole FrozenLake episode."""
    from rollout.model_init import init_tiny_model

    return init_tiny_model(tmp_path_factory.mktemp("envclient") / "m", SPEC, seed=1)


class Scripted(KafkaEnvClient):
    """The model's replies replaced by the expert's actions (so the episode's outcome is known)."""

    def __init__(self, *a: object, actions: list[str], **kw: object) -> None:
        super().__init__(*a, **kw)  # type: ignore[arg-type]
        self.script = actions

    async def step(self, episode_id: str, step: int, action: str, *, history: list[str],
                   policy_version: int) -> Observation:
        return await super().step(episode_id, step, self.script[step - 1], history=self.script[: step - 1],
                                  policy_version=policy_version)


async def test_episodes_through_kafka_and_an_env_worker(kafka: KafkaSettings, run_id: str, topics: list[str],
                                                        long_model: Path) -> None:
    engine = TorchEngine(long_model, max_batch=4)
    async with Producer(kafka) as producer, env_service(kafka, run_id):
        async def send(event: ev.Event, key: str) -> object:
            return await producer.send_and_wait(topic_name(run_id, "env.requests"), event, key=key)

        seeds = [3, 11]
        clients = [Scripted(kafka, run_id, send, timeout_s=30.0, actions=expert_actions(s)) for s in seeds]
        for c in clients:
            await c.start()
        try:
            trajs = await asyncio.gather(*(
                run_episode(engine, engine.tokenizer, c, episode_id=f"g0/{i}@abc{i}", env="frozenlake",
                            env_kwargs={"size": 4}, seed=s, params=SamplingParams(max_new_tokens=2),
                            limits=AgentLimits(max_turns=20, max_tokens_per_turn=2, max_context_tokens=4000))
                for i, (c, s) in enumerate(zip(clients, seeds, strict=True))))
            # each client skips the other's answers (one consumer per client, no group); client 0's
            # consumer may read the last of client 1's answers a moment after client 1 took it
            for _ in range(200):  # up to 10 s
                if clients[0].skipped >= clients[1].answers:
                    break
                await asyncio.sleep(0.05)
        finally:
            for c in clients:
                await c.close()
    for traj, s, c in zip(trajs, seeds, clients, strict=True):
        assert traj.finish == "terminated" and traj.success and traj.episode_return == 1.0, traj.error
        assert traj.num_turns == len(expert_actions(s)) and traj.env_s > 0
        assert all(info.get("state_hash") for info in traj.infos)
        assert c.answers == traj.num_turns + 1  # the reset and every step, each answered once
    assert clients[0].skipped >= clients[1].answers


async def test_no_env_worker_is_a_timeout_error_not_a_hang(kafka: KafkaSettings, run_id: str, topics: list[str],
                                                           model_dir: Path) -> None:
    engine = TorchEngine(model_dir, max_batch=2)
    async with Producer(kafka) as producer:
        async def send(event: ev.Event, key: str) -> object:
            return await producer.send_and_wait(topic_name(run_id, "env.requests"), event, key=key)

        client = KafkaEnvClient(kafka, run_id, send, timeout_s=1.0)
        await client.start()
        try:
            traj = await run_episode(engine, engine.tokenizer, client, episode_id="g0/0@dead", env="frozenlake",
                                     env_kwargs={}, seed=1, params=SamplingParams(max_new_tokens=2))
        finally:
            await client.close()
            await client.close()  # idempotent
    assert traj.finish == "env_error" and traj.num_turns == 0
    assert "timeout" in traj.error and "env.request_timeout_s" in traj.error
