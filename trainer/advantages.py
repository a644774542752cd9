"""Advantage estimators and reward shaping as pure tensor functions. Shapes in comments.

Conventions (as in :mod:`trainer.losses`): ``B`` samples, ``T`` response-token positions, ``mask``
(B, T) is 1 on trained tokens. Outcome estimators take one reward per sample ``rewards`` (B,) and
integer ``group_ids`` (B,) (samples of the same prompt share an id; any order, any group sizes)
and return one advantage per sample (B,), which the loss broadcasts over the sample's tokens.
Token-level estimators return (B, T) and are 0 on masked positions.

Every estimator has a ``*_reference`` plain-loop twin (the definition, for tests). Formulas and
papers: ``docs/algorithms.md``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

NormType = Literal["batch", "group", "none"]


# --------------------------------------------------------------------------- helpers


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Dense group index ``inv`` (N,) in ``0..K-1`` and ``K``. ``group_ids`` (N,) or (N, d)."""
    if group_ids.numel() == 0:
        return torch.zeros(0, dtype=torch.long), 0
    _, inv = torch.unique(group_ids, return_inverse=True, dim=0 if group_ids.dim() > 1 else None)
    return inv, int(inv.max()) + 1


def _constant(x: torch.Tensor, inv: torch.Tensor, k: int) -> torch.Tensor:
    """Whether each group's values are all equal: (K,) bool. x, inv (N,)."""
    big = torch.finfo(x.dtype).max
    hi = torch.full((k,), -big, dtype=x.dtype).scatter_reduce(0, inv, x, "amax")  # (K,)
    lo = torch.full((k,), big, dtype=x.dtype).scatter_reduce(0, inv, x, "amin")  # (K,)
    return hi == lo


