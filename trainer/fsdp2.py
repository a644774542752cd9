"""``train.strategy: fsdp2``: the local strategy of one rank of a PyTorch FSDP2 trainer.

:class:`FSDP2Strategy` is a :class:`trainer.strategy.TorchStrategy` whose model is sharded with
``torch.distributed.fsdp.fully_shard`` (each decoder layer its own unit, then the whole model;
parameters, gradients and the AdamW state split along dim 0). Every rank of the default process
group (started by :class:`trainer.ranks.MultiRankStrategy`) builds one and runs the same
:class:`~trainer.strategy.Strategy` calls in the same order with the same arguments.

Data parallel, equal to the single-process full-batch step: every rank prepares the whole batch
identically; the micro-batches that train anything are dealt round-robin (:func:`deal`), each
loss scaled by its share of the whole batch times the world size (FSDP2 averages the reduced
gradients); a rank with fewer runs a zero-weighted one so every rank takes part in the same
collectives; metrics are merged over the ranks (:func:`merge_rank_metrics`). Token logprobs are
chunked from the hidden states and micro-batches may be packed, as in the torch strategy
(``train.logprob_chunk_tokens``, ``train.micro_batch_tokens``). Parameters keep the
model's dtype (no mixed precision). The KL reference and a critic are replicated, not sharded;
LoRA is refused by the config.

Persistence: :meth:`FSDP2Strategy.export_weights` gathers the full state and rank 0 writes the
same HF directory and sha256 as ``TorchStrategy``; a checkpoint is written in full by rank 0
(``optimizer.pt`` keyed by parameter name) and read back by every rank, so it resumes with any
number of ranks, but not with ``train.strategy: torch``. Design: docs/architecture.md, "Engines
and strategies".
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from schemas.config import RunConfig
from trainer.batch import TrainSample
from trainer.logprobs import last_hidden
from trainer.strategy import EXTREME_METRICS, TorchStrategy, ValueModel, strategy_kwargs
from weights import publish_dir, read_weights, weights_sha256

__all__ = ["FSDP2Strategy", "merge_rank_metrics", "tied_aliases"]


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Parameter name -> the first name of the same tensor, for every name after the first of a
    tied parameter (``{"lm_head.weight": "model.embed_tokens.weight"}`` with tied embeddings)."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


EXTREMES = EXTREME_METRICS
"""Metrics combined by minimum / maximum (not share-weighted)."""


def merge_rank_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Combine per-rank sums of share-weighted micro-batch metrics: ``actor/ratio_min`` /
    ``actor/ratio_max`` by minimum / maximum, every other key by sum (ranks in order)."""
    out: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            if key == "actor/ratio_min":
                out[key] = min(out.get(key, value), value)
            elif key == "actor/ratio_max":
                out[key] = max(out.get(key, value), value)
            else:
                out[key] = out.get(key, 0.0) + value
    return out


