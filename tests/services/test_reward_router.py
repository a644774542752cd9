"""The reward router's scoring of multi-turn episodes and judged domains (pure: no Kafka; the router on the broker is
covered by the e2e and fuzz tests)."""

from __future__ import annotations

import re

import msgspec
import pytest

from schemas import events as ev
from schemas.config import ConfigError, RunConfig, parse_raw
from services.reward_router import (
    RewardSettings,
    judge_of,
    score,
    service_settings,
    verifier_table,
    with_verdict,
)


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


def instruct_gen(response: str) -> ev.Generation:
    task = ev.RolloutTask(run_id="r", sample_id="g1/0", group_id="g1", index=0, group_size=2, prompt_id="instruct:5",
                          domain="writing", prompt="Write one sentence about tea. Use the word \"blue\".",
                          reference='{"kind": "contains", "arg": "blue", "topic": "tea"}')
    return ev.Generation(run_id="r", task=task, prompt_ids=[1], response_ids=[2], response_text=response,
                         logprobs=[-0.1], loss_mask=[1], finish_reason="stop", policy_version=1, policy_version_end=1)


def judged_config(rewards: dict[str, float]) -> RunConfig:
    from schemas.config import DomainConfig, JudgeConfig, JudgeModelConfig

    return RunConfig(
        data=msgspec.structs.replace(RunConfig().data, domains=[
            DomainConfig(name="writing", source="instruct", judge="j", rewards=rewards),
            DomainConfig(name="arith")]),
        judge=JudgeConfig(models={"j": JudgeModelConfig(path="models/j")}))


def test_a_judged_domain_goes_to_its_judge_with_the_verifier_components() -> None:
    cfg = judged_config({"correct": 1.0, "judge": 0.5})
    table = verifier_table(cfg)
    gen = instruct_gen("Tea is blue.")
    assert judge_of(gen, table) == "j" and table["arith"].judge == "" and table["arith"].weights == {}
    s = score(gen, table, cfg.reward)
    assert s.rewards == {"correct": 1.0, "verifier": 1.0} and s.reward == 1.0  # judge not in yet
    done = with_verdict(s, "j", table["writing"].weights, score=0.4, answer="p(...)", error="", judge_s=0.2)
    assert done.rewards == {"correct": 1.0, "verifier": 1.0, "judge": 0.4}
    assert done.reward == pytest.approx(1.0 + 0.5 * 0.4) and done.judge == "j" and done.judge_s == 0.2
    assert done.details.endswith("judge j: 0.400 (p(...))") and done.judge_error == ""


def test_an_unscored_verdict_counts_zero_with_its_reason() -> None:
    cfg = judged_config({})  # default: the judge alone
    table = verifier_table(cfg)
    s = score(instruct_gen("Tea is green."), table, cfg.reward)
    assert s.rewards["correct"] == 0.0 and s.reward == 0.0
    done = with_verdict(s, "j", table["writing"].weights, score=0.9, answer="%%%", error="no integer in '%%%'",
                        judge_s=0.1)
    assert done.reward == 0.0 and done.rewards["judge"] == 0.0 and done.judge_error == "no integer in '%%%'"
    assert "judge j: unscored: no integer" in done.details


def test_weights_without_a_judge_mix_verifier_components() -> None:
    from schemas.config import DomainConfig

    cfg = RunConfig(data=msgspec.structs.replace(RunConfig().data, domains=[
        DomainConfig(name="arith", answer="tag", format_reward=0.1, rewards={"correct": 2.0, "format": 0.5})]))
    table = verifier_table(cfg)
    gen = msgspec.structs.replace(instruct_gen("<answer>5</answer>"), task=msgspec.structs.replace(
        instruct_gen("").task, domain="arith", prompt_id="arith:2+3", reference="5"))
    s = score(gen, table, cfg.reward)
    assert judge_of(gen, table) == ""
    assert s.rewards["verifier"] == pytest.approx(1.1) and s.reward == pytest.approx(2.0 + 0.5)


@pytest.mark.parametrize(("domain", "error"), [
    ({"judge": "nope"}, "data.domains[0].judge='nope' is not in judge.models (j)"),
    ({"rewards": {"style": 1.0}}, "data.domains[0].rewards: unknown component 'style'"),
    ({"rewards": {"format": 1.0}}, "data.domains[0].rewards weights 'format' but data.domains[0].answer='raw'"),
])
def test_bad_judge_settings_are_refused_naming_the_key(domain: dict[str, object], error: str) -> None:
    raw = {"judge": {"models": {"j": {"path": "m"}}}, "data": {"domains": [{"name": "w", **domain}]}}
    with pytest.raises(ConfigError, match=re.escape(error)):
        parse_raw(raw)


def test_a_weighted_judge_needs_the_domain_to_have_one() -> None:
    with pytest.raises(ConfigError, match=re.escape("rewards weights 'judge' but the domain has no judge")):
        parse_raw({"data": {"domains": [{"name": "w", "rewards": {"judge": 1.0}}]}})


def test_simulated_reward_latency_needs_a_mean_and_a_finite_tail() -> None:
    with pytest.raises(ConfigError, match=re.escape("reward.latency='lognormal' needs reward.latency_mean_s > 0")):
        parse_raw({"reward": {"latency": "lognormal"}})
    with pytest.raises(ConfigError, match=re.escape("reward.latency_sigma=1 must be > 0 (> 1 for pareto")):
        parse_raw({"reward": {"latency": "pareto", "latency_mean_s": 1.0, "latency_sigma": 1.0}})
    assert parse_raw({"reward": {"latency": "exponential", "latency_mean_s": 0.5}}).reward.latency_mean_s == 0.5


def test_delivery_picks_transactions_or_the_at_least_once_loop() -> None:
    cfg = parse_raw({})
    strict = service_settings(RewardSettings(run_id="r", config=cfg))
    assert strict.delivery.transactional and strict.delivery.transactional_id == "rs-reward-r"
    loose = service_settings(RewardSettings(run_id="r", config=parse_raw({"reward": {"delivery": "at_least_once"}})))
    assert not loose.delivery.transactional and loose.delivery.transactional_id == ""
    assert loose.delivery.deterministic_output_ids and loose.delivery.commit == "after_effect"  # copies after a crash share ids
    with pytest.raises(ConfigError, match="delivery"):
        parse_raw({"reward": {"delivery": "twice"}})
