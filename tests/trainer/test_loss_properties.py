"""Properties of every loss and estimator (hypothesis): for any finite inputs — log ratios up to
±100, any finite float32 garbage under the mask, empty masks — values, metrics and gradients are
finite; masked positions change nothing (the same loss, the same metrics, the same gradients, and
no gradient at a masked position); zero advantage gives zero policy gradient; the estimators'
``_reference`` loop twins agree. The policy losses and estimators are read from the registry, so a
new one is covered as soon as it is registered. Small shapes and few examples: seconds in all."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.config import AlgorithmConfig
from tests.floats import rounding_tol
from tests.trainer.test_registry import config_choices
from trainer import advantages as A
from trainer import algorithm as alg
from trainer import losses as L
from trainer import registry

SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
F32_MAX = float(torch.finfo(torch.float32).max)
LOGP = st.floats(-100.0, 0.0, width=32)  # log-probabilities: log ratios up to ±100
ADV = st.floats(-100.0, 100.0, width=32)
AGG_MODES = sorted(config_choices("loss_agg_mode"))


@st.composite
def garbage(draw: st.DrawFn, b: int, t: int) -> torch.Tensor:
    """(B, T) finite float32 values of any size, the extremes ±3.4e38 often (only masked positions get them)."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    scale = draw(st.sampled_from([1.0, 1e20, 1e36]))
    x = torch.randn(b, t, generator=g) * scale
    extreme = torch.rand(b, t, generator=g) < draw(st.sampled_from([0.0, 0.5, 1.0]))
    return torch.where(extreme, torch.sign(x + 0.5) * F32_MAX, x)


@st.composite
def masked_fields(draw: st.DrawFn, *values: st.SearchStrategy[float]) -> tuple[torch.Tensor, list[torch.Tensor],
                                                                              list[torch.Tensor]]:
    """A mask (B, T) (rows or the whole mask may be empty) and, per strategy in ``values``, two
    (B, T) float32 tensors that agree on the trained positions and hold different garbage elsewhere."""
    b, t = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    bits = draw(st.integers(0, 2 ** (b * t) - 1))
    mask = torch.tensor([[bool(bits >> (i * t + j) & 1) for j in range(t)] for i in range(b)])
    ones, twos = [], []
    for strategy in values:
        valid = torch.tensor(draw(st.lists(strategy, min_size=b * t, max_size=b * t))).reshape(b, t)
        ones.append(torch.where(mask, valid, draw(garbage(b, t))))
        twos.append(torch.where(mask, valid, draw(garbage(b, t))))
    return mask.float(), ones, twos


def finite(metrics: dict[str, float]) -> bool:
    return all(math.isfinite(v) for v in metrics.values())


def run_loss(fn: Any, mask: torch.Tensor, grad_of: list[torch.Tensor], *rest: torch.Tensor) -> tuple[
        torch.Tensor, dict[str, float], list[torch.Tensor]]:
    """``fn(*grad_of, *rest, mask)`` backpropagated: (loss, metrics, the gradients of ``grad_of``)."""
    leaves = [x.clone().requires_grad_(True) for x in grad_of]
    loss, metrics = fn(*leaves, *rest, mask)
    loss.backward()
    grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in leaves]
    return loss.detach(), metrics, grads


def assert_properties(fn: Any, mask: torch.Tensor, one: list[torch.Tensor], two: list[torch.Tensor],
                      n_grad: int) -> list[torch.Tensor]:
    """Finite, and blind to masked positions: ``fn`` on ``one`` and on ``two`` (the same trained
    values) gives bit-identical loss, metrics and gradients, 0 at masked positions. Gradients of
    the first ``n_grad`` inputs are taken."""
    loss1, m1, g1 = run_loss(fn, mask, one[:n_grad], *one[n_grad:])
    loss2, m2, g2 = run_loss(fn, mask, two[:n_grad], *two[n_grad:])
    assert torch.isfinite(loss1) and finite(m1), (loss1, m1)
    assert all(torch.isfinite(g).all() for g in g1), g1
    assert torch.equal(loss1, loss2) and m1 == m2
    for a, b in zip(g1, g2, strict=True):
        assert torch.equal(a, b)
        assert (a[mask == 0] == 0).all()
    return g1


# --------------------------------------------------------------------------- policy losses (the registry's)


@pytest.mark.parametrize("name", sorted(registry.POLICY_LOSSES))
@SETTINGS
@given(masked_fields(LOGP, LOGP, ADV), st.sampled_from(AGG_MODES), st.booleans(), st.booleans())
def test_every_policy_loss_is_finite_blind_to_masked_positions_and_still_at_zero_advantage(
        name: str, data: tuple, agg: str, per_token: bool, dual: bool) -> None:
    mask, one, two = data
    cfg = msgspec.convert({"pg_variant": name, "loss_agg_mode": agg, "dual_clip_loss": dual and name == "ppo"},
                          AlgorithmConfig)
    fn = registry.loss(name)
    if not per_token:  # one advantage per sample (B,), as the pure losses also take
        one[2] = one[2][:, 0].clamp(-100.0, 100.0)  # column 0 may be garbage: keep it a real advantage
        two[2] = one[2].clone()

    def loss(lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, m: torch.Tensor) -> Any:
        return fn(cfg, lp, old, adv, m, 8)

    assert_properties(loss, mask, one, two, n_grad=1)
    _, _, (g0,) = run_loss(loss, mask, one[:1], one[1], torch.zeros_like(one[2]))
    assert (g0 == 0).all(), g0  # zero advantage: zero policy gradient


