"""From the run config (``algorithm.*``) to the tensors of one optimizer step.

The building blocks are the pure functions of :mod:`trainer.advantages` and :mod:`trainer.losses`;
this module composes them in a fixed order for a collated :class:`trainer.batch.TokenBatch`
(``B`` samples, ``T = L − 1`` target positions, ``mask`` (B, T) 1 on trained tokens):

1. **rewards** (B,): clip, scale, shift (:func:`shape_rewards`);
2. **KL in the reward** (``add_token_level_kl``): per token for the token-level estimators,
   ``r − β·Σ_t kl_t`` for the others;
3. **normalisation** (:func:`resolved_norm`, :func:`normalize`), then ``whiten_rewards``;
4. **the estimator** named by ``adv_estimator`` → advantages (B, T);
5. ``whiten_advantages``, ``advantage_clip``;
6. **masks** (:func:`data_masks`, and ``masked_is`` / ``rejection`` in :func:`off_policy`);
7. **weights** ≥ 0 multiplied into the advantages (:func:`loss_weights`, importance weights, ``icepop``);
8. **the policy loss** named by ``pg_variant`` (:func:`policy_loss`).

Estimators and policy losses are registered by name (:mod:`trainer.registry`); the built-in ones
are the short adapters at the end of this module. :class:`AlgoState` carries over between steps
(adaptive KL coefficient, running reward statistics) and is checkpointed. The narrative:
docs/algorithms.md ("Order of operations") and docs/architecture.md ("Algorithms").
"""

from __future__ import annotations

import math

import msgspec
import torch

from schemas.config import AlgorithmConfig, NormType
from trainer import advantages as A
from trainer import losses as L
from trainer import registry
from trainer.registry import Estimate, EstimatorInput

Tensor = torch.Tensor


class AlgoState(msgspec.Struct, kw_only=True):
    """Algorithm state carried across steps (checkpointed)."""

    kl_coef: float
    """Coefficient β of ``add_token_level_kl`` (adapted when ``target_kl_per_token`` is set)."""
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

Norm = NormType


def resolved_norm(cfg: AlgorithmConfig) -> tuple[Norm, Norm]:
    """``(norm_mean_type, norm_std_type)`` in effect (the estimator's defaults when unset)."""
    mean, std = registry.estimator(cfg.adv_estimator).norm
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
    baselines: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """Steps 1–5 of the module doc.

    rewards, group_ids (B,); mask (B, T); values (B, T) for ``gae``; kl (B, T) the per-token
    KL(π ‖ π_ref) estimate when ``add_token_level_kl`` is on; ``step_rewards`` / ``state_hashes``
    per sample (multi-turn: one per agent turn; GiGPO's anchors, :func:`step_anchors`); ``baselines``
    (B,) ReMax's greedy rewards, shaped here as the rewards (step 1). Returns
    ``(advantages (B, T), returns (B, T) or None, metrics)``; advantages are 0 on masked positions.
    """
    est = registry.estimator(cfg.adv_estimator)
    m = (mask > 0).float()  # (B, T)
    kl = None if kl is None else L.where_mask(kl, m)  # what masked positions hold never enters
    values = None if values is None else L.where_mask(values, m)
    r = shape_rewards(cfg, rewards)  # (B,)
    metrics: dict[str, float] = {}
    beta = state.kl_coef if cfg.add_token_level_kl else 0.0
    if cfg.add_token_level_kl:
        if kl is None:
            raise ValueError("add_token_level_kl needs the per-token KL")
        seq_kl = kl.sum(dim=1)  # (B,)
        metrics["actor/reward_kl"] = float(seq_kl.mean())
        metrics["actor/kl_coef"] = beta
        if not est.token_level:
            r = r - beta * seq_kl
    mean_type, std_type = resolved_norm(cfg)
    r = normalize(r, group_ids, mean_type, std_type, state)
    if cfg.whiten_rewards:
        r = A.whiten(r, torch.ones_like(r))
    out = est.fn(cfg, EstimatorInput(r=r, group_ids=group_ids, mask=m, kl=kl if cfg.add_token_level_kl else None,
                                     kl_coef=beta, values=values, step_rewards=step_rewards,
                                     state_hashes=state_hashes,
                                     baselines=None if baselines is None else shape_rewards(cfg, baselines)))
    metrics.update(out.metrics)
    adv = out.advantages  # (B, T)
    if cfg.whiten_advantages:
        adv = A.whiten(adv, m)
    if cfg.advantage_clip is not None:
        adv = adv.clamp(-cfg.advantage_clip, cfg.advantage_clip) * m
    with torch.no_grad():
        metrics["rollout/advantage_mean"] = L._mmean(adv, m)
        metrics["rollout/advantage_abs_mean"] = L._mmean(adv.abs(), m)
    return adv, out.returns, metrics


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
    elif corr == "rejection":
        m, wm = L.rejection_mask(proximal_lp, behaviour_lp, m, cfg.rejection_level, cfg.rejection_divergence,
                                 cfg.rejection_threshold)
        metrics.update(wm)
    elif corr == "icepop":
        weights, wm = L.icepop_weights(proximal_lp, behaviour_lp, m, cfg.icepop_low, cfg.icepop_high)
        metrics.update(wm)
    return proximal_lp, weights, m, metrics


