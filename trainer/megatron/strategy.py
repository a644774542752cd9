"""``train.strategy: megatron``: :class:`MegatronStrategy`, megatron-core ``GPTModel`` with tensor
parallelism (TP) and data parallelism (DP).

Every rank of the trainer builds one after the default process group exists (world =
``train.ranks``; a single process gets a world-1 group of its own) and calls the
:class:`trainer.strategy.Strategy` methods collectively, in the same order with the same
arguments; rank 0's return values are used. ``train.tensor_parallel`` ranks share one replica;
the ``ranks / tensor_parallel`` replicas are data parallel. What differs from
:class:`~trainer.strategy.TorchStrategy`:

* **Model.** An HF Llama-family model is read once on the CPU, converted to this rank's shard
  (:mod:`trainer.megatron.convert`) and loaded into a ``GPTModel`` (Transformer Engine layers on
  CUDA when importable, the local spec otherwise); :class:`CausalLMView` calls it like an HF causal
  LM with all-gathered logits, so every loss and metric is the torch strategy's own code.
* **Token logprobs.** From the last hidden states and this rank's vocabulary rows, in chunks of
  ``train.logprob_chunk_tokens`` positions, the log-normaliser summed over the TP group
  (:func:`trainer.logprobs.sharded_head_logprobs`): neither whole nor gathered logits are held
  (the exact KL loss, ``kl_loss_type: full``, still gathers them). The warm-up too.
* **Step.** DP replica ``d`` runs micro-batches ``d, d + DP, ...`` with the torch strategy's
  shares; gradients are summed over the DP group, the clipping norm counts each TP-replicated
  parameter once, and ``torch.optim.AdamW`` steps every shard.
* **Weights and checkpoints.** :meth:`MegatronStrategy.export_weights` gathers the TP shards,
  converts them back and global rank 0 writes the torch strategy's HF directory and sha256. A
  checkpoint holds ``model/`` (TP-independent), ``optimizer_tp{r}of{TP}.pt`` per TP rank,
  ``algo_state.msgpack`` and ``trainer_state.pt``; it resumes at the same ``tensor_parallel``.

Refused (one line): a critic, LoRA, pipeline parallelism. The KL reference is a second frozen
``GPTModel``. Design: docs/architecture.md, "Engines and strategies"; docs/scaling.md.
"""

from __future__ import annotations

import importlib.util
import math
import random
import shutil
import warnings
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import torch
import torch.distributed as dist
import torch.nn.functional as F

from schemas.config import ConfigError, RunConfig, resolve_dtype
from trainer.batch import TokenBatch, TrainSample
from trainer.logprobs import sharded_head_logprobs
from trainer.losses import masked_mean
from trainer.megatron import EXTRA_HINT, check_megatron
from trainer.megatron.convert import (
    ModelShape,
    hf_to_mcore,
    mcore_to_hf,
    rope_theta,
    shape_from_hf_config,
    tp_dim,
)
from trainer.sft import SFTExample, sft_batch, sft_loss
from trainer.strategy import TorchStrategy
from weights import copy_state_, publish_dir, read_weights, replace_dir, weights_sha256

SEED = 1234
"""Seed of megatron-core's model-parallel RNG tracker (used only by dropout, which is off)."""


def _import_megatron() -> Any:
    try:
        from megatron.core import parallel_state
    except ImportError as e:
        raise ConfigError(f"config: train.strategy='megatron' needs the megatron extra: {EXTRA_HINT} ({e})") from e
    return parallel_state