# --------------------------------------------------------------------------- the other loss terms


@SETTINGS
@given(masked_fields(ADV, ADV, ADV), st.sampled_from(AGG_MODES), st.sampled_from([None, 0.2]))
def test_value_loss(data: tuple, agg: str, clip: float | None) -> None:
    mask, one, two = data
    assert_properties(lambda v, old, ret, m: L.value_loss(v, old, ret, m, clip, agg, 8), mask, one, two, n_grad=1)


@SETTINGS
@given(masked_fields(st.floats(0.0, 12.0, width=32)), st.sampled_from(AGG_MODES))
def test_entropy_loss(data: tuple, agg: str) -> None:
    mask, one, two = data
    assert_properties(lambda h, m: L.entropy_loss(h, m, 0.01, agg, 8), mask, one, two, n_grad=1)


KL_KINDS = sorted(set(config_choices("kl_loss_type")) - {"full"})


@SETTINGS
@given(masked_fields(LOGP, LOGP), st.sampled_from(KL_KINDS), st.sampled_from(AGG_MODES))
def test_kl_loss_every_estimator(data: tuple, kind: str, agg: str) -> None:
    mask, one, two = data
    assert_properties(lambda lp, ref, m: L.kl_loss(lp, ref, m, 0.1, kind, agg, 8), mask, one, two, n_grad=1)  # type: ignore[arg-type]


@SETTINGS
@given(masked_fields(LOGP, LOGP, LOGP), st.sampled_from(AGG_MODES))
def test_full_kl_loss(data: tuple, agg: str) -> None:
    """``full`` over a vocabulary of 3: each row a log-distribution where trained, garbage elsewhere."""
    mask, one, two = data

    def vocab(xs: list[torch.Tensor], shift: int) -> torch.Tensor:  # (B, T) × 3 -> (B, T, 3), log-softmax where trained
        logits = torch.stack(xs, -1).roll(shift, -1)
        return torch.where(mask.bool().unsqueeze(-1), torch.log_softmax(logits, -1), logits)

    assert_properties(lambda lp, ref, m: L.kl_loss(lp, ref, m, 0.1, "full", agg, 8), mask,
                      [vocab(one, 0), vocab(one, 1)], [vocab(two, 0), vocab(two, 1)], n_grad=1)


@SETTINGS
@given(masked_fields(ADV), st.sampled_from(AGG_MODES))
def test_aggregate_and_masked_mean(data: tuple, agg: str) -> None:
    mask, one, two = data
    assert_properties(lambda x, m: (L.aggregate(x, m, agg, 8), {"mean": float(L.masked_mean(x.detach(), m))}),
                      mask, one, two, n_grad=1)


# --------------------------------------------------------------------------- off-policy corrections (no gradient)


@SETTINGS
@given(masked_fields(LOGP, LOGP), st.sampled_from(["token", "sequence", "geometric"]),
       st.sampled_from(["token", "sequence"]), st.sampled_from(["k1", "k3"]))
def test_off_policy_corrections_are_finite_and_blind_to_masked_positions(data: tuple, is_level: str, rs_level: str,
                                                                         div: str) -> None:
    mask, (old1, beh1), (old2, beh2) = data
    calls = [lambda o, b: L.tis_weights(o, b, mask, is_level, 2.0),  # type: ignore[arg-type]
             lambda o, b: L.masked_is(o, b, mask, is_level, 0.5, 2.0),  # type: ignore[arg-type]
             lambda o, b: L.rejection_mask(o, b, mask, rs_level, div, 0.05),  # type: ignore[arg-type]
             lambda o, b: L.icepop_weights(o, b, mask, 0.5, 5.0)]
    for call in calls:
        out1, m1 = call(old1, beh1)
        out2, m2 = call(old2, beh2)
        assert torch.isfinite(out1).all() and finite(m1), m1
        assert torch.equal(out1, out2) and m1 == m2
        assert (out1[mask == 0] == 0).all() and (out1 >= 0).all()


# --------------------------------------------------------------------------- estimators


