"""Batch assembly: from scored samples to padded tensors.

* :func:`samples_from_scored` turns :class:`schemas.events.ScoredSample` into
  :class:`TrainSample` (tokens, behaviour logprobs, reward, group); advantages are computed per
  batch by :mod:`trainer.algorithm` from the config.
* :func:`collate` right-pads ``prompt + response`` into one ``(B, L)`` batch and aligns the
  per-token tensors with the *targets* ``input_ids[:, 1:]`` (``(B, L - 1)``), so position ``t``
  of ``loss_mask`` / ``old_logprobs`` describes the token predicted from positions ``<= t``.
* :func:`segment_layout`, :func:`split_rows` and :func:`merge_rows`: a windowed episode's
  independent segments as rows of their own, and back.
* :func:`shared_prefix_layout`: the rows of a micro-batch packed into one sequence in which the
  rows of one group forward their common prefix (the prompt) once (``train.shared_prefix``).

Which samples make a batch (groups, staleness, the group rules) is the trainer service's
decision: :mod:`services.trainer.groups`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

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
    state_hashes: tuple[str, ...] = ()
    """Multi-turn: the environment state each agent turn acted from (GiGPO's anchors); empty or
    ``""`` entries = unknown (such a turn is its own anchor group)."""
    segment_starts: tuple[int, ...] = ()
    """Multi-turn with history windows: where each later turn's own prompt starts in
    ``response_ids``; ``prompt + response`` is then independent sequences (:func:`segment_layout`).
    Empty = one sequence."""
    baseline: float | None = None
    """ReMax: the reward of the group's greedy response (the baseline); ``None`` = none."""
    image_hashes: tuple[str, ...] = ()
    """The images the sequence shows, in order (digests in the run's blob store): a visual task's,
    then a visual environment's observations' (``Generation.image_hashes``); the forward shows them."""
    segment_image_hashes: tuple[tuple[str, ...], ...] = ()
    """Multi-turn with history windows and images: the images of each segment (one per row of
    :func:`segment_layout`), in order (``Generation.segment_image_hashes``); each row's forward
    shows its own. Empty = none, or one sequence."""


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
    def num_rows(self) -> int:
        """Rows of the batch (sequences; a windowed episode has one per turn after :func:`split_rows`)."""
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        """Samples with at least one trained token."""
        return int((self.loss_mask.sum(dim=1) > 0).sum())

    def replace(self, **changes: torch.Tensor | dict[str, torch.Tensor]) -> TokenBatch:
        """A copy with some fields replaced."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def by_length(self) -> TokenBatch:
        """The same rows, shortest sequence first (stable): consecutive micro-batches of
        :meth:`rows` then hold similar lengths and each is trimmed to less padding. Row order
        changes nothing else: every loss is a sum over rows weighted by share."""
        return self.take(torch.argsort(self.attention_mask.sum(dim=1), stable=True))

    def by_group(self) -> TokenBatch:
        """The same rows, the rows of a group together (groups in order of first appearance, each
        shortest first): consecutive micro-batches of :meth:`rows` then hold whole groups, whose
        common prompt :func:`shared_prefix_layout` forwards once."""
        order = torch.argsort(self.attention_mask.sum(dim=1), stable=True)  # (B,)
        groups = self.extras["group_ids"][order]  # (B,) dense ints in order of first appearance
        return self.take(order[torch.argsort(groups, stable=True)])

    def take(self, index: torch.Tensor) -> TokenBatch:
        """The rows ``index`` selects (a (B,) bool mask or row indices, in their order)."""
        return TokenBatch(
            input_ids=self.input_ids[index], attention_mask=self.attention_mask[index],
            loss_mask=self.loss_mask[index], old_logprobs=self.old_logprobs[index],
            advantages=self.advantages[index], extras={k: v[index] for k, v in self.extras.items()},
        )

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
    if any(s.baseline is not None for s in samples):  # ReMax
        if (lost := next((s for s in samples if s.baseline is None), None)) is not None:
            raise ValueError(f"sample {lost.sample_id}: no greedy baseline while others have one")
        extras["baselines"] = torch.tensor([s.baseline for s in samples], dtype=torch.float)  # (B,)
    return TokenBatch(ids, attn, loss_mask, old_lp, rewards.clone(), extras)


# --------------------------------------------------------------------------- segments (history windows)


Segment = tuple[int, int, int]
"""``(sample, start, end)``: tokens ``[start, end)`` of a sample's ``prompt + response``, one row."""


def segment_layout(samples: Sequence[TrainSample]) -> list[Segment] | None:
    """The rows of a batch whose samples hold independent segments (``segment_starts``: a windowed
    episode, one segment per turn), in sample order; ``None`` when every sample is one sequence."""
    if not any(s.segment_starts for s in samples):
        return None
    rows: list[Segment] = []
    for b, s in enumerate(samples):
        p, n = len(s.prompt_ids), len(s.prompt_ids) + len(s.response_ids)
        bounds = [0, *(p + k for k in s.segment_starts), n]
        if any(b1 <= b0 for b0, b1 in pairwise(bounds)) or bounds[-2] >= n:
            raise ValueError(f"sample {s.sample_id or b}: segment_starts {list(s.segment_starts)[:8]} do not "
                             f"increase strictly within its {len(s.response_ids)} response tokens")
        rows += [(b, lo, hi) for lo, hi in pairwise(bounds)]
    return rows


def split_rows(batch: TokenBatch, layout: Sequence[Segment]) -> TokenBatch:
    """``batch`` (one row per sample) cut into one row per segment, each left-aligned and
    right-padded: ``input_ids``/``attention_mask`` columns ``[start, end)`` of its sample, per-token
    tensors (``(B, L - 1)``, aligned with the targets) columns ``[start, end - 1)``; per-sample
    tensors (``(B,)``) are repeated for each of the sample's rows. The first token of a segment is
    predicted by no row: it is a turn's prompt, never trained."""
    width = max(hi - lo for _, lo, hi in layout)
    rows = len(layout)
    src = torch.tensor([b for b, _, _ in layout])  # (R,) sample of each row

    def tokens(t: torch.Tensor, w: int, shift: int) -> torch.Tensor:
        out = torch.zeros(rows, w, dtype=t.dtype)  # (R, w)
        for r, (b, lo, hi) in enumerate(layout):
            out[r, : hi - lo - shift] = t[b, lo : hi - shift]
        return out

    def cut(t: torch.Tensor) -> torch.Tensor:
        return tokens(t, width - 1, 1) if t.dim() == 2 else t[src]

    return TokenBatch(
        input_ids=tokens(batch.input_ids, width, 0),  # padded with id 0 (attention_mask 0 there)
        attention_mask=tokens(batch.attention_mask, width, 0),
        loss_mask=cut(batch.loss_mask),
        old_logprobs=cut(batch.old_logprobs),
        advantages=cut(batch.advantages),
        extras={k: cut(v) for k, v in batch.extras.items()},
    )


def merge_rows(x: torch.Tensor, layout: Sequence[Segment], samples: int, width: int) -> torch.Tensor:
    """The inverse of :func:`split_rows` for a per-token tensor: ``x`` (R, W - 1), one row per
    segment, back to ``(samples, width - 1)`` in the samples' columns (0 where no row predicts: each
    segment's first token)."""
    out = torch.zeros(samples, width - 1, dtype=x.dtype)  # (B, L - 1)
    for r, (b, lo, hi) in enumerate(layout):
        out[b, lo : hi - 1] = x[r, : hi - lo - 1]
    return out


# --------------------------------------------------------------------------- shared prefixes


def shared_prefix_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack right-padded rows ``(b, l)`` into one sequence of ``N`` tokens in which the rows of a
    group (``group_ids`` (b,)) forward their longest common prefix once, then each row's own rest.

    Returns the packed ``ids`` (N,), ``positions`` (N,) (each row's own positions: its rest
    continues after the shared prefix), ``allowed`` (N, N) bool (query ``q`` may attend key ``k``:
    the same group, ``k <= q``, and ``k`` is in the shared prefix or in ``q``'s own row) and
    ``index`` (b, l): where each (row, column) sits in the sequence (a padding column points at
    its row's last token). Every row's hidden states equal those of its own padded forward: the
    prefix's tokens see the same tokens in both, so the result (and its gradient) is exact."""
    lens = attention_mask.sum(dim=1).tolist()  # (b,)
    members: dict[int, list[int]] = {}
    for r, g in enumerate(group_ids.tolist()):
        members.setdefault(int(g), []).append(r)
    ids: list[torch.Tensor] = []
    pos: list[torch.Tensor] = []
    owner: list[torch.Tensor] = []  # -1: a group's shared prefix, else the row of the token
    group: list[torch.Tensor] = []
    index = torch.zeros(attention_mask.shape, dtype=torch.long, device=input_ids.device)  # (b, l)
    n = 0
    for g, rows in enumerate(members.values()):
        shortest = min(lens[r] for r in rows)
        same = (input_ids[rows, :shortest] == input_ids[rows[0], :shortest]).all(dim=0)  # (shortest,)
        shared = int(same.long().cumprod(dim=0).sum())  # the longest common prefix
        start = n
        ids.append(input_ids[rows[0], :shared])
        pos.append(torch.arange(shared, device=input_ids.device))
        owner.append(torch.full((shared,), -1, dtype=torch.long, device=input_ids.device))
        n += shared
        for r in rows:
            own = lens[r] - shared
            cols = torch.arange(attention_mask.shape[1], device=input_ids.device).clamp(max=lens[r] - 1)  # (l,)
            index[r] = torch.where(cols < shared, start + cols, n + cols - shared)
            ids.append(input_ids[r, shared : lens[r]])
            pos.append(torch.arange(shared, lens[r], device=input_ids.device))
            owner.append(torch.full((own,), r, dtype=torch.long, device=input_ids.device))
            n += own
        group.append(torch.full((n - start,), g, dtype=torch.long, device=input_ids.device))
    flat_owner, flat_group = torch.cat(owner), torch.cat(group)  # (N,) each
    at = torch.arange(n, device=input_ids.device)  # (N,)
    allowed = ((flat_group[:, None] == flat_group[None, :]) & (at[None, :] <= at[:, None])
               & ((flat_owner[None, :] == -1) | (flat_owner[None, :] == flat_owner[:, None])))  # (N, N)
    return torch.cat(ids), torch.cat(pos), allowed, index


# --------------------------------------------------------------------------- tensors


def samples_from_scored(scored: list[ScoredSample], baselines: Sequence[ScoredSample] = ()) -> list[TrainSample]:
    """Training samples from scored generations, in order (advantages come later, per batch).
    ``baselines``: ReMax's greedy responses of their groups, whose rewards become the samples'
    ``baseline`` (a sample whose group has none is an error when any is given)."""
    by_group = {b.generation.task.group_id: float(b.reward) for b in baselines}
    if by_group and (lost := [s.generation.task.sample_id for s in scored
                              if s.generation.task.group_id not in by_group]):
        raise ValueError(f"sample {lost[0]}: its group has no greedy baseline (remax)")
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
            step_rewards=tuple(s.step_rewards or s.generation.step_rewards),
            policy_version=s.generation.policy_version,
            state_hashes=tuple(s.generation.state_hashes),
            segment_starts=tuple(s.generation.segment_starts),
            baseline=by_group.get(s.generation.task.group_id),
            image_hashes=(*s.generation.task.image_hashes, *s.generation.image_hashes),
            segment_image_hashes=tuple(tuple(seg) for seg in s.generation.segment_image_hashes),
        )
        for s in scored
    ]
