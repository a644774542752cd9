"""Batch assembly (pure functions): training samples from scored ones, and the tensors."""

from __future__ import annotations

import msgspec
import pytest
import torch

from schemas.events import Generation, RolloutTask, ScoredSample
from trainer.batch import TrainSample, collate, samples_from_scored


def scored(group: str, index: int, reward: float, version: int, size: int = 2) -> ScoredSample:
    task = RolloutTask(
        run_id="r",
        sample_id=f"{group}/{index}",
        group_id=group,
        index=index,
        group_size=size,
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


def group(gid: str, rewards: list[float], version: int = 0, size: int | None = None) -> list[ScoredSample]:
    return [scored(gid, i, r, version, size or len(rewards)) for i, r in enumerate(rewards)]


def ids(samples: list[ScoredSample]) -> list[str]:
    """The sample ids of ``samples`` (the trainer service's group tests use these helpers too)."""
    return [s.generation.task.sample_id for s in samples]


# --------------------------------------------------------------------------- tensors


def test_samples_from_scored_keeps_order_reward_and_group() -> None:
    batch = [scored("g", 0, 1.0, 0), scored("h", 0, 0.0, 0), scored("g", 1, 0.0, 3), scored("h", 1, 0.0, 0)]
    samples = samples_from_scored(batch)
    assert [(s.sample_id, s.group_id, s.reward) for s in samples] == [
        ("g/0", "g", 1.0), ("h/0", "h", 0.0), ("g/1", "g", 0.0), ("h/1", "h", 0.0)]
    assert samples[2].policy_version == 3 and not samples[0].truncated
    assert samples[0].response_ids == [6, 2]
    assert samples[0].old_logprobs == [-0.5, -0.1] and samples[0].loss_mask == [1, 1]
    assert samples_from_scored([]) == []
    long = msgspec.structs.replace(batch[0], generation=msgspec.structs.replace(batch[0].generation,
                                                                                finish_reason="length"))
    assert samples_from_scored([long])[0].truncated


def test_split_rows_cuts_episodes_into_their_segments_and_merge_rows_puts_them_back() -> None:
    import torch

    from trainer.batch import merge_rows, segment_layout, split_rows

    a = TrainSample([1, 5], [6, 7, 8, 9, 10], [-0.1, 0.0, 0.0, -0.4, -0.5], [1, 0, 0, 1, 1], 1.0, "a",
                    segment_starts=(1,))
    b = TrainSample([1, 4, 4], [3], [-0.3], [1], 0.0, "b")
    layout = segment_layout([a, b])
    assert layout == [(0, 0, 3), (0, 3, 7), (1, 0, 4)]
    batch = collate([a, b], pad_id=0)
    rows = split_rows(batch, layout)
    assert rows.input_ids.tolist() == [[1, 5, 6, 0], [7, 8, 9, 10], [1, 4, 4, 3]]
    assert rows.attention_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert rows.loss_mask.tolist() == [[0, 1, 0], [0, 1, 1], [0, 0, 1]]  # token 7 starts a prompt: no target
    assert rows.old_logprobs[1].tolist() == pytest.approx([0.0, -0.4, -0.5])
    assert rows.extras["rewards"].tolist() == [1.0, 1.0, 0.0] and rows.num_rows == 3
    assert rows.num_tokens == batch.num_tokens == 4
    back = merge_rows(rows.old_logprobs, layout, 2, batch.input_ids.shape[1])
    assert torch.equal(back * batch.loss_mask, batch.old_logprobs * batch.loss_mask)
    assert segment_layout([b]) is None
    with pytest.raises(ValueError, match="segment_starts"):
        segment_layout([TrainSample([1], [6, 7], [0.0, 0.0], [0, 1], 0.0, "c", segment_starts=(2,))])


def test_by_length_orders_rows_shortest_first_and_keeps_each_row_whole() -> None:
    samples = [TrainSample([1] * p, [5] * r, [-float(i)] * r, [1] * r, float(i), f"s{i}", group_id="g")
               for i, (p, r) in enumerate([(3, 4), (2, 1), (3, 4), (1, 2)])]
    batch = collate(samples, pad_id=0)
    batch = batch.replace(advantages=torch.arange(4.0), extras={**batch.extras, "tag": torch.arange(4.0) * 10})
    out = batch.by_length()
    assert out.attention_mask.sum(1).tolist() == [3, 3, 7, 7]
    order = [1, 3, 0, 2]  # stable: rows 0 and 2 (both 7 long) keep their order
    assert out.advantages.tolist() == [float(i) for i in order]
    assert out.extras["tag"].tolist() == [10.0 * i for i in order]
    assert torch.equal(out.input_ids, batch.input_ids[order]) and torch.equal(out.old_logprobs, batch.old_logprobs[order])
    assert out.rows(0, 2).input_ids.shape == (2, 3)  # the short micro-batch is trimmed to 3 columns


def grouped_rows(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded rows of a few groups: each group's rows share a prompt, some answers start
    alike (so a common prefix runs into the answers), one row is its group's prompt alone, one
    group has one row and one group's rows share nothing."""
    import random

    rng = random.Random(seed)
    rows: list[list[int]] = []
    groups: list[int] = []
    for g in range(4):
        prompt = [rng.randrange(3, 50) for _ in range(rng.randrange(2, 7))]
        for i in range(1 if g == 2 else rng.randrange(2, 5)):
            head = [7, 8] if i % 2 else []
            own = [rng.randrange(3, 50) for _ in range(rng.randrange(0 if i == 1 else 1, 5))]
            start = [] if g == 3 else prompt  # group 3: no common prompt
            rows.append((start or [rng.randrange(3, 50)]) + head + own)
            groups.append(g)
    order = list(range(len(rows)))
    rng.shuffle(order)  # a group's rows need not be neighbours
    rows, groups = [rows[i] for i in order], [groups[i] for i in order]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])  # (b, l)
    attn = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])  # (b, l)
    return ids, attn, torch.tensor(groups)


