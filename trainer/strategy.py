"""Training strategies behind one :class:`Strategy` protocol, and the single-process
:class:`TorchStrategy`.

``TorchStrategy`` holds a transformers causal LM and an AdamW optimizer and, only when the config
needs them, a frozen reference model (a KL term is on) and a critic (``adv_estimator: gae``). One
optimizer step (:meth:`TorchStrategy.train_step`) over a batch of :class:`trainer.batch.TrainSample`:
collate (right-padded); the no-grad passes the config needs (recomputed logprobs, reference
logprobs, critic values); :meth:`TorchStrategy.prepare` (advantages, masks and weights,
:mod:`trainer.algorithm`); per micro-batch of ``micro_batch_size`` samples, forward, the losses
scaled by the micro-batch's share of the batch's tokens or sequences, ``backward()`` (rows whose
gradient is exactly zero are skipped with ``skip_zero_advantage``); then clip the global gradient
norm, ``optimizer.step()``, ``step += 1`` and adapt the KL coefficient. With the default
``old_logprobs: behaviour`` the ratio's denominator is the rollout engine's behaviour logprob.

Weights are published by :meth:`TorchStrategy.export_weights` as a complete Hugging Face directory
(config, safetensors, tokenizer) through :func:`weights.publish_dir`, with the sha256 of its
safetensors files (:func:`weights.weights_sha256`). Checkpoints add the optimizer state, the
critic, the algorithm state, the RNG states and the step.

LoRA (``train.lora_rank > 0``): the policy is wrapped with ``peft`` and only the adapters train;
the published weights are merged (``W + lora_alpha / lora_rank · B @ A``) under the plain model's
names, and the KL reference is the policy with its adapters disabled while the reference weights
equal the base weights. The whole step, windowed episodes and LoRA in detail:
docs/architecture.md, "Engines and strategies".
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol, runtime_checkable

import msgspec
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from schemas.config import AlgorithmConfig, RunConfig, TrainConfig, resolve_dtype
from trainer import algorithm as alg
from trainer import losses as L
from trainer.batch import (
    Segment,
    TokenBatch,
    TrainSample,
    collate,
    merge_rows,
    segment_layout,
    shared_prefix_layout,
    split_rows,
)
from trainer.logprobs import causal_parts, head_logprobs, token_logprobs
from trainer.losses import entropy_from_logits, masked_mean
from trainer.sft import SFTExample, sft_warmup
from trainer.vlm import ImageSource, RowImages, is_vlm, vision_parameters, vision_tower_prefix, vlm_forward
from weights import (
    copy_state_,
    copy_weights_,
    load_weights_into,
    publish_dir,
    read_weights,
    weights_match,
    weights_sha256,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

ADAPTER = "default"
"""Name of the (single) peft adapter."""


@runtime_checkable
class Strategy(Protocol):
    """What the services (:mod:`services.trainer`, and replay through it) call on a
    training backend: exactly these members, nothing else."""

    step: int
    """Optimizer steps taken (the number of the next step)."""

    tokenizer: Any
    """The model's Hugging Face tokenizer (prompts and warm-up targets are encoded with it)."""

    def warmup(self, batches: Iterable[list[SFTExample]], *, lr: float, grad_clip: float) -> list[float]:
        """Supervised warm-up of the policy, one step per batch (own optimizer); return the
        losses. The policy is left in training mode."""
        ...

    def init_reference(self, path: str | Path | None = None) -> None:
        """Load the frozen reference policy (the weights at ``path``, or a copy of the current ones)."""
        ...

    def init_critic(self) -> None:
        """Create the critic the algorithm asks for (none: no-op)."""
        ...

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        """One full optimizer step over ``samples`` (micro-batched); its metrics."""
        ...

    def save_checkpoint(self, path: str | Path) -> Path:
        """Everything needed to resume (weights, optimizer, critic, algorithm state, RNG, step)."""
        ...

    def load_checkpoint(self, path: str | Path) -> int:
        """Restore :meth:`save_checkpoint`'s state; return the step."""
        ...

    def export_weights(self, path: str | Path) -> tuple[Path, str]:
        """Write the weights as a complete HF directory; return it and its sha256."""
        ...


# --------------------------------------------------------------------------- pure helpers


def _is_lora_key(key: str) -> bool:
    return any(part.startswith("lora_") for part in key.split("."))


def _plain_key(key: str) -> str:
    """The plain model's name of a peft-injected model's state key (``q_proj.base_layer.weight``
    → ``q_proj.weight``)."""
    return key.replace(".base_layer.", ".")


def _lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    """The peft LoRA layers of ``model`` by module name."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def _merged_weight(layer: Any) -> torch.Tensor:
    """``W + scale · B @ A`` of one LoRA layer, in ``W``'s dtype (a new tensor; ``W`` is untouched).
    For float32 weights this is bitwise what ``peft``'s ``merge_adapter`` writes."""
    w = layer.get_base_layer().weight
    delta = layer.get_delta_weight(ADAPTER)
    if w.dtype == torch.float32:
        return w + delta.float()
    return (w.float() + delta.float()).to(w.dtype)


def wrap_lora(model: torch.nn.Module, rank: int, alpha: float, dropout: float, targets: Sequence[str]) -> Any:
    """``model`` wrapped by ``peft.get_peft_model`` with a LoRA adapter (``bias="none"``,
    ``CAUSAL_LM``): only the adapters are trainable. Adapters on a tied weight are refused (the
    merged export could not keep the tie). A vision-language model gets adapters on its language
    side only (:func:`language_targets`)."""
    try:
        from peft import LoraConfig, TaskType, get_peft_model
    except ImportError as e:  # pragma: no cover - peft is installed with the dev environment
        raise ImportError("train.lora_rank > 0 needs the peft package (pip install peft)") from e
    config = LoraConfig(r=rank, lora_alpha=alpha,  # type: ignore[arg-type]  # (annotated int; scale = alpha / r)
                        lora_dropout=dropout, target_modules=language_targets(model, targets), bias="none",
                        task_type=TaskType.CAUSAL_LM)
    peft_model = get_peft_model(model, config)
    ptrs: dict[int, int] = {}
    for _, p in peft_model.get_base_model().named_parameters(remove_duplicate=False):
        ptrs[p.data_ptr()] = ptrs.get(p.data_ptr(), 0) + 1
    for name, layer in _lora_layers(peft_model).items():
        if ptrs.get(layer.get_base_layer().weight.data_ptr(), 0) > 1:
            raise ValueError(f"LoRA target {name!r} has a weight tied to another parameter (tied embeddings); "
                             "leave it out of train.lora_target_modules")
    return peft_model


