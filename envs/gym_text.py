"""A text adapter for Gymnasium environments, and the shared pieces of the multi-turn text envs.

:class:`GymTextEnv` wraps a Gymnasium environment (an instance, or a factory ``seed -> env`` when
the environment itself depends on the seed, as FrozenLake's random map does) behind the text
:class:`envs.base.Env` interface: ``render(obs)`` turns a Gymnasium observation into a text board,
``parse_action(text)`` turns the model's reply into a Gymnasium action (``None`` when there is
none). An unparseable reply consumes a turn, earns ``invalid_penalty`` (default 0) and leaves the
state alone; the observation says so. Episodes truncate after ``max_turns`` steps.

``info`` (JSON scalars only, so it travels in ``EnvObservation.info``) always holds ``turn``
(steps taken), ``state_hash`` (:func:`state_hash` of ``state_key(obs)``: a short stable digest
of the true state), ``success`` (true once the episode ends successfully; ``success(obs,
reward, terminated)`` decides, by default ``terminated and reward > 0``), ``invalid_action``, and
after ``reset`` the ``seed`` (drawn at random and reported when ``reset`` gets none, so every
episode can be replayed).

Action parsing (:func:`word_action_parser`): the LAST whole-word occurrence of an action word in
the reply, case-insensitive (``"I go left, no: RIGHT"`` -> right; ``"<answer>up</answer>"`` -> up);
a reply that is nothing but a single-letter alias (``"L"``) is accepted too. Single letters are not
searched for inside longer text, so prose ("I'd", "a") is never mistaken for an action.

:class:`EpisodeSource` is the task source of every multi-turn environment (one problem per seed,
held out by layout, bounded draws); :func:`check_kwargs`, :func:`check_seed` and :func:`turns_left`
are shared by the environments.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from envs.base import Env, Problem, StepResult, draw_training, first_heldout, is_heldout_key, seed_of

if TYPE_CHECKING:
    import gymnasium as gym

MAX_SEED = 2**31 - 1
"""Seeds are ``0 .. MAX_SEED`` (what NumPy / Gymnasium seeding accepts everywhere)."""


def state_hash(key: str) -> str:
    """A short stable digest (12 hex chars) of a state key string."""
    return hashlib.blake2b(key.encode(), digest_size=6).hexdigest()


def check_seed(seed: int | None) -> int:
    """``seed`` validated (a non-negative int), or a fresh random one when ``None``."""
    if seed is None:
        return random.SystemRandom().randrange(MAX_SEED + 1)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed={seed!r} must be an int in [0, {MAX_SEED}]")
    return seed


def word_action_parser(
    words: Mapping[str, int], letters: Mapping[str, int] | None = None
) -> Callable[[str], int | None]:
    """A parser returning the action of the last whole-word occurrence of one of ``words``
    (case-insensitive), else of a reply that is exactly one of ``letters`` (after stripping
    whitespace and trailing punctuation), else ``None``."""
    lower_words = {w.lower(): a for w, a in words.items()}
    lower_letters = {k.lower(): a for k, a in (letters or {}).items()}
    alternatives = "|".join(sorted(map(re.escape, lower_words), key=len, reverse=True))
    pattern = re.compile(rf"(?<![A-Za-z0-9_])({alternatives})(?![A-Za-z0-9_])", re.IGNORECASE)

    def parse(text: str) -> int | None:
        found = pattern.findall(text)
        if found:
            return lower_words[found[-1].lower()]
        return lower_letters.get(text.strip().rstrip(".!").strip().lower())

    return parse


def turns_left(turn: int, max_turns: int) -> tuple[str, bool]:
    """The line that ends an observation after ``turn`` of ``max_turns`` turns (``(2 turns left)``,
    or ``Out of turns.``) and whether the episode is out of turns (truncated)."""
    left = max_turns - turn
    if left <= 0:
        return "\nOut of turns.", True
    return f"\n({left} turn{'s' * (left != 1)} left)", False


def check_kwargs(env: str, kwargs: Mapping[str, Any], allowed: Mapping[str, type | tuple[type, ...]]) -> None:
    """Reject unknown kwargs and kwargs of the wrong JSON-scalar type, one line naming the kwarg
    (``bool`` is never accepted where a number is asked; an int is fine for a float)."""
    for key, value in kwargs.items():
        if key not in allowed:
            raise ValueError(f"{env}: unknown kwarg {key!r}; allowed: {', '.join(sorted(allowed))}")
        want = allowed[key]
        types = want if isinstance(want, tuple) else (want,)
        if isinstance(value, bool) and bool not in types:
            ok = False
        else:
            ok = isinstance(value, types) or (float in types and isinstance(value, int))
        if not ok:
            names = "/".join(t.__name__ for t in types)
            raise ValueError(f"{env}: kwarg {key}={value!r} must be {names}")


class GymTextEnv:
    """A Gymnasium environment as a text :class:`envs.base.Env`; see the module doc.

    ``gym_env``: a Gymnasium environment, or a callable ``seed -> environment`` called on every
    ``reset`` (for environments whose layout depends on the seed). The Gymnasium environment is
    reset with ``reset(seed=seed)``, so its own randomness is determined by the seed too.
    ``describe(prev_obs, action, obs, reward, terminated)`` may return a feedback line shown above
    the board after each valid step. ``instructions`` head the first observation.
    """

    def __init__(
        self,
        gym_env: gym.Env[Any, Any] | Callable[[int], gym.Env[Any, Any]],
        render: Callable[[Any], str],
        parse_action: Callable[[str], int | None],
        *,
        instructions: str = "",
        max_turns: int = 100,
        invalid_penalty: float = 0.0,
        invalid_message: str = "Invalid action: no action found in your reply.",
        state_key: Callable[[Any], str] | None = None,
        success: Callable[[Any, float, bool], bool] | None = None,
        describe: Callable[[Any, int, Any, float, bool], str] | None = None,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns={max_turns} must be >= 1")
        self._make = gym_env if callable(gym_env) else None
        self.gym_env: gym.Env[Any, Any] | None = None if callable(gym_env) else gym_env
        self.render, self.parse_action = render, parse_action
        self.instructions, self.max_turns = instructions, max_turns
        self.invalid_penalty, self.invalid_message = float(invalid_penalty), invalid_message
        self.state_key = state_key or repr
        self.success = success or (lambda obs, reward, terminated: terminated and reward > 0)
        self.describe = describe
        self.obs: Any = None
        self.seed = 0
        self.turn = 0
        self.done = True
        self.succeeded = False

    def _info(self, invalid: bool) -> dict[str, Any]:
        return {
            "turn": self.turn,
            "state_hash": state_hash(self.state_key(self.obs)),
            "success": self.succeeded,
            "invalid_action": invalid,
        }

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.seed = check_seed(seed)
        if self._make is not None:
            self.gym_env = self._make(self.seed)
        assert self.gym_env is not None
        self.obs, _ = self.gym_env.reset(seed=self.seed)
        self.turn, self.done, self.succeeded = 0, False, False
        board = self.render(self.obs)
        text = f"{self.instructions}\n\n{board}" if self.instructions else board
        return text, {**self._info(False), "seed": self.seed}

    def step(self, action: str) -> StepResult:
        if self.done or self.gym_env is None:
            raise RuntimeError("step() on a finished episode; call reset() first")
        self.turn += 1
        a = self.parse_action(action)
        if a is None:
            reward, terminated, truncated = self.invalid_penalty, False, False
            feedback = self.invalid_message
        else:
            prev = self.obs
            self.obs, r, terminated, truncated, _ = self.gym_env.step(a)
            reward, terminated, truncated = float(r), bool(terminated), bool(truncated)
            self.succeeded = bool(self.success(self.obs, reward, terminated))
            feedback = self.describe(prev, a, self.obs, reward, terminated) if self.describe else ""
        if not terminated and not truncated and self.turn >= self.max_turns:
            truncated = True
            feedback = f"{feedback} Turn limit reached.".strip()
        self.done = terminated or truncated
        board = self.render(self.obs)
        text = f"{feedback}\n\n{board}" if feedback else board
        return StepResult(text, reward, terminated, truncated, self._info(a is None))


class EpisodeSource(ABC):
    """The task source of a seeded multi-turn environment: one problem per episode seed.

    A subclass gives ``name``, ``salt``, ``heldout_fraction`` and the three abstract methods; it
    overrides ``layout(seed)`` when several seeds share a map or room (by default every seed is
    its own layout). No verifier: the environment scores.

    ``prompt_id = "<name>:<seed>"``; the prompt is the first observation; the reference is
    ``{"env": name, "kwargs": env_kwargs, "seed": seed}`` as JSON. Held out by layout: a seed is
    held out iff ``sha256(salt|layout)`` mapped to ``[0, 1)`` is below ``heldout_fraction`` (no
    held-out map is ever trained on). ``sample`` gives up after :data:`envs.base.MAX_DRAWS`
    draws, ``heldout(n)`` (the first ``n`` held-out seeds from 0) after ``200 n /
    heldout_fraction + 10_000`` seeds, each with one clear error. A demonstration is the expert's
    actions joined by ``demo_sep``.
    """

    name: str
    salt: str
    heldout_fraction: float
    default_verifier: str = ""
    demo_sep: ClassVar[str] = "\n"
    """Between the actions of a demonstration (one action per turn)."""

    @abstractmethod
    def env_kwargs(self) -> dict[str, Any]:
        """The kwargs (JSON scalars) that build this source's environment."""

    @abstractmethod
    def env(self) -> Env:
        """A fresh environment with this source's env kwargs."""

    @abstractmethod
    def expert_actions(self, seed: int) -> list[str]:
        """The expert's action of every turn of episode ``seed``."""

    def layout(self, seed: int) -> str:
        """What identifies the episode ``seed`` for the held-out split."""
        return str(seed)

    def seed_of(self, problem: Problem) -> int:
        """The episode seed of a problem of this source."""
        return seed_of(problem, self.name)

    def is_heldout_seed(self, seed: int) -> bool:
        return is_heldout_key(self.salt, self.layout(seed), self.heldout_fraction)

    def problem(self, seed: int) -> Problem:
        """The episode of ``seed`` (whichever split it belongs to)."""
        prompt, _ = self.env().reset(seed)
        reference = json.dumps({"env": self.name, "seed": seed, "kwargs": self.env_kwargs()}, sort_keys=True)
        return Problem(prompt_id=f"{self.name}:{seed}", prompt=prompt, reference=reference, verifier="")

    def is_heldout(self, problem: Problem) -> bool:
        return self.is_heldout_seed(self.seed_of(problem))

    def sample(self, rng: random.Random) -> Problem:
        """A training episode: a random seed whose layout is not held out."""
        return self.problem(draw_training(self.name, lambda: rng.randrange(MAX_SEED + 1), self.is_heldout_seed))

    def heldout_seeds(self, n: int) -> list[int]:
        """The first ``n`` held-out seeds counting from 0 (always the same for the same kwargs)."""
        return first_heldout(self.name, n, self.heldout_fraction, itertools.count(), self.is_heldout_seed,
                             "raise heldout_fraction (or allow more distinct layouts)")

    def heldout(self, n: int) -> list[Problem]:
        return [self.problem(seed) for seed in self.heldout_seeds(n)]

    def demonstration(self, problem: Problem, rng: random.Random) -> str:
        """The expert's actions joined by :attr:`demo_sep`."""
        return self.demo_sep.join(self.expert_actions(self.seed_of(problem)))
