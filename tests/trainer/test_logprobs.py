"""Chunked head logprobs and entropy (:func:`trainer.logprobs.head_logprobs`) against the whole-logits
path (:func:`trainer.logprobs.token_logprobs`, :func:`trainer.losses.entropy_from_logits`): values and
gradients w.r.t. the hidden states, the head's weight and bias, over chunk sizes that do and do not
divide the positions; and the vocabulary-sharded twin (:func:`trainer.logprobs.sharded_head_logprobs`,
Megatron's tensor parallelism) over 1 to 3 shards."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.floats import assert_close
from trainer.logprobs import head_logprobs, sharded_head_logprobs, token_logprobs
from trainer.losses import entropy_from_logits

B, L, H, V = 3, 9, 16, 40


def _setup(seed: int, dtype: torch.dtype = torch.float32, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(B, L, H, generator=g) * 2).to(dtype).requires_grad_()
    head = torch.nn.Linear(H, V, bias=bias).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g))
        if bias:
            head.bias.copy_(torch.randn(V, generator=g))
    ids = torch.randint(0, V, (B, L), generator=g)
    mask = (torch.rand(B, L - 1, generator=g) > 0.3).float()  # (B, L - 1)
    gl, ge = torch.randn(B, L - 1, generator=g), torch.randn(B, L - 1, generator=g)  # upstream gradients
    return hidden, head, ids, mask, gl, ge


def _full(hidden, head, ids, mask, gl, ge, temperature):
    """Today's path: whole logits, log-softmax; the loss Σ mask (gl·lp + ge·H)."""
    logits = head(hidden)  # (B, L, V)
    lp = token_logprobs(logits, ids, temperature)  # (B, L - 1)
    ent = entropy_from_logits(logits[:, :-1] / temperature)  # (B, L - 1)
    return lp, ent, (mask * (gl * lp + ge * ent)).sum()


def _chunked(hidden, head, ids, mask, gl, ge, temperature, chunk):
    rows, cols = torch.nonzero(mask > 0, as_tuple=True)
    lp_m, ent_m = head_logprobs(hidden.reshape(-1, H), head, rows * L + cols, ids[rows, cols + 1], temperature, chunk)
    lp = torch.zeros(B, L - 1).index_put((rows, cols), lp_m)  # (B, L - 1), 0 where the mask is
    ent = torch.zeros(B, L - 1).index_put((rows, cols), ent_m)
    return lp, ent, (mask * (gl * lp + ge * ent)).sum()


def _grads(loss, hidden, head):
    return torch.autograd.grad(loss, [hidden, head.weight] + ([head.bias] if head.bias is not None else []))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), chunk=st.integers(1, 2 * B * L), temperature=st.sampled_from([1.0, 0.7, 1.3]),
       bias=st.booleans())
def test_chunked_equals_full_logits_fp32(seed: int, chunk: int, temperature: float, bias: bool) -> None:
    hidden, head, ids, mask, gl, ge = _setup(seed, bias=bias)
    lp_f, ent_f, loss_f = _full(hidden, head, ids, mask, gl, ge, temperature)
    lp_c, ent_c, loss_c = _chunked(hidden, head, ids, mask, gl, ge, temperature, chunk)
    # a logit is a dot product of H terms (the matmul's blocking differs), a logprob and an entropy
    # reduce V of them: rounding of H + V terms of the logits' size
    size = float(head(hidden).detach().abs().max() / temperature)
    m = mask > 0
    assert_close(lp_c[m].detach(), lp_f[m].detach(), H + V, magnitude=max(size, 1.0))
    assert_close(ent_c[m].detach(), ent_f[m].detach(), H + V, magnitude=max(size, 1.0))
    assert bool((lp_c[~m] == 0).all()) and bool((ent_c[~m] == 0).all())  # masked positions: never computed
    for a, b in zip(_grads(loss_c, hidden, head), _grads(loss_f, hidden, head), strict=True):
        # a weight's gradient sums B·L positions, a hidden state's V vocabulary entries, each after the above
        assert_close(a, b, B * L + H + V)


