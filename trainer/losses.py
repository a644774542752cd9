"""Policy / value / regulariser losses and off-policy corrections as pure tensor functions.

Conventions (as in :mod:`trainer.algos`): ``logprobs`` (B, T) of the policy being trained,
``old_logprobs`` (B, T) of the policy that the ratio is taken against (detached), ``advantages``
(B,) per sample or (B, T) per token, ``mask`` (B, T) 1 on trained tokens. Every loss returns
``(loss, metrics)``: a scalar tensor to backprop and a dict of floats with stable names
(``loss/policy``, ``loss/clipfrac``, ``actor/ratio_mean``, ...) computed under ``no_grad``.
Formulas and papers: ``docs/algorithms.md``.
"""

from __future__ import annotations

from typing import Literal

import torch

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
KLKind = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full"]
ISLevel = Literal["token", "sequence", "geometric"]

_MAX_LOG_RATIO = 20.0  # clamp before exp of summed log ratios (overflow guard)


def aggregate(
    loss_mat: torch.Tensor, mask: torch.Tensor, mode: AggMode = "token-mean", max_len: int | None = None
) -> torch.Tensor:
    """Reduce a per-token loss (B, T) over ``mask`` (B, T) to a scalar.

    * ``token-mean``: ``Σ_{b,t} m·ℓ / Σ m`` (DAPO; every token weighs the same).
    * ``seq-mean-token-mean``: mean over sequences of each sequence's token mean (GRPO's original).
    * ``seq-mean-token-sum``: mean over sequences of each sequence's token sum.
    * ``seq-mean-token-sum-norm``: mean over sequences of ``token sum / max_len`` with a constant
      ``max_len`` (default ``T``): Dr. GRPO's length-unbiased aggregation. (verl divides the sum
      over sequences by ``max_len`` without the ``1/B``; here it is a mean over sequences.)

    Sequence means run over sequences with at least one trained token; an all-zero mask gives 0.
    """
    m = (mask > 0).to(loss_mat.dtype)  # (B, T)
    tok_sum = (loss_mat * m).sum(dim=-1)  # (B,)
    tok_cnt = m.sum(dim=-1)  # (B,)
    if mode == "token-mean":
        return tok_sum.sum() / tok_cnt.sum().clamp(min=1)
    seq_valid = (tok_cnt > 0).to(loss_mat.dtype)  # (B,)
    if mode == "seq-mean-token-mean":
        seq = tok_sum / tok_cnt.clamp(min=1)
    elif mode == "seq-mean-token-sum":
        seq = tok_sum
    elif mode == "seq-mean-token-sum-norm":
        seq = tok_sum / float(max_len if max_len is not None else loss_mat.shape[-1])
    else:
        raise ValueError(f"unknown aggregation mode {mode!r}")
    return (seq * seq_valid).sum() / seq_valid.sum().clamp(min=1)


def _adv(advantages: torch.Tensor) -> torch.Tensor:
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages  # (B, 1) or (B, T)


def _mmean(x: torch.Tensor, mask: torch.Tensor) -> float:
    m = (mask > 0).to(x.dtype)
    return float((x * m).sum() / m.sum().clamp(min=1))


