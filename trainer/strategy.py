"""Training strategies behind one :class:`Strategy` protocol, and the single-process
:class:`TorchStrategy`.

``TorchStrategy`` holds a transformers causal LM and an AdamW optimizer, and — only when the
config needs them — a frozen reference model (a KL term is on) and a critic (``adv_estimator:
gae``). One optimizer step (:meth:`TorchStrategy.train_step`) over a batch of
:class:`trainer.batch.TrainSample`:

1. collate (right-padded);
2. a no-grad pass in micro-batches for what the config needs: the trainer's own logprobs
   (``old_logprobs: recompute``), the reference logprobs, the critic's values;
3. :meth:`TorchStrategy.prepare`: rewards → advantages, masks and weights
   (:mod:`trainer.algorithm`, in the order its module doc gives);
4. per micro-batch of ``micro_batch_size`` samples: forward, the configured policy loss (+ KL
   loss, entropy bonus, value loss), scaled by the micro-batch's share of the batch's tokens
   (``token-mean``) or sequences (``seq-mean-*``) so the accumulated gradient is the full-batch
   loss's; ``backward()``;
5. clip the global gradient norm, ``optimizer.step()`` (and the critic's), ``step += 1``; adapt the
   KL coefficient.

With the default ``old_logprobs: behaviour`` the ratio's denominator is the rollout engine's
behaviour logprobs (so the ratio corrects for staleness directly); for exactly-on-policy samples
it is 1 up to float round-off.

Weights are published with :meth:`TorchStrategy.export_weights` as a complete Hugging Face
directory (``config.json``, safetensors weights, tokenizer) written to a temporary sibling and
renamed into place, so readers never see a half-written version; its sha256 covers the
safetensors files. Checkpoints add the optimizer state, the RNG states and the step.
"""

from __future__ import annotations

import copy
import hashlib
import math
import os
import random
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import msgspec
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from schemas.config import AlgorithmConfig
from trainer import algorithm as alg
from trainer import losses as L
from trainer.batch import TokenBatch, TrainSample, collate
from trainer.logprobs import token_logprobs
from trainer.losses import entropy_from_logits, masked_mean
from trainer.sft import SFTExample, sft_warmup

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@runtime_checkable
class Strategy(Protocol):
    """What the services (:mod:`services.trainer_service`, and replay through it) call on a
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


def weights_sha256(path: str | Path) -> str:
    """sha256 (hex) over the bytes of the ``*.safetensors`` files of ``path``, in name order."""
    digest = hashlib.sha256()
    for f in sorted(Path(path).glob("*.safetensors")):
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


@torch.no_grad()
def load_weights_into(model: torch.nn.Module, path: str | Path) -> None:
    """Load the safetensors files of directory ``path`` into ``model`` in place.

    Parameters absent from the files are allowed only when tied to one that is present.
    """
    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(str(f)))
    if not state:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    result = model.load_state_dict(state, strict=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {id(params[k]) for k in state if k in params}
    missing = [k for k in result.missing_keys if k in params and id(params[k]) not in loaded]
    if result.unexpected_keys or missing:
        raise KeyError(
            f"weights do not fit the model: unexpected {result.unexpected_keys[:5]}, missing {missing[:5]}"
        )


def _replace_dir(tmp: Path, final: Path) -> None:
    """Move the finished directory ``tmp`` to ``final`` (replacing an older one)."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


