"""The engine's fast path: a Llama-family forward pass of our own over a preallocated slot KV cache.

:class:`SlotDecoder` runs the decoder-only Llama-family models that :func:`slot_support` accepts
(``llama``, ``qwen2``; full attention, plain q/k/v/o and gate/up/down projections) for
:class:`rollout.engine.TorchEngine`:

* keys and values of every layer live in two tensors ``(layers, slots, kv_heads, capacity,
  head_dim)``, allocated once; row ``i`` of the batch is slot ``i``, its tokens fill columns
  ``0 .. len_i - 1``, and a decode step writes column ``len_i`` in place;
* eviction moves only the last live rows into the freed slots (:meth:`SlotDecoder.keep` returns
  the new order); admission writes each distinct prompt's keys/values once into every slot that
  has it, and a prefix common to the admission's prompts runs once (:func:`shared_prefix`);
* the forward is the model's own math called directly (its modules' weights, its ``rotary_emb``),
  with q/k/v and gate/up fused into one matmul each (:func:`fuse_linears`: the parameters become
  views of the fused weight, so an in-place weight swap, :func:`weights.copy_weights_`, reaches it);
* on a CUDA device each decode step is replayed as a CUDA graph (``cuda_graphs``; not with
  ``dynamic`` RoPE) over a fixed number of rows (a power of two, padding rows dropped) and every
  cache column; a failed capture falls back to eager steps.

Capacity starts at what the first prompts need (at least 64 columns) and grows by half (multiples
of 64) up to ``max_position_embeddings``; memory is ``2 × layers × slots × kv_heads × capacity ×
head_dim`` elements of the model's dtype. Results equal transformers' forward up to float round-off
(``tests/rollout/test_slot_decoder.py``). Design and measurements: docs/architecture.md, "Engines
and strategies".
"""

from __future__ import annotations

import itertools
import logging
import typing
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger("rollstream.rollout")

SLOT_MODEL_TYPES = ("llama", "qwen2")
"""``config.model_type`` values whose decoder layers :class:`SlotDecoder` computes."""
MIN_CAPACITY = 64
MIN_SHARED_PREFIX = 8
"""The shortest common prompt prefix that :meth:`SlotDecoder.prefill` computes apart: below it, the
extra batch-1 forward costs more per-op overhead than it saves."""