def _ratio_metrics(ratio: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    valid = mask > 0
    any_valid = bool(valid.any())
    return {
        "actor/ratio_mean": _mmean(ratio, mask),
        "actor/ratio_min": float(ratio[valid].min()) if any_valid else 1.0,
        "actor/ratio_max": float(ratio[valid].max()) if any_valid else 1.0,
        "actor/approx_kl": _mmean((ratio - 1) - log_ratio, mask),
    }


def ppo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: bool = False,
    dual_clip_c: float = 3.0,
    agg_mode: AggMode = "token-mean",
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017), asymmetric clip (DAPO clip-higher), optional dual clip.

    ``ℓ = max(−A·ρ, −A·clip(ρ, 1−ε_low, 1+ε_high))``; with ``dual_clip`` (Ye et al. 2020) the loss of
    a negative-advantage token is also capped at ``−c·A`` (ratio ≫ 1 cannot blow it up):
    ``ℓ = min(ℓ, −c·A)`` where ``A < 0``. Metrics: ``loss/policy``, ``loss/clipfrac``,
    ``loss/clipfrac_dual``, ``actor/ratio_*``, ``actor/approx_kl``.
    """
    adv = _adv(advantages)  # (B, 1) or (B, T)
    log_ratio = logprobs - old_logprobs  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    pg_loss1 = -adv * ratio  # (B, T)
    pg_loss2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)  # (B, T)
    clipped = torch.maximum(pg_loss1, pg_loss2)  # (B, T)
    pg_losses = clipped
    if dual_clip:
        pg_loss3 = -adv * dual_clip_c  # (B, 1) or (B, T)
        pg_losses = torch.where(adv < 0, torch.minimum(clipped, pg_loss3), clipped)  # (B, T)
    loss = aggregate(pg_losses, mask, agg_mode, max_len)
    with torch.no_grad():
        metrics = {
            "loss/policy": float(loss),
            "loss/clipfrac": _mmean((pg_loss2 > pg_loss1).to(ratio.dtype), mask),
            "loss/clipfrac_dual": _mmean((pg_losses < clipped).to(ratio.dtype), mask),
            **_ratio_metrics(ratio, log_ratio, mask),
        }
    return loss, metrics


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    agg_mode: AggMode = "seq-mean-token-mean",
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025): the PPO clip on a sequence-level ratio.

    ``s_i = exp(mean_{t∈o_i} log ρ_{i,t})`` (geometric mean of token ratios), used per token as
    ``s_{i,t} = sg(s_i) · π_t / sg(π_t)`` (same value, token-wise gradient, the paper's GSPO-token);
    ``ℓ = max(−A·s, −A·clip(s, 1−ε_low, 1+ε_high))``, aggregated per sequence. Differs from PPO in
    that a sequence is clipped as a whole; clip ranges are ~1e-4 since ``s`` is length-normalised.
    """
    adv = _adv(advantages)
    m = (mask > 0).to(logprobs.dtype)  # (B, T)
    log_ratio = logprobs - old_logprobs  # (B, T)
    seq_log_ratio = (log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1)  # (B,)
    log_s = seq_log_ratio.detach().unsqueeze(-1) + logprobs - logprobs.detach()  # (B, T)
    ratio = torch.exp(log_s.clamp(max=_MAX_LOG_RATIO))  # (B, T)
    pg_loss1 = -adv * ratio  # (B, T)
    pg_loss2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)  # (B, T)
    pg_losses = torch.maximum(pg_loss1, pg_loss2)  # (B, T)
    loss = aggregate(pg_losses, mask, agg_mode, max_len)
    with torch.no_grad():
        metrics = {
            "loss/policy": float(loss),
            "loss/clipfrac": _mmean((pg_loss2 > pg_loss1).to(ratio.dtype), mask),
            **_ratio_metrics(ratio, log_s, mask),
        }
    return loss, metrics