def group_mean(x: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over each sample's group, broadcast back.  x, group_ids (N,) -> (N,).

    A group whose values are all equal has that value as its mean exactly (a float32 sum of eight
    0.1s is not 0.8), so its centred values are 0, not round-off that a division by
    ``std + eps`` would blow up to about 1e-2."""
    inv, k = _group_index(group_ids)
    count = torch.zeros(k, dtype=x.dtype).index_add_(0, inv, torch.ones_like(x))  # (K,)
    mean = torch.zeros(k, dtype=x.dtype).index_add_(0, inv, x) / count  # (K,)
    first = torch.zeros(k, dtype=x.dtype).scatter_(0, inv, x)  # (K,) a member's value (any: they are equal)
    return torch.where(_constant(x, inv, k), first, mean)[inv]  # (N,)


def group_std(x: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Unbiased std of ``x`` over each sample's group, broadcast back (0 for a group of one).
    x, group_ids (N,) -> (N,)."""
    inv, k = _group_index(group_ids)
    count = torch.zeros(k, dtype=x.dtype).index_add_(0, inv, torch.ones_like(x))  # (K,)
    sq = torch.zeros(k, dtype=x.dtype).index_add_(0, inv, (x - group_mean(x, group_ids)) ** 2)  # (K,)
    return (sq / (count - 1).clamp(min=1)).sqrt()[inv]  # (N,)


def _compact(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable order putting each row's masked-in positions first, and the compacted valid mask.

    mask (B, T) -> order (B, T) long, valid (B, T) bool (``valid[b, j]`` iff ``j < mask[b].sum()``).
    """
    order = torch.argsort((mask <= 0).to(torch.int8), dim=1, stable=True)  # (B, T)
    n = (mask > 0).sum(dim=1, keepdim=True)  # (B, 1)
    valid = torch.arange(mask.shape[1]).unsqueeze(0) < n  # (B, T)
    return order, valid


def _scatter_back(y_c: torch.Tensor, order: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Undo :func:`_compact`: compacted values (B, T) -> original positions, 0 where masked."""
    return torch.zeros_like(y_c).scatter_(1, order, y_c * valid)  # (B, T)


def _discounted_cumsum_compact(x_c: torch.Tensor, valid: torch.Tensor, gamma: float) -> torch.Tensor:
    """``y_t = Σ_{s≥t, valid} γ^(s−t) x_s`` on compacted rows.  (B, T) -> (B, T).

    A reverse loop over ``T``, vectorised over ``B`` (memory O(B·T); no T×T matrix).
    """
    x = x_c.double() * valid  # (B, T)
    out = torch.zeros_like(x)  # (B, T)
    running = torch.zeros_like(x[:, 0])  # (B,)
    for t in reversed(range(x.shape[1])):
        running = x[:, t] + gamma * running
        out[:, t] = running
    return out


def discounted_cumsum(x: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go over the trained tokens of each row, skipping masked positions.

    ``y_t = Σ_{s ≥ t, mask_s = 1} γ^(k(s) − k(t)) x_s`` where ``k`` counts trained tokens (so an
    environment-token gap in a multi-turn sample does not discount). x, mask (B, T) -> (B, T),
    0 on masked positions.
    """
    order, valid = _compact(mask)
    y_c = _discounted_cumsum_compact(torch.gather(x, 1, order), valid, gamma)  # (B, T)
    return _scatter_back(y_c, order, valid).to(x.dtype)


# --------------------------------------------------------------------------- shaping


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """``(x − μ) / sqrt(σ² + eps)`` with μ, σ² the mean and population variance over ``mask``.

    x, mask (B, T) (or any equal shapes) -> same shape, 0 on masked positions. ``shift_mean=False``
    adds μ back (scale only). Masked values never influence the result, whatever they hold.
    """
    m = mask > 0
    xm = torch.where(m, x, torch.zeros_like(x))  # masked positions out before any arithmetic
    n = m.sum().clamp(min=1).to(x.dtype)
    mean = xm.sum() / n  # ()
    var = torch.where(m, xm - mean, torch.zeros_like(x)).square().sum() / n  # () population variance
    out = (xm - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, torch.zeros_like(out))


def clip_rewards(rewards: torch.Tensor, low: float = -1.0, high: float = 1.0) -> torch.Tensor:
    """``clamp(r, low, high)``.  Any shape."""
    return rewards.clamp(min=low, max=high)


def scale_shift(rewards: torch.Tensor, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    """``r · scale + shift``.  Any shape."""
    return rewards * scale + shift


def normalize_rewards(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    mean_type: NormType = "group",
    std_type: NormType = "group",
    eps: float = 1e-6,
) -> torch.Tensor:
    """``(r − mean) / (std + eps)`` with mean and std each taken over the batch, the group, or not at all.

    rewards, group_ids (B,) -> (B,). std is the unbiased std of the raw rewards (0 for one sample).
    ``group``/``group`` is GRPO, ``group``/``none`` Dr. GRPO, ``group``/``batch`` is the
    "batch std" variant (Hu et al. 2025, REINFORCE++-baseline; LitePPO).
    """
    r = rewards.float()  # (B,)
    if mean_type == "group":
        mean = group_mean(r, group_ids)
    elif mean_type == "batch":
        equal = r.numel() > 0 and bool((r == r[0]).all())
        mean = (r[0] if equal else r.mean()).expand_as(r)  # equal rewards: exactly 0 after centring
    else:
        mean = torch.zeros_like(r)
    centred = r - mean  # (B,)
    if std_type == "none":
        return centred
    if std_type == "batch":
        std = (r.std() if r.numel() > 1 else torch.zeros(())).expand_as(r)
    else:
        std = group_std(r, group_ids)  # (B,)
    return centred / (std + eps)


# --------------------------------------------------------------------------- outcome estimators


def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    norm_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative advantages, one per sample.

    Either ``rewards`` (N,) with integer ``group_ids`` (N,) (any order, any group sizes), or
    ``rewards`` (G, n) with ``group_ids=None`` (row = group). Returns the same shape as
    ``rewards``: ``(r - mean_g) / (std_g + eps)`` (or ``r - mean_g`` when ``norm_std`` is False),
    with ``std_g`` the unbiased std of the group (0 for a group of one).
    """
    if group_ids is None:
        if rewards.dim() != 2:
            raise ValueError("rewards must be (G, n) when group_ids is None")
        flat_ids = torch.arange(rewards.shape[0]).repeat_interleave(rewards.shape[1])  # (G*n,)
        return grpo_advantages(rewards.reshape(-1), flat_ids, norm_std, eps).reshape(rewards.shape)
    r = rewards.float()  # (N,)
    inv, k = _group_index(group_ids)
    count = torch.zeros(k).index_add_(0, inv, torch.ones_like(r))  # (K,)
    centred = r - group_mean(r, group_ids)  # (N,); exactly 0 in a group of equal rewards
    if not norm_std:
        return centred
    sq = torch.zeros(k).index_add_(0, inv, centred**2)  # (K,)
    std = (sq / (count - 1).clamp(min=1)).sqrt()  # (K,) unbiased; 0 for singletons
    return centred / (std[inv] + eps)  # (N,)


def grpo_advantages_reference(
    rewards: list[float], group_ids: list[int] | list[str], norm_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """Plain-loop GRPO advantages (the definition, for testing :func:`grpo_advantages`)."""
    groups: dict[object, list[float]] = {}
    for r, g in zip(rewards, group_ids, strict=True):
        groups.setdefault(g, []).append(r)
    out = []
    for r, g in zip(rewards, group_ids, strict=True):
        members = groups[g]
        mean = sum(members) / len(members)
        if not norm_std:
            out.append(r - mean)
            continue
        var = sum((m - mean) ** 2 for m in members) / max(len(members) - 1, 1)
        out.append((r - mean) / (var**0.5 + eps))
    return out


def dr_grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025): ``A_i = r_i − mean_{j∈g(i)} r_j`` — GRPO without the std division.

    rewards, group_ids (B,) -> (B,). Dr. GRPO also drops GRPO's per-sample ``1/|o_i|`` length
    normalisation; that is a loss-aggregation choice: use
    ``aggregate(..., mode="seq-mean-token-sum-norm")`` in :mod:`trainer.losses`.
    """
    return grpo_advantages(rewards, group_ids, norm_std=False)


def dr_grpo_advantages_reference(rewards: list[float], group_ids: list[int]) -> list[float]:
    groups: dict[int, list[float]] = {}
    for r, g in zip(rewards, group_ids, strict=True):
        groups.setdefault(g, []).append(r)
    return [r - sum(groups[g]) / len(groups[g]) for r, g in zip(rewards, group_ids, strict=True)]


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024): ``A_i = r_i − mean_{j∈g(i), j≠i} r_j``.

    rewards, group_ids (B,) -> (B,). Equals ``n/(n−1) · (r_i − mean_g)``; a group of one gets 0.
    """
    r = rewards.float()  # (B,)
    inv, k = _group_index(group_ids)
    count = torch.zeros(k).index_add_(0, inv, torch.ones_like(r))[inv]  # (B,)
    total = torch.zeros(k).index_add_(0, inv, r)[inv]  # (B,)
    baseline = (total - r) / (count - 1).clamp(min=1)  # (B,)
    signal = (count > 1) & ~_constant(r, inv, k)[inv]  # (B,) equal rewards: exactly 0, not round-off
    return torch.where(signal, r - baseline, torch.zeros_like(r))


def rloo_advantages_reference(rewards: list[float], group_ids: list[int]) -> list[float]:
    out = []
    for i, (r, g) in enumerate(zip(rewards, group_ids, strict=True)):
        others = [rj for j, (rj, gj) in enumerate(zip(rewards, group_ids, strict=True)) if gj == g and j != i]
        out.append(r - sum(others) / len(others) if others else 0.0)
    return out


def reinforce_plus_plus_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    group_ids: torch.Tensor | None = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """REINFORCE++ (Hu et al. 2025): token returns, then whitened over the whole batch.

    Token reward ``r_t = −β·kl_t`` plus the outcome reward on the sample's last trained token;
    ``G_t = Σ_{s≥t} γ^(s−t) r_s``; ``A = whiten(G, mask)``. With ``group_ids`` the group mean is
    subtracted from the outcome reward first (REINFORCE++-baseline).
    rewards (B,); mask, kl (B, T) -> (B, T).
    """
    r = rewards.float()  # (B,)
    if group_ids is not None:
        r = r - group_mean(r, group_ids)
    m = (mask > 0).float()  # (B, T)
    tok = torch.zeros_like(m) if kl is None else -kl_coef * torch.where(m > 0, kl.float(), 0.0)  # (B, T)
    last = (m * torch.arange(m.shape[1])).argmax(dim=1)  # (B,) last trained position
    has = m.sum(dim=1) > 0  # (B,)
    tok = tok.scatter_add(1, last.unsqueeze(1), (r * has).unsqueeze(1))  # (B, T)
    returns = discounted_cumsum(tok, m, gamma)  # (B, T)
    return whiten(returns, m, eps=eps)


def reinforce_plus_plus_advantages_reference(
    rewards: list[float],
    mask: list[list[int]],
    kl: list[list[float]] | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    group_ids: list[int] | None = None,
    eps: float = 1e-8,
) -> list[list[float]]:
    if group_ids is not None:
        rewards = [r - m for r, m in zip(rewards, dr_grpo_baseline(rewards, group_ids), strict=True)]
    all_returns: list[list[float]] = []
    for b, row in enumerate(mask):
        pos = [t for t, v in enumerate(row) if v]
        tok = {t: (-kl_coef * kl[b][t] if kl is not None else 0.0) for t in pos}
        if pos:
            tok[pos[-1]] += rewards[b]
        ret = [0.0] * len(row)
        g = 0.0
        for t in reversed(pos):
            g = tok[t] + gamma * g
            ret[t] = g
        all_returns.append(ret)
    vals = [all_returns[b][t] for b, row in enumerate(mask) for t, v in enumerate(row) if v]
    n = max(len(vals), 1)
    mean = sum(vals) / n
    var = sum((v - mean) ** 2 for v in vals) / n
    return [
        [((all_returns[b][t] - mean) / (var + eps) ** 0.5 if v else 0.0) for t, v in enumerate(row)]
        for b, row in enumerate(mask)
    ]


def dr_grpo_baseline(rewards: list[float], group_ids: list[int]) -> list[float]:
    """Plain-loop group mean per sample (helper for the references)."""
    d = dr_grpo_advantages_reference(rewards, group_ids)
    return [r - a for r, a in zip(rewards, d, strict=True)]


def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016) for PPO: ``δ_t = r_t + γ V_{t+1} − V_t``, ``A_t = Σ_k (γλ)^k δ_{t+k}``.

    rewards, values, mask (B, T) -> (advantages, returns) (B, T), ``returns = A + V``; both 0 on
    masked positions. Masked positions are skipped (``V_{t+1}`` is the value of the next trained
    token; the value after the last one is 0), as verl does for multi-turn samples. Advantages are
    not whitened: apply :func:`whiten` if wanted.
    """
    order, valid = _compact(mask)
    r_c = torch.gather(rewards.float(), 1, order) * valid  # (B, T)
    v_c = torch.gather(values.float(), 1, order) * valid  # (B, T)
    next_v = torch.cat([v_c[:, 1:], torch.zeros_like(v_c[:, :1])], dim=1)  # (B, T)
    deltas = r_c + gamma * next_v - v_c  # (B, T)
    adv_c = _discounted_cumsum_compact(deltas, valid, gamma * lam).float()  # (B, T)
    advantages = _scatter_back(adv_c, order, valid)  # (B, T)
    returns = _scatter_back(adv_c + v_c, order, valid)  # (B, T)
    return advantages, returns


def gae_advantages_reference(
    rewards: list[list[float]], values: list[list[float]], mask: list[list[int]], gamma: float, lam: float
) -> tuple[list[list[float]], list[list[float]]]:
    advs, rets = [], []
    for r, v, m in zip(rewards, values, mask, strict=True):
        a_row, r_row = [0.0] * len(m), [0.0] * len(m)
        next_value, last_gae = 0.0, 0.0
        for t in reversed(range(len(m))):
            if not m[t]:
                continue
            delta = r[t] + gamma * next_value - v[t]
            last_gae = delta + gamma * lam * last_gae
            a_row[t], r_row[t] = last_gae, last_gae + v[t]
            next_value = v[t]
        advs.append(a_row)
        rets.append(r_row)
    return advs, rets


def raft_mask(
    rewards: torch.Tensor, group_ids: torch.Tensor, top_k: int | None = None, min_reward: float | None = None
) -> torch.Tensor:
    """RAFT / RAFT++ (Dong et al. 2023; Xiong et al. 2025) reward-ranked filtering: which samples to train on.

    rewards, group_ids (B,) -> bool (B,). ``top_k=None``: keep the samples whose reward equals
    their group's maximum; else the ``top_k`` best of each group (ties: earlier index first).
    ``min_reward``: also require ``r > min_reward`` (e.g. 0 for binary rewards: drop all-wrong groups).
    """
    r = rewards.float()  # (B,)
    inv, _ = _group_index(group_ids)
    same = inv.unsqueeze(0) == inv.unsqueeze(1)  # (B, B)
    if top_k is None:
        keep = ~(same & (r.unsqueeze(0) > r.unsqueeze(1))).any(dim=1)  # no group member strictly better
    else:
        idx = torch.arange(r.numel())
        better = (r.unsqueeze(0) > r.unsqueeze(1)) | (
            (r.unsqueeze(0) == r.unsqueeze(1)) & (idx.unsqueeze(0) < idx.unsqueeze(1))
        )  # (B, B) better[i, j]: j ranks above i
        keep = (same & better).sum(dim=1) < top_k
    if min_reward is not None:
        keep = keep & (r > min_reward)
    return keep


def raft_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, top_k: int | None = None, min_reward: float | None = None
) -> torch.Tensor:
    """RAFT++ advantages: 1 for samples kept by :func:`raft_mask`, 0 otherwise.  (B,) -> (B,)."""
    return raft_mask(rewards, group_ids, top_k, min_reward).float()


def raft_mask_reference(
    rewards: list[float], group_ids: list[int], top_k: int | None = None, min_reward: float | None = None
) -> list[bool]:
    keep = [False] * len(rewards)
    for g in set(group_ids):
        members = [i for i, gi in enumerate(group_ids) if gi == g]
        if top_k is None:
            best = max(rewards[i] for i in members)
            chosen = [i for i in members if rewards[i] == best]
        else:
            chosen = sorted(members, key=lambda i: (-rewards[i], i))[:top_k]
        for i in chosen:
            keep[i] = min_reward is None or rewards[i] > min_reward
    return keep


# --------------------------------------------------------------------------- multi-turn (per step)


def step_reinforce_returns(
    step_rewards: torch.Tensor,
    episode_ids: torch.Tensor,
    step_index: torch.Tensor,
    step_reward_gamma: float = 1.0,
) -> torch.Tensor:
    """Discounted return of each step of a multi-turn episode: ``G_t = Σ_{t'≥t} γ^(t'−t) r_{t'}``.

    step_rewards, episode_ids, step_index (S,) -> (S,). One row per (episode, step), any order;
    ``step_index`` >= 0 (gaps discount by the index difference).
    Use as a per-step advantage (optionally after :func:`whiten`), broadcast to the step's tokens.
    """
    ep_inv, n_ep = _group_index(episode_ids)  # (S,)
    steps = step_index.long()  # (S,)
    if steps.numel() and int(steps.min()) < 0:
        raise ValueError("step_index must be >= 0")
    width = int(steps.max()) + 1 if steps.numel() else 0
    grid = torch.zeros(n_ep, width, dtype=torch.float64)  # (E, K) rewards by (episode, step)
    grid.index_put_((ep_inv, steps), step_rewards.double(), accumulate=True)
    returns = _discounted_cumsum_compact(
        grid, torch.ones_like(grid, dtype=torch.bool), step_reward_gamma
    )  # (E, K)
    return returns[ep_inv, steps].float()  # (S,)


def step_reinforce_returns_reference(
    step_rewards: list[float], episode_ids: list[int], step_index: list[int], step_reward_gamma: float = 1.0
) -> list[float]:
    out = []
    for e, t in zip(episode_ids, step_index, strict=True):
        g = 0.0
        for rj, ej, tj in zip(step_rewards, episode_ids, step_index, strict=True):
            if ej == e and tj >= t:
                g += step_reward_gamma ** (tj - t) * rj
        out.append(g)
    return out


def gigpo_advantages(
    step_rewards: torch.Tensor,
    episode_ids: torch.Tensor,
    step_index: torch.Tensor,
    group_ids: torch.Tensor,
    anchor_ids: torch.Tensor,
    step_reward_gamma: float = 0.95,
    episode_weight: float = 1.0,
    step_weight: float = 1.0,
    norm_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GiGPO (Feng et al. 2025): episode-level group advantage + step-level anchor-group advantage.

    One row per (episode, step); all (S,) -> (S,). ``group_ids``: the episode's task group
    (episodes rolled out from the same initial state); ``anchor_ids``: id of the environment state
    the step acted from (hash). Episode return ``R = Σ_t r_t``; ``A^E`` = GRPO advantage of ``R``
    over the episodes of a group (one value per episode, not per step). Step return
    ``G_t`` = :func:`step_reinforce_returns`; ``A^S`` = GRPO advantage of ``G_t`` over the steps of
    the same group that share an anchor state. ``A = episode_weight·A^E + step_weight·A^S``.
    ``norm_std=False`` drops both std divisions (the paper's ``F_norm = 1`` variant).
    """
    r = step_rewards.float()  # (S,)
    ep_inv, n_ep = _group_index(episode_ids)  # (S,)
    ep_return = torch.zeros(n_ep).index_add_(0, ep_inv, r)  # (E,)
    ep_group = torch.zeros(n_ep, dtype=group_ids.dtype).scatter_(0, ep_inv, group_ids)  # (E,)
    a_ep = grpo_advantages(ep_return, ep_group, norm_std=norm_std, eps=eps)[ep_inv]  # (S,)
    g = step_reinforce_returns(r, episode_ids, step_index, step_reward_gamma)  # (S,)
    anchor_key, _ = _group_index(torch.stack([group_ids.long(), anchor_ids.long()], dim=1))  # (S,)
    a_step = grpo_advantages(g, anchor_key, norm_std=norm_std, eps=eps)  # (S,)
    return episode_weight * a_ep + step_weight * a_step


def gigpo_advantages_reference(
    step_rewards: list[float],
    episode_ids: list[int],
    step_index: list[int],
    group_ids: list[int],
    anchor_ids: list[int],
    step_reward_gamma: float = 0.95,
    episode_weight: float = 1.0,
    step_weight: float = 1.0,
    norm_std: bool = True,
    eps: float = 1e-6,
) -> list[float]:
    ep_ret: dict[int, float] = {}
    ep_grp: dict[int, int] = {}
    for r, e, g in zip(step_rewards, episode_ids, group_ids, strict=True):
        ep_ret[e] = ep_ret.get(e, 0.0) + r
        ep_grp[e] = g
    eps_list = list(ep_ret)
    a_ep_by = dict(
        zip(
            eps_list,
            grpo_advantages_reference(
                [ep_ret[e] for e in eps_list], [ep_grp[e] for e in eps_list], norm_std, eps
            ),
            strict=True,
        )
    )
    g_t = step_reinforce_returns_reference(step_rewards, episode_ids, step_index, step_reward_gamma)
    keys = [f"{g}/{a}" for g, a in zip(group_ids, anchor_ids, strict=True)]
    a_step = grpo_advantages_reference(g_t, keys, norm_std, eps)
    return [episode_weight * a_ep_by[e] + step_weight * s for e, s in zip(episode_ids, a_step, strict=True)]


# --------------------------------------------------------------------------- newer outcome estimators (issue 37)


def _group_sums(x: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Σ_{j∈g} x_j, dense group index)``: the sum per group (K,) and each sample's group (N,)."""
    inv, k = _group_index(group_ids)
    return torch.zeros(k, dtype=x.dtype).index_add_(0, inv, x), inv


def gpg_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """GPG (Chu et al. 2025, *GPG: A Simple and Strong RL Baseline for Model Reasoning*).

    ``A_i = α·(r_i − mean_{g(i)} r)`` with ``α = B / B_valid``: ``B`` samples in the batch,
    ``B_valid`` of them in groups whose rewards are not all equal (the others get ``A = 0``
    exactly, and ``α`` restores the gradient's scale they dilute; ``α = 1`` when no group is valid).
    rewards, group_ids (B,) -> (advantages (B,), α).
    """
    r = rewards.float()  # (B,)
    inv, k = _group_index(group_ids)
    valid = ~_constant(r, inv, k)[inv]  # (B,) groups whose rewards differ
    n_valid = int(valid.sum())
    alpha = r.numel() / n_valid if n_valid else 1.0
    return torch.where(valid, alpha * (r - group_mean(r, group_ids)), torch.zeros_like(r)), alpha


def gpg_advantages_reference(rewards: list[float], group_ids: list[int]) -> tuple[list[float], float]:
    groups: dict[int, list[float]] = {}
    for r, g in zip(rewards, group_ids, strict=True):
        groups.setdefault(g, []).append(r)
    valid = [max(groups[g]) > min(groups[g]) for g in group_ids]
    alpha = len(rewards) / sum(valid) if any(valid) else 1.0
    out = [
        alpha * (r - sum(groups[g]) / len(groups[g])) if v else 0.0
        for r, g, v in zip(rewards, group_ids, valid, strict=True)
    ]
    return out, alpha


def opo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """OPO (Hao et al. 2025, *On-Policy RL with Optimal Reward Baseline*): the length-weighted
    group baseline ``b_g = Σ_{j∈g} l_j r_j / Σ_{j∈g} l_j``, ``A_i = r_i − b_{g(i)}``.

    ``l`` = each sample's trained tokens; a group with no trained token uses its plain mean. A
    group of one gets 0. rewards, group_ids, lengths (B,) -> (B,).
    """
    r = rewards.float()  # (B,)
    length = lengths.float()  # (B,)
    weighted, inv = _group_sums(length * r, group_ids)  # (K,)
    total_len, _ = _group_sums(length, group_ids)  # (K,)
    baseline = torch.where(
        total_len[inv] > 0, weighted[inv] / total_len[inv].clamp(min=1e-12), group_mean(r, group_ids)
    )  # (B,)
    constant = _constant(r, *_group_index(group_ids))[inv]  # (B,) equal rewards: exactly 0, not round-off
    return torch.where(constant, 0.0, r - baseline)


def opo_advantages_reference(rewards: list[float], group_ids: list[int], lengths: list[float]) -> list[float]:
    out = []
    for r, g in zip(rewards, group_ids, strict=True):
        members = [(rj, lj) for rj, gj, lj in zip(rewards, group_ids, lengths, strict=True) if gj == g]
        total = sum(lj for _, lj in members)
        b = (
            sum(rj * lj for rj, lj in members) / total
            if total > 0
            else sum(rj for rj, _ in members) / len(members)
        )
        out.append(r - b)
    return out


def _log_comb(n: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``log C(n, k)`` elementwise (float64), ``−inf`` where ``k < 0`` or ``k > n``."""
    n, k = n.double(), k.double()
    ok = (k >= 0) & (k <= n)
    n_, k_ = torch.where(ok, n, 0.0), torch.where(ok, k, 0.0)
    out = torch.lgamma(n_ + 1) - torch.lgamma(k_ + 1) - torch.lgamma(n_ - k_ + 1)
    return torch.where(ok, out, torch.full_like(out, -math.inf))


def pass_at_k_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, k: int, threshold: float = 0.5, eps: float = 1e-6
) -> torch.Tensor:
    """Pass@k training advantages, analytic form (Chen et al. 2025, *Pass@k Training for Adaptively
    Balancing Exploration and Exploitation of Large Reasoning Models*).

    A group of ``n`` samples, ``c`` of them correct (``r > threshold``), ``k' = min(k, n − 1)`` (at
    least 1: with ``k' = n`` there is one subset and no signal; a group that lost members keeps one). Over
    the ``C(n, k')`` subsets of ``k'`` samples, the mean pass@k reward is ``R = 1 − C(n−c, k')/C(n, k')``
    and its std ``σ = sqrt(R(1 − R))``; a correct sample gets ``A⁺ = (1 − R)/(σ + eps)``, an incorrect
    one ``A⁻ = (1 − R − C(n−c−1, k'−1)/C(n−1, k'−1))/(σ + eps)`` (its subsets that hold no correct
    sample). ``k = 1`` is GRPO on 0/1 correctness (population std). rewards, group_ids (B,) -> (B,).
    """
    correct = (rewards.float() > threshold).double()  # (B,)
    c, inv = _group_sums(correct, group_ids)  # (K,)
    n, _ = _group_sums(torch.ones_like(correct), group_ids)  # (K,)
    kk = torch.clamp(torch.clamp(n - 1, max=float(k)), min=1.0)  # (K,)
    mean = 1.0 - torch.exp(_log_comb(n - c, kk) - _log_comb(n, kk))  # (K,)
    std = (mean * (1.0 - mean)).clamp(min=0).sqrt()  # (K,)
    miss = torch.exp(_log_comb(n - c - 1, kk - 1) - _log_comb(n - 1, kk - 1))  # (K,)
    a_pos = (1.0 - mean) / (std + eps)  # (K,)
    a_neg = (1.0 - mean - miss) / (std + eps)  # (K,)
    return torch.where(correct > 0, a_pos[inv], a_neg[inv]).float()  # (B,)


def pass_at_k_advantages_reference(
    rewards: list[float], group_ids: list[int], k: int, threshold: float = 0.5, eps: float = 1e-6
) -> list[float]:
    out = []
    for r, g in zip(rewards, group_ids, strict=True):
        members = [rj for rj, gj in zip(rewards, group_ids, strict=True) if gj == g]
        n, c = len(members), sum(rj > threshold for rj in members)
        kk = max(min(k, n - 1), 1)
        mean = 1.0 - math.comb(n - c, kk) / math.comb(n, kk)
        std = math.sqrt(mean * (1.0 - mean))
        if r > threshold:
            out.append((1.0 - mean) / (std + eps))
        else:
            out.append((1.0 - mean - math.comb(n - c - 1, kk - 1) / math.comb(n - 1, kk - 1)) / (std + eps))
    return out


def remax_advantages(rewards: torch.Tensor, baselines: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """ReMax (Li et al. 2023, *ReMax: A Simple, Effective, and Efficient Reinforcement Learning
    Method for Large Language Models*): ``A_i = r_i − r(ȳ_{g(i)})``, the reward of the greedy
    response ``ȳ`` to the sample's prompt as baseline (the greedy response is never trained).

    rewards, baselines, group_ids (B,) -> (B,): ``baselines`` holds each sample's group baseline;
    samples of one group must agree on it (it is one greedy response), else ``ValueError``.
    """
    r, b = rewards.float(), baselines.float()  # (B,)
    inv, k = _group_index(group_ids)
    hi = torch.full((k,), -math.inf).scatter_reduce(0, inv, b, "amax")  # (K,)
    lo = torch.full((k,), math.inf).scatter_reduce(0, inv, b, "amin")  # (K,)
    if bool((hi != lo).any()):
        raise ValueError("remax: samples of one group carry different greedy baselines")
    return r - b


def remax_advantages_reference(rewards: list[float], baselines: list[float], group_ids: list[int]) -> list[float]:
    first: dict[int, float] = {}
    out = []
    for r, b, g in zip(rewards, baselines, group_ids, strict=True):
        if first.setdefault(g, b) != b:
            raise ValueError("remax: samples of one group carry different greedy baselines")
        out.append(r - b)
    return out
