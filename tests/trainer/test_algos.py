from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.algos import (
    entropy_from_logits,
    grpo_advantages,
    grpo_advantages_reference,
    masked_mean,
    ppo_clip_loss,
)


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(
        st.lists(st.sampled_from([0.0, 0.5, 1.0, -1.0, 2.5]), min_size=1, max_size=6), min_size=1, max_size=6
    ),
    norm_std=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_grpo_vectorised_equals_loop(groups: list[list[float]], norm_std: bool, seed: int) -> None:
    rewards = [r for g in groups for r in g]
    ids = [i for i, g in enumerate(groups) for _ in g]
    perm = torch.randperm(len(rewards), generator=torch.Generator().manual_seed(seed)).tolist()
    rewards, ids = [rewards[i] for i in perm], [ids[i] * 7 + 3 for i in perm]  # any order, any ids
    got = grpo_advantages(torch.tensor(rewards), torch.tensor(ids), norm_std=norm_std)
    want = grpo_advantages_reference(rewards, ids, norm_std=norm_std)
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float), atol=1e-5)


def test_grpo_group_layout_equals_ids_layout() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    by_rows = grpo_advantages(rewards)
    by_ids = grpo_advantages(rewards.reshape(-1), torch.arange(3).repeat_interleave(4)).reshape(3, 4)
    assert torch.allclose(by_rows, by_ids)
    assert torch.equal(by_rows[1], torch.zeros(4))  # all-equal group: no signal
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()  # unbiased
    assert by_rows[0, 0].item() == pytest.approx(0.5 / (std.item() + 1e-6))


def test_grpo_singleton_group_and_dr_grpo() -> None:
    assert grpo_advantages(torch.tensor([3.0]), torch.tensor([0])).tolist() == [0.0]
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), norm_std=False)
    assert adv.tolist() == [[0.75, -0.25, -0.25, -0.25]]


def test_ppo_ratio_one_gives_minus_mean_advantage() -> None:
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([2.0, -1.0])
    loss, m = ppo_clip_loss(lp, lp.clone(), adv, mask)
    # token mean: (2 + 2 + 2 - 1 - 1) / 5 advantages, negated
    assert loss.item() == pytest.approx(-(2 + 2 + 2 - 1 - 1) / 5)
    assert m["loss/clipfrac"] == 0.0
    assert m["actor/ratio_mean"] == m["actor/ratio_min"] == m["actor/ratio_max"] == 1.0
    assert m["actor/approx_kl"] == 0.0


def test_ppo_hand_computed_clipping() -> None:
    old = torch.zeros(1, 4)
    ratios = torch.tensor([[1.5, 0.5, 1.5, 0.5]])
    lp = ratios.log()
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    loss, m = ppo_clip_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # per token: max(-A r, -A clip(r, 0.8, 1.28))
    #   A=+1, r=1.5: max(-1.5, -1.28) = -1.28 (clipped)   A=+1, r=0.5: max(-0.5, -0.8) = -0.5
    #   A=-1, r=1.5: max(1.5, 1.28) = 1.5                 A=-1, r=0.5: max(0.5, 0.8) = 0.8 (clipped)
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 1.5 + 0.8) / 4)
    assert m["loss/clipfrac"] == pytest.approx(0.5)
    assert m["actor/ratio_max"] == pytest.approx(1.5)
    assert m["actor/ratio_min"] == pytest.approx(0.5)
    k3 = sum((r - 1) - math.log(r) for r in (1.5, 0.5, 1.5, 0.5)) / 4
    assert m["actor/approx_kl"] == pytest.approx(k3)
    # gradient flows only through the unclipped tokens: d/dlp of (-A r) = -A r
    lp.requires_grad_(True)
    ppo_clip_loss(lp, old, adv, mask, 0.2, 0.28)[0].backward()
    assert torch.allclose(lp.grad, torch.tensor([[0.0, -0.5, 1.5, 0.0]]) / 4)


def test_micro_batches_with_global_token_count_equal_full_batch() -> None:
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(4, 5, generator=g).requires_grad_(True)
    old = lp.detach() + 0.1 * torch.randn(4, 5, generator=g)
    adv = torch.randn(4, generator=g)
    mask = (torch.rand(4, 5, generator=g) > 0.3).float()
    full, _ = ppo_clip_loss(lp, old, adv, mask)
    parts = sum(
        ppo_clip_loss(lp[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2], num_tokens=mask.sum())[
            0
        ]
        for i in (0, 2)
    )
    assert torch.allclose(full, parts)


def test_masked_mean_and_entropy() -> None:
    assert masked_mean(torch.ones(2, 2), torch.zeros(2, 2)).item() == 0.0
    uniform = entropy_from_logits(torch.zeros(1, 1, 8))
    assert uniform.item() == pytest.approx(math.log(8))
    assert entropy_from_logits(torch.tensor([[[0.0, -1e9]]])).item() == pytest.approx(0.0, abs=1e-6)