class CausalLMView(torch.nn.Module):
    """A ``GPTModel`` called like an HF causal LM: ``view(input_ids=, attention_mask=,
    logits_to_keep=)`` returns an object whose ``logits`` are the full-vocabulary logits
    ``(b, logits_to_keep or l, vocab_size)``, gathered over the TP group (differentiable: the
    backward hands each rank its vocabulary slice). ``attention_mask`` must be right-padded."""

    def __init__(self, gpt: torch.nn.Module, vocab_size: int) -> None:
        super().__init__()
        self.gpt = gpt
        self.vocab_size = vocab_size

    def _inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """``GPTModel``'s position ids (b, l) and causal mask (1, 1, l, l) for right-padded rows."""
        if attention_mask is not None and bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
            raise ValueError("train.strategy=megatron needs right-padded batches")
        b, length = input_ids.shape
        pos = torch.arange(length, device=input_ids.device).unsqueeze(0).expand(b, length)  # (b, l)
        causal = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).triu(1)  # True = masked
        return input_ids, pos, causal.view(1, 1, length, length)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                output_hidden_states: bool = False, logits_to_keep: int = 0, **_: Any) -> Any:
        from megatron.core.parallel_state import get_tensor_model_parallel_group
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        if output_hidden_states:
            raise NotImplementedError("train.strategy=megatron has no hidden-state output (no critic)")
        length = input_ids.shape[1]
        logits = self.gpt(*self._inputs(input_ids, attention_mask))  # (b, l, Vp / tp)
        if logits_to_keep:
            logits = logits[:, length - logits_to_keep:]  # (b, k, Vp / tp)
        group = get_tensor_model_parallel_group()
        full = gather_from_tensor_model_parallel_region(logits.contiguous(), group)  # (b, k, Vp)
        return SimpleNamespace(logits=full[..., : self.vocab_size])  # (b, k, V)

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The last hidden states (b, l, H), after the final norm, the same on every TP rank: the
        ``GPTModel`` without its output layer (its ``post_process`` off for the call)."""
        gpt: Any = self.gpt
        gpt.post_process = False
        try:
            h = gpt(*self._inputs(input_ids, attention_mask))  # (l, b, H)
        finally:
            gpt.post_process = True
        return h.transpose(0, 1)  # type: ignore[no-any-return]

    @property
    def head_weight(self) -> torch.Tensor:
        """This TP rank's rows of the output projection (Vp / tp, H): the output layer's, or the
        word embeddings' when they are tied."""
        gpt: Any = self.gpt
        w = gpt.output_layer.weight
        return w if w is not None else gpt.shared_embedding_or_output_weight()  # type: ignore[no-any-return]


def _ensure_group(cfg: RunConfig, device: torch.device) -> None:
    """A world-1 default process group when none exists (``train.ranks: 1``); check the world size."""
    if not dist.is_initialized():
        if cfg.train.ranks != 1:
            raise RuntimeError(f"train.ranks={cfg.train.ranks}: the default process group must be initialised "
                               "by the multi-rank driver before MegatronStrategy is built")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1, timeout=timedelta(seconds=cfg.train.dist_timeout_s))
    if dist.get_world_size() != cfg.train.ranks:
        raise RuntimeError(f"process group world size {dist.get_world_size()} != train.ranks={cfg.train.ranks}")


_NOISE = ("Apex is not installed", "full scope is deprecated", "When using async grad allreduce")
"""megatron-core warnings that do not apply here (no Apex: torch norms; CUDA-only advice), filtered
once a strategy is built."""

_model_parallel_world: Any = None
"""The default process group megatron-core's groups were created in (by :func:`_init_model_parallel`)."""


def _init_model_parallel(ps: Any, tp: int, timeout_s: float) -> None:
    """megatron-core's groups for TP = ``tp`` in the current default process group. They are
    process-global: one configuration per process at a time, re-created when the default group
    (a new trainer in the same process) or the TP size changed."""
    global _model_parallel_world
    world = dist.group.WORLD
    if ps.model_parallel_is_initialized():
        if _model_parallel_world is world and ps.get_tensor_model_parallel_world_size() == tp:
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp,
                                 distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)))
    _model_parallel_world = world


