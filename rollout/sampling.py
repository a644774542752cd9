"""Sampling parameters and the per-row sampling step of the engines (pure tensor functions).

The behaviour log-probability that the engine reports for a token ``y`` is::

    logprob(y) = log_softmax(logits / T)[y]          # T = the request's temperature

i.e. the log-probability under the *tempered, untruncated* distribution — the same quantity the
trainer computes (``trainer.strategy.token_logprobs`` at the rollout temperature) for the same
weights. Two deliberate differences from "the distribution the token was drawn from":

* ``top_p < 1``: the token is drawn from the nucleus (renormalised), but the reported logprob is
  still the untruncated tempered one, because that is what the trainer can recompute. With
  ``top_p < 1`` the PPO ratio is therefore against the untruncated behaviour policy.
* ``greedy``: the token is the argmax of the logits; its reported logprob is still under
  ``softmax(logits / T)`` (so greedy with ``T = 1`` reports the plain model logprob).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request."""

    max_new_tokens: int = 32
    """Cap on generated tokens (the EOS token counts)."""
    temperature: float = 1.0
    """Softmax temperature T > 0 (also the temperature of the reported logprobs)."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 = no truncation."""
    greedy: bool = False
    """Take the argmax instead of sampling."""
    stop: tuple[str, ...] = ()
    """Stop strings: the request ends (``finish_reason="stop"``) at the token that completes one of
    them in the decoded response; that token is kept. The model's EOS tokens always stop."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} must be > 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")


def tempered_logprobs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits / T)`` in float32.  logits (B, V), temperature (B,) -> (B, V)."""
    return torch.log_softmax(logits.float() / temperature.float().unsqueeze(-1), dim=-1)  # (B, V)


def top_p_mask(logprobs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Boolean mask of the tokens inside each row's nucleus.  logprobs (B, V), top_p (B,) -> (B, V).

    A token is kept when the probability mass of the strictly more likely tokens is below
    ``top_p``; the most likely token is always kept.
    """
    sorted_lp, order = torch.sort(logprobs, dim=-1, descending=True)  # (B, V)
    probs = sorted_lp.exp()  # (B, V)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # (B, V)
    keep_sorted = mass_before < top_p.unsqueeze(-1)  # (B, V)
    keep_sorted[:, 0] = True
    keep = torch.zeros_like(keep_sorted)
    keep.scatter_(-1, order, keep_sorted)
    return keep  # (B, V)


def draw_inverse_cdf(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index per row drawn with probability ``weights / weights.sum()`` by inverse CDF: one
    uniform number per row, a cumulative sum and a binary search.  weights (B, V) >= 0 -> (B,) long.

    Equivalent in distribution to ``torch.multinomial(weights, 1)``, and several times cheaper on a
    large vocabulary on CPU (no per-row normalisation pass, no alias table). Zero-weight entries are
    never drawn (their CDF step is empty)."""
    cdf = torch.cumsum(weights, dim=-1)  # (B, V)
    u = torch.rand(weights.shape[0], 1, generator=generator, device=weights.device) * cdf[:, -1:]  # (B, 1)
    drawn = torch.searchsorted(cdf, u, right=True)  # (B, 1) first index whose CDF exceeds u
    return drawn.clamp_(max=weights.shape[-1] - 1).squeeze(-1)  # (B,)


def sample_next(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    greedy: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row and its behaviour logprob (see the module doc).

    logits (B, V); temperature (B,) float; top_p (B,) float; greedy (B,) bool
    -> tokens (B,) long, logprobs (B,) float32.
    """
    logprobs = tempered_logprobs(logits, temperature)  # (B, V)
    sample_lp = logprobs
    if bool((top_p < 1).any()):
        sample_lp = logprobs.masked_fill(~top_p_mask(logprobs, top_p), float("-inf"))  # (B, V)
    drawn = draw_inverse_cdf(sample_lp.exp(), generator)  # (B,)
    tokens = torch.where(greedy, logits.argmax(dim=-1), drawn)  # (B,)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # (B,), (B,)
