"""``shapes``: procedurally drawn images with a verifiable question about them (visual tasks).

Every problem is one ``size`` x ``size`` RGB image on a white background, drawn with numpy from
an integer seed, and a question:

* ``question: colour`` — one filled square of a colour from ``colours``, of a random side
  (``side_frac``: a quarter to a half of the image by default) at a random place; the answer is
  the colour's name.
* ``question: count`` — squares on a 3 x 3 grid of cells: 1..``max_count`` of the target colour
  (the first of ``colours``) and as many others of the other colours as fit; the answer is how
  many are of the target colour.
* ``question: quadrant`` — one square of the target colour inside one of the four quadrants and
  0..``max_distractors`` squares of the other colours in other quadrants; the answer is the
  quadrant's name (``top-left``, ``top-right``, ``bottom-left``, ``bottom-right``).
* ``question: number`` — a number of 1..``max_digits`` digits (0-9 for one digit) drawn with a
  built-in 5 x 7 bitmap font (:data:`FONT`) at a random scale, place and colour of ``colours``;
  the answer is the number's digits.

``side_frac``, ``demo_colours``, ``max_count``, ``max_distractors`` and ``max_digits`` belong to one question each; setting one for
another question is refused. The problem carries the image as PNG bytes (:attr:`envs.base.Problem.images`); the feeder writes
them to the run's blob store and the task carries their sha256 digests. The verifier is
``exact`` (the stripped response equals the reference).

Held-out split: a seed is held out iff ``sha256(salt|seed)`` mapped to ``[0, 1)`` is below
``heldout_fraction``; training problems are redrawn until they are not. Warm-up demonstrations
are the bare answer; with ``demo_colours`` (``question: colour``) the demonstrator knows only those
colours and answers the others with a colour of ``colours`` drawn uniformly: a weak teacher that
the supervised warm-up imitates and RL has to outgrow.
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
QUESTIONS = ("colour", "count", "quadrant", "number")
QUADRANTS = ("top-left", "top-right", "bottom-left", "bottom-right")
"""The answers of ``question: quadrant``, in reading order."""
_OWN_KWARGS = {"max_count": "count", "max_distractors": "quadrant", "max_digits": "number", "demo_colours": "colour",
               "side_frac": "colour"}
_FONT_ROWS = {
    "0": (".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."),
    "1": ("..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."),
    "2": (".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"),
    "3": ("#####", "...#.", "..#..", "...#.", "....#", "#...#", ".###."),
    "4": ("...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."),
    "5": ("#####", "#....", "####.", "....#", "....#", "#...#", ".###."),
    "6": ("..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."),
    "7": ("#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."),
    "8": (".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."),
    "9": (".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."),
}
FONT: dict[str, np.ndarray] = {
    d: np.array([[c == "#" for c in row] for row in rows], dtype=bool) for d, rows in _FONT_ROWS.items()
}
"""The digits' glyphs: (7, 5) bool arrays, ink where True; drawn 1 cell apart."""
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
    max_distractors: int = 3
    max_digits: int = 1
    demo_colours: tuple[str, ...] = ()
    side_frac: tuple[float, float] = (0.25, 0.5)
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
        if not 0 <= self.max_distractors <= 3:
            raise ValueError(f"shapes: max_distractors={self.max_distractors} must be in [0, 3]")
        if not 1 <= self.max_digits <= 3:
            raise ValueError(f"shapes: max_digits={self.max_digits} must be in [1, 3]")
        lo, hi = self.side_frac
        if not 0 < lo <= hi <= 1 or int(hi * self.size) < 1:
            raise ValueError(f"shapes: side_frac={list(self.side_frac)} must be [lo, hi] with 0 < lo <= hi <= 1 "
                             f"(fractions of size; hi x size at least 1 pixel)")
        if set(self.demo_colours) - set(self.colours):
            raise ValueError(f"shapes: demo_colours={list(self.demo_colours)} must be some of colours="
                             f"{list(self.colours)}")
        check_heldout_fraction("shapes", self.heldout_fraction)

    @property
    def prompt(self) -> str:
        """The question every problem of this source asks."""
        if self.question == "colour":
            return f"What colour is the square? ({', '.join(self.colours)})"
        if self.question == "quadrant":
            return f"Where is the {self.colours[0]} square? ({', '.join(QUADRANTS)})"
        if self.question == "number":
            return "What number is shown?"
        return f"How many {self.colours[0]} squares?"

    def draw(self, seed: int) -> tuple[np.ndarray, str]:
        """The image (H, W, 3) uint8 and the answer of problem ``seed``."""
        rng = random.Random(f"{self.salt}|{seed}")
        s = self.size
        img = np.full((s, s, 3), 255, dtype=np.uint8)
        if self.question == "colour":
            colour = rng.choice(self.colours)
            side = rng.randint(max(1, int(self.side_frac[0] * s)), int(self.side_frac[1] * s))
            x, y = rng.randint(0, s - side), rng.randint(0, s - side)
            img[y : y + side, x : x + side] = COLOURS[colour]
            return img, colour
        if self.question == "quadrant":
            return self._quadrant(rng, img)
        if self.question == "number":
            return self._number(rng, img)
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

    def _quadrant(self, rng: random.Random, img: np.ndarray) -> tuple[np.ndarray, str]:
        """A target square in quadrant ``t`` (strictly inside it), distractors in others."""
        half = self.size // 2
        t = rng.randrange(4)
        others = [q for q in range(4) if q != t]
        distract = rng.sample(others, rng.randint(0, self.max_distractors))
        for q in (t, *distract):
            colour = self.colours[0] if q == t else rng.choice(self.colours[1:])
            side = rng.randint(max(2, half // 3), half * 2 // 3)
            oy, ox = (q // 2) * half, (q % 2) * half
            y, x = oy + rng.randint(1, half - side - 1), ox + rng.randint(1, half - side - 1)
            img[y : y + side, x : x + side] = COLOURS[colour]
        return img, QUADRANTS[t]

    def _number(self, rng: random.Random, img: np.ndarray) -> tuple[np.ndarray, str]:
        """A number in :data:`FONT`, scaled by a whole factor, 1-pixel margin at least."""
        k = rng.randint(1, self.max_digits)
        text = str(rng.randint(0 if k == 1 else 10 ** (k - 1), 10**k - 1))
        width = 6 * len(text) - 1  # cells: 5 per glyph, 1 between glyphs
        top = min((self.size - 2) // width, (self.size - 2) // 7)
        scale = rng.randint(max(1, top // 2), top)
        ink = np.zeros((7, width), dtype=bool)  # (7, cells)
        for i, d in enumerate(text):
            ink[:, 6 * i : 6 * i + 5] = FONT[d]
        ink = ink.repeat(scale, axis=0).repeat(scale, axis=1)  # (7 * scale, width * scale)
        y = rng.randint(1, self.size - 1 - ink.shape[0])
        x = rng.randint(1, self.size - 1 - ink.shape[1])
        img[y : y + ink.shape[0], x : x + ink.shape[1]][ink] = COLOURS[rng.choice(self.colours)]
        return img, text

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
        """The bare answer; with ``demo_colours``, a demonstrator that knows only those colours
        answers any other with a colour of ``colours`` drawn uniformly."""
        if self.demo_colours and problem.reference not in self.demo_colours:
            return rng.choice(self.colours)
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
    if "demo_colours" in kwargs:
        known = kwargs["demo_colours"]
        if not isinstance(known, list | tuple) or not all(isinstance(c, str) for c in known):
            raise ValueError(f"shapes: demo_colours={known!r} must be a list of colour names")
        kwargs = {**kwargs, "demo_colours": tuple(known)}
    if "side_frac" in kwargs:
        frac = kwargs["side_frac"]
        if not isinstance(frac, list | tuple) or len(frac) != 2 or not all(
                isinstance(f, int | float) and not isinstance(f, bool) for f in frac):
            raise ValueError(f"shapes: side_frac={frac!r} must be a list [lo, hi] of two fractions of size")
        kwargs = {**kwargs, "side_frac": (float(frac[0]), float(frac[1]))}
    source = ShapesSource(**kwargs)  # type: ignore[arg-type]
    for key, owner in _OWN_KWARGS.items():
        if key in kwargs and source.question != owner:
            raise ValueError(f"shapes: {key} is for question: {owner}, not question: {source.question}; remove it")
    return source
