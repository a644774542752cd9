"""``shapes``: procedurally drawn images with a verifiable question about them (visual tasks).

Every problem is one ``size`` x ``size`` RGB image on a white background, drawn with numpy from
an integer seed, and a question:

* ``question: colour`` — one filled square of a colour from ``colours``, of a random side
  (a quarter to a half of the image) at a random place; the answer is the colour's name.
* ``question: count`` — squares on a 3 x 3 grid of cells: 1..``max_count`` of the target colour
  (the first of ``colours``) and as many others of the other colours as fit; the answer is how
  many are of the target colour.

The problem carries the image as PNG bytes (:attr:`envs.base.Problem.images`); the feeder writes
them to the run's blob store and the task carries their sha256 digests. The verifier is
``exact`` (the stripped response equals the reference).

Held-out split: a seed is held out iff ``sha256(salt|seed)`` mapped to ``[0, 1)`` is below
``heldout_fraction``; training problems are redrawn until they are not. Warm-up demonstrations
are the bare answer.
"""

from __future__ import annotations

import io
import itertools
import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from envs.base import (
    Problem,
    check_heldout_fraction,
    draw_training,
    first_heldout,
    is_heldout_key,
    reject_unknown,
    seed_of,
)
from envs.registry import VISUAL_SOURCES, register_source

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 170, 50), "blue": (30, 60, 220),
    "yellow": (230, 200, 20), "black": (0, 0, 0),
}
"""The colours a ``shapes`` image may use, by name."""
QUESTIONS = ("colour", "count")
_GRID = 3
_MAX_SEED = 2**31 - 1


def png_bytes(pixels: np.ndarray) -> bytes:
    """An (H, W, 3) uint8 array as PNG bytes (deterministic for the same pixels)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels, mode="RGB").save(buf, format="PNG", optimize=False)
    return buf.getvalue()


@dataclass(frozen=True)
class ShapesSource:
    """Questions about drawn squares; see the module doc. Registered as ``shapes``."""

    question: str = "colour"
    colours: tuple[str, ...] = ("red", "green", "blue")
    size: int = 56
    max_count: int = 3
    heldout_fraction: float = 0.05
    salt: str = "shapes"
    name: str = "shapes"
    default_verifier: str = "exact"

    def __post_init__(self) -> None:
        if self.question not in QUESTIONS:
            raise ValueError(f"shapes: question={self.question!r} must be one of {list(QUESTIONS)}")
        unknown = [c for c in self.colours if c not in COLOURS]
        if len(self.colours) < 2 or unknown or len(set(self.colours)) != len(self.colours):
            raise ValueError(f"shapes: colours={list(self.colours)} must be 2 or more distinct names of "
                             f"{sorted(COLOURS)}")
        if not 28 <= self.size <= 448:
            raise ValueError(f"shapes: size={self.size} must be in [28, 448] pixels")
        if not 1 <= self.max_count <= _GRID * _GRID:
            raise ValueError(f"shapes: max_count={self.max_count} must be in [1, {_GRID * _GRID}]")
        check_heldout_fraction("shapes", self.heldout_fraction)

    @property
    def prompt(self) -> str:
        """The question every problem of this source asks."""
        if self.question == "colour":
            return f"What colour is the square? ({', '.join(self.colours)})"
        return f"How many {self.colours[0]} squares?"

    def draw(self, seed: int) -> tuple[np.ndarray, str]:
        """The image (H, W, 3) uint8 and the answer of problem ``seed``."""
        rng = random.Random(f"{self.salt}|{seed}")
        s = self.size
        img = np.full((s, s, 3), 255, dtype=np.uint8)
        if self.question == "colour":
            colour = rng.choice(self.colours)
            side = rng.randint(s // 4, s // 2)
            x, y = rng.randint(0, s - side), rng.randint(0, s - side)
            img[y : y + side, x : x + side] = COLOURS[colour]
            return img, colour
        cell = s // _GRID
        pad = max(1, cell // 6)
        cells = rng.sample(range(_GRID * _GRID), _GRID * _GRID)
        n = rng.randint(1, self.max_count)
        others = rng.randint(0, _GRID * _GRID - n)
        for k, c in enumerate(cells[: n + others]):
            colour = self.colours[0] if k < n else rng.choice(self.colours[1:])
            y, x = (c // _GRID) * cell, (c % _GRID) * cell
            img[y + pad : y + cell - pad, x + pad : x + cell - pad] = COLOURS[colour]
        return img, str(n)

    def problem(self, seed: int) -> Problem:
        """Problem ``seed`` (whichever split it belongs to)."""
        pixels, answer = self.draw(seed)
        return Problem(prompt_id=f"{self.name}:{seed}", prompt=self.prompt, reference=answer,
                       verifier=self.default_verifier, images=(png_bytes(pixels),))

    def _heldout(self, seed: int) -> bool:
        return is_heldout_key(self.salt, seed, self.heldout_fraction)

    def is_heldout(self, problem: Problem) -> bool:
        return self._heldout(seed_of(problem, self.name))

    def sample(self, rng: random.Random) -> Problem:
        """A uniformly drawn training problem (held-out seeds are redrawn)."""
        return self.problem(draw_training("shapes", lambda: rng.randint(0, _MAX_SEED), self._heldout))

    def heldout(self, n: int) -> list[Problem]:
        """``n`` distinct held-out problems, always the same for the same kwargs."""
        found = first_heldout("shapes", n, self.heldout_fraction, itertools.count(), self._heldout,
                              "raise heldout_fraction")
        return [self.problem(seed) for seed in found]

    def demonstration(self, problem: Problem, rng: random.Random) -> str:
        """The bare answer."""
        return problem.reference


VISUAL_SOURCES.add("shapes")


@register_source("shapes")
def make_shapes(**kwargs: Any) -> ShapesSource:
    """Build a :class:`ShapesSource` from domain kwargs (unknown keys are an error)."""
    reject_unknown("shapes", kwargs, set(ShapesSource.__dataclass_fields__) - {"name", "default_verifier"})
    if "colours" in kwargs:
        colours = kwargs["colours"]
        if not isinstance(colours, list | tuple) or not all(isinstance(c, str) for c in colours):
            raise ValueError(f"shapes: colours={colours!r} must be a list of colour names")
        kwargs = {**kwargs, "colours": tuple(colours)}
    return ShapesSource(**kwargs)  # type: ignore[arg-type]