@st.composite
def groups(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards (B,) (integers up to ±100: the loop twins compare in float64) and group ids (B,),
    groups of any size (one included), in any order."""
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    ids = [g * 5 + 2 for g, n in enumerate(sizes) for _ in range(n)]
    perm = draw(st.permutations(range(len(ids))))
    r = draw(st.lists(st.integers(-100, 100), min_size=len(ids), max_size=len(ids)))
    return torch.tensor(r, dtype=torch.float32), torch.tensor([ids[i] for i in perm])


def assert_twin(got: torch.Tensor, want: Any, scale: float, terms: int) -> None:
    """``got`` (float32) against the loop twin's float64 values, to float32 rounding of ``terms``
    terms of size ``scale``."""
    w = torch.tensor(want, dtype=torch.float64)
    assert torch.isfinite(got).all()
    tol = rounding_tol(scale, terms)
    assert float((got.double() - w).abs().max()) <= tol, (got, want, tol)


@SETTINGS
@given(groups(), st.booleans())
def test_outcome_estimators_are_finite_and_match_their_twins(data: tuple, norm_std: bool) -> None:
    r, g = data
    rl, gl = r.tolist(), g.tolist()
    n = r.numel()
    big = 1.0 + float(r.abs().max())
    # GRPO divides by the group std (at least 1/2 for distinct integers): magnitude up to 2·big
    assert_twin(A.grpo_advantages(r, g, norm_std), A.grpo_advantages_reference(rl, gl, norm_std), 4 * big, 4 * n)
    assert_twin(A.dr_grpo_advantages(r, g), A.dr_grpo_advantages_reference(rl, gl), big, 4 * n)
    assert_twin(A.rloo_advantages(r, g), A.rloo_advantages_reference(rl, gl), big, 4 * n)
    assert A.raft_mask(r, g, 2, 0.0).tolist() == A.raft_mask_reference(rl, gl, 2, 0.0)
    wide = r * 1e30  # finite but huge rewards: finite advantages (0/0 and inf/inf never happen)
    for out in (A.grpo_advantages(wide, g), A.rloo_advantages(wide, g), A.normalize_rewards(wide, g, "batch", "batch")):
        assert torch.isfinite(out).all()


@SETTINGS
@given(masked_fields(ADV, ADV), st.sampled_from([1.0, 0.9]), st.sampled_from([1.0, 0.95]), st.floats(0.0, 2.0))
def test_token_estimators_are_finite_blind_to_masked_positions_and_match_their_twins(
        data: tuple, gamma: float, lam: float, kl_coef: float) -> None:
    mask, (r1, v1), (r2, v2) = data
    ml = mask.long().tolist()
    gae1, ret1 = A.gae_advantages(r1, v1, mask, gamma, lam)
    gae2, ret2 = A.gae_advantages(r2, v2, mask, gamma, lam)
    assert torch.equal(gae1, gae2) and torch.equal(ret1, ret2)
    want_a, want_r = A.gae_advantages_reference(r1.tolist(), v1.tolist(), ml, gamma, lam)
    scale = 2 * mask.shape[1] * (1.0 + float(torch.where(mask > 0, r1.abs() + v1.abs(), 0).max()))
    assert_twin(gae1, want_a, scale, 4 * mask.shape[1])
    assert_twin(ret1, want_r, scale, 4 * mask.shape[1])
    rewards = r1[:, 0].clamp(-100, 100).round()
    pp1 = A.reinforce_plus_plus_advantages(rewards, mask, v1, kl_coef, gamma)  # v: the per-token KL here
    pp2 = A.reinforce_plus_plus_advantages(rewards, mask, v2, kl_coef, gamma)
    assert torch.isfinite(pp1).all() and torch.equal(pp1, pp2) and (pp1[mask == 0] == 0).all()
    w1, w2 = A.whiten(r1, mask), A.whiten(r2, mask)
    assert torch.isfinite(w1).all() and torch.equal(w1, w2)


@pytest.mark.parametrize("name", sorted(registry.ESTIMATORS))
@SETTINGS
@given(masked_fields(ADV, ADV), st.integers(0, 10_000))
def test_every_registered_estimator_is_finite_and_blind_to_masked_positions(name: str, data: tuple,
                                                                           seed: int) -> None:
    """``compute_advantages`` with each estimator, the KL in the rewards and a critic's values:
    finite, 0 on masked positions, and the same whatever the masked KL and values hold."""
    mask, (kl1, v1), (kl2, v2) = data
    b = mask.shape[0]
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (b,), generator=g).float()
    group_ids = torch.randint(0, 2, (b,), generator=g)
    greedy = torch.randint(0, 2, (2,), generator=g).float()[group_ids] if name == "remax" else None  # (B,)
    cfg = msgspec.convert({"adv_estimator": name, "critic": "value_head" if name == "gae" else "none",
                           "add_token_level_kl": True, "init_kl_coef": 1.5}, AlgorithmConfig)
    outs = []
    for kl, v in ((kl1, v1), (kl2, v2)):
        adv, ret, metrics = alg.compute_advantages(cfg, alg.initial_state(cfg), rewards, group_ids, mask,
                                                   values=v, kl=kl, baselines=greedy)
        assert torch.isfinite(adv).all() and finite(metrics) and (adv[mask == 0] == 0).all()
        outs.append((adv, ret))
    assert torch.equal(outs[0][0], outs[1][0])
    if outs[0][1] is not None:
        assert outs[1][1] is not None and torch.equal(outs[0][1], outs[1][1])
