"""Hugging Face Llama-family weights ↔ megatron-core ``GPTModel`` weights, tensor-parallel aware.

Pure functions on state dicts (no megatron import, no process group): the strategy calls
:func:`hf_to_mcore` once per tensor-parallel rank to build that rank's shard, and
:func:`mcore_to_hf` on every rank's shard (gathered) to get back the HF state that rollout
loads. Both directions are exact (only copies, concatenations and views).

Layout (``h`` hidden size, ``nh`` query heads, ``ng`` key/value heads (query groups), ``d`` head
dim, ``f`` MLP width, ``V`` vocabulary, ``Vp`` padded vocabulary, ``tp`` tensor-parallel size):

* ``linear_qkv.weight``: per query group its ``nh / ng`` query heads, then its key and value
  heads, ``(ng · (nh / ng + 2) · d, h)``; rank ``r`` holds groups ``r · ng / tp ..`` (column
  parallel; ``ng`` and ``nh`` multiples of ``tp``). Optional q/k/v biases (Qwen2) pack the same way.
* ``linear_proj`` (``o_proj``) and ``linear_fc2`` (``down_proj``): row parallel (split on dim 1).
* ``linear_fc1``: ``[gate_r; up_r]``, each rank's slice of ``gate_proj`` then of ``up_proj``
  (column parallel, ``(2 · f / tp, h)``).
* ``embedding.word_embeddings`` and ``output_layer``: vocab parallel, zero-padded to ``Vp`` (the
  next multiple of ``tp``) and split on dim 0; the padding rows never reach a logit the trainer
  uses and are dropped on the way back. Tied embeddings: no ``output_layer.weight`` (and no HF
  ``lm_head.weight``).
* Norm weights are replicated. With Transformer Engine layers the pre-attention and pre-MLP norms
  are fused into the next linear (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``;
  ``fused_norm=True``); with the local spec they are ``input_layernorm.weight`` and
  ``pre_mlp_layernorm.weight``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
"""HF ``model_type`` values this conversion handles (the Llama block: RMSNorm, RoPE, SwiGLU, GQA)."""


@dataclass(frozen=True)
class ModelShape:
    """What the conversion needs to know about the model (read from an HF ``config.json``)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_groups: int
    """Key/value heads (megatron-core: query groups)."""
    head_dim: int
    ffn_size: int
    vocab_size: int
    tied: bool
    """Tied input embeddings and output layer."""
    qkv_bias: bool = False

    def padded_vocab(self, tp: int) -> int:
        """The vocabulary rounded up to a multiple of ``tp``."""
        return -(-self.vocab_size // tp) * tp

    def check_tp(self, tp: int) -> str | None:
        """Why this model cannot be split ``tp`` ways (``None``: it can)."""
        for what, n in (("num_attention_heads", self.num_heads), ("num_key_value_heads", self.num_groups),
                        ("intermediate_size", self.ffn_size)):
            if n % tp:
                return f"{what}={n} is not a multiple of train.tensor_parallel={tp}"
        return None


def shape_from_hf_config(config: Any) -> ModelShape:
    """:class:`ModelShape` of a transformers ``PretrainedConfig``; ``ValueError`` (one line) for a
    model this conversion does not handle."""
    kind = getattr(config, "model_type", "")
    if kind not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type={kind!r} is not supported by train.strategy=megatron "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ValueError(f"rope_type={rope.get('rope_type', rope.get('type'))!r} is not supported by "
                         "train.strategy=megatron (plain RoPE only)")
    if getattr(config, "mlp_bias", False) or getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError("train.strategy=megatron supports the SwiGLU MLP without biases only")
    if kind == "llama" and getattr(config, "attention_bias", False):
        raise ValueError("train.strategy=megatron: Llama attention_bias=true (o_proj bias) is not supported")
    if getattr(config, "use_sliding_window", False):
        raise ValueError("train.strategy=megatron does not support sliding-window attention")
    heads = int(config.num_attention_heads)
    return ModelShape(
        num_layers=int(config.num_hidden_layers), hidden_size=int(config.hidden_size), num_heads=heads,
        num_groups=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
        ffn_size=int(config.intermediate_size), vocab_size=int(config.vocab_size),
        tied=bool(getattr(config, "tie_word_embeddings", False)), qkv_bias=kind == "qwen2",
    )


