"""``instruct``: open-ended writing requests with one checkable constraint each (IFEval-like).

Each prompt asks for a short piece of writing on a topic under one verifiable constraint, e.g.
``Write one sentence about the ocean. Use the word "blue".`` The quality of the writing has no
verifier (that is what a judge or a reward model is for, ``docs/rewards.md``); the constraint
does: verifier ``instruct`` checks it (``correct``), so a domain can mix the two
(``rewards: {correct: 1.0, judge: 0.5}``) and SQL can compare judge and verifier.

Constraints (reference = JSON ``{"kind", "arg"}``):

* ``contains``: the word ``arg`` appears (whole word, any case);
* ``starts``: the response's first word is ``arg`` (any case, punctuation ignored);
* ``max_words``: at most ``arg`` words;
* ``lowercase``: no uppercase letter at all (``arg`` empty);
* ``ends``: the response ends with the character ``arg`` (trailing spaces ignored).

``prompt_id = "instruct:<seed>"``; everything is a function of the seed. Seeds are held out by
``sha256("instruct|<seed>") < heldout_fraction``; ``heldout(n)`` is the first ``n`` held-out seeds
from 0. ``demonstration`` writes a template sentence that satisfies the constraint.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from dataclasses import dataclass
from typing import Any

from envs.base import (
    Problem,
    VerifyResult,
    check_heldout_fraction,
    draw_training,
    first_heldout,
    is_heldout_key,
    reject_unknown,
    seed_of,
)
from envs.registry import register_source, register_verifier

TOPICS = ("the ocean", "a city at night", "a garden", "winter", "a train ride", "the moon", "a market",
          "a library", "a storm", "a mountain", "coffee", "a river", "an old house", "a forest", "music")
WORDS = ("blue", "quiet", "light", "green", "cold", "bright", "small", "warm", "old", "soft", "fast", "dark")
KINDS = ("contains", "starts", "max_words", "lowercase", "ends")
_WORD_RE = re.compile(r"[A-Za-z']+")


def _instruction(kind: str, arg: str) -> str:
    return {
        "contains": f'Use the word "{arg}".',
        "starts": f'Start with the word "{arg}".',
        "max_words": f"Use at most {arg} words.",
        "lowercase": "Write only lowercase letters.",
        "ends": f'End with "{arg}".',
    }[kind]


def check_constraint(response: str, kind: str, arg: str) -> tuple[bool, str]:
    """Whether ``response`` meets the constraint, and a short reason."""
    words = _WORD_RE.findall(response)
    if kind == "contains":
        ok = arg.lower() in (w.lower() for w in words)
        return ok, f"word {arg!r} {'present' if ok else 'missing'}"
    if kind == "starts":
        first = words[0].lower() if words else ""
        return first == arg.lower(), f"starts with {first!r}"
    if kind == "max_words":
        return 0 < len(words) <= int(arg), f"{len(words)} words (max {arg})"
    if kind == "lowercase":
        upper = sum(c.isupper() for c in response)
        return bool(words) and upper == 0, f"{upper} uppercase letters"
    if kind == "ends":
        tail = response.rstrip()[-len(arg):] if response.strip() else ""
        return tail == arg, f"ends with {tail!r}"
    raise ValueError(f"unknown constraint kind {kind!r}; one of {', '.join(KINDS)}")


@register_verifier("instruct")
def verify_instruct(response: str, reference: str, **_: Any) -> VerifyResult:
    """Check the constraint of an ``instruct`` problem (reference ``{"kind", "arg"}``)."""
    ref = json.loads(reference)
    ok, why = check_constraint(response, str(ref["kind"]), str(ref.get("arg", "")))
    return VerifyResult(reward=float(ok), correct=ok, details=f"{ref['kind']}: {why}")


@dataclass
class InstructSource:
    """Open-ended writing requests with one constraint each (see the module doc)."""

    kinds: tuple[str, ...] | list[str] = KINDS
    """Constraint kinds drawn from (uniformly)."""
    heldout_fraction: float = 0.1
    """Share of seeds held out for evaluation."""
    name: str = "instruct"
    default_verifier: str = "instruct"

    def __post_init__(self) -> None:
        self.kinds = tuple(self.kinds)
        bad = [k for k in self.kinds if k not in KINDS]
        if bad or not self.kinds:
            raise ValueError(f"instruct: kinds {list(self.kinds)} must be a non-empty subset of {list(KINDS)}")
        check_heldout_fraction("instruct", self.heldout_fraction)

    def problem(self, seed: int) -> Problem:
        rng = random.Random(f"instruct|{seed}")
        topic, kind = rng.choice(TOPICS), rng.choice(self.kinds)
        arg = {"contains": rng.choice(WORDS), "starts": rng.choice(("in", "under", "at", "beyond", "after")),
               "max_words": str(rng.randint(6, 12)), "lowercase": "", "ends": rng.choice(("!", ".", "?"))}[kind]
        prompt = f"Write one sentence about {topic}. {_instruction(kind, arg)}"
        return Problem(prompt_id=f"{self.name}:{seed}", prompt=prompt,
                       reference=json.dumps({"kind": kind, "arg": arg, "topic": topic}), verifier=self.default_verifier)

    def _held(self, seed: int) -> bool:
        return is_heldout_key(self.name, seed, self.heldout_fraction)

    def sample(self, rng: random.Random) -> Problem:
        return self.problem(draw_training(self.name, lambda: rng.randrange(1 << 31), self._held))

    def heldout(self, n: int) -> list[Problem]:
        seeds = first_heldout(self.name, n, self.heldout_fraction, itertools.count(), self._held,
                              "raise heldout_fraction")
        return [self.problem(seed) for seed in seeds]

    def is_heldout(self, problem: Problem) -> bool:
        return self._held(seed_of(problem, self.name))

    def demonstration(self, problem: Problem, rng: random.Random) -> str:
        ref = json.loads(problem.reference)
        kind, arg, topic = ref["kind"], ref["arg"], ref["topic"]
        adjective = rng.choice(WORDS)
        text = {
            "contains": f"I remember {topic} as {arg} and calm.",
            "starts": f"{arg.capitalize()} the evening light, {topic} is {adjective}.",
            "max_words": f"{topic.capitalize()} feels {adjective}.",
            "lowercase": f"{topic} feels {adjective} to me.",
            "ends": f"{topic.capitalize()} is {adjective}{arg}",
        }[kind]
        return text


@register_source("instruct")
def make_instruct(**kwargs: Any) -> InstructSource:
    """Build an :class:`InstructSource` from domain kwargs (unknown keys are an error)."""
    reject_unknown("instruct", kwargs, ("kinds", "heldout_fraction"))
    return InstructSource(**kwargs)