def update_kl_coef(cfg: AlgorithmConfig, state: AlgoState, kl: torch.Tensor, mask: torch.Tensor,
                   num_samples: int) -> None:
    """Adaptive KL controller (Ziegler et al. 2019): ``β ← β·(1 + clip(KL/target − 1, ±0.2)·n/horizon)``
    with ``KL`` the batch's mean per-token KL over the trained tokens and ``target`` =
    ``target_kl_per_token``.  kl, mask (B, T)."""
    if cfg.target_kl_per_token is None or not cfg.add_token_level_kl:
        return
    kl_per_token = L._mmean(kl, mask)
    error = min(max(kl_per_token / cfg.target_kl_per_token - 1.0, -0.2), 0.2)
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
    return registry.loss(cfg.pg_variant)(cfg, logprobs, old_logprobs, advantages, mask, max_len)


def sample_advantages(cfg: AlgorithmConfig, rewards: torch.Tensor, group_ids: torch.Tensor,
                      baselines: torch.Tensor | None = None) -> torch.Tensor:
    """One advantage per sample from rewards alone (B,) -> (B,), for reports such as
    ``replay rescore``: the outcome estimators exactly; for token-level estimators the value of
    the sample's last token with no KL and no critic (``gae``: values 0). ``baselines`` (B,):
    ReMax's greedy rewards."""
    mask = torch.ones(rewards.shape[0], 1)
    state = initial_state(cfg)
    zeros = torch.zeros_like(mask)  # (B, 1) the critic's values and the KL, for the estimators that read them
    adv, _, _ = compute_advantages(cfg, state, rewards, group_ids, mask, values=zeros, kl=zeros, baselines=baselines)
    return adv[:, 0]


# --------------------------------------------------------------------------- advantage estimators by name
# One function each: (cfg, x) -> Estimate, advantages (B, T) 0 on masked positions (outcome
# estimators broadcast one value per sample over its trained tokens).


@registry.advantage_estimator("grpo", norm=("group", "group"))
def _grpo(cfg: AlgorithmConfig, x: EstimatorInput) -> Estimate:
    """GRPO: the group-normalised reward (step 3 does the normalisation)."""
    return Estimate(x.r.unsqueeze(1) * x.mask)  # (B, T)


@registry.advantage_estimator("dr_grpo", norm=("group", "none"))
def _dr_grpo(cfg: AlgorithmConfig, x: EstimatorInput) -> Estimate:
    """Dr. GRPO: the group-centred reward, no std division (step 3)."""
    return Estimate(x.r.unsqueeze(1) * x.mask)  # (B, T)


@registry.advantage_estimator("rloo")
def _rloo(cfg: AlgorithmConfig, x: EstimatorInput) -> Estimate:
    return Estimate(A.rloo_advantages(x.r, x.group_ids).unsqueeze(1) * x.mask)  # (B, T)


