"""The environment interface (GEM-style), task sources, and the results verifiers return.

An environment is driven by ``reset()`` then ``step(action)`` until ``terminated`` or
``truncated`` (the Gymnasium / GEM convention, with text observations and actions). A
single-turn verifier is an environment with exactly one step: ``reset`` returns the prompt,
``step(response)`` returns the reward and terminates (:class:`envs.single_turn.SingleTurnEnv`).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable


class StepResult(NamedTuple):
    """What ``Env.step`` returns; unpacks like Gymnasium's 5-tuple."""

    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]


@runtime_checkable
class Env(Protocol):
    """A text environment: ``reset() -> (observation, info)``, ``step(action) -> StepResult``."""

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]: ...

    def step(self, action: str) -> StepResult: ...


@dataclass(frozen=True)
class VerifyResult:
    """A verifier's judgement of one response. ``error`` is non-empty when it crashed or timed out
    (then ``reward`` is 0 and ``correct`` False)."""

    reward: float
    correct: bool
    details: str = ""
    error: str = ""
    components: dict[str, float] = field(default_factory=dict)


class Verifier(Protocol):
    """``verifier(response, reference, **kwargs) -> VerifyResult`` (may raise; callers guard it)."""

    def __call__(self, response: str, reference: str, **kwargs: Any) -> VerifyResult: ...


@dataclass(frozen=True)
class Problem:
    """One prompt of a task source with its ground truth."""

    prompt_id: str
    """Stable id within the source (same across runs)."""
    prompt: str
    reference: str
    """What the verifier compares against."""
    verifier: str
    """The source's default verifier name."""


@runtime_checkable
class TaskSource(Protocol):
    """A generator of training prompts with a fixed, disjoint held-out split."""

    name: str
    default_verifier: str

    def sample(self, rng: random.Random) -> Problem:
        """A training problem (never a held-out one)."""
        ...

    def heldout(self, n: int) -> list[Problem]:
        """The first ``n`` problems of the fixed held-out split (deterministic)."""
        ...

    def is_heldout(self, problem: Problem) -> bool:
        """Whether ``problem`` belongs to the held-out split."""
        ...

    def demonstration(self, problem: Problem, rng: random.Random) -> str:
        """A correct response to ``problem`` to imitate in the supervised warm-up."""
        ...


@dataclass(frozen=True)
class EpisodeRef:
    """The reference of a multi-turn problem: which environment, with which kwargs, from which seed."""

    env: str
    kwargs: dict[str, Any]
    seed: int


def episode_ref(reference: str) -> EpisodeRef:
    """Parse a multi-turn problem's reference (``{"env", "seed", "kwargs"}`` as JSON, as the episode
    sources write it); ``ValueError`` naming what is missing or malformed."""
    try:
        ref = json.loads(reference)
        return EpisodeRef(env=str(ref["env"]), kwargs=dict(ref.get("kwargs") or {}), seed=int(ref["seed"]))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"the reference of a multi-turn problem must be JSON with env, seed and kwargs: "
                         f"{type(e).__name__}: {e}") from None


def seed_heldout(salt: str, seed: int, fraction: float) -> bool:
    """Whether ``seed`` is in the held-out split: ``sha256(salt|seed)`` in ``[0, 1)`` < fraction."""
    digest = hashlib.sha256(f"{salt}|{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def seed_of(problem: Problem, name: str) -> int:
    """The seed of a ``"<name>:<seed>"`` problem id."""
    prefix, _, seed = problem.prompt_id.partition(":")
    if prefix != name or not seed.lstrip("-").isdigit():
        raise ValueError(f"not a {name} problem id: {problem.prompt_id!r}")
    return int(seed)
