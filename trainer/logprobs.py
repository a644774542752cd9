"""Token logprobs: the one definition the strategy's losses and the supervised warm-up share (and
that the rollout engine's behaviour logprobs match, :mod:`rollout.sampling`).

* :func:`token_logprobs`: from whole logits ``(B, L, V)`` (the reference; the models whose
  logits are not ``head(last hidden state)``, Megatron's ``GPTModel``).
* :func:`head_logprobs`: the chosen tokens' logprobs and the entropy from the last hidden states
  and the output projection, in chunks of positions, without ever holding ``(B, L, V)``: the
  forward keeps one chunk's logits at a time and the backward recomputes them chunk by chunk
  (:class:`HeadLogprobs`). Same numbers up to float summation order.
* :func:`causal_parts`: the decoder and the head of a model where that applies;
  :func:`last_hidden`: the decoder's output from a call of the whole model (sharded models).
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


def causal_parts(model: Any) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """The decoder (hidden states) and the output projection of an HF causal LM (a ``PeftModel``
    too) whose logits are exactly ``head(last hidden state)``; ``None`` for any other model (no
    such parts, logit soft-capping or scaling): its logprobs come from whole logits."""
    hf: Any = model.get_base_model() if hasattr(model, "get_base_model") else model
    get_decoder, get_head = getattr(hf, "get_decoder", None), getattr(hf, "get_output_embeddings", None)
    if get_decoder is None or get_head is None:
        return None
    head, config = get_head(), getattr(hf, "config", None)
    if not isinstance(head, torch.nn.Linear) or type(head).forward is not torch.nn.Linear.forward:
        return None
    for key, neutral in (("final_logit_softcapping", None), ("logit_scale", None), ("logits_scaling", 1.0),
                         ("output_multiplier_scale", None)):
        if getattr(config, key, neutral) not in (neutral, None):
            return None
    decoder = get_decoder()
    return (decoder, head) if isinstance(decoder, torch.nn.Module) and decoder is not hf else None


def last_hidden(model: torch.nn.Module, decoder: torch.nn.Module, **inputs: Any) -> torch.Tensor:
    """The last hidden states ``decoder`` gives inside a call of the whole ``model`` on ``inputs``
    (``(b, l, H)``), no logits computed (``logits_to_keep`` = no position). Through the model's
    own forward, so what wraps it runs too: FSDP2's root unit gathers the embedding, final norm
    and head (and keeps them gathered until its backward), a ``PeftModel`` its adapters."""
    box: list[torch.Tensor] = []
    handle = decoder.register_forward_hook(lambda _m, _a, out: box.append(out.last_hidden_state))
    try:
        ids = inputs["input_ids"]
        model(**inputs, logits_to_keep=torch.empty(0, dtype=torch.long, device=ids.device), use_cache=False)
    finally:
        handle.remove()
    return box[-1]


def _all_reduce(x: torch.Tensor, group: Any, op: Any = None) -> torch.Tensor:
    """``x`` reduced over ``group`` in place (nothing without a group)."""
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(x, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return x


class ShardedHeadLogprobs(torch.autograd.Function):
    """:class:`HeadLogprobs` with the vocabulary split over the ranks of ``group`` (Megatron's
    vocabulary-parallel output layer): this rank holds the head's rows ``offset .. offset + v``,
    of which the first ``valid`` are real tokens (the rest pad the vocabulary to a multiple of the
    ranks). hidden (M, H) the same on every rank, weight (v, H) -> lp (M,), entropy (M,) float32.

    Per chunk the log-normaliser ``lse = log Σ_v e^{s_v}`` and ``Σ_v e^{s_v} s_v`` (the entropy
    ``lse − Σ p s``) are summed over the ranks after a max over them; the backward recomputes this
    rank's ``s``, takes ``p = e^{s − lse}`` with the saved ``lse`` and sums the hidden states'
    gradient over the ranks (each rank's is its vocabulary slice's part)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk: int, group: Any, offset: int, valid: int) -> tuple[torch.Tensor, torch.Tensor]:
        import torch.distributed as dist

        m = hidden.shape[0]
        lse = torch.empty(m, dtype=torch.float32, device=hidden.device)  # (M,)
        lp = torch.empty(m, dtype=torch.float32, device=hidden.device)  # (M,)
        ent = torch.empty(m, dtype=torch.float32, device=hidden.device)  # (M,)
        w = weight[:valid]  # (v', H) the real tokens' rows
        with torch.no_grad():
            for s in range(0, m, chunk):
                t = targets[s : s + chunk] - offset  # (c,) this rank's column of the target, if it has it
                mine = (t >= 0) & (t < w.shape[0])  # (c,)
                z = torch.nn.functional.linear(hidden[s : s + chunk], w).float() / temperature  # (c, v')
                top = _all_reduce(z.max(-1).values if w.shape[0] else torch.full(t.shape, -torch.inf,
                                  device=z.device), group, dist.ReduceOp.MAX)  # (c,)
                e = torch.exp(z - top.unsqueeze(-1))  # (c, v')
                zt = torch.where(mine, z.gather(-1, t.clamp(0, max(w.shape[0] - 1, 0)).unsqueeze(-1)).squeeze(-1)
                                 if w.shape[0] else torch.zeros_like(top), 0.0)  # (c,)
                sums = _all_reduce(torch.stack([e.sum(-1), (e * z).sum(-1), zt]), group)  # (3, c)
                lse[s : s + chunk] = top + sums[0].log()
                lp[s : s + chunk] = sums[2] - lse[s : s + chunk]
                ent[s : s + chunk] = lse[s : s + chunk] - sums[1] / sums[0]
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.args = (temperature, chunk, group, offset, valid)
        return lp, ent

    @staticmethod
    def backward(ctx: Any, g_lp: torch.Tensor, g_ent: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        temperature, chunk, group, offset, valid = ctx.args
        w = weight[:valid]  # (v', H)
        g_h = torch.empty_like(hidden)  # (M, H)
        g_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # (v, H), 0 on padding rows
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]  # (c, H)
            t = targets[s : s + chunk] - offset  # (c,)
            mine = (t >= 0) & (t < w.shape[0])  # (c,)
            with torch.no_grad():
                gl, ge = g_lp[s : s + chunk].unsqueeze(-1), g_ent[s : s + chunk].unsqueeze(-1)  # (c, 1)
                logp = torch.nn.functional.linear(h, w).float() / temperature - lse[s : s + chunk, None]  # (c, v')
                p = logp.exp()  # (c, v')
                g = logp.add_(ent[s : s + chunk, None]).mul_(ge).add_(gl).mul_(p).neg_()  # (c, v'): −p (gl + ge (log p + H))
                rows = torch.nonzero(mine).squeeze(-1)  # chunk rows whose target is this rank's
                g[rows, t[rows]] += gl[rows, 0]  # + gl at the target
                g_z = (g / temperature).to(weight.dtype)  # (c, v')
                g_h[s : s + chunk] = g_z @ w  # (c, H) this slice's part
                g_w[:valid] += (g_z.t() @ h).float()  # (v', H)
        _all_reduce(g_h, group)  # the hidden states feed every rank's slice
        return g_h, g_w.to(weight.dtype), None, None, None, None, None, None


def sharded_head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor,
                          temperature: float, chunk: int, group: Any, offset: int,
                          valid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`head_logprobs` for a vocabulary split over ``group`` (:class:`ShardedHeadLogprobs`):
    hidden (N, H), weight (v, H) this rank's rows from ``offset`` (``valid`` of them real),
    positions (M,), targets (M,) -> lp (M,), entropy (M,) float32, the same on every rank."""
    out: tuple[torch.Tensor, torch.Tensor] = ShardedHeadLogprobs.apply(
        hidden[positions], weight, targets, temperature, chunk, group, offset, valid)
    return out
