"""Token logprobs from logits: the one definition the strategy's losses and the supervised
warm-up share (and that the rollout engine's behaviour logprobs match, :mod:`rollout.sampling`)."""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits[:, :-1] / T)`` at the next tokens ``input_ids[:, 1:]``.

    logits (B, L, V), input_ids (B, L) -> (B, L - 1) float32. Same distribution as the rollout
    engine's behaviour logprobs (:mod:`rollout.sampling`).
    """
    scaled = logits[:, :-1].float() / temperature  # (B, L - 1, V)
    targets = input_ids[:, 1:].unsqueeze(-1)  # (B, L - 1, 1)
    return scaled.gather(-1, targets).squeeze(-1) - torch.logsumexp(scaled, dim=-1)  # (B, L - 1)
