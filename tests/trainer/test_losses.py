from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.floats import assert_close, rounding_tol
from trainer import losses as L
from trainer.losses import (
    aggregate,
    cispo_loss,
    entropy_from_logits,
    entropy_loss,
    gspo_loss,
    icepop_weights,
    icepop_weights_reference,
    kl_loss,
    kl_penalty,
    kl_penalty_straight_through_reference,
    masked_is,
    masked_mean,
    pg_loss,
    ppo_loss,
    rejection_mask,
    rejection_mask_reference,
    tis_weights,
    topr_loss,
    value_loss,
)

LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 99.0, 99.0]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])


def test_aggregate_hand_computed() -> None:
    assert aggregate(LOSS, MASK, "token-mean").item() == pytest.approx((1 + 2 + 3 + 4 + 10 + 20) / 6)
    assert aggregate(LOSS, MASK, "seq-mean-token-mean").item() == pytest.approx((2.5 + 15) / 2)
    assert aggregate(LOSS, MASK, "seq-mean-token-sum").item() == pytest.approx((10 + 30) / 2)
    assert aggregate(LOSS, MASK, "seq-mean-token-sum-norm").item() == pytest.approx((10 / 4 + 30 / 4) / 2)
    assert aggregate(LOSS, MASK, "seq-mean-token-sum-norm", max_len=8).item() == pytest.approx(
        (10 + 30) / 8 / 2
    )
    empty = torch.zeros_like(MASK)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        assert aggregate(LOSS, empty, mode).item() == 0.0  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        aggregate(LOSS, MASK, "nope")  # type: ignore[arg-type]


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]),
    st.lists(st.lists(st.integers(0, 1), min_size=5, max_size=5), min_size=1, max_size=4),
    st.integers(0, 10_000),
)
def test_aggregate_ignores_masked_positions(mode: str, m: list[list[int]], seed: int) -> None:
    mt = torch.tensor(m)
    x = torch.randn(mt.shape, generator=torch.Generator().manual_seed(seed))
    junk = torch.where(mt > 0, x, torch.full_like(x, 1e9))
    assert aggregate(x, mt, mode).item() == pytest.approx(aggregate(junk, mt, mode).item())  # type: ignore[arg-type]


def test_ppo_ratio_one_is_minus_mean_advantage() -> None:
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([2.0, -1.0])
    loss, m = ppo_loss(lp, lp.clone(), adv, mask, dual_clip=True)
    assert loss.item() == pytest.approx(-(2 + 2 + 2 - 1 - 1) / 5)
    assert m["loss/clipfrac"] == 0.0 and m["loss/clipfrac_dual"] == 0.0 and m["actor/ratio_mean"] == 1.0


def test_ppo_dual_clip_bound_for_large_ratio_negative_advantage() -> None:
    old = torch.zeros(1, 3)
    lp = torch.tensor([[math.log(10.0), math.log(10.0), math.log(2.0)]])
    adv = torch.tensor([[-1.0, 1.0, -1.0]])
    loss, m = ppo_loss(lp, old, adv, torch.ones(1, 3), dual_clip=True, dual_clip_c=3.0)
    # tok0: max(10, 1.2) = 10 -> min(10, 3) = 3 (dual bound) ; tok1: max(-10, -1.2) = -1.2 ; tok2: max(2, 1.2) = 2 < 3
    assert loss.item() == pytest.approx((3 - 1.2 + 2) / 3)
    assert m["loss/clipfrac_dual"] == pytest.approx(1 / 3)
    plain, _ = ppo_loss(lp, old, adv, torch.ones(1, 3))
    assert plain.item() == pytest.approx((10 - 1.2 + 2) / 3)
    lp_g = lp.clone().requires_grad_(True)
    ppo_loss(lp_g, old, adv, torch.ones(1, 3), dual_clip=True)[0].backward()
    assert lp_g.grad is not None and lp_g.grad[0, 0].item() == 0.0  # bound is constant in the ratio