def topr_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    level: Literal["token", "sequence"] = "sequence",
    agg_mode: AggMode = "token-mean",
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """TOPR (Le Roux et al. 2025, tapered off-policy REINFORCE).

    ``ℓ = −w·A·log π`` with ``w = 1`` for ``A ≥ 0`` (plain REINFORCE on good samples, no IS) and
    ``w = sg(clip(ρ, 0, 1))`` for ``A < 0`` (truncated ratio: bad samples the policy already left
    are pushed down less). ``level="sequence"`` (the paper) uses the trajectory ratio
    ``exp(Σ_t log ρ_t)``; ``"token"`` the per-token ratio. Unlike PPO there is no clipping of good samples.
    """
    adv = _adv(advantages)  # (B, 1) or (B, T)
    m = (mask > 0).to(logprobs.dtype)
    with torch.no_grad():
        log_ratio = logprobs - old_logprobs  # (B, T)
        if level == "sequence":
            log_ratio = (log_ratio * m).sum(-1, keepdim=True).expand_as(log_ratio)  # (B, T)
        ratio = torch.exp(log_ratio.clamp(max=_MAX_LOG_RATIO))  # (B, T)
        w = torch.where(adv >= 0, torch.ones_like(ratio), ratio.clamp(max=1.0))  # (B, T)
    pg_losses = -w * adv * logprobs  # (B, T)
    loss = aggregate(pg_losses, mask, agg_mode, max_len)
    with torch.no_grad():
        metrics = {
            "loss/policy": float(loss),
            "loss/truncfrac": _mmean(((adv < 0) & (ratio < 1)).to(ratio.dtype), mask),
            **_ratio_metrics(ratio, log_ratio, mask),
        }
    return loss, metrics


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 1.0,
    clip_high: float = 0.28,
    agg_mode: AggMode = "token-mean",
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, 2025): ``ℓ = −sg(clip(ρ, 1−ε_low, 1+ε_high))·A·log π``.

    Clips the importance weight, not the update: unlike PPO every token keeps a gradient (PPO
    zeroes clipped tokens). ``clip_low=1.0`` means no lower bound, as in the paper.
    """
    adv = _adv(advantages)
    with torch.no_grad():
        log_ratio = logprobs - old_logprobs  # (B, T)
        ratio = torch.exp(log_ratio)  # (B, T)
        w = ratio.clamp(min=1.0 - clip_low, max=1.0 + clip_high)  # (B, T)
    pg_losses = -w * adv * logprobs  # (B, T)
    loss = aggregate(pg_losses, mask, agg_mode, max_len)
    with torch.no_grad():
        metrics = {
            "loss/policy": float(loss),
            "loss/clipfrac": _mmean((w != ratio).to(ratio.dtype), mask),
            **_ratio_metrics(ratio, log_ratio, mask),
        }
    return loss, metrics


def pg_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    agg_mode: AggMode = "token-mean",
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Plain policy gradient / REINFORCE (Williams 1992): ``ℓ = −A·log π`` (on-policy, no ratio)."""
    pg_losses = -_adv(advantages) * logprobs  # (B, T)
    loss = aggregate(pg_losses, mask, agg_mode, max_len)
    return loss, {"loss/policy": float(loss.detach())}


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    value_clip: float | None = 0.2,
    agg_mode: AggMode = "token-mean",
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO value loss: ``½·max((V − R)², (V_old + clip(V − V_old, −c, c) − R)²)`` (no clip if ``value_clip`` is None).

    values, old_values, returns, mask (B, T). Metrics: ``loss/value``, ``loss/value_clipfrac``, ``critic/values_mean``.
    """
    vf_losses1 = (values - returns) ** 2  # (B, T)
    if value_clip is None:
        vf_losses = vf_losses1
        vf_losses2 = vf_losses1
    else:
        values_clipped = old_values + torch.clamp(values - old_values, -value_clip, value_clip)  # (B, T)
        vf_losses2 = (values_clipped - returns) ** 2  # (B, T)
        vf_losses = torch.maximum(vf_losses1, vf_losses2)  # (B, T)
    loss = 0.5 * aggregate(vf_losses, mask, agg_mode, max_len)
    with torch.no_grad():
        metrics = {
            "loss/value": float(loss),
            "loss/value_clipfrac": _mmean((vf_losses2 > vf_losses1).to(values.dtype), mask),
            "critic/values_mean": _mmean(values, mask),
        }
    return loss, metrics


def entropy_loss(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    coef: float = 0.0,
    agg_mode: AggMode = "token-mean",
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Entropy bonus as a loss: ``−coef · agg(H)``.  entropy, mask (B, T). Metric ``actor/entropy``."""
    ent = aggregate(entropy, mask, agg_mode, max_len)
    with torch.no_grad():
        metrics = {"actor/entropy": float(ent)}
    return -coef * ent, metrics


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: KLKind = "low_var_kl") -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from sampled-token log-probs (Schulman 2020, "Approximating KL").

    ``kl``/``k1``: ``log π − log π_ref``; ``abs``: ``|log π − log π_ref|``; ``mse``/``k2``:
    ``½(log π − log π_ref)²``; ``low_var_kl``/``k3``: ``e^{−d} + d − 1`` with ``d = log π − log π_ref``,
    clamped to [−10, 10] as in verl; ``full``: exact ``Σ_v p(v)(log p(v) − log q(v))`` where
    ``logprob``/``ref_logprob`` are full log-distributions (B, T, V). Returns (B, T).
    """
    if kind == "full":
        return (logprob.exp() * (logprob - ref_logprob)).sum(-1)  # (B, T)
    d = logprob - ref_logprob  # (B, T)
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return d.abs()
    if kind in ("mse", "k2"):
        return 0.5 * d.square()
    if kind in ("low_var_kl", "k3"):
        return (torch.exp(-d) + d - 1).clamp(min=-10.0, max=10.0)
    raise ValueError(f"unknown kl kind {kind!r}")


def kl_loss(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    mask: torch.Tensor,
    coef: float = 0.0,
    kind: KLKind = "low_var_kl",
    agg_mode: AggMode = "token-mean",
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-to-reference penalty as a loss term (GRPO's ``β·KL``): ``coef · agg(kl_penalty)``. Metric ``actor/kl``."""
    kl = aggregate(kl_penalty(logprob, ref_logprob, kind), mask, agg_mode, max_len)
    with torch.no_grad():
        metrics = {"actor/kl": float(kl)}
    return coef * kl, metrics


