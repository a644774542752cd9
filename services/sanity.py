"""Impossible values a service rejects — the record is dead-lettered with the reason — instead of
handling them: the rollout worker checks each ``RolloutTask``, the reward router each
``Generation``, the trainer each ``ScoredSample`` (every check of the stages before included).

Each check returns one line saying what is wrong, or ``None`` when the event is sound.
"""

from __future__ import annotations

import math
from collections.abc import Collection

from schemas import events as ev

__all__ = ["check_generation", "check_scored", "check_task"]


def check_task(task: ev.RolloutTask, domains: Collection[str] = ()) -> str | None:
    """A task's group must be possible (``0 <= index < group_size``), its token cap positive, and
    (when ``domains`` is given and the task names no ``env``) its domain one of the run's."""
    if task.group_size < 1 or not 0 <= task.index < task.group_size:
        return f"task {task.sample_id}: index {task.index} impossible in a group of {task.group_size}"
    if task.max_new_tokens is not None and task.max_new_tokens < 1:
        return f"task {task.sample_id}: max_new_tokens {task.max_new_tokens} < 1"
    if domains and task.env is None and task.domain not in domains:
        return f"task {task.sample_id}: unknown domain {task.domain!r} (this run has: {', '.join(sorted(domains))})"
    return None


def check_generation(gen: ev.Generation) -> str | None:
    """A generation's per-token lists must line up (``response_ids``, ``logprobs``,
    ``loss_mask``), its logprobs be finite, and its task be possible."""
    sid = gen.task.sample_id
    if not len(gen.response_ids) == len(gen.logprobs) == len(gen.loss_mask):
        return (f"generation {sid}: response_ids ({len(gen.response_ids)}), logprobs ({len(gen.logprobs)}) and "
                f"loss_mask ({len(gen.loss_mask)}) lengths differ")
    if not all(math.isfinite(x) for x in gen.logprobs):
        return f"generation {sid}: logprobs hold non-finite values"
    if gen.policy_version < 0:
        return f"generation {sid}: policy_version {gen.policy_version} < 0"
    return check_task(gen.task)


def check_scored(s: ev.ScoredSample) -> str | None:
    """A scored sample's reward must be finite, and its generation sound."""
    if not math.isfinite(s.reward):
        return f"scored {s.generation.task.sample_id}: reward is {s.reward} (not finite)"
    return check_generation(s.generation)
