"""The environment interface (GEM-style), task sources, and the results verifiers return.

An environment is driven by ``reset()`` then ``step(action)`` until ``terminated`` or
``truncated`` (the Gymnasium / GEM convention, with text observations and actions). A
single-turn verifier is an environment with exactly one step: ``reset`` returns the prompt,
``step(response)`` returns the reward and terminates (:class:`envs.single_turn.SingleTurnEnv`).

Every task source's split uses the helpers at the end: :func:`is_heldout_key` (a key is held out
by its salted hash), :func:`draw_training` (at most :data:`MAX_DRAWS` draws for a training
problem) and :func:`first_heldout` (a bounded search for the held-out problems), each failing
with one clear error instead of looping forever.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar, runtime_checkable

K = TypeVar("K", bound=Hashable)


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


def observation_images(env: Any) -> tuple[bytes, ...]:
    """The images (PNG bytes) the latest observation of ``env`` shows: a visual environment's
    ``observation_images()`` (e.g. ``frozenlake_pixels``), ``()`` for a text environment."""
    shown = getattr(env, "observation_images", None)
    return tuple(bytes(b) for b in shown()) if callable(shown) else ()


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
    system_prompt: str = ""
    """This problem's own system turn (a file row's ``system_key``); empty = its domain's
    ``system_prompt``, else ``model.system_prompt``."""
    images: tuple[bytes, ...] = ()
    """A visual task's images (PNG bytes), shown before the prompt text; the feeder stores them in
    the run's blob store and the task carries their digests (``RolloutTask.image_hashes``)."""


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


MAX_DRAWS = 10_000
"""Draws a task source makes for one training problem before it gives up (every one held out)."""


def is_heldout_key(salt: str, key: str | int, fraction: float) -> bool:
    """Whether ``key`` is in the held-out split: ``sha256(salt|key)`` mapped to ``[0, 1)`` < fraction."""
    digest = hashlib.sha256(f"{salt}|{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def reject_unknown(name: str, kwargs: Iterable[str], allowed: Iterable[str]) -> None:
    """A ``ValueError`` naming the kwargs of ``kwargs`` that are not ``allowed``, if any."""
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise ValueError(f"{name}: unknown kwargs {unknown}; allowed: {sorted(allowed)}")


def check_heldout_fraction(name: str, fraction: Any) -> float:
    """``fraction`` as a float in ``(0, 1)``, else a ``ValueError`` naming it."""
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction < 1:
        raise ValueError(f"{name}: heldout_fraction={fraction!r} must be in (0, 1)")
    return float(fraction)


def draw_training(name: str, draw: Callable[[], K], heldout: Callable[[K], bool]) -> K:
    """The first of at most :data:`MAX_DRAWS` ``draw()`` that is not ``heldout``; a ``RuntimeError``
    naming the source when every one was."""
    for _ in range(MAX_DRAWS):
        key = draw()
        if not heldout(key):
            return key
    raise RuntimeError(f"{name}: every one of {MAX_DRAWS} draws was held out, no training problem "
                       "(heldout_fraction too large?)")


def first_heldout(name: str, n: int, fraction: float, candidates: Iterable[K], heldout: Callable[[K], bool],
                  hint: str) -> list[K]:
    """The first ``n`` distinct ``heldout`` keys among ``candidates``, looking at no more than
    ``200 n / fraction + 10_000`` of them (else a ``ValueError`` naming the source and ``hint``)."""
    found: dict[K, None] = {}
    limit = 200 * n / fraction + 10_000
    for tried, key in enumerate(candidates):
        if len(found) >= n:
            break
        if tried >= limit:
            raise ValueError(f"{name}: only {len(found)} held-out problems found, {n} asked; {hint}")
        if key not in found and heldout(key):
            found[key] = None
    return list(found)


def seed_of(problem: Problem, name: str) -> int:
    """The seed of a ``"<name>:<seed>"`` problem id."""
    prefix, _, seed = problem.prompt_id.partition(":")
    if prefix != name or not (seed.isascii() and seed.isdigit()):
        raise ValueError(f"not a {name} problem id: {problem.prompt_id!r}")
    return int(seed)