def rope_theta(config: Any) -> float:
    """RoPE base of an HF config (transformers 5 ``rope_parameters`` or the older ``rope_theta``)."""
    rope = getattr(config, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


# --------------------------------------------------------------------------- tensor pieces


def _shard(t: torch.Tensor, dim: int, rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous 1/``tp`` of ``t`` along ``dim`` (a copy)."""
    return t.chunk(tp, dim=dim)[rank].clone()


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` (V, ...) with zero rows appended up to (rows, ...)."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """HF q (nh·d, ...), k (ng·d, ...), v (ng·d, ...) → megatron's per-group packing
    (ng·(nh/ng + 2)·d, ...); works for weights (..., h) and biases (no trailing dim)."""
    ng, d, per = shape.num_groups, shape.head_dim, shape.num_heads // shape.num_groups
    rest = q.shape[1:]
    qg = q.reshape(ng, per * d, *rest)  # (ng, per·d, ...)
    kg = k.reshape(ng, d, *rest)  # (ng, d, ...)
    vg = v.reshape(ng, d, *rest)  # (ng, d, ...)
    return torch.cat([qg, kg, vg], dim=1).reshape(ng * (per + 2) * d, *rest)


def unpack_qkv(qkv: torch.Tensor, shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_qkv`: (ng·(nh/ng + 2)·d, ...) → q (nh·d, ...), k (ng·d, ...), v (ng·d, ...)."""
    ng, d, per = shape.num_groups, shape.head_dim, shape.num_heads // shape.num_groups
    rest = qkv.shape[1:]
    g = qkv.reshape(ng, (per + 2) * d, *rest)  # (ng, (per + 2)·d, ...)
    q, k, v = g.split([per * d, d, d], dim=1)
    return (q.reshape(ng * per * d, *rest).clone(), k.reshape(ng * d, *rest).clone(),
            v.reshape(ng * d, *rest).clone())


def _norm_names(i: int, fused_norm: bool) -> tuple[str, str]:
    """Megatron names of layer ``i``'s pre-attention and pre-MLP norm weights."""
    q = f"decoder.layers.{i}."
    if fused_norm:
        return q + "self_attention.linear_qkv.layer_norm_weight", q + "mlp.linear_fc1.layer_norm_weight"
    return q + "input_layernorm.weight", q + "pre_mlp_layernorm.weight"


# --------------------------------------------------------------------------- both directions


def hf_to_mcore(hf: Mapping[str, torch.Tensor], shape: ModelShape, rank: int, tp: int,
                fused_norm: bool = False) -> dict[str, torch.Tensor]:
    """Tensor-parallel rank ``rank``'s (of ``tp``) megatron-core ``GPTModel`` state from the HF
    state ``hf`` (``model.*`` / ``lm_head.weight`` names). See the module doc for the layout."""
    vp = shape.padded_vocab(tp)
    out = {
        "embedding.word_embeddings.weight": _shard(pad_rows(hf["model.embed_tokens.weight"], vp), 0, rank, tp),
        "decoder.final_layernorm.weight": hf["model.norm.weight"].clone(),
    }
    if not shape.tied:
        out["output_layer.weight"] = _shard(pad_rows(hf["lm_head.weight"], vp), 0, rank, tp)  # (Vp/tp, h)
    for i in range(shape.num_layers):
        p, q = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = p + "self_attn."
        qkv = pack_qkv(hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], shape)
        out[q + "self_attention.linear_qkv.weight"] = _shard(qkv, 0, rank, tp)  # (ng/tp·(per+2)·d, h)
        if shape.qkv_bias:
            b = pack_qkv(hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], shape)
            out[q + "self_attention.linear_qkv.bias"] = _shard(b, 0, rank, tp)
        out[q + "self_attention.linear_proj.weight"] = _shard(hf[a + "o_proj.weight"], 1, rank, tp)  # (h, nh·d/tp)
        in_norm, mlp_norm = _norm_names(i, fused_norm)
        out[in_norm] = hf[p + "input_layernorm.weight"].clone()
        out[mlp_norm] = hf[p + "post_attention_layernorm.weight"].clone()
        gate = _shard(hf[p + "mlp.gate_proj.weight"], 0, rank, tp)  # (f/tp, h)
        up = _shard(hf[p + "mlp.up_proj.weight"], 0, rank, tp)  # (f/tp, h)
        out[q + "mlp.linear_fc1.weight"] = torch.cat([gate, up])  # (2·f/tp, h)
        out[q + "mlp.linear_fc2.weight"] = _shard(hf[p + "mlp.down_proj.weight"], 1, rank, tp)  # (h, f/tp)
    return out


