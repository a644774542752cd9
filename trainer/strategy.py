"""Training strategies behind one :class:`Strategy` protocol, and the single-process
:class:`TorchStrategy`.

``TorchStrategy`` holds a transformers causal LM and an AdamW optimizer. One optimizer step
(:meth:`TorchStrategy.train_step`) over a batch of :class:`trainer.batch.TrainSample`:

1. collate (right-padded) and split into micro-batches of ``micro_batch_size`` samples;
2. per micro-batch: forward over ``prompt + response``, token logprobs at the rollout
   temperature (:func:`token_logprobs`), PPO-clip loss against the samples' behaviour logprobs
   with the token mean taken over the *whole* batch's trained tokens, ``backward()``
   (gradients accumulate);
3. clip the global gradient norm, ``optimizer.step()``, ``step += 1``.

The old logprobs are the rollout engine's behaviour logprobs (so the PPO ratio is the
importance ratio against the policy that actually sampled, including staleness); for
exactly-on-policy samples the ratio is 1 up to float round-off.

Weights are published with :meth:`TorchStrategy.export_weights` as a complete Hugging Face
directory (``config.json``, safetensors weights, tokenizer) written to a temporary sibling and
renamed into place, so readers never see a half-written version; its sha256 covers the
safetensors files. Checkpoints add the optimizer state, the RNG states and the step.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import shutil
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.algos import entropy_from_logits, masked_mean, ppo_clip_loss
from trainer.batch import TokenBatch, TrainSample, collate

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@runtime_checkable
class Strategy(Protocol):
    """What the trainer service needs from a training backend."""

    step: int

    def logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """Token logprobs of ``batch`` under the current weights, (B, L - 1), no grad."""
        ...

    def backward(self, micro: TokenBatch, num_tokens: int) -> dict[str, float]:
        """Loss and ``backward()`` of one micro-batch (token mean over ``num_tokens``)."""
        ...

    def optimizer_step(self) -> dict[str, float]:
        """Clip, step, zero the gradients; ``step += 1``."""
        ...

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        """One full optimizer step over ``samples`` (micro-batched)."""
        ...

    def save_checkpoint(self, path: str | Path) -> Path: ...

    def load_checkpoint(self, path: str | Path) -> int: ...

    def export_weights(self, path: str | Path) -> tuple[Path, str]: ...


# --------------------------------------------------------------------------- pure helpers


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits[:, :-1] / T)`` at the next tokens ``input_ids[:, 1:]``.

    logits (B, L, V), input_ids (B, L) -> (B, L - 1) float32. Same distribution as the rollout
    engine's behaviour logprobs (:mod:`rollout.sampling`).
    """
    scaled = logits[:, :-1].float() / temperature  # (B, L - 1, V)
    targets = input_ids[:, 1:].unsqueeze(-1)  # (B, L - 1, 1)
    return scaled.gather(-1, targets).squeeze(-1) - torch.logsumexp(scaled, dim=-1)  # (B, L - 1)


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
        clip_low: float = 0.2,
        clip_high: float = 0.2,
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
        self.total_steps, self.min_lr_ratio = total_steps, min_lr_ratio
        self.grad_clip = grad_clip
        self.micro_batch_size = micro_batch_size
        self.temperature = temperature
        self.clip_low, self.clip_high = clip_low, clip_high
        self.step = 0

    def _forward_logits(self, batch: TokenBatch) -> torch.Tensor:
        out = self.model(
            input_ids=batch.input_ids.to(self.device), attention_mask=batch.attention_mask.to(self.device)
        )
        return out.logits  # (B, L, V)

    @torch.no_grad()
    def logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """Token logprobs at the rollout temperature, (B, L - 1), without gradients."""
        parts = []
        for start in range(0, batch.input_ids.shape[0], self.micro_batch_size):
            micro = batch.rows(start, start + self.micro_batch_size)
            lp = token_logprobs(
                self._forward_logits(micro), micro.input_ids.to(self.device), self.temperature
            )
            parts.append(torch.nn.functional.pad(lp, (0, batch.input_ids.shape[1] - 1 - lp.shape[1])))
        return torch.cat(parts).cpu()

    def backward(self, micro: TokenBatch, num_tokens: int) -> dict[str, float]:
        """PPO-clip loss of ``micro`` with the token mean over ``num_tokens``; ``backward()``.

        Metrics also include ``actor/entropy``: the mean entropy of the tempered policy
        ``softmax(logits / T)`` over the trained tokens.
        """
        logits = self._forward_logits(micro)  # (b, l, V)
        ids = micro.input_ids.to(self.device)
        lp = token_logprobs(logits, ids, self.temperature)  # (b, l - 1)
        mask = micro.loss_mask.to(self.device)
        loss, metrics = ppo_clip_loss(
            lp,
            micro.old_logprobs.to(self.device),
            micro.advantages.to(self.device),
            mask,
            self.clip_low,
            self.clip_high,
            num_tokens=num_tokens,
        )
        loss.backward()
        with torch.no_grad():
            ent = entropy_from_logits(logits[:, :-1].detach() / self.temperature)  # (b, l - 1)
            metrics["actor/entropy"] = float(masked_mean(ent, mask))
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
        zero grads."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.tensor(0.0)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"actor/grad_norm": float(norm), "actor/lr": float(self.optimizer.param_groups[0]["lr"])}

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        """One optimizer step over ``samples``; metrics are token-weighted over micro-batches."""
        batch = collate(samples, self.pad_id)
        total = max(batch.num_tokens, 1)
        sums: dict[str, float] = {}
        for start in range(0, len(samples), self.micro_batch_size):
            micro = batch.rows(start, start + self.micro_batch_size)
            weight = micro.num_tokens / total
            for key, value in self.backward(micro, total).items():
                if key == "actor/ratio_min":
                    sums[key] = min(sums.get(key, value), value)
                elif key == "actor/ratio_max":
                    sums[key] = max(sums.get(key, value), value)
                else:
                    sums[key] = sums.get(key, 0.0) + weight * value
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
        """Weights (HF dir under ``model/``), optimizer state, RNG states and step at ``path``."""
        final = Path(path)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        self.export_weights(tmp / "model")
        torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
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
        state = torch.load(root / "trainer_state.pt", weights_only=True)
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        self.step = int(state["step"])
        return self.step
