"""Supervised warm-up: next-token cross-entropy on generated (prompt, answer) pairs.

Before RL the tiny model knows nothing; a short supervised stage on correct solutions teaches it
the answer format and some arithmetic, so sampled groups contain both right and wrong answers
and GRPO gets a signal. The loss is the token mean of ``-log p(target)`` over the answer tokens
only (prompt tokens are context, not targets), at temperature 1, with its own AdamW optimizer
and a constant learning rate. The logprobs come from the last hidden states ``chunk`` positions
at a time (:func:`trainer.logprobs.head_logprobs`) where the model allows it, else from whole
logits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from trainer.batch import TokenBatch, TrainSample, collate
from trainer.logprobs import causal_parts, head_logprobs, last_hidden, token_logprobs
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


def sft_loss(model: torch.nn.Module, batch: TokenBatch, chunk: int = 1024,
             logits: torch.Tensor | None = None) -> torch.Tensor:
    """Token-mean negative log-likelihood of the target tokens of ``batch``: from ``logits`` (the
    model's (B, L, V) on it when the caller ran the forward, e.g. with images); else from the
    hidden states, ``chunk`` positions' logits at a time, where :func:`trainer.logprobs.causal_parts`
    finds a decoder and a head; from whole logits otherwise (or when ``chunk`` is 0)."""
    device = next(model.parameters()).device
    ids, attn = batch.input_ids.to(device), batch.attention_mask.to(device)  # (B, L)
    mask = batch.loss_mask.to(device)  # (B, L - 1)
    parts = causal_parts(model) if chunk and logits is None else None
    if parts is None:
        if logits is None:
            logits = model(input_ids=ids, attention_mask=attn).logits  # (B, L, V)
        return masked_mean(-token_logprobs(logits, ids), mask)
    hidden = last_hidden(model, parts[0], input_ids=ids, attention_mask=attn)  # (B, L, H)
    rows, cols = torch.nonzero(mask > 0, as_tuple=True)  # (M,) each
    lp_m, _ = head_logprobs(hidden.reshape(-1, hidden.shape[-1]), parts[1], rows * ids.shape[1] + cols,
                            ids[rows, cols + 1], 1.0, chunk)  # (M,)
    lp = torch.zeros(mask.shape, device=device).index_put((rows, cols), lp_m)  # (B, L - 1), 0 untrained
    return masked_mean(-lp, mask)


def sft_warmup(
    model: torch.nn.Module,
    batches: Iterable[list[SFTExample]],
    *,
    lr: float,
    pad_id: int,
    grad_clip: float = 1.0,
    weight_decay: float = 0.0,
    chunk: int = 1024,
    on_step: Callable[[int, float], None] | None = None,
    forward: Callable[[list[SFTExample], TokenBatch], torch.Tensor] | None = None,
) -> list[float]:
    """Train ``model`` in place, one AdamW step per batch; return the loss of every step.

    ``on_step(step, loss)`` is called after each step (progress output). ``batches`` must be
    finite: its length is the number of steps. ``chunk``: positions per logits chunk (:func:`sft_loss`).
    ``forward(examples, batch)``: the logits (B, L, V) when the model needs more than the token ids
    (a VLM's images).
    """
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]  # frozen ones (LoRA's base, a frozen tower) get no state
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    losses = []
    for step, examples in enumerate(batches, start=1):
        batch = sft_batch(examples, pad_id)
        loss = sft_loss(model, batch, chunk, forward(examples, batch) if forward is not None else None)
        loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, losses[-1])
    return losses