def language_targets(model: torch.nn.Module, targets: Sequence[str]) -> list[str]:
    """``targets`` (module name suffixes, ``peft``'s ``target_modules``) for a text model; for a
    vision-language model the full names of the modules they match (as ``peft`` matches: the name, or
    a dotted suffix of it) outside the vision tower, so the tower's modules of the same names get no
    adapter. ``ValueError`` when they match no module of the language model."""
    prefix = vision_tower_prefix(model)
    if prefix is None:
        return list(targets)
    names = [n for n, m in model.named_modules() if n and not n.startswith(prefix) and not list(m.children())
             and any(n == t or n.endswith("." + t) for t in targets)]
    if not names:
        raise ValueError(f"train.lora_target_modules {list(targets)} name no module of the language model")
    return names


class _AdaptersDisabled(torch.nn.Module):
    """The LoRA policy with its adapters disabled (``peft``'s ``disable_adapter``), in eval mode
    and without gradients: the base model, used as the KL reference without a copy of the
    weights. It holds the policy outside its own module tree, so it owns no parameters."""

    def __init__(self, peft_model: Any) -> None:
        super().__init__()
        self._policy = [peft_model]  # a list, not a submodule: its parameters stay the policy's

    @property
    def policy(self) -> Any:
        """The ``PeftModel`` this reference is (adapters on outside :meth:`adapters_off`)."""
        return self._policy[0]

    @contextlib.contextmanager
    def adapters_off(self) -> Iterator[None]:
        """The policy in eval mode, without gradients and with its adapters disabled."""
        model = self._policy[0]
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), model.disable_adapter():
                yield
        finally:
            model.train(was_training)

    def forward(self, **kwargs: Any) -> Any:
        with self.adapters_off():
            return self._policy[0](**kwargs)


def strategy_kwargs(cfg: RunConfig, device: str) -> dict[str, Any]:
    """The :class:`trainer.strategy.TorchStrategy` keyword arguments ``cfg`` gives, for ``device``
    (a concrete torch device; ``model.dtype: auto`` resolves for it)."""
    return dict(
        lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, grad_clip=cfg.train.grad_clip,
        micro_batch_size=cfg.train.micro_rows, micro_batch_tokens=cfg.train.micro_batch_tokens,
        logprob_chunk_tokens=cfg.train.logprob_chunk_tokens, temperature=cfg.rollout.temperature,
        algo=cfg.algorithm, max_len=cfg.rollout.max_new_tokens, dtype=resolve_dtype(cfg.model.dtype, device),
        total_steps=cfg.train.steps, min_lr_ratio=cfg.train.min_lr_ratio,
        lr_warmup_steps=cfg.train.lr_warmup_steps, device=device,
        lora_rank=cfg.train.lora_rank, lora_alpha=cfg.train.lora_alpha, lora_dropout=cfg.train.lora_dropout,
        lora_target_modules=cfg.train.lora_target_modules, skip_zero_advantage=cfg.train.skip_zero_advantage,
        freeze_vision=cfg.train.freeze_vision, shared_prefix=cfg.train.shared_prefix,
    )


# --------------------------------------------------------------------------- strategy


LOSS_METRICS = ("loss/policy", "loss/total")
"""Micro-batch metrics that are the loss itself: share-weighted, they sum to the whole batch's loss."""
EXTREME_METRICS = ("actor/ratio_min", "actor/ratio_max")
"""Micro-batch metrics merged by minimum / maximum, not by share-weighted sum."""


def first_trained_col(batch: TokenBatch) -> int:
    """The first column of ``loss_mask`` (B, L - 1) that any row trains on (0 when none does): the
    logits of earlier positions (the shared part of the prompts) are never needed."""
    cols = torch.nonzero(batch.loss_mask.sum(dim=0))
    return int(cols[0]) if len(cols) else 0