def test_gspo_equals_ppo_when_token_ratios_equal() -> None:
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.2, -0.4, -0.6, -0.8]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    for r in (1.0, 1.0002, 1.01, 0.9):
        lp = old + math.log(r)
        adv = torch.tensor([1.5, -0.5])
        g, mg = gspo_loss(lp, old, adv, mask, 3e-4, 4e-4)
        p, mp = ppo_loss(lp, old, adv, mask, 3e-4, 4e-4, agg_mode="seq-mean-token-mean")
        assert g.item() == pytest.approx(p.item(), rel=1e-5)
        assert mg["loss/clipfrac"] == mp["loss/clipfrac"]


def test_gspo_clips_whole_sequence_on_geometric_mean() -> None:
    old = torch.zeros(1, 2)
    lp = torch.tensor([[math.log(2.0), math.log(0.5)]])  # geometric mean 1: nothing clipped
    lp_g = lp.clone().requires_grad_(True)
    loss, m = gspo_loss(lp_g, old, torch.tensor([1.0]), torch.ones(1, 2), 0.1, 0.1)
    assert loss.item() == pytest.approx(-1.0) and m["loss/clipfrac"] == 0.0
    loss.backward()
    assert lp_g.grad is not None and torch.allclose(lp_g.grad, torch.tensor([[-0.5, -0.5]]))


def test_topr_hand_computed() -> None:
    old = torch.zeros(2, 2)
    lp = torch.tensor([[-1.0, -1.0], [-0.5, -0.5]])  # seq ratios e^-2, e^-1 (<1)
    mask = torch.ones(2, 2)
    adv = torch.tensor([1.0, -1.0])
    loss, _ = topr_loss(lp, old, adv, mask)
    # positive: -1*lp (no IS) ; negative: -(-1)*e^-1*lp
    want = (1 + 1 + math.exp(-1) * -0.5 * 2) / 4
    assert loss.item() == pytest.approx(want)
    tok, _ = topr_loss(lp, old, adv, mask, level="token")
    assert tok.item() == pytest.approx((1 + 1 + math.exp(-0.5) * -0.5 * 2) / 4)
    # ratio > 1 on a negative sample is truncated at 1
    hi, _ = topr_loss(
        torch.full((1, 1), -0.1), torch.full((1, 1), -2.0), torch.tensor([-1.0]), torch.ones(1, 1)
    )
    assert hi.item() == pytest.approx(-0.1)


def test_cispo_and_pg_hand_computed_gradients() -> None:
    old = torch.zeros(1, 3)
    lp = torch.tensor([[math.log(2.0), math.log(0.5), 0.0]]).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    loss, m = cispo_loss(lp, old, adv, torch.ones(1, 3), clip_low=1.0, clip_high=0.28)
    # weights clip(ρ, 0, 1.28) = [1.28, 0.5, 1]; loss = -(1.28*log2 + 0.5*log0.5 - 0) / 3
    assert loss.item() == pytest.approx(-(1.28 * math.log(2) + 0.5 * math.log(0.5)) / 3)
    assert m["loss/clipfrac"] == pytest.approx(1 / 3)
    loss.backward()
    assert lp.grad is not None and torch.allclose(lp.grad, torch.tensor([[-1.28, -0.5, 1.0]]) / 3)
    p, _ = pg_loss(torch.tensor([[-1.0, -2.0]]), torch.tensor([2.0]), torch.tensor([[1, 0]]))
    assert p.item() == pytest.approx(2.0)


def test_value_loss_clip() -> None:
    values, old, ret = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    loss, _ = value_loss(values, old, ret, torch.ones(1, 2), value_clip=0.2)
    # tok0: (1-0)^2=1 vs (0.2-0)^2=.04 -> 1 ; tok1: (0-1)^2=1 vs (0-1)^2=1 -> 1
    assert loss.item() == pytest.approx(0.5 * 1.0)
    values2 = torch.tensor([[0.5, 0.0]])
    loss2, m2 = value_loss(values2, old, torch.tensor([[1.0, 0.0]]), torch.ones(1, 2), value_clip=0.2)
    # tok0: (0.5-1)^2=.25 vs (0.2-1)^2=.64 -> .64 (clipped active) ; tok1: 0
    assert loss2.item() == pytest.approx(0.5 * 0.64 / 2) and m2["loss/value_clipfrac"] == 0.5
    loss3, _ = value_loss(values2, old, torch.tensor([[1.0, 0.0]]), torch.ones(1, 2), value_clip=None)
    assert loss3.item() == pytest.approx(0.5 * 0.25 / 2)


