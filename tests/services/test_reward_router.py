"""The reward router's scoring of multi-turn episodes (pure: no Kafka; the router on the broker is
covered by the e2e and fuzz tests)."""

from __future__ import annotations

from schemas import events as ev
from schemas.config import RunConfig
from services.reward_router import score, verifier_table


def episode(**kw: object) -> ev.Generation:
    task = ev.RolloutTask(run_id="r", sample_id="g0/0", group_id="g0", index=0, group_size=2, prompt_id="frozenlake:3",
                          domain="lake", prompt="board", reference='{"env": "frozenlake", "seed": 3, "kwargs": {}}',
                          env=ev.EnvSpec(name="frozenlake"))
    base: dict[str, object] = dict(
        run_id="r", task=task, prompt_ids=[1, 2], response_ids=[3, 4, 5, 6], response_text="down ... right",
        logprobs=[-0.1, 0.0, 0.0, -0.2], loss_mask=[1, 0, 0, 1], finish_reason="stop", policy_version=2,
        policy_version_end=2, num_turns=2, episode_id="g0/0@00ff00ff", step_rewards=[0.0, 1.0], turn_versions=[2, 2],
        state_hashes=["a", "b"], env_finish="terminated", success=True)
    base.update(kw)
    return ev.Generation(**base)  # type: ignore[arg-type]


def test_an_episode_is_scored_by_its_step_rewards_not_a_verifier() -> None:
    cfg = RunConfig()
    s = score(episode(), verifier_table(cfg), cfg.reward)
    assert s.reward == 1.0 and s.step_rewards == [0.0, 1.0] and s.verifier == "env:frozenlake"
    assert s.rewards == {"correct": 1.0, "return": 1.0, "turns": 2.0}
    assert s.details == "terminated after 2 turn(s)" and s.policy_version == 2
    lost = score(episode(step_rewards=[0.0, -0.5], success=False, env_finish="max_turns"), verifier_table(cfg),
                 cfg.reward)
    assert lost.reward == -0.5 and lost.rewards["correct"] == 0.0 and lost.details.startswith("max_turns")