@registry.advantage_estimator("raft")
def _raft(cfg: AlgorithmConfig, x: EstimatorInput) -> Estimate:
    keep = A.raft_advantages(x.r, x.group_ids, cfg.raft_top_k or None, cfg.raft_min_reward)  # (B,)
    kept_frac = float(keep.mean()) if keep.numel() else 0.0
    return Estimate(keep.unsqueeze(1) * x.mask, metrics={"raft/kept_frac": kept_frac})


@registry.advantage_estimator("reinforce", token_level=True)
def _reinforce(cfg: AlgorithmConfig, x: EstimatorInput) -> Estimate:
    return Estimate(A.reinforce_plus_plus_advantages(
        x.r, x.mask, kl=x.kl, kl_coef=x.kl_coef, gamma=cfg.gamma,
        group_ids=x.group_ids if cfg.reinforce_baseline else None))


@registry.advantage_estimator("gae", token_level=True)
def _gae(cfg: AlgorithmConfig, x: EstimatorInput) -> Estimate:
    """GAE over token rewards: the outcome on the last trained token, ``−β·kl_t`` on every one."""
    if x.values is None:
        raise ValueError("adv_estimator=gae needs the critic's values")
    m = x.mask  # (B, T)
    last = (m * torch.arange(m.shape[1])).argmax(dim=1)  # (B,) last trained position
    tok_r = torch.zeros_like(m).scatter_(1, last.unsqueeze(1), (x.r * (m.sum(1) > 0)).unsqueeze(1))  # (B, T)
    if x.kl is not None:
        tok_r = tok_r - x.kl_coef * x.kl * m
    adv, returns = A.gae_advantages(tok_r, x.values, m, cfg.gamma, cfg.lam)
    if not cfg.whiten_advantages:  # PPO whitens GAE advantages; the knob does it once (step 5)
        adv = A.whiten(adv, m)
    return Estimate(adv, returns)


@registry.advantage_estimator("step_reinforce")
def _step_reinforce(cfg: AlgorithmConfig, x: EstimatorInput) -> Estimate:
    """Per turn: the episode's group advantage plus the whitened discounted return of the turn."""
    step_r, episodes, steps, turns = _step_rows(x.r, x.mask, x.step_rewards)  # (S,) ×3, (B, T)
    ret = A.step_reinforce_returns(step_r, episodes, steps, cfg.step_reward_gamma)  # (S,)
    ep_ret = torch.zeros(x.r.shape[0]).index_add_(0, episodes, step_r)  # (B,)
    a_ep = A.normalize_rewards(ep_ret, x.group_ids, "group", "group")[episodes]  # (S,)
    step_adv = cfg.episode_reward_weight * a_ep + cfg.step_reward_weight * A.whiten(ret, torch.ones_like(ret))
    return Estimate(_broadcast_steps(step_adv, episodes, steps, turns))


@registry.advantage_estimator("gigpo")
def _gigpo(cfg: AlgorithmConfig, x: EstimatorInput) -> Estimate:
    step_r, episodes, steps, turns = _step_rows(x.r, x.mask, x.step_rewards)  # (S,) ×3, (B, T)
    anchors = step_anchors(episodes, steps, x.state_hashes)  # (S,)
    step_adv = A.gigpo_advantages(step_r, episodes, steps, x.group_ids[episodes], anchors, cfg.step_reward_gamma,
                                  cfg.episode_reward_weight, cfg.step_reward_weight)  # (S,)
    return Estimate(_broadcast_steps(step_adv, episodes, steps, turns))


# --------------------------------------------------------------------------- policy losses by name
# One function each: (cfg, logprobs, old_logprobs, advantages, mask, max_len), all (B, T) -> (loss, metrics).


@registry.policy_loss("ppo")
def _ppo(cfg: AlgorithmConfig, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
         max_len: int | None) -> tuple[Tensor, dict[str, float]]:
    return L.ppo_loss(logprobs, old_logprobs, advantages, mask, cfg.clip_low, cfg.clip_high, cfg.dual_clip_loss,
                      cfg.dual_clip_c, cfg.loss_agg_mode, max_len=max_len)