def test_kl_penalties_and_entropy() -> None:
    lp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    d = math.log(2.0)
    assert kl_penalty(lp, ref, "kl").item() == pytest.approx(d)
    assert kl_penalty(ref, lp, "abs").item() == pytest.approx(d)
    assert kl_penalty(lp, ref, "mse").item() == pytest.approx(0.5 * d * d)
    assert kl_penalty(lp, ref, "low_var_kl").item() == pytest.approx(0.5 - 1 + d)
    assert kl_penalty(lp, lp, "k3").item() == 0.0
    p, q = torch.tensor([[[0.5, 0.5]]]), torch.tensor([[[0.25, 0.75]]])
    full = kl_penalty(p.log(), q.log(), "full")
    assert full.item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75))
    with pytest.raises(ValueError):
        kl_penalty(lp, ref, "nope")  # type: ignore[arg-type]
    loss, m = kl_loss(lp, ref, torch.ones(1, 1), coef=0.1, kind="kl")
    assert loss.item() == pytest.approx(0.1 * d) and m["actor/kl"] == pytest.approx(d)
    eloss, em = entropy_loss(torch.tensor([[1.0, 3.0]]), torch.tensor([[1, 0]]), coef=0.01)
    assert eloss.item() == pytest.approx(-0.01) and em["actor/entropy"] == 1.0


def test_tis_weights_levels() -> None:
    old = torch.tensor([[math.log(3.0), math.log(0.5), 5.0]])
    beh = torch.zeros(1, 3)
    mask = torch.tensor([[1, 1, 0]])
    w, m = tis_weights(old, beh, mask, "token", cap=2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 0.5, 0.0]]))
    assert m["offpolicy/is_ratio_mean"] == pytest.approx(1.75) and m["offpolicy/truncated_frac"] == 0.5
    w, _ = tis_weights(old, beh, mask, "sequence", cap=2.0)  # product 1.5
    assert torch.allclose(w, torch.tensor([[1.5, 1.5, 0.0]]))
    w, _ = tis_weights(old, beh, mask, "geometric", cap=2.0)  # sqrt(1.5)
    assert torch.allclose(w, torch.tensor([[1.5**0.5, 1.5**0.5, 0.0]]))


def test_masked_is_levels() -> None:
    old = torch.tensor([[math.log(3.0), math.log(0.5), 0.0], [0.0, 0.0, 0.0]])
    beh = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    nm, m = masked_is(old, beh, mask, "token", low=0.5, high=2.0)
    assert nm.tolist() == [[0, 1, 1], [1, 1, 0]] and m["offpolicy/masked_frac"] == pytest.approx(1 / 5)
    nm, m = masked_is(old, beh, mask, "sequence", low=0.8, high=1.2)  # seq 0 ratio 1.5 -> dropped
    assert nm.tolist() == [[0, 0, 0], [1, 1, 0]] and m["offpolicy/masked_frac"] == pytest.approx(3 / 5)


def test_ppo_ratio_one_gives_minus_mean_advantage() -> None:
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([2.0, -1.0])
    loss, m = ppo_loss(lp, lp.clone(), adv, mask)
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
    loss, m = ppo_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
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
    ppo_loss(lp, old, adv, mask, 0.2, 0.28)[0].backward()
    assert torch.allclose(lp.grad, torch.tensor([[0.0, -0.5, 1.5, 0.0]]) / 4)


# --------------------------------------------------------------------------- newer objectives (issue 37)

