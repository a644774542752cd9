"""Batch assembly: from scored samples to padded token tensors.

* :func:`split_stale` keeps samples with ``trainer_version - policy_version <= max_staleness``.
* :func:`samples_from_scored` groups :class:`schemas.events.ScoredSample` by ``group_id`` and
  computes GRPO advantages per group (:func:`trainer.algos.grpo_advantages`).
* :func:`collate` right-pads ``prompt + response`` into one ``(B, L)`` batch and aligns the
  per-token tensors with the *targets* ``input_ids[:, 1:]`` (``(B, L - 1)``), so position ``t``
  of ``loss_mask`` / ``old_logprobs`` describes the token predicted from positions ``<= t``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from schemas.events import ScoredSample
from trainer.algos import grpo_advantages


@dataclass(frozen=True)
class TrainSample:
    """One trajectory ready for the loss."""

    prompt_ids: list[int]
    response_ids: list[int]
    old_logprobs: list[float]
    """Behaviour logprob of each response token (``len == len(response_ids)``)."""
    loss_mask: list[int]
    """1 for response tokens that are trained on."""
    advantage: float
    sample_id: str = ""


@dataclass(frozen=True)
class TokenBatch:
    """Padded tensors of a list of :class:`TrainSample`."""

    input_ids: torch.Tensor  # (B, L) long, right-padded
    attention_mask: torch.Tensor  # (B, L) long
    loss_mask: torch.Tensor  # (B, L - 1) float, aligned with input_ids[:, 1:]
    old_logprobs: torch.Tensor  # (B, L - 1) float, aligned with input_ids[:, 1:]
    advantages: torch.Tensor  # (B,) float

    @property
    def num_tokens(self) -> int:
        """Trained tokens in the batch."""
        return int(self.loss_mask.sum())

    def rows(self, start: int, stop: int) -> TokenBatch:
        """Rows ``start:stop`` (a micro-batch), trimmed to their longest sequence."""
        width = int(self.attention_mask[start:stop].sum(dim=1).max())
        return TokenBatch(
            input_ids=self.input_ids[start:stop, :width],
            attention_mask=self.attention_mask[start:stop, :width],
            loss_mask=self.loss_mask[start:stop, : width - 1],
            old_logprobs=self.old_logprobs[start:stop, : width - 1],
            advantages=self.advantages[start:stop],
        )


def collate(samples: list[TrainSample], pad_id: int) -> TokenBatch:
    """Right-pad ``prompt + response`` of every sample into one batch (see the module doc)."""
    if not samples:
        raise ValueError("collate: no samples")
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)  # (B, L)
    attn = torch.zeros(len(samples), width, dtype=torch.long)  # (B, L)
    loss_mask = torch.zeros(len(samples), width - 1)  # (B, L - 1)
    old_lp = torch.zeros(len(samples), width - 1)  # (B, L - 1)
    for i, s in enumerate(samples):
        if not (len(s.response_ids) == len(s.old_logprobs) == len(s.loss_mask)):
            raise ValueError(f"sample {s.sample_id or i}: response, logprobs and loss_mask lengths differ")
        p, n = len(s.prompt_ids), len(s.response_ids)
        ids[i, : p + n] = torch.tensor(s.prompt_ids + s.response_ids)
        attn[i, : p + n] = 1
        # the target at input position p + j is response token j; it sits at column p + j - 1
        loss_mask[i, p - 1 : p - 1 + n] = torch.tensor(s.loss_mask, dtype=torch.float)
        old_lp[i, p - 1 : p - 1 + n] = torch.tensor(s.old_logprobs, dtype=torch.float)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float)  # (B,)
    return TokenBatch(ids, attn, loss_mask, old_lp, advantages)


def split_stale(
    samples: list[ScoredSample], trainer_version: int, max_staleness: int
) -> tuple[list[ScoredSample], list[tuple[ScoredSample, str]]]:
    """``(kept, dropped_with_reason)`` by the staleness rule of DESIGN.md."""
    kept, dropped = [], []
    for s in samples:
        gap = trainer_version - s.generation.policy_version
        if gap <= max_staleness:
            kept.append(s)
        else:
            dropped.append((s, f"stale: gap {gap} > {max_staleness}"))
    return kept, dropped


def samples_from_scored(
    scored: list[ScoredSample], norm_std: bool = True, eps: float = 1e-6
) -> list[TrainSample]:
    """GRPO training samples from scored generations (advantages computed within ``group_id``)."""
    if not scored:
        return []
    group_index = {g: i for i, g in enumerate(dict.fromkeys(s.generation.task.group_id for s in scored))}
    ids = torch.tensor([group_index[s.generation.task.group_id] for s in scored])  # (N,)
    rewards = torch.tensor([s.reward for s in scored], dtype=torch.float)  # (N,)
    adv = grpo_advantages(rewards, ids, norm_std=norm_std, eps=eps).tolist()
    return [
        TrainSample(
            prompt_ids=list(s.generation.prompt_ids),
            response_ids=list(s.generation.response_ids),
            old_logprobs=list(s.generation.logprobs),
            loss_mask=list(s.generation.loss_mask),
            advantage=a,
            sample_id=s.generation.task.sample_id,
        )
        for s, a in zip(scored, adv, strict=True)
    ]
