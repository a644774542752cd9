"""Token logprobs: the one definition the strategy's losses and the supervised warm-up share (and
that the rollout engine's behaviour logprobs match, :mod:`rollout.sampling`).

* :func:`token_logprobs`: from whole logits ``(B, L, V)`` (the reference; the warm-up, the
  strategies whose model only gives logits).
* :func:`head_logprobs`: the chosen tokens' logprobs and the entropy from the last hidden states
  and the output projection, in chunks of positions, without ever holding ``(B, L, V)``: the
  forward keeps one chunk's logits at a time and the backward recomputes them chunk by chunk
  (:class:`HeadLogprobs`). Same numbers up to float summation order.
"""

from __future__ import annotations

from typing import Any

import torch


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits[:, :-1] / T)`` at the next tokens ``input_ids[:, 1:]``.

    logits (B, L, V), input_ids (B, L) -> (B, L - 1) float32. Same distribution as the rollout
    engine's behaviour logprobs (:mod:`rollout.sampling`).
    """
    scaled = logits[:, :-1].float() / temperature  # (B, L - 1, V)
    targets = input_ids[:, 1:].unsqueeze(-1)  # (B, L - 1, 1)
    return scaled.gather(-1, targets).squeeze(-1) - torch.logsumexp(scaled, dim=-1)  # (B, L - 1)


def _chunk_stats(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, t: torch.Tensor,
                 temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk: ``log_softmax(h W^T + b) / T`` (c, V) float32, the targets' logprobs (c,) and the
    entropies (c,). The logits are computed in the weights' dtype, as the model's head does."""
    logp = torch.log_softmax(torch.nn.functional.linear(h, weight, bias).float() / temperature, dim=-1)  # (c, V)
    lp = logp.gather(-1, t.unsqueeze(-1)).squeeze(-1)  # (c,)
    ent = -(logp.exp() * logp).sum(-1)  # (c,)
    return logp, lp, ent


class HeadLogprobs(torch.autograd.Function):
    """``(lp, entropy) = f(hidden, weight, bias)`` per position, ``chunk`` positions at a time.

    hidden (M, H), weight (V, H), bias (V,) or None, targets (M,) -> lp (M,), entropy (M,) float32.
    With ``s = (h W^T + b) / T``, ``p = softmax(s)``: ``∂lp/∂s = onehot(t) − p`` and
    ``∂H/∂s = −p ⊙ (log p + H)``; the backward recomputes each chunk's ``s`` and applies both.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, temperature: float, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        m = hidden.shape[0]
        lp = torch.empty(m, dtype=torch.float32, device=hidden.device)  # (M,)
        ent = torch.empty(m, dtype=torch.float32, device=hidden.device)  # (M,)
        with torch.no_grad():
            for s in range(0, m, chunk):
                _, lp[s : s + chunk], ent[s : s + chunk] = _chunk_stats(
                    hidden[s : s + chunk], weight, bias, targets[s : s + chunk], temperature)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature, ctx.chunk = temperature, chunk
        return lp, ent

    @staticmethod
    def backward(ctx: Any, g_lp: torch.Tensor, g_ent: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, bias, targets = ctx.saved_tensors
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        g_h = torch.empty_like(hidden) if want_h else None  # (M, H)
        g_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None  # (V, H)
        g_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if want_b else None  # (V,)
        for s in range(0, hidden.shape[0], ctx.chunk):
            h, t = hidden[s : s + ctx.chunk], targets[s : s + ctx.chunk]  # (c, H), (c,)
            with torch.no_grad():
                gl, ge = g_lp[s : s + ctx.chunk].unsqueeze(-1), g_ent[s : s + ctx.chunk].unsqueeze(-1)  # (c, 1)
                g_s = _grad_scores(h, weight, bias, t, gl, ge, ctx.temperature)  # (c, V)
                g_z = (g_s / ctx.temperature).to(weight.dtype)  # (c, V) gradient w.r.t. the logits
                if g_h is not None:
                    g_h[s : s + ctx.chunk] = g_z @ weight  # (c, H)
                if g_w is not None:
                    g_w += (g_z.t() @ h).float()  # (V, H)
                if g_b is not None:
                    g_b += g_z.float().sum(0)  # (V,)
        return (g_h, None if g_w is None else g_w.to(weight.dtype), None if g_b is None else g_b.to(weight.dtype),
                None, None, None)


def _grad_scores(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, t: torch.Tensor,
                 gl: torch.Tensor, ge: torch.Tensor, temperature: float) -> torch.Tensor:
    """``∂(gl·lp + ge·H)/∂s`` of one chunk (c, V) float32: ``gl (onehot(t) − p) − ge p (log p + H)``."""
    logp, _, ent = _chunk_stats(h, weight, bias, t, temperature)  # (c, V), (c,)
    p = logp.exp()  # (c, V)
    g = logp.add_(ent.unsqueeze(-1)).mul_(ge).add_(gl).mul_(p).neg_()  # (c, V): −p (gl + ge (log p + H))
    g.scatter_add_(-1, t.unsqueeze(-1), gl)  # + gl at the target
    return g


def head_logprobs(hidden: torch.Tensor, head: torch.nn.Linear, positions: torch.Tensor, targets: torch.Tensor,
                  temperature: float = 1.0, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """The logprobs of ``targets`` and the entropies of ``softmax(head(hidden[positions]) / T)``.

    hidden (N, H) the last hidden states, positions (M,) rows of ``hidden``, targets (M,) token ids
    -> lp (M,), entropy (M,) float32, differentiable w.r.t. ``hidden`` and ``head``'s parameters;
    neither pass holds more than ``chunk`` positions' logits.
    """
    out: tuple[torch.Tensor, torch.Tensor] = HeadLogprobs.apply(
        hidden[positions], head.weight, head.bias, targets, temperature, chunk)
    return out