@registry.policy_loss("gspo")
def _gspo(cfg: AlgorithmConfig, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
          max_len: int | None) -> tuple[Tensor, dict[str, float]]:
    return L.gspo_loss(logprobs, old_logprobs, advantages, mask, cfg.clip_low, cfg.clip_high, cfg.loss_agg_mode,
                       max_len=max_len)


@registry.policy_loss("topr")
def _topr(cfg: AlgorithmConfig, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
          max_len: int | None) -> tuple[Tensor, dict[str, float]]:
    return L.topr_loss(logprobs, old_logprobs, advantages, mask, "sequence", cfg.loss_agg_mode, max_len=max_len)


@registry.policy_loss("cispo")
def _cispo(cfg: AlgorithmConfig, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
           max_len: int | None) -> tuple[Tensor, dict[str, float]]:
    return L.cispo_loss(logprobs, old_logprobs, advantages, mask, cfg.clip_low, cfg.clip_high, cfg.loss_agg_mode,
                        max_len=max_len)


@registry.policy_loss("pg")
def _pg(cfg: AlgorithmConfig, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
        max_len: int | None) -> tuple[Tensor, dict[str, float]]:
    """Plain policy gradient, with the ratio diagnostics of the other losses."""
    loss, metrics = L.pg_loss(logprobs, advantages, mask, cfg.loss_agg_mode, max_len=max_len)
    with torch.no_grad():
        log_ratio = L.clamp_log_ratio(logprobs - old_logprobs)  # (B, T)
        metrics.update(L._ratio_metrics(torch.exp(log_ratio), log_ratio, mask))
    return loss, metrics


# --------------------------------------------------------------------------- newer objectives (issue 37)
# Estimators gpg, opo, pass_at_k, remax; losses sapo, gmpo, clip_cov, kl_cov (the last two choose
# their tokens over the whole batch: :func:`select_tokens` before micro-batching).


@registry.advantage_estimator("gpg")
def _gpg(cfg: AlgorithmConfig, x: EstimatorInput) -> Estimate:
    """GPG: group-centred reward times α = B / B_valid (``norm_std_type: group`` is the paper's F_norm = std)."""
    adv, alpha = A.gpg_advantages(x.r, x.group_ids)  # (B,)
    return Estimate(adv.unsqueeze(1) * x.mask, metrics={"gpg/alpha": alpha})  # (B, T)


@registry.advantage_estimator("opo")
def _opo(cfg: AlgorithmConfig, x: EstimatorInput) -> Estimate:
    """OPO: the group baseline weighted by each sample's trained tokens."""
    return Estimate(A.opo_advantages(x.r, x.group_ids, x.mask.sum(dim=1)).unsqueeze(1) * x.mask)  # (B, T)


@registry.advantage_estimator("pass_at_k")
def _pass_at_k(cfg: AlgorithmConfig, x: EstimatorInput) -> Estimate:
    adv = A.pass_at_k_advantages(x.r, x.group_ids, cfg.pass_k, cfg.pass_k_threshold)  # (B,)
    return Estimate(adv.unsqueeze(1) * x.mask)  # (B, T)


@registry.advantage_estimator("remax")
def _remax(cfg: AlgorithmConfig, x: EstimatorInput) -> Estimate:
    """ReMax (Li et al. 2023): ``A = r − r_greedy``, the reward of the group's greedy response (the
    feeder's extra task, never trained) as baseline. Metric ``remax/baseline_mean``: its mean."""
    if x.baselines is None:
        raise ValueError("adv_estimator=remax needs each sample's greedy baseline reward")
    adv = A.remax_advantages(x.r, x.baselines, x.group_ids)  # (B,)
    return Estimate(adv.unsqueeze(1) * x.mask, metrics={"remax/baseline_mean": float(x.baselines.mean())})  # (B, T)