def mcore_to_hf(shards: Sequence[Mapping[str, torch.Tensor]], shape: ModelShape,
                fused_norm: bool = False) -> dict[str, torch.Tensor]:
    """The HF state from every tensor-parallel rank's megatron-core state (``shards[r]`` = rank
    ``r``'s, ``tp = len(shards)``); inverse of :func:`hf_to_mcore`. Replicated tensors are taken
    from rank 0; the vocabulary padding is dropped."""
    first = shards[0]
    v = shape.vocab_size

    def cat(name: str, dim: int) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=dim)

    out = {
        "model.embed_tokens.weight": cat("embedding.word_embeddings.weight", 0)[:v].clone(),  # (V, h)
        "model.norm.weight": first["decoder.final_layernorm.weight"].clone(),
    }
    if not shape.tied:
        out["lm_head.weight"] = cat("output_layer.weight", 0)[:v].clone()  # (V, h)
    for i in range(shape.num_layers):
        p, q = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = p + "self_attn."
        qkv = cat(q + "self_attention.linear_qkv.weight", 0)  # (ng·(per+2)·d, h)
        out[a + "q_proj.weight"], out[a + "k_proj.weight"], out[a + "v_proj.weight"] = unpack_qkv(qkv, shape)
        if shape.qkv_bias:
            b = cat(q + "self_attention.linear_qkv.bias", 0)
            out[a + "q_proj.bias"], out[a + "k_proj.bias"], out[a + "v_proj.bias"] = unpack_qkv(b, shape)
        out[a + "o_proj.weight"] = cat(q + "self_attention.linear_proj.weight", 1)  # (h, nh·d)
        in_norm, mlp_norm = _norm_names(i, fused_norm)
        out[p + "input_layernorm.weight"] = first[in_norm].clone()
        out[p + "post_attention_layernorm.weight"] = first[mlp_norm].clone()
        halves = [s[q + "mlp.linear_fc1.weight"].chunk(2, dim=0) for s in shards]  # tp × ((f/tp, h), (f/tp, h))
        out[p + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in halves])  # (f, h)
        out[p + "mlp.up_proj.weight"] = torch.cat([u for _, u in halves])  # (f, h)
        out[p + "mlp.down_proj.weight"] = cat(q + "mlp.linear_fc2.weight", 1)  # (h, f)
    return out


TP_DIM = {
    "embedding.word_embeddings.weight": 0, "output_layer.weight": 0, "self_attention.linear_qkv.weight": 0,
    "self_attention.linear_qkv.bias": 0, "self_attention.linear_proj.weight": 1, "mlp.linear_fc1.weight": 0,
    "mlp.linear_fc2.weight": 1,
}
"""Split dimension of every tensor-parallel megatron-core tensor, by name suffix (others are replicated)."""


def tp_dim(name: str) -> int | None:
    """The dimension megatron-core splits tensor ``name`` along (``None``: replicated)."""
    for suffix, dim in TP_DIM.items():
        if name.endswith(suffix):
            return dim
    return None
