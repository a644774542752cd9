"""Supervised warm-up: next-token cross-entropy on generated (prompt, answer) pairs.

Before RL the tiny model knows nothing; a short supervised stage on correct solutions teaches it
the answer format and some arithmetic, so sampled groups contain both right and wrong answers
and GRPO gets a signal. The loss is the token mean of ``-log p(target)`` over the answer tokens
only (prompt tokens are context, not targets), at temperature 1, with its own AdamW optimizer
and a constant learning rate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from trainer.batch import TokenBatch, TrainSample, collate
from trainer.logprobs import token_logprobs
from trainer.losses import masked_mean


@dataclass(frozen=True)
class SFTExample:
    """A prompt and the tokens the model should produce after it (answer + EOS)."""

    prompt_ids: list[int]
    target_ids: list[int]
    target_mask: list[int] | None = None
    """Which target tokens are trained on (1) or context only (0: a multi-turn demonstration's
    environment turns); ``None`` = all of them."""
    images: tuple[bytes, ...] = ()
    """A visual problem's images (PNG bytes) whose image tokens ``prompt_ids`` hold (a VLM policy)."""


def sft_batch(examples: list[SFTExample], pad_id: int) -> TokenBatch:
    """Collate examples; ``loss_mask`` covers the target tokens (those ``target_mask`` keeps)."""
    return collate(
        [
            TrainSample(e.prompt_ids, e.target_ids, [0.0] * len(e.target_ids),
                        list(e.target_mask) if e.target_mask is not None else [1] * len(e.target_ids), 0.0)
            for e in examples
        ],
        pad_id,
    )


def sft_loss(model: torch.nn.Module, batch: TokenBatch, logits: torch.Tensor | None = None) -> torch.Tensor:
    """Token-mean negative log-likelihood of the target tokens of ``batch`` (``logits``: the model's
    (B, L, V) on it when the caller ran the forward, e.g. with images)."""
    device = next(model.parameters()).device
    ids = batch.input_ids.to(device)
    if logits is None:
        logits = model(input_ids=ids, attention_mask=batch.attention_mask.to(device)).logits  # (B, L, V)
    nll = -token_logprobs(logits, ids)  # (B, L - 1)
    return masked_mean(nll, batch.loss_mask.to(device))


def sft_warmup(
    model: torch.nn.Module,
    batches: Iterable[list[SFTExample]],
    *,
    lr: float,
    pad_id: int,
    grad_clip: float = 1.0,
    weight_decay: float = 0.0,
    on_step: Callable[[int, float], None] | None = None,
    forward: Callable[[list[SFTExample], TokenBatch], torch.Tensor] | None = None,
) -> list[float]:
    """Train ``model`` in place, one AdamW step per batch; return the loss of every step.

    ``on_step(step, loss)`` is called after each step (progress output). ``batches`` must be
    finite: its length is the number of steps. ``forward(examples, batch)``: the logits (B, L, V)
    when the model needs more than the token ids (a VLM's images).
    """
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    losses = []
    for step, examples in enumerate(batches, start=1):
        batch = sft_batch(examples, pad_id)
        loss = sft_loss(model, batch, forward(examples, batch) if forward is not None else None)
        loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, losses[-1])
    return losses