@pytest.mark.parametrize("seed", range(6))
def test_shared_prefix_layout_gives_each_row_exactly_its_own_context(seed: int) -> None:
    """Each (row, column) sits at a token with that row's id and position, and attends exactly the
    tokens of its own row's columns up to it; a group's common prefix appears once."""
    from trainer.batch import shared_prefix_layout

    ids, attn, groups = grouped_rows(seed)
    flat, pos, allowed, index = shared_prefix_layout(ids, attn, groups)
    lens = attn.sum(1).tolist()
    n = flat.shape[0]
    assert pos.shape == (n,) and allowed.shape == (n, n) and index.shape == ids.shape
    for r, length in enumerate(lens):
        assert flat[index[r, :length]].tolist() == ids[r, :length].tolist()
        assert pos[index[r, :length]].tolist() == list(range(length))
        assert bool((index[r, length:] == index[r, length - 1]).all())  # padding: the row's last token
        for c in range(length):
            seen = set(torch.nonzero(allowed[index[r, c]]).flatten().tolist())
            assert seen == set(index[r, : c + 1].tolist())
    expected = 0  # each group: its common prefix once, then every row's rest
    for g in groups.unique().tolist():
        members = [r for r in range(len(lens)) if groups[r] == g]
        shared = 0
        while shared < min(lens[r] for r in members) and len({int(ids[r, shared]) for r in members}) == 1:
            shared += 1
        expected += shared + sum(lens[r] - shared for r in members)
    assert n == expected < sum(lens)


def test_by_group_keeps_groups_together_shortest_first() -> None:
    samples = [TrainSample([1] * p, [2] * r, [0.0] * r, [1] * r, 0.0, f"s{i}", group_id=g)
               for i, (p, r, g) in enumerate([(3, 2, "a"), (2, 1, "b"), (3, 1, "a"), (2, 4, "b"), (3, 3, "a")])]
    b = collate(samples, pad_id=0).by_group()
    assert b.extras["group_ids"].tolist() == [0, 0, 0, 1, 1]
    assert b.attention_mask.sum(1).tolist() == [4, 5, 6, 3, 6]