def deal(n: int, world: int, rank: int) -> tuple[list[int], int]:
    """Round-robin ``n`` items over ``world`` ranks: the indices of ``rank``'s items, and the most
    any rank gets (every rank runs that many micro-batches)."""
    return list(range(rank, n, world)), -(-n // world)


class FSDP2Strategy(TorchStrategy):
    """One rank of an FSDP2 data-parallel trainer (see the module doc). Needs
    ``torch.distributed`` initialised (world size = ``train.ranks``)."""

    def _decode(self, model: torch.nn.Module, decoder: torch.nn.Module, **inputs: Any) -> torch.Tensor:
        """The policy's last hidden states through its root FSDP unit's forward (with no logits:
        :func:`trainer.logprobs.last_hidden`), which gathers the embedding, final norm and head and
        keeps them gathered until its backward: the chunked head then reads the full head weight
        and its gradient is reduce-scattered with the root unit's. The reference and a critic's
        trunk are plain models."""
        if model is not self.model:
            return super()._decode(model, decoder, **inputs)
        hidden = last_hidden(model, decoder, **inputs)
        head: Any = self.model.get_output_embeddings()  # type: ignore[operator]
        if isinstance(head.weight, DTensor):  # a torch whose root unit reshards
            raise RuntimeError(f"fsdp2: torch {torch.__version__} resharded the root FSDP unit after its forward; "
                               "the chunked token logprobs need its full head weight there")
        return hidden

    def __init__(self, cfg: RunConfig, model_dir: str | Path, *, device: str) -> None:
        if not dist.is_initialized():
            raise RuntimeError("FSDP2Strategy needs torch.distributed initialised (trainer.ranks.MultiRankStrategy "
                               "starts the ranks and does it)")
        super().__init__(model_dir, **strategy_kwargs(cfg, device))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._aliases = tied_aliases(self.model)
        mesh = init_device_mesh(self.device.type, (self.world,))
        units = set(getattr(self.model, "_no_split_modules", None) or [])  # e.g. {"LlamaDecoderLayer"}
        for module in list(self.model.modules()):
            if type(module).__name__ in units:
                fully_shard(module, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        defaults = {k: v for k, v in self.optimizer.defaults.items() if k != "decoupled_weight_decay"}  # AdamW's own
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **defaults)  # over the sharded parameters

    # ----------------------------------------------------------------- state

    def full_state(self, *, everywhere: bool = False) -> dict[str, torch.Tensor]:
        """The full (unsharded) model state on the CPU, tied names sharing one tensor (as in
        ``state_dict()``). Collective. On rank 0 only (the other ranks get ``{}``) unless
        ``everywhere``."""
        raw = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True,
                                                                        cpu_offload=not everywhere))
        state = {k: v.detach().cpu() for k, v in raw.items() if isinstance(v, torch.Tensor)}
        for alias, name in self._aliases.items():
            if name in state:
                state[alias] = state[name]
        return state

    def _load_full_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full state (tied names may be missing) into the sharded model on every rank."""
        full: dict[str, Any] = dict(state)
        for alias, name in self._aliases.items():
            if alias not in full and name in full:
                full[alias] = full[name]
        set_model_state_dict(self.model, full, options=StateDictOptions(full_state_dict=True))

    def _rank0_writes(self, final: Path, write: Any) -> str:
        """Rank 0: ``write(tmp)`` into a temporary sibling of ``final``, then rename it into place;
        return the sha256 of its safetensors (the HF dir) or "". Every rank gets rank 0's result
        once the directory is in place (a collective)."""
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                with publish_dir(final) as tmp:
                    write(tmp)
                    checksum = weights_sha256(tmp) if any(tmp.glob("*.safetensors")) else ""
                box[0] = ("ok", checksum)
            except Exception as e:  # the other ranks must not wait for a directory that never comes
                box[0] = ("error", f"{type(e).__name__}: {e}")
                dist.broadcast_object_list(box, src=0)
                raise
        dist.broadcast_object_list(box, src=0)
        status, value = box[0]
        if status != "ok":
            raise RuntimeError(f"rank 0 failed to write {final}: {value}")
        return str(value)

    def _write_hf(self, path: Path, state: dict[str, torch.Tensor]) -> None:
        self.model.save_pretrained(path, state_dict=state)
        self.tokenizer.save_pretrained(path)

    def export_weights(self, path: str | Path) -> tuple[Path, str]:
        """Gather the full weights (collective); rank 0 writes them as a complete HF dir at
        ``path`` (as ``TorchStrategy`` does). Every rank returns the path and its sha256."""
        state = self.full_state()
        final = Path(path)
        checksum = self._rank0_writes(final, lambda tmp: self._write_hf(tmp, state))
        return final, checksum

    def save_checkpoint(self, path: str | Path) -> Path:
        """Rank 0 writes the full checkpoint; collective. ``model/`` (HF dir), ``optimizer.pt`` (the
        full AdamW state keyed by parameter name, as ``get_optimizer_state_dict`` gives it),
        ``critic.pt``, ``algo_state.msgpack``, ``trainer_state.pt`` (step, rank 0's RNG states)."""
        state = self.full_state()
        optim = get_optimizer_state_dict(self.model, self.optimizer,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))

        def write(tmp: Path) -> None:
            self._write_hf(tmp / "model", state)
            torch.save(optim, tmp / "optimizer.pt")
            if self.critic is not None and self.critic_optimizer is not None:
                torch.save({"model": self.critic.state_dict(), "optimizer": self.critic_optimizer.state_dict()},
                           tmp / "critic.pt")
            (tmp / "algo_state.msgpack").write_bytes(msgspec.msgpack.encode(self.algo_state))
            torch.save({"step": self.step, "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
                        "world_size": self.world}, tmp / "trainer_state.pt")

        final = Path(path)
        self._rank0_writes(final, write)
        return final

    def load_checkpoint(self, path: str | Path) -> int:
        """Every rank reads :meth:`save_checkpoint`'s files: model, optimizer (resharded), critic,
        algorithm state, RNG states (rank 0's) and step; returns the step."""
        root = Path(path)
        self._load_full_state(read_weights(root / "model"))
        optim = torch.load(root / "optimizer.pt", map_location="cpu", weights_only=False)
        if not isinstance(optim.get("state"), dict) or any(isinstance(k, int) for k in optim["state"]):
            raise ValueError(f"{root} is not an fsdp2 checkpoint (its optimizer.pt is keyed by parameter index: "
                             "written by train.strategy=torch); resume it with train.strategy=torch")
        set_optimizer_state_dict(self.model, self.optimizer, optim, options=StateDictOptions(full_state_dict=True))
        self._load_critic(root)
        return self._load_run_state(root)

    # ----------------------------------------------------------------- optional models

    def init_reference(self, path: str | Path | None = None) -> None:
        """The frozen reference: a plain (unsharded) copy on every rank of the weights at ``path``
        (an exported HF dir) or of the current weights (gathered, collective)."""
        state = read_weights(path) if path is not None else self.full_state(everywhere=True)
        self.ref_model = self._plain_copy(state)

    def init_critic(self) -> None:
        """The critic, replicated on every rank: a zero-initialised value head on the policy's
        hidden states (``value_head``) or on a plain copy of the current policy's trunk
        (``separate``; gathered, collective)."""
        if self.algo.critic == "none":
            return
        hidden = int(self.model.config.hidden_size)
        trunk = None
        if self.algo.critic == "separate":
            plain = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=self.dtype, local_files_only=True,
                                                         attn_implementation="sdpa")
            plain.load_state_dict(self.full_state(everywhere=True), strict=False)
            trunk = plain.base_model
        self.critic = ValueModel(hidden, trunk).to(self.device)
        self.critic.train()
        lr = self.algo.critic_lr if self.algo.critic_lr is not None else self.base_lr * 10
        self.critic_optimizer = torch.optim.AdamW(
            [p for p in self.critic.parameters() if p.requires_grad], lr=lr, betas=self.betas)

    # ----------------------------------------------------------------- one step

    def optimizer_step(self) -> dict[str, float]:
        """Average the replicated critic's gradients over the ranks, then ``TorchStrategy``'s step
        (the policy's gradients are already reduced by FSDP2)."""
        if self.critic is not None:
            for p in self.critic.parameters():
                if p.requires_grad:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    dist.all_reduce(p.grad)
                    p.grad.div_(self.world)
        return super().optimizer_step()

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        """One optimizer step over ``samples``, this rank training its share of the micro-batches
        (see the module doc); the metrics are those of the whole batch."""
        batch, sums = self.prepare(samples)
        trained, micros = self.micro_batches(batch)
        mine, rounds = deal(len(micros), self.world, self.rank)
        acc: dict[str, float] = {}
        for i in range(rounds):
            if i < len(mine):
                micro, share = micros[mine[i]]
                metrics = self.backward(micro, share * self.world)  # FSDP2 divides the reduced gradient by world
                acc = merge_rank_metrics([acc, {k: v if k in EXTREMES else share * v
                                                for k, v in metrics.items()}])
            else:  # keep in step with the other ranks' collectives; adds nothing
                self.backward(micros[0][0], 0.0)
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, acc)
        sums.update(self.trained_metrics(merge_rank_metrics(parts), batch, trained))
        sums.update(self.optimizer_step())
        sums["train/tokens"] = float(batch.num_tokens)
        sums["train/samples"] = float(len(samples))
        return sums
