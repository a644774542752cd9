"""From the run config (``algorithm.*``) to the tensors of one optimizer step.

The building blocks are the pure functions of :mod:`trainer.advantages` and :mod:`trainer.losses`;
this module composes them in a fixed order for a collated :class:`trainer.batch.TokenBatch`
(``B`` samples, ``T = L − 1`` target positions, ``mask`` (B, T) 1 on trained tokens):

1. **rewards** (B,): ``clip`` to ±``reward_clip`` → ``× reward_scale + reward_shift``;
2. **KL in the reward** (``add_token_level_kl``): per-token ``−β·kl_t`` for the token-level
   estimators (``reinforce``, ``gae``); outcome estimators get ``r − β·Σ_t kl_t``;
3. **normalisation** by ``norm_mean_type`` / ``norm_std_type`` (``batch``, ``group``, ``running``,
   ``none``; unset = the estimator's own: ``grpo`` group/group, ``dr_grpo`` group/none, others
   none/none), then ``whiten_rewards``;
4. **the estimator** → advantages (B, T) (outcome ones broadcast over the sample's tokens);
5. ``whiten_advantages`` over the trained tokens, then ``advantage_clip``;
6. **masks**: ``max_len_mask``, ``difficulty_mask``, ``error_max_len_clip`` (and ``masked_is`` in
   :func:`off_policy`);
7. **weights** ≥ 0 multiply the advantages (so they scale each token's loss exactly, for every
   loss that is linear in ``A``): ``difficulty_loss_weight``, ``length_loss_weight``, and the
   ``tis`` / ``decoupled`` importance weights.

:class:`AlgoState` is what carries over between steps (the adaptive KL coefficient and the
running reward statistics); it is saved in checkpoints.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec
import torch

from schemas.config import AlgorithmConfig
from trainer import advantages as A
from trainer import losses as L


class AlgoState(msgspec.Struct, kw_only=True):
    """Algorithm state carried across steps (checkpointed)."""

    kl_coef: float
    """Coefficient β of ``add_token_level_kl`` (adapted when ``target_kl`` is set)."""
    reward_count: float = 0.0
    """Rewards seen by the ``running`` normalisation."""
    reward_mean: float = 0.0
    """Their mean."""
    reward_m2: float = 0.0
    """Their sum of squared deviations (Welford/Chan)."""


def initial_state(cfg: AlgorithmConfig) -> AlgoState:
    return AlgoState(kl_coef=cfg.init_kl_coef if cfg.add_token_level_kl else 0.0)


# --------------------------------------------------------------------------- group filters


def group_filter_reason(cfg: AlgorithmConfig, rewards: list[float]) -> str | None:
    """Why ``dynamic_filter`` drops a group with these rewards, or ``None`` to keep it."""
    if cfg.dynamic_filter == "none" or not rewards:
        return None
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))  # population std
    if cfg.dynamic_filter == "all_equal":
        if max(rewards) - min(rewards) <= 1e-9:
            return f"dynamic filter: all {len(rewards)} rewards equal ({rewards[0]:g})"
        return None
    if cfg.dynamic_filter == "mean":
        if not cfg.dynamic_filter_low <= mean <= cfg.dynamic_filter_high:
            return (f"dynamic filter: group mean reward {mean:.3g} outside "
                    f"[{cfg.dynamic_filter_low:g}, {cfg.dynamic_filter_high:g}]")
        return None
    if std < cfg.dynamic_filter_low:
        return f"dynamic filter: group reward std {std:.3g} < {cfg.dynamic_filter_low:g}"
    return None


# --------------------------------------------------------------------------- rewards

Norm = Literal["batch", "group", "running", "none"]


def resolved_norm(cfg: AlgorithmConfig) -> tuple[Norm, Norm]:
    """``(norm_mean_type, norm_std_type)`` in effect (the estimator's defaults when unset)."""
    defaults: dict[str, tuple[Norm, Norm]] = {"grpo": ("group", "group"), "dr_grpo": ("group", "none")}
    mean, std = defaults.get(cfg.adv_estimator, ("none", "none"))
    if cfg.norm_std is False and cfg.norm_std_type is None:  # deprecated spelling of norm_std_type: none
        std = "none"
    return cfg.norm_mean_type or mean, cfg.norm_std_type or std


def _update_running(state: AlgoState, r: torch.Tensor) -> None:
    """Merge the batch ``r`` (B,) into the running mean/variance (Chan et al.)."""
    n_b = float(r.numel())
    if n_b == 0:
        return
    mean_b = float(r.double().mean())
    m2_b = float(((r.double() - mean_b) ** 2).sum())
    n = state.reward_count + n_b
    delta = mean_b - state.reward_mean
    state.reward_mean += delta * n_b / n
    state.reward_m2 += m2_b + delta**2 * state.reward_count * n_b / n
    state.reward_count = n


def normalize(
    r: torch.Tensor, group_ids: torch.Tensor, mean_type: Norm, std_type: Norm, state: AlgoState, eps: float = 1e-6
) -> torch.Tensor:
    """``(r − mean) / (std + eps)`` with each statistic over the batch, the group, all batches so
    far (``running``, this batch included) or not at all.  r, group_ids (B,) -> (B,).

    std is unbiased (0 for a single sample), as in :func:`trainer.advantages.grpo_advantages`.
    """
    r = r.float()
    if "running" in (mean_type, std_type):
        _update_running(state, r)
    if mean_type == "group":
        mean = A.group_mean(r, group_ids)
    elif mean_type == "batch":
        mean = r.mean().expand_as(r)
    elif mean_type == "running":
        mean = torch.full_like(r, state.reward_mean)
    else:
        mean = torch.zeros_like(r)
    out = r - mean  # (B,)
    if std_type == "none":
        return out
    if std_type == "batch":
        std = (r.std() if r.numel() > 1 else torch.zeros(())).expand_as(r)
    elif std_type == "running":
        std = torch.full_like(r, math.sqrt(state.reward_m2 / max(state.reward_count - 1, 1)))
    else:
        std = A.group_std(r, group_ids)  # (B,)
    return out / (std + eps)


def shape_rewards(cfg: AlgorithmConfig, rewards: torch.Tensor) -> torch.Tensor:
    """Steps 1 of the module doc: clip, then scale and shift.  (B,) -> (B,)."""
    r = rewards.float()
    if cfg.reward_clip is not None:
        r = A.clip_rewards(r, -cfg.reward_clip, cfg.reward_clip)
    return A.scale_shift(r, cfg.reward_scale, cfg.reward_shift)


# --------------------------------------------------------------------------- turns (multi-turn samples)


def turn_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the agent turn of each trained token: a turn is a contiguous run of ``mask == 1``.

    mask (B, T) -> (B, T) long, −1 on masked positions.
    """
    m = (mask > 0).long()  # (B, T)
    prev = torch.nn.functional.pad(m[:, :-1], (1, 0))  # (B, T)
    starts = m * (1 - prev)  # (B, T) 1 where a turn begins
    return torch.where(m > 0, starts.cumsum(dim=1) - 1, torch.full_like(m, -1))


def _step_rows(
    rewards: torch.Tensor, mask: torch.Tensor, step_rewards: list[tuple[float, ...]] | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row per (sample, turn): ``(reward, episode, step, token turn index (B, T))``.

    A sample's ``step_rewards`` are used when there is one per turn; otherwise its outcome
    reward goes to the last turn and earlier turns get 0.
    """
    turns = turn_index(mask)  # (B, T)
    n_turns = (turns.max(dim=1).values + 1).clamp(min=1)  # (B,)
    rows_r, rows_e, rows_t = [], [], []
    for b in range(rewards.shape[0]):
        k = int(n_turns[b])
        given = step_rewards[b] if step_rewards is not None and b < len(step_rewards) else ()
        per_turn = list(given) if len(given) == k else [0.0] * (k - 1) + [float(rewards[b])]
        rows_r += per_turn
        rows_e += [b] * k
        rows_t += list(range(k))
    return torch.tensor(rows_r), torch.tensor(rows_e), torch.tensor(rows_t), turns


def step_anchors(episodes: torch.Tensor, steps: torch.Tensor, state_hashes: list[tuple[str, ...]] | None) -> torch.Tensor:
    """GiGPO's anchor id of every (episode, step) row: steps that acted from the same environment
    state share an id (with the group id, :func:`trainer.advantages.gigpo_advantages` forms the
    step groups).

    episodes, steps (S,) -> (S,) long. The state is the turn's ``state_hashes`` entry. A turn
    without one (empty hash, or no hashes for that sample): step 0 shares anchor 0 (every episode
    of a group starts from the same state), any later step is its own anchor (no step-level
    comparison), as in the paper's fallback where no state repeats.
    """
    ids: dict[str, int] = {"": 0}
    out: list[int] = []
    for row, (e, t) in enumerate(zip(episodes.tolist(), steps.tolist(), strict=True)):
        hashes = state_hashes[e] if state_hashes is not None and e < len(state_hashes) else ()
        h = hashes[t] if t < len(hashes) else ""
        if h:
            out.append(ids.setdefault(h, len(ids)))
        else:
            out.append(0 if t == 0 else -(row + 1))  # unique negative id: its own anchor
    return torch.tensor(out, dtype=torch.long)


def _broadcast_steps(step_adv: torch.Tensor, episodes: torch.Tensor, steps: torch.Tensor,
                     turns: torch.Tensor) -> torch.Tensor:
    """Per-step advantages (S,) onto the tokens of their turn: (B, T), 0 on masked positions."""
    b_count, width = turns.shape
    k = int(steps.max()) + 1 if steps.numel() else 1
    grid = torch.zeros(b_count, k)  # (B, K)
    grid[episodes, steps] = step_adv.float()
    idx = turns.clamp(min=0)  # (B, T)
    return torch.where(turns >= 0, grid.gather(1, idx.clamp(max=k - 1)), torch.zeros(b_count, width))


# --------------------------------------------------------------------------- advantages


def compute_advantages(
    cfg: AlgorithmConfig,
    state: AlgoState,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    kl: torch.Tensor | None = None,
    step_rewards: list[tuple[float, ...]] | None = None,
    state_hashes: list[tuple[str, ...]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """Steps 1–5 of the module doc.

    rewards, group_ids (B,); mask (B, T); values (B, T) for ``gae``; kl (B, T) the per-token
    KL(π ‖ π_ref) estimate when ``add_token_level_kl`` is on; ``step_rewards`` / ``state_hashes``
    per sample (multi-turn: one per agent turn; GiGPO's anchors, :func:`step_anchors`). Returns ``(advantages (B, T),
    returns (B, T) or None, metrics)``; advantages are 0 on masked positions.
    """
    m = (mask > 0).float()  # (B, T)
    r = shape_rewards(cfg, rewards)  # (B,)
    metrics: dict[str, float] = {}
    token_level = cfg.adv_estimator in ("reinforce", "gae")
    beta = state.kl_coef if cfg.add_token_level_kl else 0.0
    if cfg.add_token_level_kl:
        if kl is None:
            raise ValueError("add_token_level_kl needs the per-token KL")
        seq_kl = (kl * m).sum(dim=1)  # (B,)
        metrics["actor/reward_kl"] = float(seq_kl.mean())
        metrics["actor/kl_coef"] = beta
        if not token_level:
            r = r - beta * seq_kl
    mean_type, std_type = resolved_norm(cfg)
    r = normalize(r, group_ids, mean_type, std_type, state)
    if cfg.whiten_rewards:
        r = A.whiten(r, torch.ones_like(r))
    returns = None
    est = cfg.adv_estimator
    if est in ("grpo", "dr_grpo"):
        adv = r.unsqueeze(1) * m  # (B, T)
    elif est == "rloo":
        adv = A.rloo_advantages(r, group_ids).unsqueeze(1) * m
    elif est == "raft":
        keep = A.raft_advantages(r, group_ids, cfg.raft_top_k or None, cfg.raft_min_reward)  # (B,)
        metrics["raft/kept_frac"] = float(keep.mean()) if keep.numel() else 0.0
        adv = keep.unsqueeze(1) * m
    elif est == "reinforce":
        adv = A.reinforce_plus_plus_advantages(
            r, m, kl=kl if cfg.add_token_level_kl else None, kl_coef=beta, gamma=cfg.gamma,
            group_ids=group_ids if cfg.reinforce_baseline else None)
    elif est == "gae":
        if values is None:
            raise ValueError("adv_estimator=gae needs the critic's values")
        last = (m * torch.arange(m.shape[1])).argmax(dim=1)  # (B,) last trained position
        tok_r = torch.zeros_like(m).scatter_(1, last.unsqueeze(1), (r * (m.sum(1) > 0)).unsqueeze(1))  # (B, T)
        if cfg.add_token_level_kl and kl is not None:
            tok_r = tok_r - beta * kl * m
        adv, returns = A.gae_advantages(tok_r, values, m, cfg.gamma, cfg.lam)
        if not cfg.whiten_advantages:  # PPO whitens GAE advantages; the knob below does it once
            adv = A.whiten(adv, m)
    else:  # step_reinforce, gigpo
        step_r, episodes, steps, turns = _step_rows(r, m, step_rewards)
        ep_group = group_ids[episodes]  # (S,)
        if est == "gigpo":
            anchors = step_anchors(episodes, steps, state_hashes)  # (S,)
            step_adv = A.gigpo_advantages(step_r, episodes, steps, ep_group, anchors, cfg.step_reward_gamma,
                                          cfg.episode_reward_weight, cfg.step_reward_weight)
        else:
            ret = A.step_reinforce_returns(step_r, episodes, steps, cfg.step_reward_gamma)  # (S,)
            ep_ret = torch.zeros(r.shape[0]).index_add_(0, episodes, step_r)  # (B,)
            a_ep = A.normalize_rewards(ep_ret, group_ids, "group", "group")[episodes]  # (S,)
            step_adv = cfg.episode_reward_weight * a_ep + cfg.step_reward_weight * A.whiten(ret, torch.ones_like(ret))
        adv = _broadcast_steps(step_adv, episodes, steps, turns)
    if cfg.whiten_advantages:
        adv = A.whiten(adv, m)
    if cfg.advantage_clip is not None:
        adv = adv.clamp(-cfg.advantage_clip, cfg.advantage_clip) * m
    with torch.no_grad():
        metrics["rollout/advantage_mean"] = L._mmean(adv, m)
        metrics["rollout/advantage_abs_mean"] = L._mmean(adv.abs(), m)
    return adv, returns, metrics


# --------------------------------------------------------------------------- masks and weights


def data_masks(
    cfg: AlgorithmConfig, mask: torch.Tensor, rewards: torch.Tensor, group_ids: torch.Tensor, truncated: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """``max_len_mask``, ``difficulty_mask``, ``error_max_len_clip`` on the loss mask.

    mask (B, T); rewards (raw), group_ids, truncated (B,) -> (mask (B, T), metrics).
    """
    m = (mask > 0).float()  # (B, T)
    out = m.clone()
    metrics: dict[str, float] = {}
    if cfg.max_len_mask:
        out = out * (~truncated).float().unsqueeze(1)
        metrics["mask/truncated_frac"] = float(truncated.float().mean()) if truncated.numel() else 0.0
    if cfg.difficulty_mask:
        acc = A.group_mean(rewards.float(), group_ids)  # (B,)
        hard_or_easy = (acc <= cfg.difficulty_low_threshold) | (acc >= cfg.difficulty_high_threshold)  # (B,)
        out = out * (~hard_or_easy).float().unsqueeze(1)
        metrics["mask/difficulty_frac"] = float(hard_or_easy.float().mean()) if acc.numel() else 0.0
    if cfg.error_max_len_clip:
        rank = m.cumsum(dim=1)  # (B, T) 1-based position among trained tokens
        wrong = (rewards <= 0).unsqueeze(1)  # (B, 1)
        out = torch.where(wrong & (rank > cfg.error_max_len_threshold), torch.zeros_like(out), out)
    total = float(m.sum())
    metrics["mask/masked_frac"] = 1.0 - float(out.sum()) / total if total else 0.0
    return out, metrics


def loss_weights(
    cfg: AlgorithmConfig, rewards: torch.Tensor, group_ids: torch.Tensor, response_len: torch.Tensor
) -> torch.Tensor | None:
    """Per-sample loss weights (B,) ≥ 0 with batch mean 1, or ``None`` when none is on.

    ``difficulty_loss_weight``: ``1 − clamp(mean group reward, 0, 1)``; ``length_loss_weight``:
    ``mean length / length``. (Our definitions; ROLL has knobs of the same names.)
    """
    if not (cfg.difficulty_loss_weight or cfg.length_loss_weight):
        return None
    w = torch.ones_like(rewards, dtype=torch.float)  # (B,)
    if cfg.difficulty_loss_weight:
        w = w * (1 - A.group_mean(rewards.float(), group_ids).clamp(0, 1))
    if cfg.length_loss_weight:
        length = response_len.float().clamp(min=1)
        w = w * (length.mean() / length)
    mean = w.mean()
    return w / mean if float(mean) > 0 else w


def off_policy(
    cfg: AlgorithmConfig, mask: torch.Tensor, behaviour_lp: torch.Tensor, proximal_lp: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """The ratio's denominator, importance weights and mask for ``old_logprobs`` / ``off_policy_correction``.

    mask, behaviour_lp (B, T); proximal_lp (B, T) the trainer's recomputed logprobs (needed unless
    ``old_logprobs == "behaviour"``). Returns ``(old_logprobs (B, T), weights (B, T) or None,
    mask (B, T), metrics)``.
    """
    if cfg.old_logprobs == "behaviour":
        return behaviour_lp, None, mask, {}
    if proximal_lp is None:
        raise ValueError("old_logprobs=recompute needs the recomputed logprobs")
    m = (mask > 0).float()
    metrics = {"offpolicy/behav_log_ratio_mean": L._mmean(proximal_lp - behaviour_lp, m)}
    weights = None
    corr = cfg.off_policy_correction
    if corr in ("tis", "decoupled"):
        level = cfg.is_level if corr == "tis" else "token"
        weights, wm = L.tis_weights(proximal_lp, behaviour_lp, m, level, cfg.is_cap)
        metrics.update(wm)
    elif corr == "masked_is":
        m, wm = L.masked_is(proximal_lp, behaviour_lp, m, cfg.is_level, cfg.is_low, cfg.is_high)
        metrics.update(wm)
    return proximal_lp, weights, m, metrics


def update_kl_coef(cfg: AlgorithmConfig, state: AlgoState, seq_kl_mean: float, num_samples: int) -> None:
    """Adaptive KL controller (Ziegler et al. 2019): ``β ← β·(1 + clip(KL/target − 1, ±0.2)·n/horizon)``."""
    if cfg.target_kl is None or not cfg.add_token_level_kl:
        return
    error = min(max(seq_kl_mean / cfg.target_kl - 1.0, -0.2), 0.2)
    state.kl_coef *= 1.0 + error * num_samples / cfg.kl_horizon


# --------------------------------------------------------------------------- the policy loss


def policy_loss(
    cfg: AlgorithmConfig,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The configured ``pg_variant`` with ``loss_agg_mode``.  (B, T) tensors -> (loss, metrics)."""
    agg = cfg.loss_agg_mode
    v = cfg.pg_variant
    if v == "ppo":
        return L.ppo_loss(logprobs, old_logprobs, advantages, mask, cfg.clip_low, cfg.clip_high,
                          cfg.dual_clip_loss, cfg.dual_clip_c, agg, max_len=max_len)
    if v == "gspo":
        return L.gspo_loss(logprobs, old_logprobs, advantages, mask, cfg.clip_low, cfg.clip_high, agg, max_len=max_len)
    if v == "topr":
        return L.topr_loss(logprobs, old_logprobs, advantages, mask, "sequence", agg, max_len=max_len)
    if v == "cispo":
        return L.cispo_loss(logprobs, old_logprobs, advantages, mask, cfg.clip_low, cfg.clip_high, agg, max_len=max_len)
    loss, metrics = L.pg_loss(logprobs, advantages, mask, agg, max_len=max_len)
    with torch.no_grad():
        metrics.update(L._ratio_metrics(torch.exp(logprobs - old_logprobs), logprobs - old_logprobs, mask))
    return loss, metrics


def sample_advantages(cfg: AlgorithmConfig, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """One advantage per sample from rewards alone (B,) -> (B,), for reports such as
    ``replay rescore``: the outcome estimators exactly; for token-level estimators the value of
    the sample's last token with no KL and no critic (``gae``: values 0)."""
    mask = torch.ones(rewards.shape[0], 1)
    state = initial_state(cfg)
    values = torch.zeros_like(mask) if cfg.adv_estimator == "gae" else None
    kl = torch.zeros_like(mask) if cfg.add_token_level_kl else None
    adv, _, _ = compute_advantages(cfg, state, rewards, group_ids, mask, values=values, kl=kl)
    return adv[:, 0]