# --------------------------------------------------------------------------- off-policy correction


def _level_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: ISLevel) -> torch.Tensor:
    """Token log ratio (B, T) -> per-position log ratio at ``level`` (B, T)."""
    m = (mask > 0).to(log_ratio.dtype)
    if level == "token":
        return log_ratio
    total = (log_ratio * m).sum(-1, keepdim=True)  # (B, 1)
    if level == "sequence":
        return total.clamp(max=_MAX_LOG_RATIO).expand_as(log_ratio)
    if level == "geometric":
        return (total / m.sum(-1, keepdim=True).clamp(min=1)).expand_as(log_ratio)
    raise ValueError(f"unknown IS level {level!r}")


@torch.no_grad()
def tis_weights(
    logprob_old_policy: torch.Tensor,
    logprob_behaviour: torch.Tensor,
    mask: torch.Tensor,
    level: ISLevel = "token",
    cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance sampling (Ionides 2008; Yao et al. 2025 "Your efficient RL framework secretly brings you off-policy RL").

    ``w = min(π_old / μ, cap)`` where ``μ`` is the behaviour (inference engine) policy; the ratio
    is per token, per sequence (product over tokens) or geometric (per-token geometric mean over
    the sequence). Multiply the per-token loss by ``w``. Returns ``w`` (B, T) (0 on masked
    positions, detached) and ``offpolicy/is_ratio_mean``, ``offpolicy/is_ratio_max``, ``offpolicy/truncated_frac``.
    """
    m = (mask > 0).to(logprob_old_policy.dtype)
    ratio = torch.exp(_level_log_ratio(logprob_old_policy - logprob_behaviour, mask, level))  # (B, T)
    w = ratio.clamp(max=cap) * m  # (B, T)
    metrics = {
        "offpolicy/is_ratio_mean": _mmean(ratio, mask),
        "offpolicy/is_ratio_max": float(ratio[mask > 0].max()) if bool((mask > 0).any()) else 1.0,
        "offpolicy/truncated_frac": _mmean((ratio > cap).to(ratio.dtype), mask),
    }
    return w, metrics


@torch.no_grad()
def masked_is(
    logprob_old_policy: torch.Tensor,
    logprob_behaviour: torch.Tensor,
    mask: torch.Tensor,
    level: ISLevel = "token",
    low: float = 0.5,
    high: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Masked importance sampling: drop tokens (or whole sequences) whose ratio ``π_old/μ`` is outside ``[low, high]``.

    Returns the new mask (B, T) (``mask`` with those positions zeroed) and ``offpolicy/masked_frac``
    (share of trained tokens dropped), ``offpolicy/is_ratio_mean``.
    """
    ratio = torch.exp(_level_log_ratio(logprob_old_policy - logprob_behaviour, mask, level))  # (B, T)
    keep = (ratio >= low) & (ratio <= high)  # (B, T)
    new_mask = mask * keep.to(mask.dtype)  # (B, T)
    metrics = {
        "offpolicy/masked_frac": _mmean((~keep).to(ratio.dtype), mask),
        "offpolicy/is_ratio_mean": _mmean(ratio, mask),
    }
    return new_mask, metrics
