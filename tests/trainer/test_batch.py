from __future__ import annotations

from schemas.events import Generation, RolloutTask, ScoredSample
from trainer.batch import samples_from_scored, split_stale


def scored(group: str, index: int, reward: float, version: int) -> ScoredSample:
    task = RolloutTask(
        run_id="r",
        sample_id=f"{group}/{index}",
        group_id=group,
        index=index,
        group_size=2,
        prompt_id="p",
        domain="arith",
        prompt="1+1=",
    )
    gen = Generation(
        run_id="r",
        task=task,
        prompt_ids=[1, 5, 14, 5, 18],
        response_ids=[6, 2],
        response_text="2",
        logprobs=[-0.5, -0.1],
        loss_mask=[1, 1],
        finish_reason="stop",
        policy_version=version,
        policy_version_end=version,
    )
    return ScoredSample(run_id="r", generation=gen, reward=reward, policy_version=version)


def test_split_stale_keeps_within_max_staleness() -> None:
    batch = [scored("g", 0, 1.0, 5), scored("g", 1, 0.0, 3), scored("h", 0, 1.0, 2)]
    kept, dropped = split_stale(batch, trainer_version=5, max_staleness=2)
    assert [s.generation.task.sample_id for s in kept] == ["g/0", "g/1"]
    assert [(s.generation.task.sample_id, why) for s, why in dropped] == [("h/0", "stale: gap 3 > 2")]


def test_samples_from_scored_keeps_order_reward_and_group() -> None:
    batch = [scored("g", 0, 1.0, 0), scored("h", 0, 0.0, 0), scored("g", 1, 0.0, 3), scored("h", 1, 0.0, 0)]
    samples = samples_from_scored(batch)
    assert [(s.sample_id, s.group_id, s.reward) for s in samples] == [
        ("g/0", "g", 1.0), ("h/0", "h", 0.0), ("g/1", "g", 0.0), ("h/1", "h", 0.0)]
    assert samples[2].policy_version == 3 and not samples[0].truncated
    assert samples[0].response_ids == [6, 2]
    assert samples[0].old_logprobs == [-0.5, -0.1] and samples[0].loss_mask == [1, 1]
    assert samples_from_scored([]) == []