LOG_RATIO = st.sampled_from([0.0, 0.05, -0.1, 0.3, -0.6, 1.5, -3.0, 25.0, -99.0])
ADV = st.sampled_from([-2.0, -0.5, 0.0, 1.0, 3.0])


@st.composite
def policy_batch(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logprobs, old_logprobs, advantages, mask)`` (B, T): per-sequence advantages, log ratios up
    to the extremes, and garbage (huge finite numbers) under the mask."""
    b, t = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    lp = torch.tensor(draw(st.lists(st.floats(-8.0, -0.01), min_size=b * t, max_size=b * t))).view(b, t)
    d = torch.tensor(draw(st.lists(LOG_RATIO, min_size=b * t, max_size=b * t))).view(b, t)
    adv = torch.tensor(draw(st.lists(ADV, min_size=b, max_size=b))).unsqueeze(1).expand(b, t).contiguous()
    mask = torch.tensor(
        draw(st.lists(st.integers(0, 1), min_size=b * t, max_size=b * t)), dtype=torch.float
    ).view(b, t)
    garbage = torch.full_like(lp, 1e4)
    return torch.where(mask > 0, lp, -garbage), torch.where(mask > 0, lp - d, garbage), adv, mask


def lists(*xs: torch.Tensor) -> list[list[list[float]]]:
    return [x.tolist() for x in xs]


@settings(max_examples=30, deadline=None)
@given(policy_batch())
def test_sapo_matches_the_loop_and_stays_finite(batch: tuple[torch.Tensor, ...]) -> None:
    lp, old, adv, mask = batch
    lp = lp.clone().requires_grad_(True)
    loss, m = L.sapo_loss(lp, old, adv, mask, tau_pos=1.0, tau_neg=1.05)
    want = L.sapo_loss_reference(*lists(lp.detach(), old, adv), mask.int().tolist(), 1.0, 1.05)
    # per token at most (4/τ)·|A| ≤ 12; float32 sigmoid/exp and a mean over the tokens
    assert loss.item() == pytest.approx(want, abs=rounding_tol(12.0, 4 * lp.numel()))
    loss.backward()
    assert (
        lp.grad is not None
        and bool(torch.isfinite(lp.grad).all())
        and math.isfinite(m["loss/sapo_gate_mean"])
    )
    assert bool((lp.grad[mask == 0] == 0).all())


def test_sapo_gradient_is_the_policy_gradient_on_policy_and_decays_off_it() -> None:
    lp = torch.tensor([[-1.0, -2.0, -0.5, -0.3]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    L.sapo_loss(lp, lp.detach(), adv, mask)[0].backward()
    assert lp.grad is not None
    assert torch.allclose(lp.grad, -adv / 4, atol=1e-7)  # ρ = 1: w = 4σ(0)(1 − σ(0))·1 = 1, as −A·log π
    # ρ = 2 on every token: w = 4σ(τ)(1 − σ(τ))·2, smaller for the larger τ of negative advantages
    far = lp.detach().clone().requires_grad_(True)
    L.sapo_loss(far, far.detach() - math.log(2.0), adv, mask, tau_pos=1.0, tau_neg=2.0)[0].backward()
    assert far.grad is not None
    for tau, g in ((1.0, far.grad[0, 0]), (2.0, -far.grad[0, 2])):
        s = 1 / (1 + math.exp(-tau))
        assert g.item() == pytest.approx(-4 * s * (1 - s) * 2 / 4, rel=1e-5)
    assert abs(far.grad[0, 2].item()) < abs(far.grad[0, 0].item())


@settings(max_examples=30, deadline=None)
@given(policy_batch())
def test_gmpo_matches_the_loop_and_stays_finite(batch: tuple[torch.Tensor, ...]) -> None:
    lp, old, adv, mask = batch
    lp = lp.clone().requires_grad_(True)
    loss, _ = L.gmpo_loss(lp, old, adv, mask, clip_low=0.4, clip_high=0.4)
    want = L.gmpo_loss_reference(*lists(lp.detach(), old, adv), mask.int().tolist(), 0.4, 0.4)
    # a sequence's loss is |A|·exp(mean of log ratios ≤ 20): relative rounding of exp of a float32 mean
    size = max(
        abs(want), 3.0 * math.exp(20.0) if bool((((lp - old) > 19) & (mask > 0)).any()) else 3.0 * math.e
    )
    assert loss.item() == pytest.approx(want, abs=rounding_tol(size, 25 * lp.shape[1]))
    loss.backward()
    assert lp.grad is not None and bool(torch.isfinite(lp.grad).all())
    assert bool((lp.grad[mask == 0] == 0).all())


def test_gmpo_clips_tokens_one_sided_in_log_space() -> None:
    old = torch.zeros(2, 3)
    lp = torch.tensor([[0.1, 1.0, -1.0], [0.1, 1.0, -1.0]], requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    loss, m = L.gmpo_loss(lp, old, adv, torch.ones(2, 3), clip_low=0.4, clip_high=0.4)
    # A > 0 clips log ρ above 0.4 only: (0.1 + 0.4 − 1.0)/3; A < 0 below −0.4 only: (0.1 + 1.0 − 0.4)/3
    pos, neg = math.exp((0.1 + 0.4 - 1.0) / 3), math.exp((0.1 + 1.0 - 0.4) / 3)
    assert loss.item() == pytest.approx((-2 * pos + neg) / 2, rel=1e-6)
    assert m["loss/clipfrac"] == pytest.approx(2 / 6)
    loss.backward()
    assert lp.grad is not None
    assert lp.grad[0, 1].item() == 0.0 and lp.grad[1, 2].item() == 0.0  # the clipped tokens
    assert lp.grad[0, 0].item() == pytest.approx(
        -2 * pos / 3 / 2, rel=1e-6
    )  # d/dlog ρ of −A·e^{mean}: −A·r/|o|/B


def test_gmpo_with_equal_token_ratios_inside_the_clip_is_gspo() -> None:
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]])
    old = lp - torch.tensor([[0.1], [-0.2]])
    adv, mask = torch.tensor([1.5, -1.0]), torch.tensor([[1, 1, 1], [1, 1, 0]])
    got, _ = L.gmpo_loss(lp, old, adv, mask)
    want, _ = gspo_loss(lp, old, adv, mask, clip_low=1.0, clip_high=1.0)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


@settings(max_examples=30, deadline=None)
@given(policy_batch(), st.sampled_from([0.05, 0.2, 0.5, 1.0]))
def test_kl_cov_choice_and_loss_match_the_loop(batch: tuple[torch.Tensor, ...], ratio: float) -> None:
    lp, old, adv, mask = batch
    adv = adv + 0.25 * torch.arange(lp.shape[1])  # per-token advantages: covariance within a row too
    cov = L.token_covariance(lp, adv, mask)
    want_cov = L.token_covariance_reference(*lists(lp, adv), mask.int().tolist())
    assert_close(cov, torch.tensor(want_cov), terms=2 * lp.numel())
    chosen = L.kl_cov_select(lp, adv, mask, ratio)
    picked = {(int(b), int(t)) for b, t in chosen.nonzero().tolist()}
    want = L.kl_cov_select_reference(*lists(lp, adv), mask.int().tolist(), ratio)
    if len(set(round(c, 3) for row in want_cov for c in row)) == sum(
        len(r) for r in want_cov
    ):  # no near-ties
        assert picked == set(want)
    assert len(picked) == len(want) and all(mask[b, t] > 0 and cov[b, t] > 0 for b, t in picked)
    lp_g = lp.clone().requires_grad_(True)
    loss, m = L.kl_cov_loss(lp_g, old, adv, mask, chosen, coef=1.0)
    ref = L.kl_cov_loss_reference(*lists(lp, old, adv), mask.int().tolist(), chosen.int().tolist(), 1.0)
    size = max(
        abs(ref),
        5.0 * math.exp(20.0) if bool((((lp - old) > 19) & (mask > 0)).any()) else 5.0 * math.exp(1.5),
    )
    assert loss.item() == pytest.approx(ref, abs=rounding_tol(size, 4 * lp.numel()))
    loss.backward()
    assert lp_g.grad is not None and bool(torch.isfinite(lp_g.grad).all()) and math.isfinite(m["loss/cov_kl"])


def test_kl_cov_penalises_only_the_chosen_tokens() -> None:
    old = torch.zeros(1, 3)
    lp = torch.tensor([[0.5, -0.5, 0.2]], requires_grad=True)
    adv, mask, chosen = torch.tensor([[1.0, 1.0, 1.0]]), torch.ones(1, 3), torch.tensor([[1.0, 0.0, 0.0]])
    loss, m = L.kl_cov_loss(lp, old, adv, mask, chosen, coef=2.0)
    want = (-math.exp(0.5) + 2 * 0.5 - math.exp(-0.5) - math.exp(0.2)) / 3
    assert loss.item() == pytest.approx(want, rel=1e-6) and m["loss/cov_kl"] == pytest.approx(0.5 / 3)
    loss.backward()
    assert lp.grad is not None
    assert lp.grad[0, 0].item() == pytest.approx(
        (-math.exp(0.5) + 2.0) / 3, rel=1e-6
    )  # −Aρ + coef·sign(log ρ)
    assert lp.grad[0, 1].item() == pytest.approx(-math.exp(-0.5) / 3, rel=1e-6)


def test_kl_cov_chooses_nothing_without_a_positive_covariance() -> None:
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    assert L.kl_cov_select(lp, torch.zeros(2), torch.ones(2, 2), 1.0).sum() == 0  # zero advantages
    assert L.kl_cov_select(lp, torch.ones(2), torch.zeros(2, 2), 1.0).sum() == 0  # nothing trained


@settings(max_examples=30, deadline=None)
@given(policy_batch(), st.sampled_from([0.1, 0.5, 1.0]), st.integers(0, 3))
def test_clip_cov_draws_its_tokens_among_the_loops_candidates(
    batch: tuple[torch.Tensor, ...], ratio: float, seed: int
) -> None:
    lp, old, adv, mask = batch
    adv = adv + 0.25 * torch.arange(lp.shape[1])

    def draw() -> torch.Tensor:
        return L.clip_cov_select(
            lp,
            old,
            adv,
            mask,
            ratio,
            cov_low=-0.5,
            cov_high=2.0,
            clip_low=0.2,
            clip_high=0.28,
            generator=torch.Generator().manual_seed(seed),
        )

    chosen = draw()
    cand = set(
        L.clip_cov_candidates_reference(*lists(lp, old, adv), mask.int().tolist(), -0.5, 2.0, 0.2, 0.28)
    )
    picked = {(int(b), int(t)) for b, t in chosen.nonzero().tolist()}
    trained = int(mask.sum())
    k = min(max(int(ratio * trained), 1), trained)
    cov = L.token_covariance(lp, adv, mask)
    clear = all(min(abs(cov[b, t] + 0.5), abs(cov[b, t] - 2.0)) > 1e-4 for b, t in mask.nonzero().tolist())
    if clear:  # no covariance term within rounding of a bound
        assert picked <= cand and len(picked) == min(k, len(cand))
    assert torch.equal(draw(), chosen)  # the same seed draws the same tokens


def test_clip_cov_is_ppo_with_the_chosen_tokens_detached() -> None:
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.2]])
    old = lp + torch.tensor([[0.1, -0.5, 0.0], [0.3, 0.0, -0.1]])
    adv, mask = torch.tensor([1.0, -2.0]), torch.ones(2, 3)
    chosen = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    a, b = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    got, m = L.clip_cov_loss(a, old, adv, mask, chosen, clip_low=0.2, clip_high=0.2)
    want, _ = ppo_loss(b, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)  # the value is PPO's
    got.backward()
    want.backward()
    assert a.grad is not None and b.grad is not None
    assert torch.equal(a.grad * chosen, torch.zeros(2, 3))
    assert torch.allclose(a.grad * (1 - chosen), b.grad * (1 - chosen))
    assert m["loss/cov_selected_frac"] == pytest.approx(2 / 6)


@pytest.mark.parametrize("variant", ["clip_cov", "kl_cov"])
def test_a_selective_loss_called_plainly_chooses_over_its_inputs(variant: str) -> None:
    import msgspec

    from schemas.config import AlgorithmConfig
    from trainer import algorithm as alg
    from trainer import registry

    cfg = msgspec.convert({"pg_variant": variant, f"{variant}_ratio": 0.5}, AlgorithmConfig)
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.2]])
    old, adv, mask = lp + 0.1, torch.tensor([[1.0, 2.0, -1.0], [0.5, -2.0, 1.0]]), torch.ones(2, 3)
    chosen, metrics = alg.select_tokens(cfg, lp, old, adv, mask, seed=0)
    assert chosen is not None and metrics["loss/cov_selected"] == float(chosen.sum())
    plain, _ = registry.loss(variant)(cfg, lp, old, adv, mask, None)
    with_choice, _ = alg.selective_policy_loss(cfg, lp, old, adv, mask, None, chosen)
    assert plain.item() == with_choice.item()
    assert alg.select_tokens(msgspec.convert({}, AlgorithmConfig), lp, old, adv, mask, seed=0) == (None, {})


def test_masked_mean_and_entropy() -> None:
    assert masked_mean(torch.ones(2, 2), torch.zeros(2, 2)).item() == 0.0
    uniform = entropy_from_logits(torch.zeros(1, 1, 8))
    assert uniform.item() == pytest.approx(math.log(8))
    assert entropy_from_logits(torch.tensor([[[0.0, -1e9]]])).item() == pytest.approx(0.0, abs=1e-6)


# --------------------------------------------------------------------------- defects of issue 37 (each failed before its fix)


def test_k3_kl_has_finite_gradients_at_extreme_log_ratios_even_masked() -> None:
    """d = log π − log π_ref = −99 overflowed exp(−d) in float32: the value was clamped but the
    gradient was NaN, even with the position masked out of ``kl_loss``."""
    ref = torch.tensor([[0.0, 0.0, 0.0]])
    lp = torch.tensor([[-0.5, -99.0, 99.0]], requires_grad=True)
    mask = torch.tensor([[1, 0, 1]])
    loss, m = kl_loss(lp, ref, mask, coef=1.0, kind="k3")
    loss.backward()
    assert lp.grad is not None and torch.isfinite(lp.grad).all() and math.isfinite(m["actor/kl"])
    assert lp.grad[0, 1].item() == 0.0  # the masked position gets no gradient
    for kind in ("k3", "low_var_kl"):
        x = torch.tensor([[-99.0, -25.0, 25.0, 99.0]], requires_grad=True)
        k = kl_penalty(x, torch.zeros(1, 4), kind)  # type: ignore[arg-type]
        k.sum().backward()
        assert torch.isfinite(k).all() and x.grad is not None and torch.isfinite(x.grad).all()
        assert k[0, 0].item() == 10.0  # e^{20} − 21 clamped to 10, as before


def test_ppo_clamps_the_log_ratio_before_the_exp() -> None:
    """With dual clip off, a log ratio of 25 made the loss ≈ 7e10 (and 100 made it inf): the log
    ratio is clamped to ±20 before the exp (as peers do), which also stops its gradient."""
    old = torch.zeros(1, 3)
    lp = torch.tensor([[25.0, 100.0, -100.0]], requires_grad=True)
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    loss, m = ppo_loss(lp, old, adv, torch.ones(1, 3))
    cap = math.exp(20.0)
    assert loss.item() == pytest.approx((cap + cap - math.exp(-20.0)) / 3, rel=1e-5)
    loss.backward()
    assert lp.grad is not None and lp.grad[0, :2].tolist() == [0.0, 0.0] and torch.isfinite(lp.grad).all()
    assert all(math.isfinite(v) for v in m.values()) and m["actor/ratio_max"] == pytest.approx(cap, rel=1e-5)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.floats(-30, 0), st.floats(-30, 0)), min_size=1, max_size=6),
       st.sampled_from(["k1+", "k3+"]))
def test_straight_through_kl_matches_the_loop(pairs: list[tuple[float, float]], kind: str) -> None:
    """``k1+``/``k3+``: the value of k1/k3, the gradient of k2 (``∂/∂log π = d``), as the loop twin says."""
    lp_list, ref_list = [p for p, _ in pairs], [r for _, r in pairs]
    want_v, want_g = kl_penalty_straight_through_reference(lp_list, ref_list, kind)
    lp = torch.tensor([lp_list], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([ref_list], dtype=torch.float64)
    v = kl_penalty(lp, ref, kind)  # type: ignore[arg-type]
    v.sum().backward()
    assert lp.grad is not None
    assert v[0].tolist() == pytest.approx(want_v, rel=1e-12, abs=1e-12)
    assert lp.grad[0].tolist() == pytest.approx(want_g, rel=1e-12, abs=1e-12)
    base = kl_penalty(lp.detach(), ref, kind[:2])  # type: ignore[arg-type]
    assert torch.equal(v.detach(), base)  # the value is exactly k1's / k3's


def test_rejection_by_hand() -> None:
    old = torch.tensor([[math.log(3.0), 0.0, 0.0], [math.log(0.9), math.log(1.1), 7.0]])
    beh = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    k3_3 = 3 - 1 - math.log(3)  # ≈ 0.90
    nm, m = rejection_mask(old, beh, mask, "token", "k3", threshold=0.5)
    assert nm.tolist() == [[0, 1, 1], [1, 1, 0]]
    assert (m["offpolicy/rejected_tokens"], m["offpolicy/rejected_seqs"], m["offpolicy/rejected_frac"]) == (1.0, 0.0, 0.2)
    nm, m = rejection_mask(old, beh, mask, "sequence", "k3", threshold=k3_3 / 3 - 1e-3)  # seq 0's mean is k3_3 / 3
    assert nm.tolist() == [[0, 0, 0], [1, 1, 0]] and m["offpolicy/rejected_seqs"] == 1.0
    nm, _ = rejection_mask(old, beh, mask, "sequence", "k1", threshold=0.01)  # |mean k1|: ln3/3 and ~0.0045
    assert nm.tolist() == [[0, 0, 0], [1, 1, 0]]
    nm, _ = rejection_mask(old, beh, mask, "token", "k1", threshold=0.1)  # |ln 0.9| = 0.105, |ln 1.1| = 0.095
    assert nm.tolist() == [[0, 1, 1], [0, 1, 0]]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 5), st.integers(0, 10_000), st.sampled_from(["token", "sequence"]),
       st.sampled_from(["k1", "k3"]), st.floats(1e-3, 2.0), st.floats(0.0, 0.99), st.floats(1.01, 10.0))
def test_rejection_and_icepop_match_their_loops(b: int, t: int, seed: int, level: str, div: str, tau: float,
                                                low: float, high: float) -> None:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    beh = old + torch.randn(b, t, generator=g, dtype=torch.float64) * torch.rand(1, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=g) < 0.7).long()
    nm, m = rejection_mask(old, beh, mask, level, div, tau)  # type: ignore[arg-type]
    want = rejection_mask_reference(old.tolist(), beh.tolist(), mask.tolist(), level, div, tau)
    assert nm.tolist() == want
    assert m["offpolicy/rejected_tokens"] == float((mask > 0).sum() - (torch.tensor(want) > 0).sum())
    w, _ = icepop_weights(old, beh, mask, low, high)
    want_w = icepop_weights_reference(old.tolist(), beh.tolist(), mask.tolist(), low, high)
    assert w.flatten().tolist() == pytest.approx([x for row in want_w for x in row], rel=1e-12, abs=0.0)