@registry.policy_loss("sapo")
def _sapo(cfg: AlgorithmConfig, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
          max_len: int | None) -> tuple[Tensor, dict[str, float]]:
    return L.sapo_loss(logprobs, old_logprobs, advantages, mask, cfg.sapo_tau_pos, cfg.sapo_tau_neg,
                       cfg.loss_agg_mode, max_len=max_len)


@registry.policy_loss("gmpo")
def _gmpo(cfg: AlgorithmConfig, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
          max_len: int | None) -> tuple[Tensor, dict[str, float]]:
    return L.gmpo_loss(logprobs, old_logprobs, advantages, mask, cfg.clip_low, cfg.clip_high, cfg.loss_agg_mode,
                       max_len=max_len)


def _clip_cov_select(cfg: AlgorithmConfig, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                     mask: Tensor, generator: torch.Generator) -> Tensor:
    return L.clip_cov_select(logprobs, old_logprobs, advantages, mask, cfg.clip_cov_ratio, cfg.clip_cov_lb,
                             cfg.clip_cov_ub, cfg.clip_low, cfg.clip_high, generator)


@registry.selective_policy_loss("clip_cov", _clip_cov_select)
def _clip_cov(cfg: AlgorithmConfig, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
              max_len: int | None, select: Tensor) -> tuple[Tensor, dict[str, float]]:
    return L.clip_cov_loss(logprobs, old_logprobs, advantages, mask, select, cfg.clip_low, cfg.clip_high,
                           cfg.loss_agg_mode, max_len=max_len)


def _kl_cov_select(cfg: AlgorithmConfig, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                   mask: Tensor, generator: torch.Generator) -> Tensor:
    return L.kl_cov_select(logprobs, advantages, mask, cfg.kl_cov_ratio)


@registry.selective_policy_loss("kl_cov", _kl_cov_select)
def _kl_cov(cfg: AlgorithmConfig, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
            max_len: int | None, select: Tensor) -> tuple[Tensor, dict[str, float]]:
    return L.kl_cov_loss(logprobs, old_logprobs, advantages, mask, select, cfg.kl_cov_coef, cfg.loss_agg_mode,
                         max_len=max_len)


def selects_tokens(cfg: AlgorithmConfig) -> bool:
    """Whether ``pg_variant`` chooses tokens over the whole batch (:func:`select_tokens`)."""
    return registry.selective(cfg.pg_variant) is not None


def select_tokens(
    cfg: AlgorithmConfig, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, seed: int
) -> tuple[Tensor | None, dict[str, float]]:
    """The whole batch's token choice of a selective ``pg_variant`` (``clip_cov``, ``kl_cov``), or
    ``None`` for the others. logprobs (B, T) of the policy at the start of the step; old_logprobs,
    advantages, mask (B, T) as the loss gets them; ``seed`` seeds the random draw (the step number,
    so a resumed or replayed step draws the same tokens). Metric ``loss/cov_selected``: tokens chosen."""
    entry = registry.selective(cfg.pg_variant)
    if entry is None:
        return None, {}
    with torch.no_grad():
        chosen = entry.select(cfg, logprobs, old_logprobs, advantages, mask, torch.Generator().manual_seed(seed))
        cov = L.token_covariance(logprobs, advantages, mask)  # (B, T)
    return chosen, {"loss/cov_selected": float(chosen.sum()), "actor/cov_mean": L._mmean(cov, mask)}


def selective_policy_loss(
    cfg: AlgorithmConfig, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
    max_len: int | None, select: Tensor,
) -> tuple[Tensor, dict[str, float]]:
    """:func:`policy_loss` of a selective ``pg_variant`` with the batch's token choice ``select`` (B, T)
    (rows as the other tensors: a micro-batch's rows of :func:`select_tokens`' result)."""
    entry = registry.selective(cfg.pg_variant)
    if entry is None:
        raise ValueError(f"pg_variant={cfg.pg_variant} chooses no tokens")
    return entry.loss(cfg, logprobs, old_logprobs, advantages, mask, max_len, select)
