"""Batch assembly: from scored samples to padded token tensors.

* :func:`split_stale` keeps samples with ``trainer_version - policy_version <= max_staleness``.
* :func:`samples_from_scored` turns :class:`schemas.events.ScoredSample` into
  :class:`TrainSample` (tokens, behaviour logprobs, reward, group); advantages are computed per
  batch by :mod:`trainer.algorithm` from the config.
* :func:`collate` right-pads ``prompt + response`` into one ``(B, L)`` batch and aligns the
  per-token tensors with the *targets* ``input_ids[:, 1:]`` (``(B, L - 1)``), so position ``t``
  of ``loss_mask`` / ``old_logprobs`` describes the token predicted from positions ``<= t``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from schemas.events import ScoredSample


@dataclass(frozen=True)
class TrainSample:
    """One trajectory ready for the loss."""

    prompt_ids: list[int]
    response_ids: list[int]
    old_logprobs: list[float]
    """Behaviour logprob of each response token (``len == len(response_ids)``)."""
    loss_mask: list[int]
    """1 for response tokens that are trained on."""
    reward: float
    """The sample's (outcome) reward."""
    sample_id: str = ""
    group_id: str = ""
    """Samples of the same prompt share it (the group baseline of GRPO, RLOO, ...)."""
    truncated: bool = False
    """The response hit the token limit (``finish_reason == "length"``)."""
    step_rewards: tuple[float, ...] = ()
    """Multi-turn: one reward per agent turn (contiguous run of ``loss_mask == 1``); empty = the
    outcome ``reward`` on the last turn."""
    policy_version: int = 0
    """Weights version that generated it."""


@dataclass(frozen=True)
class TokenBatch:
    """Padded tensors of a list of :class:`TrainSample`."""

    input_ids: torch.Tensor  # (B, L) long, right-padded
    attention_mask: torch.Tensor  # (B, L) long
    loss_mask: torch.Tensor  # (B, L - 1) float, aligned with input_ids[:, 1:]
    old_logprobs: torch.Tensor  # (B, L - 1) float, aligned with input_ids[:, 1:]
    advantages: torch.Tensor  # (B,) or (B, L - 1) float
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    """More per-sample (B,) or per-token (B, L - 1) tensors (rewards, ref logprobs, values, ...)."""

    @property
    def num_tokens(self) -> int:
        """Trained tokens in the batch."""
        return int(self.loss_mask.sum())

    @property
    def num_seqs(self) -> int:
        """Samples with at least one trained token."""
        return int((self.loss_mask.sum(dim=1) > 0).sum())

    def replace(self, **changes: torch.Tensor | dict[str, torch.Tensor]) -> TokenBatch:
        """A copy with some fields replaced."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def rows(self, start: int, stop: int) -> TokenBatch:
        """Rows ``start:stop`` (a micro-batch), trimmed to their longest sequence."""
        width = int(self.attention_mask[start:stop].sum(dim=1).max())

        def cut(t: torch.Tensor) -> torch.Tensor:
            return t[start:stop, : width - 1] if t.dim() == 2 else t[start:stop]

        return TokenBatch(
            input_ids=self.input_ids[start:stop, :width],
            attention_mask=self.attention_mask[start:stop, :width],
            loss_mask=cut(self.loss_mask),
            old_logprobs=cut(self.old_logprobs),
            advantages=cut(self.advantages),
            extras={k: cut(v) for k, v in self.extras.items()},
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
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float)  # (B,)
    group_index = {g: i for i, g in enumerate(dict.fromkeys(s.group_id for s in samples))}
    extras = {
        "rewards": rewards,
        "group_ids": torch.tensor([group_index[s.group_id] for s in samples]),  # (B,) dense ints
        "truncated": torch.tensor([s.truncated for s in samples], dtype=torch.bool),  # (B,)
        "response_len": torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float),  # (B,)
    }
    return TokenBatch(ids, attn, loss_mask, old_lp, rewards.clone(), extras)


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


def samples_from_scored(scored: list[ScoredSample]) -> list[TrainSample]:
    """Training samples from scored generations, in order (advantages come later, per batch)."""
    return [
        TrainSample(
            prompt_ids=list(s.generation.prompt_ids),
            response_ids=list(s.generation.response_ids),
            old_logprobs=list(s.generation.logprobs),
            loss_mask=list(s.generation.loss_mask),
            reward=float(s.reward),
            sample_id=s.generation.task.sample_id,
            group_id=s.generation.task.group_id,
            truncated=s.generation.finish_reason == "length",
            step_rewards=tuple(s.step_rewards),
            policy_version=s.generation.policy_version,
        )
        for s in scored
    ]
