"""The rollout worker's multi-turn pieces that need no broker: an episode as a ``Generation``."""

from __future__ import annotations

from typing import Any

from rollout.agent import Trajectory
from schemas import events as ev
from services.rollout_worker import generation_of
from services.sanity import check_generation


class Tok:
    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


def task() -> ev.RolloutTask:
    return ev.RolloutTask(run_id="r", sample_id="g0/1", group_id="g0", index=1, group_size=2, prompt_id="frozenlake:3",
                          domain="lake", prompt="", reference='{"env": "frozenlake", "seed": 3, "kwargs": {}}',
                          env=ev.EnvSpec(name="frozenlake"), ts=100.0)


def test_an_episode_becomes_one_generation_with_its_turns() -> None:
    infos: list[dict[str, Any]] = [{"state_hash": "s0"}, {"state_hash": "s1"}, {"state_hash": "s2", "success": True}]
    traj = Trajectory(prompt_ids=[1, 2], response_ids=[5, 6, 0, 0, 7], logprobs=[-0.5, -0.1, 0.0, 0.0, -0.2],
                      loss_mask=[1, 1, 0, 0, 1], step_rewards=[0.0, 1.0], actions=["down", "right"],
                      observations=["o0", "o1", "o2"], versions=[(3, 3), (4, 4)], infos=infos, finish="terminated",
                      success=True, gen_s=1.5, env_s=0.25)
    gen = generation_of(task(), traj, "g0/1@0123abcd", "w0", Tok(), queued_s=2.0)
    assert check_generation(gen) is None
    assert (gen.policy_version, gen.policy_version_end, gen.turn_versions) == (3, 4, [3, 4])
    assert gen.state_hashes == ["s0", "s1"]  # the state each turn acted from: the observation before it
    assert (gen.num_turns, gen.step_rewards, gen.env_finish, gen.success) == (2, [0.0, 1.0], "terminated", True)
    assert gen.finish_reason == "stop" and gen.response_text == "5 6 0 0 7" and gen.episode_id == "g0/1@0123abcd"
    assert (gen.gen_s, gen.env_s, gen.queued_s, gen.worker_id) == (1.5, 0.25, 2.0, "w0")
    cut = generation_of(task(), Trajectory(prompt_ids=[1], response_ids=[5], logprobs=[-1.0], loss_mask=[1],
                                           step_rewards=[0.0], actions=["x"], versions=[(0, 0)], infos=[{}],
                                           finish="context"), "e", "w", Tok(), 0.0)
    assert cut.finish_reason == "length" and cut.state_hashes == [""]