class MegatronStrategy(TorchStrategy):
    """megatron-core training of an HF Llama-family model on this rank's TP shard (module doc).

    ``device``: this rank's torch device (``cpu``, or its own ``cuda:N``). On the CPU the
    :mod:`~trainer.megatron.cpu_shim` is applied first.
    """

    def __init__(self, cfg: RunConfig, model_dir: str | Path, *, device: str = "cpu") -> None:
        check_megatron(cfg)
        ps = _import_megatron()
        t = cfg.train
        # the torch strategy's set-up (tokenizer, algorithm, lr schedule) with the HF model on the CPU;
        # its weights are converted below and the HF model dropped
        super().__init__(
            model_dir, lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
            micro_batch_size=t.micro_rows, logprob_chunk_tokens=t.logprob_chunk_tokens,
            temperature=cfg.rollout.temperature, algo=cfg.algorithm,
            max_len=cfg.rollout.max_new_tokens, dtype=resolve_dtype(cfg.model.dtype, device),
            total_steps=t.steps, min_lr_ratio=t.min_lr_ratio, lr_warmup_steps=t.lr_warmup_steps, device="cpu",
            skip_zero_advantage=t.skip_zero_advantage, shared_prefix=False,  # its own forward: rows as they are
        )
        self.device = torch.device(device)
        hf_model = self.model
        self.hf_config = hf_model.config
        try:
            self.shape: ModelShape = shape_from_hf_config(self.hf_config)
        except ValueError as e:
            raise ConfigError(f"config: model {model_dir}: {e}") from e
        self.tp = t.tensor_parallel
        why = self.shape.check_tp(self.tp)
        if why:
            raise ConfigError(f"config: model {model_dir}: {why}; choose a train.tensor_parallel that divides it")
        if self.device.type == "cpu":
            from trainer.megatron import cpu_shim

            cpu_shim.apply()
        elif self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        _ensure_group(cfg, self.device)
        _init_model_parallel(ps, self.tp, t.dist_timeout_s)
        for message in _NOISE:
            warnings.filterwarnings("ignore", message=message)
        self.ps = ps
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.tp_group, self.dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        with torch.random.fork_rng(devices=[]):  # (the CPU shim's seeding would reseed the CPU generator)
            model_parallel_cuda_manual_seed(SEED)
        self.transformer_engine = (self.device.type == "cuda"
                                   and importlib.util.find_spec("transformer_engine") is not None)
        gpt = self._build_gpt()
        self._load_hf_state(gpt, hf_model.state_dict())
        del hf_model
        self.model = CausalLMView(gpt, self.shape.vocab_size)
        self.model.train()
        # parameters the global grad norm counts: TP shards, and replicated ones on TP rank 0 only (by
        # convert's split table: without perform_initialization megatron-core does not set its own marks)
        self._counted = {id(p) for n, p in gpt.named_parameters() if tp_dim(n) is not None or self.tp_rank == 0}
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=t.lr, weight_decay=t.weight_decay,
                                           betas=self.betas)

    # ----------------------------------------------------------------- model

    @property
    def gpt(self) -> torch.nn.Module:
        """This rank's ``GPTModel`` shard."""
        return self.model.gpt  # type: ignore[return-value]

    def _build_gpt(self) -> torch.nn.Module:
        """An uninitialised ``GPTModel`` of :attr:`shape` for this rank (weights come from HF)."""
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_local_spec,
            get_gpt_layer_with_transformer_engine_spec,
        )
        from megatron.core.transformer.transformer_config import TransformerConfig

        s, c = self.shape, self.hf_config
        config = TransformerConfig(
            num_layers=s.num_layers, hidden_size=s.hidden_size, num_attention_heads=s.num_heads,
            num_query_groups=s.num_groups, kv_channels=s.head_dim, ffn_hidden_size=s.ffn_size,
            normalization="RMSNorm", layernorm_epsilon=float(c.rms_norm_eps), gated_linear_unit=True,
            activation_func=F.silu, add_bias_linear=False, add_qkv_bias=s.qkv_bias,
            tensor_model_parallel_size=self.tp, use_cpu_initialization=True, perform_initialization=False,
            params_dtype=self.dtype, pipeline_dtype=self.dtype, bf16=self.dtype == torch.bfloat16,
            fp16=self.dtype == torch.float16, gradient_accumulation_fusion=False, bias_activation_fusion=False,
            bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
            persist_layer_norm=False, attention_dropout=0.0, hidden_dropout=0.0,
        )
        spec = (get_gpt_layer_with_transformer_engine_spec() if self.transformer_engine
                else get_gpt_layer_local_spec(normalization="RMSNorm"))
        gpt = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=s.padded_vocab(self.tp),
                       max_sequence_length=int(c.max_position_embeddings), position_embedding_type="rope",
                       rotary_base=rope_theta(c), share_embeddings_and_output_weights=s.tied)
        return gpt.to(self.device)

    @torch.no_grad()
    def _load_hf_state(self, gpt: torch.nn.Module, hf: dict[str, torch.Tensor]) -> None:
        """Load this rank's shard of the HF state ``hf`` into ``gpt`` (every parameter must be set)."""
        shard = hf_to_mcore(hf, self.shape, self.tp_rank, self.tp, fused_norm=self.transformer_engine)
        copy_state_(dict(gpt.named_parameters()), shard, "HF weights converted to megatron")

    def _hf_state(self) -> dict[str, torch.Tensor] | None:
        """The current weights under HF names (on the CPU), gathered over the TP group, on DP
        replica 0's ranks (``None`` on the others)."""
        if self.dp_rank != 0:
            return None
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(self.tp)]
        for name, p in self.gpt.named_parameters():
            dim = tp_dim(name)
            if dim is None or self.tp == 1:
                for s in shards:
                    s[name] = p.detach().cpu()
                continue
            parts = [torch.empty_like(p) for _ in range(self.tp)]
            dist.all_gather(parts, p.detach().contiguous(), group=self.tp_group)
            for s, part in zip(shards, parts, strict=True):
                s[name] = part.cpu()
        return mcore_to_hf(shards, self.shape, fused_norm=self.transformer_engine)

    def init_reference(self, path: str | Path | None = None) -> None:
        """The frozen reference policy: a second ``GPTModel`` with the weights at ``path`` (an HF
        dir) or a copy of the current ones."""
        gpt = self._build_gpt()
        if path is None:
            with torch.no_grad():
                for p, q in zip(gpt.parameters(), self.gpt.parameters(), strict=True):
                    p.copy_(q)
        else:
            self._load_hf_state(gpt, read_weights(path))
        self.ref_model = self._freeze(CausalLMView(gpt, self.shape.vocab_size))

    def init_critic(self) -> None:
        """No critic with megatron (refused by :func:`trainer.megatron.check_megatron`)."""
        if self.algo.critic != "none":
            raise ConfigError(f"config: algorithm.critic={self.algo.critic!r} is not supported with "
                              "train.strategy='megatron'")

    def warmup(self, batches: Iterable[list[SFTExample]], *, lr: float, grad_clip: float) -> list[float]:
        """Supervised warm-up (as :func:`trainer.sft.sft_warmup`: own AdamW at ``lr``, one step per
        batch): every rank runs the whole batch (identical on every DP replica), the gradient
        norm is clipped TP-aware. Returns the losses."""
        params = list(self.model.parameters())
        optimizer = torch.optim.AdamW(params, lr=lr)
        losses = []
        self.model.train()
        for examples in batches:
            batch = sft_batch(examples, self.pad_id)
            if self.chunked_head:
                lp = self._sharded_logprobs(self.model, batch, 1.0)[0]  # (B, L - 1), 0 untrained
                loss = masked_mean(-lp, batch.loss_mask.to(self.device))
            else:
                loss = sft_loss(self.model, batch, chunk=0)
            loss.backward()
            if grad_clip > 0:
                self._clip(params, grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        return losses

    # ----------------------------------------------------------------- token logprobs

    def _parts(self, model: torch.nn.Module) -> tuple[torch.nn.Module, Any] | None:
        """Chunked logprobs for the policy and the reference (:meth:`_head_logprobs`)."""
        return (model, None) if self.chunked_head and isinstance(model, CausalLMView) else None

    def _sharded_logprobs(self, view: CausalLMView, micro: TokenBatch,
                          temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token logprobs and entropies (b, l - 1) at the trained positions (0 elsewhere) from the
        last hidden states and this TP rank's vocabulary rows, ``logprob_chunk_tokens`` positions
        at a time (:func:`trainer.logprobs.sharded_head_logprobs`); and the hidden states (N, H)."""
        ids, attn = micro.input_ids.to(self.device), micro.attention_mask.to(self.device)  # (b, l)
        b, width = ids.shape
        hidden = view.hidden(ids, attn).reshape(b * width, -1)  # (N, H)
        mask = micro.loss_mask.to(self.device) > 0  # (b, l - 1)
        rows, cols = torch.nonzero(mask, as_tuple=True)  # (M,) each
        weight = view.head_weight  # (Vp / tp, H)
        offset = self.tp_rank * weight.shape[0]
        lp_m, ent_m = sharded_head_logprobs(
            hidden, weight, rows * width + cols, ids[rows, cols + 1], temperature, self.logprob_chunk_tokens,
            self.tp_group if self.tp > 1 else None, offset, max(0, min(weight.shape[0], self.shape.vocab_size - offset)))
        zeros = torch.zeros(mask.shape, device=self.device)  # (b, l - 1)
        return zeros.index_put((rows, cols), lp_m), zeros.index_put((rows, cols), ent_m), hidden

    def _head_logprobs(self, parts: tuple[torch.nn.Module, Any], model: torch.nn.Module,
                       micro: TokenBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`_sharded_logprobs` at the rollout temperature, as the torch strategy's."""
        assert isinstance(model, CausalLMView)
        lp, ent, hidden = self._sharded_logprobs(model, micro, self.temperature)
        b, width = micro.input_ids.shape
        return lp, ent, hidden, torch.arange(b * width, device=self.device).view(b, width)

    # ----------------------------------------------------------------- one step

    def _clip(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """Global gradient norm over the model (TP-replicated parameters counted once: on TP rank 0;
        summed over the TP group); scale the gradients by ``min(1, max_norm / (norm + 1e-6))`` as
        ``torch.nn.utils.clip_grad_norm_`` does. Returns the norm (before clipping)."""
        grads = [p.grad for p in params if p.grad is not None]
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for p in params:
            if p.grad is not None and id(p) in self._counted:
                sq += p.grad.detach().float().pow(2).sum()
        if self.tp > 1:
            dist.all_reduce(sq, group=self.tp_group)
        norm = sq.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.detach().mul_(coef.to(g.dtype))
        return norm

    def _reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the gradients over the DP group (one flat all-reduce). A replica that trained no
        micro-batch contributes zeros; when no replica did, the gradients stay ``None``."""
        if self.dp == 1:
            return
        has = torch.tensor([float(any(p.grad is not None for p in params))], device=self.device)
        dist.all_reduce(has, op=dist.ReduceOp.MAX, group=self.dp_group)
        if not has.item():
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()

    def optimizer_step(self) -> dict[str, float]:
        """DP gradient sum, TP-aware global-norm clip (when ``grad_clip > 0``), AdamW at
        :meth:`lr_at`, zero grads; ``step += 1``. Same metrics as the torch strategy's."""
        params = list(self.model.parameters())
        self._reduce_grads(params)
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        norm = self._clip(params, max_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"actor/grad_norm": float(norm), "actor/lr": float(self.optimizer.param_groups[0]["lr"])}

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        """One optimizer step over ``samples`` (every rank passes the whole batch): this DP
        replica's micro-batches, metrics merged over the DP group as the torch strategy merges
        its micro-batches (share-weighted sums, min / max for the ratio extremes)."""
        batch, sums = self.prepare(samples)
        trained, micros = self.micro_batches(batch)
        acc: dict[str, float] = {}
        for micro, share in micros[self.dp_rank :: self.dp]:  # this DP replica's micro-batches
            _merge(acc, {k: (v if k in _EXTREMES else share * v) for k, v in self.backward(micro, share).items()})
        if self.dp > 1:
            parts: list[Any] = [None] * self.dp
            dist.all_gather_object(parts, acc, group=self.dp_group)
            acc = {}
            for part in parts:
                _merge(acc, part)
        sums.update(self.trained_metrics(acc, batch, trained))
        sums.update(self.optimizer_step())
        sums["train/tokens"] = float(batch.num_tokens)
        sums["train/samples"] = float(len(samples))
        return sums

    # ----------------------------------------------------------------- persistence

    def _write_hf(self, path: Path, state: dict[str, torch.Tensor]) -> None:
        """The HF directory of ``state`` at ``path`` (config, generation config, tokenizer, safetensors),
        written as the torch strategy writes it."""
        from transformers import AutoModelForCausalLM, GenerationConfig

        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(self.hf_config, dtype=self.dtype)
        try:
            skeleton.generation_config = GenerationConfig.from_pretrained(str(self.model_dir), local_files_only=True)
        except OSError:
            pass
        skeleton.save_pretrained(path, state_dict={k: v.to(self.dtype) for k, v in state.items()})
        self.tokenizer.save_pretrained(path)

    def _barrier(self) -> None:
        dist.barrier()

    def export_weights(self, path: str | Path) -> tuple[Path, str]:
        """Gather the weights, write them as a complete HF dir at ``path`` (global rank 0, through a
        temporary sibling renamed into place); return it and the sha256 of its safetensors files
        (rank 0; the other ranks return ``""``). Collective."""
        final = Path(path)
        state = self._hf_state()
        checksum = ""
        if dist.get_rank() == 0:
            assert state is not None
            with publish_dir(final) as tmp:
                self._write_hf(tmp, state)
                checksum = weights_sha256(tmp)
        self._barrier()
        return final, checksum

    def _optimizer_file(self, root: Path) -> Path:
        return root / f"optimizer_tp{self.tp_rank}of{self.tp}.pt"

    def save_checkpoint(self, path: str | Path) -> Path:
        """Write the checkpoint (layout in the module doc) through a temporary sibling renamed
        into place by rank 0. Collective."""
        final = Path(path)
        tmp = final.with_name(f".{final.name}.tmp-megatron")
        rank0 = dist.get_rank() == 0
        if rank0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        self._barrier()
        state = self._hf_state()
        if self.dp_rank == 0:
            torch.save(self.optimizer.state_dict(), self._optimizer_file(tmp))
        if rank0:
            assert state is not None
            self._write_hf(tmp / "model", state)
            (tmp / "algo_state.msgpack").write_bytes(msgspec.msgpack.encode(self.algo_state))
            torch.save({"step": self.step, "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
                        "tensor_parallel": self.tp}, tmp / "trainer_state.pt")
        self._barrier()
        if rank0:
            replace_dir(tmp, final)
        self._barrier()
        return final

    def load_checkpoint(self, path: str | Path) -> int:
        """Restore :meth:`save_checkpoint`'s weights, optimizer state, algorithm state, RNG states
        and step (same ``tensor_parallel`` as at saving); return the step."""
        root = Path(path)
        opt_file = self._optimizer_file(root)
        if not opt_file.exists():
            raise ValueError(f"{root} holds no {opt_file.name}: it was not saved by train.strategy=megatron "
                             f"with train.tensor_parallel={self.tp}")
        self._load_hf_state(self.gpt, read_weights(root / "model"))
        self.optimizer.load_state_dict(torch.load(opt_file, map_location=self.device))
        return self._load_run_state(root)


_EXTREMES = {"actor/ratio_min": min, "actor/ratio_max": max}


def _merge(acc: dict[str, float], part: dict[str, float]) -> None:
    """Fold the (already share-weighted) metrics ``part`` into ``acc``: sums, min / max for the ratio extremes."""
    for key, value in part.items():
        pick = _EXTREMES.get(key)
        acc[key] = (pick(acc[key], value) if pick else acc[key] + value) if key in acc else value
