"""Impossible values a service rejects — the record is dead-lettered with the reason — instead of
handling them: the rollout worker checks each ``RolloutTask``, the reward router each
``Generation``, the trainer each ``ScoredSample`` (every check of the stages before included).

An event that decoded is type-valid, not sound: its numbers can still be NaN or infinite, its
counts negative or absurdly large, its per-token lists of different lengths. Each check returns
one line saying what is wrong, or ``None`` when the event is sound; none raises.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable
from itertools import pairwise

from schemas import events as ev

__all__ = ["MAX_GROUP_SIZE", "MAX_TOKENS", "MAX_TOKEN_ID", "check_generation", "check_scored", "check_task"]

MAX_GROUP_SIZE = 1 << 16
"""Most samples one group can have (far above any real ``rollout.group_size``)."""
MAX_TOKENS = 1 << 20
"""Most tokens one sample can have, prompt and response together (and a task's token cap)."""
MAX_TOKEN_ID = (1 << 31) - 1
"""Largest token id (int32, what every engine and trainer indexes with)."""
_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_LOGPROB_SLACK = 1e-3
"""A log-probability above this is impossible (``log p <= 0``; a little float error allowed)."""


_ZERO_ONE = frozenset((0, 1))


def _first_bad(values: Iterable[float]) -> float | None:
    return next((x for x in values if not math.isfinite(x)), None)


def _ids_in_range(ids: list[int]) -> bool:
    """Whether every token id is in ``[0, MAX_TOKEN_ID]`` (an empty list is)."""
    return not ids or (min(ids) >= 0 and max(ids) <= MAX_TOKEN_ID)


def check_task(task: ev.RolloutTask, domains: Collection[str] = ()) -> str | None:
    """A task's group must be possible (``0 <= index < group_size + redundancy <= MAX_GROUP_SIZE``, or
    ``index == baseline_index == group_size + redundancy``: a ReMax baseline), its token
    cap positive and sane, its ids non-empty, its policy version >= 0, its image hashes sha256 hex
    digests, and (when ``domains`` is given
    and the task names no ``env``) its domain one of the run's."""
    sid = task.sample_id
    if not sid or not task.group_id:
        return f"task {sid!r}: sample_id and group_id must not be empty"
    if task.redundancy < 0 or task.group_size < 1 or task.group_size + task.redundancy > MAX_GROUP_SIZE \
            or not (0 <= task.index < task.group_size + task.redundancy or task.is_baseline):
        extra = f" + {task.redundancy} redundant" if task.redundancy else ""
        return f"task {sid}: index {task.index} impossible in a group of {task.group_size}{extra}"
    if task.baseline_index not in (-1, task.group_size + task.redundancy):
        return (f"task {sid}: baseline_index {task.baseline_index} must be -1 or "
                f"{task.group_size + task.redundancy} (one past the group's samples)")
    if task.max_new_tokens is not None and not 1 <= task.max_new_tokens <= MAX_TOKENS:
        return f"task {sid}: max_new_tokens {task.max_new_tokens} not in [1, {MAX_TOKENS}]"
    if task.policy_version < 0:
        return f"task {sid}: policy_version {task.policy_version} < 0"
    if task.env is not None and _first_bad(v for v in task.env.kwargs.values() if isinstance(v, float)) is not None:
        return f"task {sid}: env.kwargs hold a non-finite number"
    bad = next((h for h in task.image_hashes if not _DIGEST.match(h)), None) if task.image_hashes else None
    if bad is not None:
        return f"task {sid}: image hash {bad[:80]!r} is not a sha256 hex digest (64 lowercase hex digits)"
    if domains and task.env is None and task.domain not in domains:
        return f"task {sid}: unknown domain {task.domain!r} (this run has: {', '.join(sorted(domains))})"
    return None


def check_generation(gen: ev.Generation) -> str | None:
    """A generation's per-token lists must line up (``response_ids``, ``logprobs``,
    ``loss_mask``), its ``segment_starts`` increasing and on untrained tokens, its prompt be non-empty, its token ids in ``[0, MAX_TOKEN_ID]`` and its length
    at most ``MAX_TOKENS``, its logprobs finite and ``<= 0``, its loss mask 0/1, its policy versions
    ordered (``0 <= policy_version <= policy_version_end``), its timings finite, its image hashes
    sha256 digests (a windowed episode's ``segment_image_hashes`` one list per segment, concatenated
    its ``image_hashes``), and its task possible."""
    sid = gen.task.sample_id
    if not len(gen.response_ids) == len(gen.logprobs) == len(gen.loss_mask):
        return (f"generation {sid}: response_ids ({len(gen.response_ids)}), logprobs ({len(gen.logprobs)}) and "
                f"loss_mask ({len(gen.loss_mask)}) lengths differ")
    if not gen.prompt_ids:
        return f"generation {sid}: prompt_ids is empty"
    if len(gen.prompt_ids) + len(gen.response_ids) > MAX_TOKENS:
        return f"generation {sid}: {len(gen.prompt_ids) + len(gen.response_ids)} tokens (more than {MAX_TOKENS})"
    # every sample passes these per-token checks: min, max, map and set run them at C speed
    if not _ids_in_range(gen.prompt_ids) or not _ids_in_range(gen.response_ids):
        return f"generation {sid}: token ids outside [0, {MAX_TOKEN_ID}]"
    if not all(map(math.isfinite, gen.logprobs)):
        return f"generation {sid}: logprobs hold non-finite values ({_first_bad(gen.logprobs)})"
    if gen.logprobs and max(gen.logprobs) > _LOGPROB_SLACK:
        return f"generation {sid}: logprobs above 0 (log-probabilities are <= 0)"
    if not _ZERO_ONE.issuperset(gen.loss_mask):
        return f"generation {sid}: loss_mask holds values other than 0 and 1"
    starts = gen.segment_starts
    if starts:
        if any(b <= a for a, b in pairwise([0, *starts])) or starts[-1] >= len(gen.response_ids):
            return (f"generation {sid}: segment_starts {starts[:8]} must increase strictly within the "
                    f"{len(gen.response_ids)} response tokens, after the first")
        if any(gen.loss_mask[i] for i in starts):
            return f"generation {sid}: a segment starts on a trained token (segment_starts begin a turn's prompt)"
    if gen.policy_version < 0:
        return f"generation {sid}: policy_version {gen.policy_version} < 0"
    if gen.policy_version_end < gen.policy_version:
        return f"generation {sid}: policy_version_end {gen.policy_version_end} < policy_version {gen.policy_version}"
    if gen.num_turns < 1:
        return f"generation {sid}: num_turns {gen.num_turns} < 1"
    bad = _first_bad((gen.queued_s, gen.gen_s, gen.env_s))
    if bad is not None:
        return f"generation {sid}: timings hold non-finite values ({bad})"
    odd = next((h for h in gen.image_hashes if not _DIGEST.match(h)), None) if gen.image_hashes else None
    if odd is not None:
        return f"generation {sid}: image hash {odd[:80]!r} is not a sha256 hex digest (64 lowercase hex digits)"
    if gen.segment_image_hashes:
        if len(gen.segment_image_hashes) != len(starts) + 1:
            return (f"generation {sid}: segment_image_hashes has {len(gen.segment_image_hashes)} segments, "
                    f"segment_starts gives {len(starts) + 1}")
        if [h for seg in gen.segment_image_hashes for h in seg] != list(gen.image_hashes):
            return f"generation {sid}: image_hashes is not the concatenation of segment_image_hashes"
    return check_task(gen.task)


def check_scored(s: ev.ScoredSample) -> str | None:
    """A scored sample's rewards (``reward``, ``rewards``, ``step_rewards``) and ``reward_s`` must be
    finite, its policy version >= 0, and its generation sound."""
    sid = s.generation.task.sample_id
    if not math.isfinite(s.reward):
        return f"scored {sid}: reward is {s.reward} (not finite)"
    bad = _first_bad([*s.rewards.values(), *s.step_rewards, s.reward_s])
    if bad is not None:
        return f"scored {sid}: rewards, step_rewards or reward_s hold non-finite values ({bad})"
    if s.policy_version < 0:
        return f"scored {sid}: policy_version {s.policy_version} < 0"
    return check_generation(s.generation)