def slot_support(model: Any) -> str:
    """Why :class:`SlotDecoder` cannot run ``model`` ("" when it can)."""
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in SLOT_MODEL_TYPES:
        return f"model_type {kind!r} is not one of {SLOT_MODEL_TYPES}"
    assert cfg is not None
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    if getattr(cfg, "use_sliding_window", False):
        return "sliding-window attention"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return "layers other than full attention"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "not a transformers Llama-style causal LM (model.model.layers, model.model.rotary_emb)"
    if not hasattr(model, "lm_head"):
        return "no lm_head"
    for layer in inner.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or any(
            not isinstance(getattr(attn, n, None), torch.nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "o_proj")
        ) or any(not isinstance(getattr(mlp, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
            return "decoder layers that are not plain Linear q/k/v/o and gate/up/down projections"
        for group in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
            if len({lin.bias is None for lin in group}) > 1:
                return "projections fused together of which only some have a bias"
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            return "query/key norms"
    return ""


def fuse_linears(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for ``linears`` that share an input: their weights concatenated along
    the output dimension, each layer's parameter re-pointed at its rows of it (``param.data`` becomes
    a view). One matmul then computes all of them, and an in-place weight copy into the layers
    (:func:`weights.copy_weights_`) updates the fused weight too: there is no copy to go stale.

    Fusing the same linears again (a second decoder on the same model) returns the first fusion:
    a new one would re-point the parameters away from the tensors the first decoder reads, and
    that decoder would no longer see weight copies."""
    first = linears[0]
    fused = getattr(first, "_rollstream_fused", None)
    if fused is not None and fused[0] == tuple(map(id, linears)):
        weight, bias = fused[1], fused[2]
        starts = [0, *itertools.accumulate(lin.weight.shape[0] for lin in linears)]
        if all(lin.weight.data_ptr() == weight[s].data_ptr() for lin, s in zip(linears, starts, strict=False)):
            return weight, bias  # still the views of that fusion (a move or a reassignment re-fuses)
    weight = torch.cat([lin.weight.detach() for lin in linears])
    biases = [lin.bias for lin in linears]
    bias = torch.cat([b.detach() for b in biases if b is not None]) if all(b is not None for b in biases) else None
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = weight[start : start + rows]
        if bias is not None and lin.bias is not None:
            lin.bias.data = bias[start : start + rows]
        start += rows
    object.__setattr__(first, "_rollstream_fused", (tuple(map(id, linears)), weight, bias))  # a plain attribute
    return weight, bias


def forget_fusions(model: torch.nn.Module) -> None:
    """Drop the fused weights :func:`fuse_linears` keeps on ``model``'s modules, so that a model whose
    parameters moved (the engine's ``release``) holds no tensor on the old device; the next
    :class:`SlotDecoder` fuses again."""
    for module in model.modules():
        module.__dict__.pop("_rollstream_fused", None)


def shared_prefix(prompts: list[list[int]]) -> int:
    """How many leading tokens :meth:`SlotDecoder.prefill` computes once for all of ``prompts``
    (distinct prompts): their longest common prefix, less each prompt's last token (whose logits
    each row needs), or 0 when that is under :data:`MIN_SHARED_PREFIX` tokens or there is one prompt."""
    if len(prompts) < 2:
        return 0
    lo, hi = min(prompts), max(prompts)  # the common prefix of all = that of the lexicographic extremes
    common = next((i for i, (x, y) in enumerate(zip(lo, hi, strict=False)) if x != y), min(len(lo), len(hi)))
    shared = min(common, min(len(p) for p in prompts) - 1)
    return shared if shared >= MIN_SHARED_PREFIX else 0


def _rms_norm(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """transformers' Llama RMSNorm, in float32 and back (the same op order)."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class SlotDecoder:
    """The running batch's keys/values and lengths for :class:`rollout.engine.TorchEngine`
    (see the module doc). Rows are ``0 .. rows - 1`` in the engine's order."""

    def __init__(self, model: Any, slots: int, cuda_graphs: bool = True) -> None:
        cfg = model.config
        self.model = model
        self.inner = model.model
        self.slots = slots
        self.n_heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 1 << 30))
        self.n_layers = len(self.inner.layers)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.keys: torch.Tensor | None = None  # (layers, slots, kv_heads, capacity, head_dim)
        self.values: torch.Tensor | None = None
        self.lens = torch.zeros(0, dtype=torch.long, device=self.device)  # (B,) tokens in the cache per row
        self._host_lens: list[int] = []
        """``lens`` on the host (no device sync to size a step)."""
        rope_type = str(getattr(self.inner.rotary_emb, "rope_type", "default"))
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda" and "dynamic" not in rope_type
        """Whether decode steps replay CUDA graphs (module doc): asked for, on a CUDA device, with a
        fixed RoPE table."""
        self._static_shapes = self.cuda_graphs
        """Whether decode steps run over the fixed shapes that a graph needs (always with graphs; the
        tests set it alone on the CPU to check that math eagerly)."""
        self._graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        """(rows, capacity) -> (its captured ``torch.cuda.CUDAGraph``, the logits tensor it writes)."""
        self._graph_pool: Any = None
        self._static: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        """The graphs' inputs: tokens (slots,), lens (slots,) and the row indices ``0 .. slots - 1``."""
        self.graph_captures = 0
        """CUDA graphs captured so far."""
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin (positions, head_dim)
        self.qkv: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        """Per layer, the fused q/k/v projection (:func:`fuse_linears`)."""
        self.gate_up: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        """Per layer, the fused gate/up projection."""
        self.duplicate_tokens = 0
        """Prompt tokens not prefilled because an identical prompt in the same admission was."""
        self.shared_prefix_tokens = 0
        """Prompt tokens not prefilled because they were the prefix shared by an admission's prompts."""
        with torch.no_grad():
            for layer in self.inner.layers:
                a, mlp = layer.self_attn, layer.mlp
                self.qkv.append(fuse_linears([a.q_proj, a.k_proj, a.v_proj]))
                self.gate_up.append(fuse_linears([mlp.gate_proj, mlp.up_proj]))

    @property
    def rows(self) -> int:
        return int(self.lens.shape[0])

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens :meth:`prefill` did not compute: ``duplicate_tokens + shared_prefix_tokens``."""
        return self.duplicate_tokens + self.shared_prefix_tokens

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[3])

    def _reserve(self, columns: int) -> None:
        """Make room for ``columns`` cache columns per row (growing by half; never beyond the model's positions)."""
        if columns <= self.capacity:
            return
        if columns > self.max_positions:
            raise ValueError(f"a row needs {columns} cache columns, the model has {self.max_positions} positions")
        grown = max(MIN_CAPACITY, self.capacity + self.capacity // 2, columns)
        cap = min(self.max_positions, -(-grown // MIN_CAPACITY) * MIN_CAPACITY)  # a multiple of MIN_CAPACITY
        shape = (self.n_layers, self.slots, self.kv_heads, cap, self.head_dim)
        keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.keys is not None and self.values is not None:
            old = self.capacity
            keys[:, :, :, :old] = self.keys
            values[:, :, :, :old] = self.values
        self.keys, self.values = keys, values
        self._graphs.clear()  # they read the old tensors
        self._graph_pool = None  # a pool whose graphs are all freed is released: the next capture needs a new one

    def _rope(self, h: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's rotary ``cos, sin`` (b, q, head_dim) at ``pos`` (b, q): looked up in a table the
        model's ``rotary_emb`` computed once for every position, unless its RoPE type rescales with
        the sequence length (``dynamic``), which is computed per call as transformers does."""
        rotary = self.inner.rotary_emb
        if "dynamic" in str(getattr(rotary, "rope_type", "default")):
            return typing.cast(tuple[torch.Tensor, torch.Tensor], rotary(h, pos))
        if self._rope_table is None or self._rope_table[0].dtype != h.dtype:
            every = torch.arange(self.max_positions, device=self.device)[None]  # (1, P)
            cos, sin = rotary(h, every)  # (1, P, head_dim)
            self._rope_table = (cos[0], sin[0])
        return self._rope_table[0][pos], self._rope_table[1][pos]

    def _attend(self, qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                bias: torch.Tensor | None, scale: float) -> torch.Tensor:
        """Attention of ``qs`` (b, heads, q, head_dim) over ``k``/``v`` (b, kv_heads, L, head_dim).
        A decode step on the CPU (``bias`` (b, 1, 1, L) float32, 0 or -inf) uses two batched matmuls with the
        query heads grouped per key head: 1.5–2× faster there than SDPA's kernel at these shapes
        (bench/README.md); otherwise SDPA with the boolean ``mask`` (b, 1, q, L)."""
        if bias is None:
            return F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale,
                                                  enable_gqa=self.kv_heads != self.n_heads)
        b, heads, _, d = qs.shape
        grouped = qs.view(b, self.kv_heads, heads // self.kv_heads, d)  # (b, kv_heads, group, head_dim)
        scores = torch.matmul(grouped, k.transpose(-1, -2)).float() * scale  # (b, kv_heads, group, L)
        probs = torch.softmax(scores + bias, dim=-1).to(v.dtype)  # softmax in float32, as SDPA's kernels
        return torch.matmul(probs, v).view(b, heads, 1, d)  # (b, heads, 1, head_dim)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, write: Any,
                 read: Any, last: torch.Tensor) -> torch.Tensor:
        """The model's forward over ``ids`` (b, q) at positions ``pos`` (b, q); ``mask`` (b, 1, q, L) bool
        says which key columns each query sees; ``write(l, k, v)`` stores a layer's new keys/values
        and ``read(l, k, v)`` returns what the layer attends to; the logits (b, V) of the query
        positions ``last`` (b,)."""
        h = self._layers(ids, pos, mask, write, read)  # (b, q, hidden)
        h_last = h[torch.arange(ids.shape[0], device=h.device), last]  # (b, hidden)
        return self.model.lm_head(_rms_norm(h_last, self.inner.norm))  # (b, V)

    def _layers(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, write: Any, read: Any) -> torch.Tensor:
        """The decoder layers of :meth:`_forward`: the hidden states (b, q, hidden) before the final norm."""
        m = self.inner
        h = m.embed_tokens(ids)  # (b, q, hidden)
        cos, sin = self._rope(h, pos)  # (b, q, head_dim) each
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (b, 1, q, head_dim)
        b, q = ids.shape
        bias = None
        if q == 1 and self.device.type == "cpu":
            bias = torch.zeros(mask.shape, device=self.device).masked_fill_(~mask, float("-inf"))  # float32
        heads, kv = self.n_heads, self.kv_heads
        for i, layer in enumerate(m.layers):
            attn, mlp = layer.self_attn, layer.mlp
            x = _rms_norm(h, layer.input_layernorm)  # (b, q, hidden)
            qkv = F.linear(x, *self.qkv[i]).view(b, q, heads + 2 * kv, self.head_dim).transpose(1, 2)
            qk = qkv[:, : heads + kv]  # (b, heads + kv_heads, q, head_dim): the rotary part
            qk = qk * cos + _rotate_half(qk) * sin
            qs, ks, vs = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv :]
            write(i, ks, vs)
            k_all, v_all = read(i, ks, vs)  # (b, kv_heads, L, head_dim)
            o = self._attend(qs, k_all, v_all, mask, bias, attn.scaling)  # (b, heads, q, head_dim)
            o = o.transpose(1, 2).reshape(b, q, -1)
            h = h + F.linear(o, attn.o_proj.weight, attn.o_proj.bias)
            x = _rms_norm(h, layer.post_attention_layernorm)
            gate, up = F.linear(x, *self.gate_up[i]).chunk(2, dim=-1)
            h = h + F.linear(mlp.act_fn(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
        return h

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Append rows for ``prompts``; return the logits (b, V) after each prompt's last token.

        Work that prompts share is computed once (module doc): identical prompts
        are prefilled once and their keys/values copied into each of their slots, and the longest
        prefix common to all the distinct prompts (:func:`shared_prefix`) is prefilled once, at
        batch 1, before the remainders, which attend to it. On an error the batch is unchanged
        except for the new rows' (unused) slots."""
        b, start = len(prompts), self.rows
        if start + b > self.slots:
            raise ValueError(f"{start + b} rows for {self.slots} slots")
        distinct: dict[tuple[int, ...], int] = {}
        which = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]  # (b,): row -> distinct prompt
        uniq = [list(p) for p in distinct]
        u, lens_u = len(uniq), [len(p) for p in uniq]
        shared = shared_prefix(uniq)
        self._reserve(max(lens_u))
        assert self.keys is not None and self.values is not None
        keys, values = self.keys, self.values
        slots = slice(start, start + b)
        gather = None if u == b else torch.tensor(which, device=self.device)  # (b,)

        def spread(x: torch.Tensor) -> torch.Tensor:  # (u, ...) -> (b, ...): each row its prompt's
            return x if gather is None else x[gather]

        prefix: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer, the prefix's (1, kv_heads, c, head_dim) pair
        if shared:
            cols = torch.arange(shared, device=self.device)  # (c,)
            causal = (cols[None, :] <= cols[:, None])[None, None]  # (1, 1, c, c)

            def write_prefix(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
                keys[layer, slots, :, :shared] = k  # the one row, broadcast into every new slot
                values[layer, slots, :, :shared] = v
                prefix.append((k, v))

            self._layers(torch.tensor([uniq[0][:shared]], device=self.device), cols[None], causal, write_prefix,
                         lambda _, k, v: (k, v))
        width = max(lens_u) - shared
        ids = torch.tensor([p[shared:] + [0] * (width - len(p) + shared) for p in uniq], device=self.device)  # (u, w)
        rest = torch.tensor(lens_u, device=self.device) - shared  # (u,) tokens after the prefix
        cols = torch.arange(width, device=self.device)  # (w,)
        own = (cols[None, :] <= cols[:, None])[None] & (cols[None, None, :] < rest[:, None, None])  # (u, w, w)
        mask = torch.cat([own.new_ones(u, width, shared), own], dim=-1) if shared else own  # (u, w, c + w)

        def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            keys[layer, slots, :, shared : shared + width] = spread(k)
            values[layer, slots, :, shared : shared + width] = spread(v)

        def read(layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if not shared:
                return k, v
            pk, pv = prefix[layer]
            return torch.cat([pk.expand(u, -1, -1, -1), k], dim=2), torch.cat([pv.expand(u, -1, -1, -1), v], dim=2)

        logits = self._forward(ids, shared + cols.expand(u, width), mask[:, None], write, read, rest - 1)  # (u, V)
        new_lens = [len(p) for p in prompts]
        self.lens = torch.cat([self.lens, torch.tensor(new_lens, device=self.device)])
        self._host_lens += new_lens
        self.duplicate_tokens += sum(map(len, prompts)) - sum(lens_u)
        self.shared_prefix_tokens += shared * (u - 1)
        return spread(logits)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (B,); return the next logits (B, V)."""
        b = self.rows
        self._reserve(max(self._host_lens) + 1)
        if self._static_shapes:
            logits = self._decode_fixed(tokens, b)
        else:
            logits = self._decode_eager(tokens, b)
        self.lens = self.lens + 1
        self._host_lens = [n + 1 for n in self._host_lens]
        return logits

    def _decode_eager(self, tokens: torch.Tensor, b: int) -> torch.Tensor:
        """A decode step over exactly the ``b`` rows and the columns up to the longest row's new one."""
        return self._step_rows(tokens, self.lens, torch.arange(b, device=self.device), max(self._host_lens) + 1)

    def _step_rows(self, tokens: torch.Tensor, lens: torch.Tensor, rows: torch.Tensor, columns: int) -> torch.Tensor:
        """One decode step of the cache rows ``rows`` (n,) = ``0 .. n - 1``, fed ``tokens`` (n,) at
        positions ``lens`` (n,) (each row's new column), attending over cache columns
        ``0 .. columns - 1`` under the length mask; the logits (n, V). No host sync."""
        assert self.keys is not None and self.values is not None
        keys, values = self.keys, self.values
        n = rows.shape[0]
        mask = torch.arange(columns, device=self.device)[None, :] <= lens[:, None]  # (n, columns)

        def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            keys[layer, rows, :, lens] = k[:, :, 0]  # (n, kv_heads, head_dim) into column lens[i] of row i
            values[layer, rows, :, lens] = v[:, :, 0]

        def read(layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return keys[layer, :n, :, :columns], values[layer, :n, :, :columns]

        return self._forward(tokens[:, None], lens[:, None], mask[:, None, None], write, read, rows * 0)

    def _decode_fixed(self, tokens: torch.Tensor, b: int) -> torch.Tensor:
        """A decode step over the fixed shapes of a CUDA graph (module doc): ``b`` rows padded to a
        power of two, every cache column. Replays (capturing first, if new) that shape's graph when
        :attr:`cuda_graphs`, else runs the same step eagerly."""
        if self._static is None:
            self._static = (torch.zeros(self.slots, dtype=torch.long, device=self.device),
                            torch.zeros(self.slots, dtype=torch.long, device=self.device),
                            torch.arange(self.slots, device=self.device))
        static_tokens, static_lens, _ = self._static
        # the padding rows keep whatever tokens and lengths they last had: lengths below capacity,
        # in free slots, at columns a later row overwrites before reading them (docs/architecture.md)
        static_tokens[:b].copy_(tokens)
        static_lens[:b].copy_(self.lens)
        n = min(self.slots, 1 << (b - 1).bit_length())  # rows the step computes
        if not self.cuda_graphs:
            return self._fixed_step(n)[:b]
        key = (n, self.capacity)
        if key not in self._graphs:
            try:
                self._graphs[key] = self._capture(n)
            except RuntimeError as e:  # e.g. another thread's CUDA call during the capture
                log.warning("CUDA graph capture failed (%s); this engine's decode steps run eagerly from now on", e)
                self.cuda_graphs = self._static_shapes = False
                self._graphs.clear()
                return self._fixed_step(n)[:b]  # the same step again: it rewrites the same keys/values
        graph, logits = self._graphs[key]
        graph.replay()
        return logits[:b].clone()  # the next replay overwrites the graph's own tensor

    def _capture(self, n: int) -> tuple[Any, torch.Tensor]:
        """Run the fixed step for ``n`` rows once eagerly (on a side stream, as CUDA graph capture
        needs; it computes this step, and the replay after the capture writes the same keys/values
        again), then capture it."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._fixed_step(n)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the engine captures on its own thread; CUDA work of the process's other threads
        # (a trainer beside an evaluation engine) neither breaks the capture nor fails because of it
        with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
            logits = self._fixed_step(n)
        self.graph_captures += 1
        return graph, logits

    def _fixed_step(self, n: int) -> torch.Tensor:
        """The decode step of the first ``n`` rows of the static inputs over every cache column:
        the logits (n, V). No shape that depends on the data (graph-capturable)."""
        assert self._static is not None and self.keys is not None
        static_tokens, static_lens, static_rows = self._static
        return self._step_rows(static_tokens[:n], static_lens[:n], static_rows[:n], self.capacity)

    def keep(self, keep: list[int]) -> list[int]:
        """Keep the rows ``keep`` (old indices, ascending), evict the others; return the kept rows'
        old indices in their new order (row ``j`` of the batch is now old row ``order[j]``)."""
        n = len(keep)
        kept = set(keep)
        holes = [i for i in range(n) if i not in kept]  # freed slots that must be filled
        movers = [i for i in keep if i >= n]  # live rows beyond the new end, as many as holes
        order = list(range(n))
        if holes:
            for h, src in zip(holes, movers, strict=True):
                order[h] = src
            if self.keys is not None and self.values is not None:
                dst = torch.tensor(holes, device=self.device)
                srcs = torch.tensor(movers, device=self.device)
                used = max(self._host_lens[i] for i in movers)
                self.keys[:, dst, :, :used] = self.keys[:, srcs, :, :used]
                self.values[:, dst, :, :used] = self.values[:, srcs, :, :used]
        self.lens = self.lens[torch.tensor(order, dtype=torch.long, device=self.device)]
        self._host_lens = [self._host_lens[i] for i in order]
        return order