def pad_left(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` (b, n) with ``k`` zero columns in front (b, k + n)."""
    return torch.nn.functional.pad(x, (k, 0)) if k else x


class ValueModel(torch.nn.Module):
    """A critic: a scalar head on a transformer's last hidden state.

    ``trunk`` is a separate copy of the policy (``critic: separate``) or ``None`` (``value_head``:
    the head reads the policy's own hidden states, so the value loss also trains the shared trunk).
    """

    def __init__(self, hidden_size: int, trunk: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.trunk = trunk
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, hidden: torch.Tensor | None, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Values aligned with the targets: (B, L - 1) (position t = the state before token t + 1)."""
        if self.trunk is not None:
            hidden = self.trunk(input_ids=input_ids, attention_mask=attention_mask,
                                output_hidden_states=True).hidden_states[-1]
        assert hidden is not None
        return self.head(hidden[:, :-1].float()).squeeze(-1)  # (B, L - 1)


class TorchStrategy:
    """Single-process PyTorch training of a local HF causal LM (see the module doc).

    ``lora_rank > 0`` trains a LoRA adapter (``peft``) instead of all parameters: ``model`` is then
    the ``PeftModel`` and :attr:`hf_model` the HF model inside it (with the adapter layers injected).
    ``skip_zero_advantage`` leaves rows with no gradient out of the backward passes
    (:meth:`gradient_rows`; ``train.skip_zero_advantage``, on in a run's config, off by default here).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        micro_batch_size: int = 16,
        micro_batch_tokens: int = 0,
        logprob_chunk_tokens: int = 1024,
        temperature: float = 1.0,
        algo: AlgorithmConfig | None = None,
        max_len: int | None = None,
        clip_low: float | None = None,
        clip_high: float | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        total_steps: int = 0,
        min_lr_ratio: float = 1.0,
        lr_warmup_steps: int = 0,
        dtype: str = "float32",
        device: str = "cpu",
        lora_rank: int = 0,
        lora_alpha: float = 32.0,
        lora_dropout: float = 0.0,
        lora_target_modules: Sequence[str] | None = None,
        skip_zero_advantage: bool = False,
        blob_dir: str | Path | None = None,
        freeze_vision: bool = False,
        shared_prefix: bool = True,
    ) -> None:
        if lora_rank < 0:
            raise ValueError(f"lora_rank={lora_rank} must be >= 0 (0 = no LoRA)")
        self.model_dir = Path(model_dir)
        self.dtype = DTYPES[dtype]
        self.lora = lora_rank > 0
        self.images = ImageSource(model_dir, blob_dir) if is_vlm(model_dir) else None
        """A vision-language policy's images (samples' ``image_hashes`` in the run's blob store
        ``blob_dir``); None for a text model."""
        if freeze_vision and self.images is None:
            raise ValueError("train.freeze_vision: true needs a vision-language model; this one is a text model")
        self._row_images: list[RowImages | None] = []
        """The images of the samples of the batch being worked on, by ``extras["image_row"]``."""
        if self.images is not None:
            self.chunked_head = False  # logprobs from whole logits: the forward needs the pixels
        self._auto = AutoModelForImageTextToText if self.images is not None else AutoModelForCausalLM
        model: Any = self._auto.from_pretrained(
            str(model_dir), dtype=self.dtype, local_files_only=True, attn_implementation="sdpa"
        )
        for p in (vision_parameters(model).values() if freeze_vision else ()):
            p.requires_grad_(False)  # no gradient, so no optimizer state (the merger still trains)
        if self.lora:
            targets = TrainConfig().lora_target_modules if lora_target_modules is None else lora_target_modules
            model = wrap_lora(model, lora_rank, lora_alpha, lora_dropout, targets)
        self.model = model
        torch.nn.Module.to(self.model, torch.device(device))  # (transformers' typed ``.to`` confuses mypy)
        self.model.train()
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self.pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)
        self.device = torch.device(device)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay, betas=betas
        )  # with LoRA only the adapters
        self.base_lr = lr
        self.betas = betas
        self.total_steps, self.min_lr_ratio = total_steps, min_lr_ratio
        self.lr_warmup_steps = lr_warmup_steps
        self.grad_clip = grad_clip
        self.micro_batch_size = micro_batch_size
        self.micro_batch_tokens = micro_batch_tokens
        self.shared_prefix = shared_prefix
        """Rows of one group forward their common prefix once (:meth:`_hidden`, the chunked head's path)."""
        self.logprob_chunk_tokens = logprob_chunk_tokens
        self.temperature = temperature
        algo = algo or AlgorithmConfig()
        if clip_low is not None:
            algo = msgspec.structs.replace(algo, pg_clip_low=clip_low)
        if clip_high is not None:
            algo = msgspec.structs.replace(algo, pg_clip_high=clip_high)
        RunConfig(algorithm=algo)  # refuses what a run config refuses: bounds and rules (ConfigError)
        self.algo = algo
        self.algo_state = alg.initial_state(algo)
        self.max_len = max_len
        self.skip_zero_advantage = skip_zero_advantage
        self.ref_model: torch.nn.Module | None = None
        self._ref_path: Path | None = None  # LoRA: the weights the adapters-disabled reference must equal
        self._ref_checked = True
        self.critic: ValueModel | None = None
        self.critic_optimizer: torch.optim.Optimizer | None = None
        self.step = 0

    # ----------------------------------------------------------------- optional models

    @property
    def hf_model(self) -> Any:
        """The HF causal LM being trained (with LoRA: the one inside the ``PeftModel``, adapter
        layers injected)."""
        return self.model.get_base_model() if self.lora else self.model

    def init_reference(self, path: str | Path | None = None) -> None:
        """Load the frozen reference policy: the weights at ``path`` (an exported HF dir), or a copy
        of the current weights. Only call it when a KL term is on (``algo.uses_reference``).

        With LoRA the reference is the policy with its adapters disabled (no copy) as long as the
        reference weights equal the base weights bitwise — always at the RL start, since the
        warm-up folds its adapters into the base. For ``path`` that is checked at the next
        :meth:`train_step` (so a :meth:`load_checkpoint` in between, which restores the base, is
        taken into account); when they differ, the reference becomes a separate frozen copy of the
        weights at ``path`` (the merged current weights for ``path=None``)."""
        if not self.lora:
            ref = copy.deepcopy(self.model)
            if path is not None:
                load_weights_into(ref, path)
            self.ref_model = self._freeze(ref)
            return
        self.ref_model = _AdaptersDisabled(self.model)
        self._ref_path, self._ref_checked = (None, True) if path is None else (Path(path), False)
        if path is None and not all(torch.equal(_merged_weight(layer), layer.get_base_layer().weight)
                                    for layer in _lora_layers(self.hf_model).values()):
            self.ref_model = self._plain_copy(self._plain_state(merged=True, cpu=True))

    @staticmethod
    def _freeze(ref: torch.nn.Module) -> torch.nn.Module:
        ref.eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def _plain_copy(self, state: dict[str, torch.Tensor]) -> torch.nn.Module:
        """A separate frozen plain HF model (no adapters) holding ``state`` (plain names)."""
        ref = self._auto.from_pretrained(
            str(self.model_dir), dtype=self.dtype, local_files_only=True, attn_implementation="sdpa"
        )
        torch.nn.Module.to(ref, self.device)
        copy_weights_(ref, {k: v.detach() for k, v in state.items()})
        return self._freeze(ref)

    def _check_reference(self) -> None:
        """LoRA: replace the adapters-disabled reference by a copy of the weights at its path when
        they are not the base weights (see :meth:`init_reference`)."""
        if self._ref_checked or not isinstance(self.ref_model, _AdaptersDisabled):
            return
        assert self._ref_path is not None
        if not weights_match(self._ref_path, self._plain_state(merged=False)):
            self.ref_model = self._plain_copy(read_weights(self._ref_path))
        self._ref_checked = True

    def _base_changing(self) -> None:
        """LoRA: the base weights are about to change; keep the reference what it was."""
        if not isinstance(self.ref_model, _AdaptersDisabled):
            return
        if self._ref_path is None:  # defined as the current base: pin a copy of it
            self.ref_model = self._plain_copy(self._plain_state(merged=False))
        else:
            self._ref_checked = False

    def init_critic(self) -> None:
        """Create the critic from the current policy weights (``algo.critic``): a zero-initialised
        value head, on a copy of the policy's trunk (``separate``) or on the policy itself
        (``value_head``). With LoRA, ``value_head``'s value loss trains the head and the policy's
        adapters; a ``separate`` trunk is a copy of the policy's with its base weights frozen and
        its own copy of the adapters trained."""
        if self.algo.critic == "none":
            return
        hf = self.hf_model
        hidden = int(hf.config.hidden_size)
        trunk = copy.deepcopy(hf.base_model) if self.algo.critic == "separate" else None  # base model, no LM head
        self.critic = ValueModel(hidden, trunk).to(self.device)
        self.critic.train()
        lr = self.algo.critic_lr if self.algo.critic_lr is not None else self.base_lr * 10
        self.critic_optimizer = torch.optim.AdamW(
            [p for p in self.critic.parameters() if p.requires_grad], lr=lr, betas=self.betas)

    # ----------------------------------------------------------------- supervised warm-up

    def warmup(self, batches: Iterable[list[SFTExample]], *, lr: float, grad_clip: float) -> list[float]:
        """Supervised warm-up of the policy (:func:`trainer.sft.sft_warmup`: its own AdamW at a
        constant ``lr``, one step per batch); the RL optimizer's state is untouched and the
        policy is left in training mode. Returns the loss of every step.

        With LoRA the warm-up trains the adapters only; afterwards they are folded into the base
        weights (``W += scale · B @ A``) and re-initialised (``B = 0``, ``A`` as ``peft`` does), so
        the policy is unchanged (up to float round-off) and RL starts with fresh adapters on the
        warmed-up base. Call it before RL: it would make the RL optimizer's adapter moments stale."""
        forward = None
        if self.images is not None:
            source = self.images

            def forward(examples: list[SFTExample], batch: TokenBatch) -> torch.Tensor:  # (B, L, V)
                self._row_images = [source.of_bytes(e.images) if e.images else None for e in examples]
                return self._forward(self.model, batch.replace(
                    extras={**batch.extras, "image_row": torch.arange(batch.num_rows)})).logits

        try:
            losses = sft_warmup(self.model, batches, lr=lr, pad_id=self.pad_id, grad_clip=grad_clip,
                                chunk=self.logprob_chunk_tokens if self.chunked_head else 0, forward=forward)
        finally:
            self.model.train()
        if self.lora:
            self._fold_adapters()
        return losses

    @torch.no_grad()
    def _fold_adapters(self) -> None:
        """LoRA: ``W <- W + scale · B @ A`` for every adapted module, then fresh adapters."""
        self._base_changing()
        for layer in _lora_layers(self.hf_model).values():
            merged = _merged_weight(layer)
            layer.get_base_layer().weight.copy_(merged)
            layer.reset_lora_parameters(ADAPTER, True)

    # ----------------------------------------------------------------- forward passes

    def _forward(self, model: torch.nn.Module, batch: TokenBatch, hidden: bool = False, keep_from: int = 0) -> Any:
        """The model's output; its ``logits`` cover positions ``keep_from ..`` only (``(b, l - keep_from, V)``:
        the output projection and everything computed from the logits skip the prompt columns
        before the first trained token, see :func:`first_trained_col`). A VLM's rows show their
        samples' images (:meth:`_with_images`)."""
        if self.images is not None:
            rows = batch.extras["image_row"].tolist()
            return vlm_forward(model, batch.input_ids.to(self.device), batch.attention_mask.to(self.device),
                               [self._row_images[int(r)] for r in rows], rope_model=self.hf_model,
                               output_hidden_states=hidden,
                               logits_to_keep=batch.input_ids.shape[1] - keep_from, use_cache=False)
        return model(
            input_ids=batch.input_ids.to(self.device), attention_mask=batch.attention_mask.to(self.device),
            output_hidden_states=hidden, logits_to_keep=batch.input_ids.shape[1] - keep_from,
            use_cache=False,  # a whole sequence at once: no KV cache to build (HF builds one by default)
        )

    def _forward_logits(self, batch: TokenBatch) -> torch.Tensor:
        return self._forward(self.model, batch).logits  # (B, L, V)

    chunked_head = True
    """Compute token logprobs from hidden states in chunks (:meth:`_head_logprobs`) where the model
    allows it (:func:`causal_parts`); off: whole logits (tests compare the two paths)."""

    def _parts(self, model: torch.nn.Module) -> tuple[torch.nn.Module, Any] | None:
        if not self.chunked_head:
            return None
        return causal_parts(model.policy if isinstance(model, _AdaptersDisabled) else model)

    def _hidden(self, model: torch.nn.Module, decoder: torch.nn.Module, micro: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The last hidden states of ``micro`` (N, H) and the row of each (sample, position) in them
        (b, l). Shared prefixes (``shared_prefix``, the default): the rows packed into one sequence
        in which a group's common prompt is forwarded once (:func:`trainer.batch.shared_prefix_layout`,
        an explicit attention mask). Padded: ``N = b · l``. Packed (``micro_batch_tokens``): the
        samples' tokens one after the other (``N`` = their sum), position ids restarting at each
        sample, which transformers turns into an attention within each sample."""
        ids, attn = micro.input_ids.to(self.device), micro.attention_mask.to(self.device)  # (b, l)
        b, width = ids.shape
        off = model.adapters_off() if isinstance(model, _AdaptersDisabled) else contextlib.nullcontext()
        with off:
            if self._shares_prefixes(micro):
                flat, pos, allowed, index = shared_prefix_layout(ids, attn, micro.extras["group_ids"].to(self.device))
                h = self._decode(model, decoder, input_ids=flat[None], position_ids=pos[None],
                                 attention_mask=allowed[None, None])[0]  # (N, H)
                return h, index
            if not self.micro_batch_tokens:
                h = self._decode(model, decoder, input_ids=ids, attention_mask=attn)  # (b, l, H)
                return h.reshape(b * width, -1), torch.arange(b * width, device=self.device).view(b, width)
            keep = attn.bool()  # (b, l) right-padded: row-major order is each sample in turn
            pos = (attn.cumsum(1) - 1)[keep]  # (N,) 0.. per sample
            h = self._decode(model, decoder, input_ids=ids[keep][None], position_ids=pos[None],
                             attention_mask=None)[0]  # (N, H)
        lens = attn.sum(1)  # (b,)
        starts = lens.cumsum(0) - lens  # (b,)
        index = (starts[:, None] + torch.arange(width, device=self.device)).clamp(max=h.shape[0] - 1)  # (b, l)
        return h, index

    @property
    def _prefix_sharing(self) -> bool:
        """Whether prompts are shared at all: ``shared_prefix`` is on, the logprobs come from the
        hidden states (:meth:`_hidden`, the chunked head) and the model's attention takes a
        boolean 4-D mask (``sdpa``, the one this strategy loads). Else rows are forwarded on their
        own and :meth:`micro_batches` orders them by length."""
        impl = getattr(getattr(self.hf_model, "config", None), "_attn_implementation", None)
        return self.shared_prefix and self.chunked_head and impl == "sdpa"

    def _shares_prefixes(self, micro: TokenBatch) -> bool:
        """Whether :meth:`_hidden` forwards ``micro`` with shared prefixes (:attr:`_prefix_sharing`,
        and the rows carry their groups)."""
        return self._prefix_sharing and "group_ids" in micro.extras

    def _decode(self, model: torch.nn.Module, decoder: torch.nn.Module, **inputs: Any) -> torch.Tensor:
        """The last hidden states (b, l, H) of ``model``'s ``decoder`` on ``inputs``."""
        return decoder(**inputs, use_cache=False).last_hidden_state  # type: ignore[no-any-return]

    def _head_logprobs(self, parts: tuple[torch.nn.Module, Any], model: torch.nn.Module,
                       micro: TokenBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token logprobs and entropies at the rollout temperature (b, l - 1) at the positions of
        ``micro.loss_mask > 0`` (0 elsewhere: those are never computed), from the hidden states in
        chunks of ``logprob_chunk_tokens`` (:func:`trainer.logprobs.head_logprobs`); also the hidden
        states (N, H) and their index (b, l) (:meth:`_hidden`)."""
        decoder, head = parts
        hidden, index = self._hidden(model, decoder, micro)
        mask = micro.loss_mask.to(self.device) > 0  # (b, l - 1)
        rows, cols = torch.nonzero(mask, as_tuple=True)  # (M,) each
        targets = micro.input_ids.to(self.device)[rows, cols + 1]  # (M,) the token predicted at (row, col)
        with model.adapters_off() if isinstance(model, _AdaptersDisabled) else contextlib.nullcontext():
            lp_m, ent_m = head_logprobs(hidden, head, index[rows, cols], targets, self.temperature,
                                        self.logprob_chunk_tokens)  # (M,) each
        zeros = torch.zeros(mask.shape, device=self.device)  # (b, l - 1)
        return zeros.index_put((rows, cols), lp_m), zeros.index_put((rows, cols), ent_m), hidden, index

    def _groups(self, batch: TokenBatch) -> list[tuple[int, int]]:
        """Row ranges ``[start, stop)`` of ``batch``'s micro-batches, in order: ``micro_batch_size``
        rows each, or (``micro_batch_tokens``) consecutive rows whose tokens add up to at most
        ``micro_batch_tokens`` (a longer row alone)."""
        n = batch.num_rows
        if not self.micro_batch_tokens:
            return [(i, min(i + self.micro_batch_size, n)) for i in range(0, n, self.micro_batch_size)]
        out, start, total = [], 0, 0
        for i, length in enumerate(batch.attention_mask.sum(dim=1).tolist()):
            if i > start and total + length > self.micro_batch_tokens:
                out.append((start, i))
                start, total = i, 0
            total += length
        return [*out, (start, n)] if n else out

    def _values(self, out: Any, micro: TokenBatch) -> torch.Tensor:
        assert self.critic is not None
        hidden = out.hidden_states[-1] if self.critic.trunk is None else None
        return self.critic(hidden, micro.input_ids.to(self.device), micro.attention_mask.to(self.device))

    @torch.no_grad()
    def logprobs(self, batch: TokenBatch, model: torch.nn.Module | None = None) -> torch.Tensor:
        """Token logprobs at the rollout temperature, (B, L - 1), without gradients."""
        if model is not None and model is self.ref_model:
            self._check_reference()
            model = self.ref_model
        model = self.model if model is None else model
        head = self._parts(model)
        parts = []
        for start, stop in self._groups(batch):
            micro = batch.rows(start, stop)
            if head is not None:  # the trained positions only (0 elsewhere), without whole logits
                lp = self._head_logprobs(head, model, micro)[0]  # (b, l - 1)
            else:
                k0 = first_trained_col(micro)
                logits = self._forward(model, micro, keep_from=k0).logits  # (b, l - k0, V)
                lp = pad_left(token_logprobs(logits, micro.input_ids[:, k0:].to(self.device), self.temperature), k0)
            parts.append(torch.nn.functional.pad(lp, (0, batch.input_ids.shape[1] - 1 - lp.shape[1])))
        return torch.cat(parts).cpu()

    @torch.no_grad()
    def full_kl(self, batch: TokenBatch) -> torch.Tensor:
        """Exact per-token KL(π ‖ π_ref) over the whole vocabulary at the rollout temperature,
        (B, L - 1), without gradients (``kl_penalty: full``). Needs the reference model."""
        self._check_reference()
        assert self.ref_model is not None
        parts = []
        for start, stop in self._groups(batch):
            micro = batch.rows(start, stop)
            pol = torch.log_softmax(self._forward(self.model, micro).logits[:, :-1].float() / self.temperature, -1)
            ref = torch.log_softmax(self._forward(self.ref_model, micro).logits[:, :-1].float() / self.temperature, -1)
            kl = L.kl_penalty(pol, ref, "full")  # (b, l - 1)
            parts.append(torch.nn.functional.pad(kl, (0, batch.input_ids.shape[1] - 1 - kl.shape[1])))
        return torch.cat(parts).cpu()

    @torch.no_grad()
    def values(self, batch: TokenBatch) -> torch.Tensor:
        """The critic's values (B, L - 1), without gradients."""
        parts = []
        for start, stop in self._groups(batch):
            micro = batch.rows(start, stop)
            shared_trunk = self.critic is not None and self.critic.trunk is None
            out = self._forward(self.model, micro, hidden=True) if shared_trunk else None
            v = self._values(out, micro)
            parts.append(torch.nn.functional.pad(v, (0, batch.input_ids.shape[1] - 1 - v.shape[1])))
        return torch.cat(parts).float().cpu()

    # ----------------------------------------------------------------- one step

    def prepare(self, samples: list[TrainSample]) -> tuple[TokenBatch, dict[str, float]]:
        """Collate ``samples`` and compute everything the loss needs (steps 1–3 of the
        step in docs/architecture.md, "The torch strategy").

        The returned batch's ``old_logprobs`` are the ratio's denominators, ``advantages`` are
        per token (B, L - 1) with every weight applied, ``loss_mask`` has every mask applied, and
        ``extras`` hold ``ref_logprobs``, ``old_values`` and ``returns`` when they are used, and
        ``pg_select`` (the tokens a ``clip_cov`` / ``kl_cov`` loss treats apart) for those losses.
        """
        cfg = self.algo
        self._check_reference()
        # windowed episodes: forward passes see one row per segment, advantages the whole episode
        layout = segment_layout(samples)
        batch = collate(samples, self.pad_id)
        if layout is None:
            batch = self._with_images(batch, [s.image_hashes for s in samples])
        ex = batch.extras
        metrics: dict[str, float] = {}
        mask = batch.loss_mask
        seen = self._segment_images(split_rows(batch, layout), samples, layout) if layout is not None else batch

        def per_sample(x: torch.Tensor) -> torch.Tensor:  # (R, W - 1) -> (B, L - 1)
            return x if layout is None else merge_rows(x, layout, batch.num_rows, batch.input_ids.shape[1])

        prox = per_sample(self.logprobs(seen)) if cfg.old_logprobs == "recompute" else None
        ref = per_sample(self.logprobs(seen, self.ref_model)) if self.ref_model is not None else None
        values = per_sample(self.values(seen)) if self.critic is not None else None
        kl = None
        if cfg.add_token_level_kl:
            if ref is None:
                raise RuntimeError("add_token_level_kl is on but no reference model was loaded (init_reference)")
            if cfg.kl_penalty == "full":
                kl = per_sample(self.full_kl(seen)) * (mask > 0)  # (B, T)
            else:
                current = prox if prox is not None else batch.old_logprobs
                kl = L.where_mask(L.kl_penalty(current, ref, cfg.kl_penalty), mask)  # (B, T)
        adv, returns, m = alg.compute_advantages(
            cfg, self.algo_state, ex["rewards"], ex["group_ids"], mask, values=values, kl=kl,
            step_rewards=[s.step_rewards for s in samples], state_hashes=[s.state_hashes for s in samples],
            baselines=ex.get("baselines"))
        metrics.update(m)
        mask, m = alg.data_masks(cfg, mask, ex["rewards"], ex["group_ids"], ex["truncated"])
        metrics.update(m)
        old_lp, is_w, mask, m = alg.off_policy(cfg, mask, batch.old_logprobs, prox)
        metrics.update(m)
        w = alg.loss_weights(cfg, ex["rewards"], ex["group_ids"], ex["response_len"])
        if w is not None:
            adv = adv * w.unsqueeze(1)
        if is_w is not None:
            adv = adv * is_w
        extras = dict(ex)
        if ref is not None:
            extras["ref_logprobs"] = ref
        if values is not None and returns is not None:
            extras["old_values"] = values
            extras["returns"] = returns
            metrics["critic/returns_mean"] = L._mmean(returns, mask)
        if alg.selects_tokens(cfg):  # clip_cov / kl_cov: tokens chosen over the whole batch
            current = prox if prox is not None else per_sample(self.logprobs(seen))  # (B, T) π at the step's start
            chosen, m = alg.select_tokens(cfg, current, old_lp, adv * (mask > 0), mask, self.step)
            if chosen is not None:
                extras["pg_select"] = chosen
            metrics.update(m)
        if kl is not None:
            alg.update_kl_coef(cfg, self.algo_state, kl, mask, len(samples))
        out = batch.replace(old_logprobs=old_lp, advantages=adv * (mask > 0), loss_mask=mask, extras=extras)
        if layout is None:
            return out, metrics
        rows = split_rows(out, layout)
        if "image_row" in seen.extras:  # the rows' images, loaded once for ``seen``
            rows = rows.replace(extras={**rows.extras, "image_row": seen.extras["image_row"]})
        return rows, metrics

    def _with_images(self, batch: TokenBatch, hashes: Sequence[Sequence[str]]) -> TokenBatch:
        """A VLM: load the images of the batch's rows (``hashes[i]``: row i's, from the blob
        store) and tag each row with its sample (``extras["image_row"]``, (B,)), so micro-batches
        and reordered rows find their pixels. A text model: ``batch`` as it is."""
        if self.images is None:
            if any(hashes):
                raise ValueError("a sample has images but the policy is not a vision-language model")
            return batch
        source = self.images
        self._row_images = [source.of_hashes(h) if h else None for h in hashes]
        return batch.replace(extras={**batch.extras, "image_row": torch.arange(batch.num_rows)})

    def _segment_images(self, rows: TokenBatch, samples: Sequence[TrainSample], layout: Sequence[Segment]) -> TokenBatch:
        """A VLM: :meth:`_with_images` for the rows of :func:`split_rows` (one per segment), each row
        showing its own segment's images (``segment_image_hashes``; a one-segment sample's row its
        ``image_hashes``), so each window's pass sees the pixels its turn's request carried."""
        hashes: list[tuple[str, ...]] = []
        segment = 0  # the row's segment within its sample (a sample's rows are consecutive)
        for k, (b, _, _) in enumerate(layout):
            s = samples[b]
            segment = segment + 1 if k and layout[k - 1][0] == b else 0
            if s.segment_image_hashes:
                if len(s.segment_image_hashes) != len(s.segment_starts) + 1:
                    raise ValueError(f"sample {s.sample_id or b}: {len(s.segment_image_hashes)} segments of images "
                                     f"for {len(s.segment_starts) + 1} segments")
                hashes.append(s.segment_image_hashes[segment])
            elif s.segment_starts and s.image_hashes:
                raise ValueError(f"sample {s.sample_id or b}: a windowed episode with images but no "
                                 "segment_image_hashes (which segment shows which image is unknown)")
            else:
                hashes.append(tuple(s.image_hashes))
        return self._with_images(rows, hashes)

    def backward(self, micro: TokenBatch, share: float) -> dict[str, float]:
        """The configured loss of one prepared micro-batch times ``share``; ``backward()``.

        Metrics are this micro-batch's means; they include ``actor/entropy``: the mean entropy of
        the tempered policy ``softmax(logits / T)`` over the trained tokens.
        """
        cfg = self.algo
        need_hidden = self.critic is not None and self.critic.trunk is None
        full_kl_loss = cfg.use_kl_loss and cfg.kl_loss_type == "full" and "ref_logprobs" in micro.extras
        head = None if full_kl_loss else self._parts(self.model)
        mask = micro.loss_mask.to(self.device)
        if head is not None:  # chunked from the hidden states: no (b, l, V) tensor in either pass
            lp, ent, hidden, index = self._head_logprobs(head, self.model, micro)  # (b, l - 1) each
            out: Any = SimpleNamespace(hidden_states=(hidden[index],) if need_hidden else ())  # (b, l, H): a value head
            if not cfg.entropy_loss_coef:
                ent = ent.detach()
        else:
            k0 = 0 if full_kl_loss else first_trained_col(micro)  # prompt columns before it need no logits
            out = self._forward(self.model, micro, hidden=need_hidden, keep_from=k0)
            logits = out.logits  # (b, l - k0, V)
            ids = micro.input_ids.to(self.device)
            lp = pad_left(token_logprobs(logits, ids[:, k0:], self.temperature), k0)  # (b, l - 1)
            if cfg.entropy_loss_coef:
                ent = pad_left(entropy_from_logits(logits[:, :-1] / self.temperature), k0)  # (b, l - 1)
            else:
                with torch.no_grad():
                    ent = pad_left(entropy_from_logits(logits[:, :-1].detach() / self.temperature), k0)  # (b, l - 1)
        if "pg_select" in micro.extras:  # a selective loss (clip_cov, kl_cov): the batch's token choice
            loss, metrics = alg.selective_policy_loss(cfg, lp, micro.old_logprobs.to(self.device),
                                                      micro.advantages.to(self.device), mask, self.max_len,
                                                      micro.extras["pg_select"].to(self.device))
        else:
            loss, metrics = alg.policy_loss(cfg, lp, micro.old_logprobs.to(self.device),
                                            micro.advantages.to(self.device), mask, self.max_len)
        if cfg.entropy_loss_coef:
            e_loss, m = L.entropy_loss(ent, mask, cfg.entropy_loss_coef, cfg.loss_agg_mode, self.max_len)
            loss = loss + e_loss
        metrics["actor/entropy"] = float(masked_mean(ent.detach(), mask))
        if "ref_logprobs" in micro.extras:
            coef = cfg.kl_loss_coef if cfg.use_kl_loss else 0.0
            if cfg.use_kl_loss and cfg.kl_loss_type == "full":  # exact KL over the vocabulary, with gradient
                assert self.ref_model is not None
                with torch.no_grad():
                    ref_logits = self._forward(self.ref_model, micro).logits[:, :-1].float()
                pol_full = torch.log_softmax(logits[:, :-1].float() / self.temperature, -1)  # (b, l - 1, V)
                ref_full = torch.log_softmax(ref_logits / self.temperature, -1)  # (b, l - 1, V)
                kl_l, m = L.kl_loss(pol_full, ref_full, mask, coef, "full", cfg.loss_agg_mode, self.max_len)
            else:
                ref = micro.extras["ref_logprobs"].to(self.device)
                kl_l, m = L.kl_loss(lp, ref, mask, coef, cfg.kl_loss_type, cfg.loss_agg_mode, self.max_len)
            metrics.update(m)
            if cfg.use_kl_loss:
                loss = loss + kl_l
                metrics["loss/kl"] = float(kl_l.detach())
        if self.critic is not None:
            values = self._values(out, micro)  # (b, l - 1)
            vf, m = L.value_loss(values, micro.extras["old_values"].to(self.device),
                                 micro.extras["returns"].to(self.device), mask, cfg.value_clip,
                                 cfg.loss_agg_mode, self.max_len)
            metrics.update(m)
            loss = loss + cfg.vf_coef * vf
        (loss * share).backward()
        metrics["loss/total"] = float(loss.detach())
        return metrics

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based): cosine decay from ``lr`` to
        ``lr * min_lr_ratio`` over ``total_steps`` (constant ``lr`` when ``total_steps <= 0``
        or ``min_lr_ratio == 1``; stays at the floor after ``total_steps``), times the linear
        warm-up factor ``(step + 1) / lr_warmup_steps`` during the first ``lr_warmup_steps``."""
        warm = min(1.0, (step + 1) / self.lr_warmup_steps) if self.lr_warmup_steps > 0 else 1.0
        if self.total_steps <= 0 or self.min_lr_ratio == 1.0:
            return self.base_lr * warm
        progress = min(step / max(self.total_steps - 1, 1), 1.0)
        scale = self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return self.base_lr * scale * warm

    def optimizer_step(self) -> dict[str, float]:
        """Clip the global grad norm (when ``grad_clip > 0``), AdamW step at :meth:`lr_at`,
        zero grads; the critic's optimizer likewise (its own norm and learning rate)."""
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.tensor(0.0)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = {"actor/grad_norm": float(norm), "actor/lr": float(self.optimizer.param_groups[0]["lr"])}
        if self.critic is not None and self.critic_optimizer is not None:
            cparams = [p for p in self.critic.parameters() if p.grad is not None]
            cnorm = torch.nn.utils.clip_grad_norm_(cparams, max_norm) if cparams else torch.tensor(0.0)
            self.critic_optimizer.step()
            self.critic_optimizer.zero_grad(set_to_none=True)
            metrics["critic/grad_norm"] = float(cnorm)
        self.step += 1
        return metrics

    def gradient_rows(self, batch: TokenBatch) -> TokenBatch:
        """The rows of a prepared batch that the backward pass needs (``skip_zero_advantage``).

        When the loss is the policy loss alone (no ``use_kl_loss``, no ``entropy_loss_coef``, no
        critic), a row whose advantage is 0 at every trained token (``advantages`` already carry
        the masks) adds exactly 0 to the loss and to every gradient, in each ``pg_variant``
        (each is ``A`` times a per-token term) and each ``loss_agg_mode`` (sums over rows over a
        normaliser that :meth:`train_step` takes from the whole batch). Such rows are left out
        of the forward and backward passes: GRPO's groups whose samples all got the same reward,
        a third or more of a batch in the main example. If no row is left, the first one is kept:
        its zero gradient still gives AdamW's step (moments, weight decay) as without skipping.
        Otherwise, or with ``skip_zero_advantage`` off, the batch is returned as it is."""
        cfg = self.algo
        if not self.skip_zero_advantage or self.critic is not None or cfg.use_kl_loss or cfg.entropy_loss_coef:
            return batch
        keep = (batch.advantages != 0).any(dim=1)  # (B,); NaN counts as non-zero
        if "pg_select" in batch.extras:  # kl_cov penalises its chosen tokens whatever their advantage
            keep = keep | (batch.extras["pg_select"] > 0).any(dim=1)
        if bool(keep.all()):
            return batch
        if not bool(keep.any()):
            keep[int((batch.loss_mask > 0).any(dim=1).to(torch.int8).argmax())] = True  # first row with a trained token
        return batch.take(keep)

    def micro_batches(self, batch: TokenBatch) -> tuple[TokenBatch, list[tuple[TokenBatch, float]]]:
        """The rows of a prepared ``batch`` that train (:meth:`gradient_rows`), the rows of each group
        together (:attr:`_prefix_sharing`: a micro-batch then holds whole groups, whose prompt is
        forwarded once) or else shortest first (so each micro-batch is trimmed to less padding), and their
        micro-batches of
        ``micro_batch_size`` rows with each one's share of the whole batch's normaliser (its
        tokens for ``token-mean``, else its sequences). Micro-batches with nothing trained (share
        0: no loss, no gradient) are left out. Every rank of a multi-rank strategy prepares the
        same batch, so every rank gets the same list."""
        by_tokens = self.algo.loss_agg_mode == "token-mean"
        total = max(batch.num_tokens if by_tokens else batch.num_seqs, 1)
        trained = self.gradient_rows(batch)
        trained = trained.by_group() if self._prefix_sharing else trained.by_length()
        micros = []
        for start, stop in self._groups(trained):
            micro = trained.rows(start, stop)
            share = (micro.num_tokens if by_tokens else micro.num_seqs) / total
            if share > 0:
                micros.append((micro, share))
        return trained, micros

    def trained_metrics(self, acc: dict[str, float], batch: TokenBatch, trained: TokenBatch) -> dict[str, float]:
        """The step's micro-batch metrics ``acc`` (share-weighted sums, :data:`EXTREME_METRICS`
        by min / max), given that only the rows ``trained`` of ``batch`` ran (:meth:`micro_batches`).

        ``loss/policy`` and ``loss/total`` stay the whole batch's loss (the rows left out add 0).
        The other means (``loss/clipfrac``, ``actor/ratio_mean``, ``actor/approx_kl``,
        ``actor/entropy``, ...) are rescaled to means over the trained rows' tokens (sequences in
        ``seq-mean-*`` modes); ``train/skipped_rows`` counts the rows left out (0 when none was)."""
        out = dict(acc)
        skipped = batch.num_rows - trained.num_rows
        out["train/skipped_rows"] = float(skipped)
        part = trained.num_tokens / max(batch.num_tokens, 1) if self.algo.loss_agg_mode == "token-mean" \
            else trained.num_seqs / max(batch.num_seqs, 1)
        if skipped and part > 0:
            for key in acc:
                if key not in LOSS_METRICS and key not in EXTREME_METRICS:
                    out[key] = acc[key] / part
        return out

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        """One optimizer step over ``samples``; metrics are share-weighted over micro-batches
        (see :meth:`trained_metrics` for the rows :meth:`gradient_rows` leaves out)."""
        batch, sums = self.prepare(samples)
        trained, micros = self.micro_batches(batch)
        acc: dict[str, float] = {}
        for micro, share in micros:
            for key, value in self.backward(micro, share).items():
                if key == "actor/ratio_min":
                    acc[key] = min(acc.get(key, value), value)
                elif key == "actor/ratio_max":
                    acc[key] = max(acc.get(key, value), value)
                else:
                    acc[key] = acc.get(key, 0.0) + share * value
        sums.update(self.trained_metrics(acc, batch, trained))
        sums.update(self.optimizer_step())
        sums["train/tokens"] = float(batch.num_tokens)
        sums["train/samples"] = float(len(samples))
        return sums

    # ----------------------------------------------------------------- persistence

    @torch.no_grad()
    def _plain_state(self, merged: bool, cpu: bool = False) -> dict[str, torch.Tensor]:
        """The model's state under the plain HF model's names (tied weights share a tensor, as in
        ``state_dict()``). With LoRA: the base weights, or (``merged``) the adapted modules'
        ``W + scale · B @ A`` computed aside (one module at a time, moved to the CPU when ``cpu``,
        so the device holds one extra module at most); the adapters themselves are left out."""
        if not self.lora:
            return dict(self.model.state_dict())
        hf = self.hf_model
        state = {_plain_key(k): v for k, v in hf.state_dict().items() if not _is_lora_key(k)}
        if merged:
            for name, layer in _lora_layers(hf).items():
                w = _merged_weight(layer)
                state[f"{name}.weight"] = w.cpu() if cpu else w
        return state

    def _adapter_params(self) -> dict[str, torch.nn.Parameter]:
        """LoRA: the trainable adapter parameters by their ``PeftModel`` names."""
        return {k: p for k, p in self.model.named_parameters() if p.requires_grad}

    def _write_hf_dir(self, path: Path, merged: bool) -> None:
        if self.lora:  # plain names, tied weights dropped as save_pretrained drops them
            self.hf_model.save_pretrained(path, state_dict=self._plain_state(merged, cpu=True))
        else:
            self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        if self.images is not None:  # a VLM's directory is complete with its image processor
            self.images.processor.save_pretrained(path)

    def export_weights(self, path: str | Path) -> tuple[Path, str]:
        """Write the current weights as a complete HF model dir at ``path``; return it and the
        sha256 of its safetensors files. The rollout engine's ``load_weights`` reads it.

        With LoRA these are the merged weights under the plain model's parameter names (the
        adapted modules' ``W + scale · B @ A``), computed without touching the training state."""
        with publish_dir(path) as tmp:
            self._write_hf_dir(tmp, merged=True)
            checksum = weights_sha256(tmp)
        return Path(path), checksum

    def export_state(self) -> dict[str, torch.Tensor]:
        """The tensors :meth:`export_weights` writes, by the same names, without writing them:
        views of the live parameters (tied ones share a tensor), with LoRA the merged weights
        computed aside. The caller copies them before the next step changes them (the trainer's
        shared-memory handoff, ``train.weights_handoff``)."""
        return self._plain_state(merged=True)

    def save_checkpoint(self, path: str | Path) -> Path:
        """Weights (HF dir under ``model/``), optimizer state, the critic (and its optimizer), the
        algorithm state, RNG states and step at ``path``.

        With LoRA ``model/`` holds the base weights (plain names; the warm-up's folded adapters
        included), ``adapter.safetensors`` the adapters and ``optimizer.pt`` their AdamW state; the
        policy is their merge (as :meth:`export_weights` writes it)."""
        with publish_dir(path) as tmp:
            if self.lora:
                self._write_hf_dir(tmp / "model", merged=False)
                save_file({k: p.detach().contiguous() for k, p in self._adapter_params().items()},
                          str(tmp / "adapter.safetensors"))
            else:
                self.export_weights(tmp / "model")
            torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
            if self.critic is not None and self.critic_optimizer is not None:
                torch.save({"model": self.critic.state_dict(), "optimizer": self.critic_optimizer.state_dict()},
                           tmp / "critic.pt")
            (tmp / "algo_state.msgpack").write_bytes(msgspec.msgpack.encode(self.algo_state))
            state: dict[str, Any] = {
                "step": self.step,
                "torch_rng": torch.get_rng_state(),
                "python_rng": random.getstate(),
            }
            torch.save(state, tmp / "trainer_state.pt")
        return Path(path)

    def load_checkpoint(self, path: str | Path) -> int:
        """Restore weights, optimizer, RNG states and step from :meth:`save_checkpoint`; return the
        step. A LoRA checkpoint needs a strategy with the same LoRA shape, and a full one none."""
        root = Path(path)
        has_adapter = (root / "adapter.safetensors").exists()
        if has_adapter != self.lora:
            raise ValueError(f"{root} was saved {'with' if has_adapter else 'without'} LoRA adapters but this "
                             f"strategy has train.lora_rank {'0' if has_adapter else '> 0'}")
        if self.lora:
            self._load_lora(root)
        else:
            load_weights_into(self.model, root / "model")
        self.optimizer.load_state_dict(torch.load(root / "optimizer.pt", map_location=self.device))
        self._load_critic(root)
        return self._load_run_state(root)

    def _load_critic(self, root: Path) -> None:
        """The critic and its optimizer of checkpoint ``root`` (when it holds one)."""
        if (root / "critic.pt").exists():
            if self.critic is None:
                self.init_critic()
            if self.critic is None or self.critic_optimizer is None:
                raise ValueError(f"{root} holds a critic but algorithm.critic is none")
            saved = torch.load(root / "critic.pt", map_location=self.device)
            self.critic.load_state_dict(saved["model"])
            self.critic_optimizer.load_state_dict(saved["optimizer"])

    def _load_run_state(self, root: Path) -> int:
        """The algorithm state, the RNG states and the step of checkpoint ``root``; the step."""
        if (root / "algo_state.msgpack").exists():
            self.algo_state = msgspec.msgpack.decode((root / "algo_state.msgpack").read_bytes(), type=alg.AlgoState)
        state = torch.load(root / "trainer_state.pt", weights_only=True)
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        self.step = int(state["step"])
        return self.step

    @torch.no_grad()
    def _load_lora(self, root: Path) -> None:
        """LoRA: the base weights of ``root/model`` and the adapters of ``root/adapter.safetensors``."""
        base = read_weights(root / "model")
        targets = {_plain_key(k): v for k, v in self.hf_model.state_dict(keep_vars=True).items()
                   if not _is_lora_key(k)}
        current = self._plain_state(merged=False)
        if not all(k in current and torch.equal(v.to(current[k].device), current[k]) for k, v in base.items()):
            self._base_changing()
            copy_state_(targets, base, f"weights at {root / 'model'}")
        adapter = root / "adapter.safetensors"
        copy_state_(dict(self._adapter_params()), read_weights(adapter), f"adapters at {adapter}")