# --------------------------------------------------------------------------- strategy


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
    """Single-process PyTorch training of a local HF causal LM (see the module doc)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        micro_batch_size: int = 16,
        temperature: float = 1.0,
        algo: AlgorithmConfig | None = None,
        max_len: int | None = None,
        clip_low: float | None = None,
        clip_high: float | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        total_steps: int = 0,
        min_lr_ratio: float = 1.0,
        dtype: str = "float32",
        device: str = "cpu",
    ) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=DTYPES[dtype], local_files_only=True, attn_implementation="sdpa"
        )
        torch.nn.Module.to(self.model, torch.device(device))  # (transformers' typed ``.to`` confuses mypy)
        self.model.train()
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self.pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)
        self.device = torch.device(device)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lr, weight_decay=weight_decay, betas=betas
        )
        self.base_lr = lr
        self.betas = betas
        self.total_steps, self.min_lr_ratio = total_steps, min_lr_ratio
        self.grad_clip = grad_clip
        self.micro_batch_size = micro_batch_size
        self.temperature = temperature
        algo = algo or AlgorithmConfig()
        if clip_low is not None:
            algo = msgspec.structs.replace(algo, pg_clip_low=clip_low)
        if clip_high is not None:
            algo = msgspec.structs.replace(algo, pg_clip_high=clip_high)
        algo.validate()
        self.algo = algo
        self.algo_state = alg.initial_state(algo)
        self.max_len = max_len
        self.ref_model: torch.nn.Module | None = None
        self.critic: ValueModel | None = None
        self.critic_optimizer: torch.optim.Optimizer | None = None
        self.step = 0

    # ----------------------------------------------------------------- optional models

    def init_reference(self, path: str | Path | None = None) -> None:
        """Load the frozen reference policy: the weights at ``path`` (an exported HF dir), or a copy
        of the current weights. Only call it when a KL term is on (``algo.uses_reference``)."""
        ref = copy.deepcopy(self.model)
        if path is not None:
            load_weights_into(ref, path)
        ref.eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        self.ref_model = ref

    def init_critic(self) -> None:
        """Create the critic from the current policy weights (``algo.critic``): a zero-initialised
        value head, on a copy of the policy (``separate``) or on the policy itself (``value_head``)."""
        if self.algo.critic == "none":
            return
        hidden = int(self.model.config.hidden_size)
        trunk = copy.deepcopy(self.model.base_model) if self.algo.critic == "separate" else None  # base model, no LM head
        self.critic = ValueModel(hidden, trunk).to(self.device)
        self.critic.train()
        lr = self.algo.critic_lr if self.algo.critic_lr is not None else self.base_lr * 10
        self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=lr, betas=self.betas)

    # ----------------------------------------------------------------- supervised warm-up

    def warmup(self, batches: Iterable[list[SFTExample]], *, lr: float, grad_clip: float) -> list[float]:
        """Supervised warm-up of the policy (:func:`trainer.sft.sft_warmup`: its own AdamW at a
        constant ``lr``, one step per batch); the RL optimizer's state is untouched and the
        policy is left in training mode. Returns the loss of every step."""
        try:
            return sft_warmup(self.model, batches, lr=lr, pad_id=self.pad_id, grad_clip=grad_clip)
        finally:
            self.model.train()

    # ----------------------------------------------------------------- forward passes

    def _forward(self, model: torch.nn.Module, batch: TokenBatch, hidden: bool = False) -> Any:
        return model(
            input_ids=batch.input_ids.to(self.device), attention_mask=batch.attention_mask.to(self.device),
            output_hidden_states=hidden,
        )

    def _forward_logits(self, batch: TokenBatch) -> torch.Tensor:
        return self._forward(self.model, batch).logits  # (B, L, V)

    def _values(self, out: Any, micro: TokenBatch) -> torch.Tensor:
        assert self.critic is not None
        hidden = out.hidden_states[-1] if self.critic.trunk is None else None
        return self.critic(hidden, micro.input_ids.to(self.device), micro.attention_mask.to(self.device))

    @torch.no_grad()
    def logprobs(self, batch: TokenBatch, model: torch.nn.Module | None = None) -> torch.Tensor:
        """Token logprobs at the rollout temperature, (B, L - 1), without gradients."""
        model = self.model if model is None else model
        parts = []
        for start in range(0, batch.input_ids.shape[0], self.micro_batch_size):
            micro = batch.rows(start, start + self.micro_batch_size)
            lp = token_logprobs(self._forward(model, micro).logits, micro.input_ids.to(self.device), self.temperature)
            parts.append(torch.nn.functional.pad(lp, (0, batch.input_ids.shape[1] - 1 - lp.shape[1])))
        return torch.cat(parts).cpu()

    @torch.no_grad()
    def full_kl(self, batch: TokenBatch) -> torch.Tensor:
        """Exact per-token KL(π ‖ π_ref) over the whole vocabulary at the rollout temperature,
        (B, L - 1), without gradients (``kl_penalty: full``). Needs the reference model."""
        assert self.ref_model is not None
        parts = []
        for start in range(0, batch.input_ids.shape[0], self.micro_batch_size):
            micro = batch.rows(start, start + self.micro_batch_size)
            pol = torch.log_softmax(self._forward(self.model, micro).logits[:, :-1].float() / self.temperature, -1)
            ref = torch.log_softmax(self._forward(self.ref_model, micro).logits[:, :-1].float() / self.temperature, -1)
            kl = L.kl_penalty(pol, ref, "full")  # (b, l - 1)
            parts.append(torch.nn.functional.pad(kl, (0, batch.input_ids.shape[1] - 1 - kl.shape[1])))
        return torch.cat(parts).cpu()

    @torch.no_grad()
    def values(self, batch: TokenBatch) -> torch.Tensor:
        """The critic's values (B, L - 1), without gradients."""
        parts = []
        for start in range(0, batch.input_ids.shape[0], self.micro_batch_size):
            micro = batch.rows(start, start + self.micro_batch_size)
            shared_trunk = self.critic is not None and self.critic.trunk is None
            out = self._forward(self.model, micro, hidden=True) if shared_trunk else None
            v = self._values(out, micro)
            parts.append(torch.nn.functional.pad(v, (0, batch.input_ids.shape[1] - 1 - v.shape[1])))
        return torch.cat(parts).float().cpu()

    # ----------------------------------------------------------------- one step

    def prepare(self, samples: list[TrainSample]) -> tuple[TokenBatch, dict[str, float]]:
        """Collate ``samples`` and compute everything the loss needs (see the module doc, steps 1–3).

        The returned batch's ``old_logprobs`` are the ratio's denominators, ``advantages`` are
        per token (B, L - 1) with every weight applied, ``loss_mask`` has every mask applied, and
        ``extras`` hold ``ref_logprobs``, ``old_values`` and ``returns`` when they are used.
        """
        cfg = self.algo
        batch = collate(samples, self.pad_id)
        ex = batch.extras
        metrics: dict[str, float] = {}
        mask = batch.loss_mask
        prox = self.logprobs(batch) if cfg.old_logprobs == "recompute" else None
        ref = self.logprobs(batch, self.ref_model) if self.ref_model is not None else None
        values = self.values(batch) if self.critic is not None else None
        kl = None
        if cfg.add_token_level_kl:
            if ref is None:
                raise RuntimeError("add_token_level_kl is on but no reference model was loaded (init_reference)")
            if cfg.kl_penalty == "full":
                kl = self.full_kl(batch) * (mask > 0)  # (B, T)
            else:
                current = prox if prox is not None else batch.old_logprobs
                kl = L.kl_penalty(current, ref, cfg.kl_penalty) * (mask > 0)  # (B, T)
        adv, returns, m = alg.compute_advantages(
            cfg, self.algo_state, ex["rewards"], ex["group_ids"], mask, values=values, kl=kl,
            step_rewards=[s.step_rewards for s in samples])
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
        if kl is not None:
            alg.update_kl_coef(cfg, self.algo_state, float((kl * (mask > 0)).sum(1).mean()), len(samples))
        return batch.replace(old_logprobs=old_lp, advantages=adv * (mask > 0), loss_mask=mask, extras=extras), metrics

    def backward(self, micro: TokenBatch, share: float) -> dict[str, float]:
        """The configured loss of one prepared micro-batch times ``share``; ``backward()``.

        Metrics are this micro-batch's means; they include ``actor/entropy``: the mean entropy of
        the tempered policy ``softmax(logits / T)`` over the trained tokens.
        """
        cfg = self.algo
        need_hidden = self.critic is not None and self.critic.trunk is None
        out = self._forward(self.model, micro, hidden=need_hidden)
        logits = out.logits  # (b, l, V)
        ids = micro.input_ids.to(self.device)
        lp = token_logprobs(logits, ids, self.temperature)  # (b, l - 1)
        mask = micro.loss_mask.to(self.device)
        loss, metrics = alg.policy_loss(cfg, lp, micro.old_logprobs.to(self.device),
                                        micro.advantages.to(self.device), mask, self.max_len)
        if cfg.entropy_loss_coef:
            ent = entropy_from_logits(logits[:, :-1] / self.temperature)  # (b, l - 1)
            e_loss, m = L.entropy_loss(ent, mask, cfg.entropy_loss_coef, cfg.loss_agg_mode, self.max_len)
            loss = loss + e_loss
        else:
            with torch.no_grad():
                ent = entropy_from_logits(logits[:, :-1].detach() / self.temperature)  # (b, l - 1)
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
        or ``min_lr_ratio == 1``; stays at the floor after ``total_steps``)."""
        if self.total_steps <= 0 or self.min_lr_ratio == 1.0:
            return self.base_lr
        progress = min(step / max(self.total_steps - 1, 1), 1.0)
        scale = self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return self.base_lr * scale

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

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        """One optimizer step over ``samples``; metrics are share-weighted over micro-batches."""
        batch, sums = self.prepare(samples)
        by_tokens = self.algo.loss_agg_mode == "token-mean"
        total = max(batch.num_tokens if by_tokens else batch.num_seqs, 1)
        acc: dict[str, float] = {}
        for start in range(0, len(samples), self.micro_batch_size):
            micro = batch.rows(start, start + self.micro_batch_size)
            share = (micro.num_tokens if by_tokens else micro.num_seqs) / total
            if share == 0:
                continue  # nothing trained in these rows (masked out): no loss, no gradient
            for key, value in self.backward(micro, share).items():
                if key == "actor/ratio_min":
                    acc[key] = min(acc.get(key, value), value)
                elif key == "actor/ratio_max":
                    acc[key] = max(acc.get(key, value), value)
                else:
                    acc[key] = acc.get(key, 0.0) + share * value
        sums.update(acc)
        sums.update(self.optimizer_step())
        sums["train/tokens"] = float(batch.num_tokens)
        sums["train/samples"] = float(len(samples))
        return sums

    # ----------------------------------------------------------------- persistence

    def export_weights(self, path: str | Path) -> tuple[Path, str]:
        """Write the current weights as a complete HF model dir at ``path``; return it and the
        sha256 of its safetensors files. The rollout engine's ``load_weights`` reads it."""
        final = Path(path)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(tmp)
        self.tokenizer.save_pretrained(tmp)
        checksum = weights_sha256(tmp)
        _replace_dir(tmp, final)
        return final, checksum

    def save_checkpoint(self, path: str | Path) -> Path:
        """Weights (HF dir under ``model/``), optimizer state, the critic (and its optimizer), the
        algorithm state, RNG states and step at ``path``."""
        final = Path(path)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
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
        _replace_dir(tmp, final)
        return final

    def load_checkpoint(self, path: str | Path) -> int:
        """Restore weights, optimizer, RNG states and step from :meth:`save_checkpoint`; return the step."""
        root = Path(path)
        load_weights_into(self.model, root / "model")
        self.optimizer.load_state_dict(torch.load(root / "optimizer.pt", map_location=self.device))
        if (root / "critic.pt").exists():
            if self.critic is None:
                self.init_critic()
            if self.critic is None or self.critic_optimizer is None:
                raise ValueError(f"{root} holds a critic but algorithm.critic is none")
            saved = torch.load(root / "critic.pt", map_location=self.device)
            self.critic.load_state_dict(saved["model"])
            self.critic_optimizer.load_state_dict(saved["optimizer"])
        if (root / "algo_state.msgpack").exists():
            self.algo_state = msgspec.msgpack.decode((root / "algo_state.msgpack").read_bytes(), type=alg.AlgoState)
        state = torch.load(root / "trainer_state.pt", weights_only=True)
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        self.step = int(state["step"])
        return self.step