def test_masked_positions_get_no_gradient() -> None:
    hidden, head, ids, mask, gl, ge = _setup(1)
    mask[:, :] = 0
    mask[1, 4] = 1
    _, _, loss = _chunked(hidden, head, ids, mask, gl, ge, 1.0, 3)
    (g_h, _, _) = _grads(loss, hidden, head)
    others = torch.ones(B, L, dtype=torch.bool)
    others[1, 4] = False
    assert float(g_h[1, 4].abs().sum()) > 0 and bool((g_h[others] == 0).all())


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_bf16_within_round_off(chunk: int) -> None:
    """bf16 weights and hidden states: the logits are computed in bf16 by both paths (then fp32), so
    values agree to fp32 round-off; gradients differ by bf16 round-off of the logits' gradient and
    of the matmuls (the chunked path accumulates the weight's gradient in fp32): a few bf16 ulps."""
    hidden, head, ids, mask, gl, ge = _setup(2, torch.bfloat16)
    lp_f, ent_f, loss_f = _full(hidden, head, ids, mask, gl, ge, 1.0)
    lp_c, ent_c, loss_c = _chunked(hidden, head, ids, mask, gl, ge, 1.0, chunk)
    m = mask > 0
    scale = float(head(hidden).detach().float().abs().max())
    assert torch.allclose(lp_c[m], lp_f[m], atol=V * torch.finfo(torch.float32).eps * scale, rtol=0)
    assert torch.allclose(ent_c[m], ent_f[m], atol=V * torch.finfo(torch.float32).eps * scale, rtol=0)
    bf = torch.finfo(torch.bfloat16).eps  # 2^-7
    for a, b in zip(_grads(loss_c, hidden, head), _grads(loss_f, hidden, head), strict=True):
        # sums of up to B·L (weight) or V (hidden) bf16 products: a few ulps of the largest entry
        assert torch.allclose(a.float(), b.float(), atol=4 * bf * float(b.float().abs().max()), rtol=0)


@pytest.mark.parametrize("tp,chunk", [(1, 4), (2, 5), (3, 64)])
def test_vocabulary_sharded_equals_full_logits(tp: int, chunk: int) -> None:
    """:func:`sharded_head_logprobs` on ``tp`` vocabulary shards (threads joined by a gloo group),
    the vocabulary padded to a multiple of ``tp`` with rows of noise that must be ignored: every
    rank's values and hidden-state gradient, and the shards' weight gradients put together, are
    the whole-logits path's; the padding rows get none."""
    hidden, head, ids, mask, gl, ge = _setup(3, bias=False)
    temperature = 0.8
    lp_f, ent_f, loss_f = _full(hidden, head, ids, mask, gl, ge, temperature)
    g_h, g_w = _grads(loss_f, hidden, head)
    v = -(-V // tp)  # rows per shard
    padded = torch.cat([head.weight.detach(), torch.randn(v * tp - V, H) * 5])  # (v·tp, H)
    rows, cols = torch.nonzero(mask > 0, as_tuple=True)
    store, got = dist.HashStore(), {}

    def rank(r: int) -> None:
        group = dist.ProcessGroupGloo(store, r, tp) if tp > 1 else None
        h = hidden.detach().clone().requires_grad_()
        w = padded[r * v : (r + 1) * v].clone().requires_grad_()  # (v, H)
        lp_m, ent_m = sharded_head_logprobs(h.reshape(-1, H), w, rows * L + cols, ids[rows, cols + 1], temperature,
                                            chunk, group, r * v, max(0, min(v, V - r * v)))
        lp, ent = torch.zeros(B, L - 1).index_put((rows, cols), lp_m), torch.zeros(B, L - 1).index_put((rows, cols), ent_m)
        (mask * (gl * lp + ge * ent)).sum().backward()
        got[r] = (lp.detach(), ent.detach(), h.grad, w.grad)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(tp))
    size = max(float(head(hidden).detach().abs().max() / temperature), 1.0)
    m = mask > 0
    for lp, ent, h_grad, _ in got.values():
        assert_close(lp[m], lp_f[m].detach(), H + V, magnitude=size)
        assert_close(ent[m], ent_f[m].detach(), H + V, magnitude=size)
        assert_close(h_grad, g_h, B * L + H + V)  # the sum over the shards' parts
    w_grad = torch.cat([got[r][3] for r in range(tp)])  # (v·tp, H)
    assert_close(w_grad[:V], g_w, B * L + H + V)
    assert bool((w_grad[V:] == 0).all())
