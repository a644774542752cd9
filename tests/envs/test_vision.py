"""The ``shapes`` visual task source: its images say what its references say, its split is fixed and
disjoint, and bad kwargs are refused in one line."""

from __future__ import annotations

import hashlib
import io
import random

import numpy as np
import pytest
from PIL import Image

import envs
from envs.vision import COLOURS, FONT, QUADRANTS, ShapesSource


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def _n_colours(img: np.ndarray) -> int:
    """How many distinct RGB colours ``img`` (..., 3) has, white included."""
    return len(np.unique(img.reshape(-1, 3).astype(np.int64) @ np.array([1 << 16, 1 << 8, 1])))


def test_colour_problems_show_one_square_of_the_reference_colour() -> None:
    src = envs.make_source("shapes", colours=["red", "green", "blue"])
    rng = random.Random(0)
    seen = set()
    for _ in range(30):
        p = src.sample(rng)
        img = _pixels(p.images[0])
        assert img.shape == (56, 56, 3)
        colours = {tuple(int(v) for v in px) for px in img.reshape(-1, 3)} - {(255, 255, 255)}
        assert colours == {COLOURS[p.reference]}
        seen.add(p.reference)
        assert not src.is_heldout(p)
    assert seen == {"red", "green", "blue"}


def test_count_problems_show_as_many_target_squares_as_the_reference() -> None:
    src = ShapesSource(question="count", colours=("red", "blue"), size=84, max_count=4)
    for seed in range(20):
        p = src.problem(seed)
        img = _pixels(p.images[0])
        red = np.all(img == COLOURS["red"], axis=-1)  # (H, W)
        cell = 84 // 3
        squares = sum(bool(red[r * cell + cell // 2, c * cell + cell // 2]) for r in range(3) for c in range(3))
        assert str(squares) == p.reference and 1 <= squares <= 4


def test_colour_and_count_images_are_those_of_before_the_new_questions() -> None:
    # digests of seeds 0..19 taken before quadrant and number were added: recorded runs rely on them
    for question, digest in (("colour", "182373721742fa4c"), ("count", "8ed60ebf5ee3fc4d")):
        src = ShapesSource(question=question, colours=("red", "green", "blue", "yellow"), size=56)
        h = hashlib.sha256()
        for seed in range(20):
            pixels, answer = src.draw(seed)
            h.update(pixels.tobytes())
            h.update(answer.encode())
        assert h.hexdigest()[:16] == digest, question


@pytest.mark.parametrize("size", [56, 57, 28])
def test_quadrant_problems_show_the_target_square_in_the_reference_quadrant(size: int) -> None:
    src = envs.make_source("shapes", question="quadrant", colours=["red", "green", "blue"], size=size)
    assert all(q in src.prompt for q in QUADRANTS)
    half, seen, distractors = size // 2, set(), 0
    for seed in range(40):
        p = src.problem(seed)
        img = _pixels(p.images[0])
        quads = {"top-left": img[:half, :half], "top-right": img[:half, half:],
                 "bottom-left": img[half:, :half], "bottom-right": img[half:, half:]}
        for name, quad in quads.items():
            red = int(np.all(quad == COLOURS["red"], axis=-1).sum())
            inks = _n_colours(quad) - 1  # colours besides white
            assert (red > 0) == (name == p.reference)  # the target square lies in its quadrant only
            assert inks <= 1  # one square a quadrant
            distractors += name != p.reference and inks == 1
        seen.add(p.reference)
    assert seen == set(QUADRANTS) and distractors > 0
    plain = ShapesSource(question="quadrant", max_distractors=0)
    assert all(_n_colours(plain.draw(seed)[0]) == 2 for seed in range(10))


def _trimmed(glyph: np.ndarray) -> np.ndarray:
    cols = np.flatnonzero(glyph.any(axis=0))
    return glyph[:, cols[0] : cols[-1] + 1]


def _read_number(img: np.ndarray) -> str:
    """Read a drawn number back: ink rows give the scale (every glyph spans its 7 rows), blank
    columns split the glyphs, each glyph sampled at its cells' centres is matched to the font."""
    ink = np.any(img != 255, axis=-1)  # (H, W)
    rows = np.flatnonzero(ink.any(axis=1))
    scale, top = len(rows) // 7, rows[0]
    assert len(rows) == 7 * scale and rows[-1] - top + 1 == 7 * scale
    cols = ink.any(axis=0)
    starts = [x for x in range(len(cols)) if cols[x] and (x == 0 or not cols[x - 1])]
    text = ""
    for x0 in starts:
        x1 = x0
        while x1 < len(cols) and cols[x1]:
            x1 += 1
        assert (x1 - x0) % scale == 0
        cells = ink[top + scale // 2 : top + 7 * scale : scale, x0 + scale // 2 : x1 : scale]  # (7, w)
        text += "".join(d for d, g in FONT.items() if _trimmed(g).shape == cells.shape and (_trimmed(g) == cells).all())
    return text


def test_font_digits_are_distinct_full_height_and_have_no_blank_inner_column() -> None:
    trimmed = [_trimmed(FONT[d]) for d in "0123456789"]
    assert all(g.shape[0] == 7 and g[0].any() and g[-1].any() and g.any(axis=0).all() for g in trimmed)
    assert len({(g.shape, g.tobytes()) for g in trimmed}) == 10


@pytest.mark.parametrize("max_digits, size", [(1, 56), (2, 56), (3, 84), (3, 28)])
def test_number_problems_show_the_reference_number(max_digits: int, size: int) -> None:
    src = envs.make_source("shapes", question="number", max_digits=max_digits, size=size)
    seen_len, seen_digits, scales = set(), set(), set()
    for seed in range(30):
        p = src.problem(seed)
        img = _pixels(p.images[0])
        assert _read_number(img) == p.reference
        assert p.reference == str(int(p.reference)) and len(p.reference) <= max_digits
        assert _n_colours(img) == 2  # white and the number's colour
        border = np.concatenate([img[0], img[-1], img[:, 0], img[:, -1]])
        assert (border == 255).all()
        seen_len.add(len(p.reference))
        seen_digits.update(p.reference)
        scales.add(int(np.any(img != 255, axis=-1).any(axis=1).sum()) // 7)
    assert seen_len == set(range(1, max_digits + 1)) and len(seen_digits) >= 8
    assert len(scales) > 1 or size == 28


@pytest.mark.parametrize("question", ["quadrant", "number"])
def test_new_questions_are_deterministic_with_a_disjoint_heldout_split(question: str) -> None:
    src = ShapesSource(question=question, heldout_fraction=0.2)
    again = envs.make_source("shapes", question=question, heldout_fraction=0.2)
    held = src.heldout(8)
    assert [(p.prompt_id, p.images, p.reference) for p in held] == [
        (p.prompt_id, p.images, p.reference) for p in again.heldout(8)]
    assert all(src.is_heldout(p) for p in held)
    rng_a, rng_b = random.Random(3), random.Random(3)
    train = [src.sample(rng_a) for _ in range(30)]
    assert [p.images for p in train] == [again.sample(rng_b).images for _ in range(30)]
    assert not any(src.is_heldout(p) for p in train)
    assert not {p.prompt_id for p in train} & {p.prompt_id for p in held}
    assert src.demonstration(held[0], random.Random(0)) == held[0].reference
    assert held[0].verifier == "exact"


def test_heldout_split_is_fixed_and_disjoint_from_training() -> None:
    src = ShapesSource(heldout_fraction=0.2)
    held = src.heldout(10)
    assert [p.prompt_id for p in held] == [p.prompt_id for p in ShapesSource(heldout_fraction=0.2).heldout(10)]
    assert all(src.is_heldout(p) for p in held)
    rng = random.Random(1)
    assert not any(src.is_heldout(src.sample(rng)) for _ in range(50))
    assert held[0].images == src.problem(int(held[0].prompt_id.split(":")[1])).images  # same seed, same bytes


@pytest.mark.parametrize("kwargs, needle", [
    ({"question": "where"}, "question='where'"),
    ({"colours": ["red"]}, "colours=['red']"),
    ({"colours": ["red", "mauve"]}, "mauve"),
    ({"size": 8}, "size=8"),
    ({"max_count": 0}, "max_count=0"),
    ({"question": "quadrant", "max_distractors": 4}, "max_distractors=4"),
    ({"question": "number", "max_digits": 0}, "max_digits=0"),
    ({"question": "number", "max_digits": 4}, "max_digits=4"),
    ({"question": "colour", "max_digits": 2}, "max_digits is for question: number"),
    ({"question": "number", "max_count": 2}, "max_count is for question: count"),
    ({"max_distractors": 1}, "max_distractors is for question: quadrant"),
    ({"shape": "circle"}, "unknown kwargs ['shape']"),
    ({"demo_colours": ["red", "black"]}, "demo_colours=['red', 'black'] must be some of colours"),
    ({"demo_colours": "red"}, "demo_colours='red' must be a list"),
    ({"question": "count", "demo_colours": ["red"]}, "demo_colours is for question: colour"),
    ({"side_frac": [0.5, 0.25]}, "side_frac=[0.5, 0.25] must be [lo, hi] with 0 < lo <= hi <= 1"),
    ({"side_frac": [0.0, 0.5]}, "side_frac=[0.0, 0.5]"),
    ({"side_frac": [0.5, 1.5]}, "side_frac=[0.5, 1.5]"),
    ({"side_frac": 0.5}, "side_frac=0.5 must be a list [lo, hi]"),
    ({"side_frac": [0.5, "big"]}, "side_frac=[0.5, 'big'] must be a list [lo, hi]"),
    ({"question": "quadrant", "side_frac": [0.5, 1.0]}, "side_frac is for question: colour"),
])
def test_bad_kwargs_are_one_clear_error(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=None) as e:
        envs.make_source("shapes", **kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("size", [56, 57, 28])
def test_side_frac_bounds_the_square_side(size: int) -> None:
    """``side_frac: [lo, hi]``: every square's side is in [int(lo * size), int(hi * size)] pixels,
    both ends drawn; the default [0.25, 0.5] draws the images of before the key existed."""
    src = ShapesSource(question="colour", colours=("red", "green"), size=size, side_frac=(0.5, 1.0))
    sides = set()
    for seed in range(400):
        pixels, _ = src.draw(seed)
        ink = np.any(pixels != 255, axis=-1)  # (H, W)
        rows, cols = np.flatnonzero(ink.any(axis=1)), np.flatnonzero(ink.any(axis=0))
        assert rows.size == cols.size and ink.sum() == rows.size**2  # one filled square
        sides.add(int(rows.size))
    assert min(sides) == size // 2 and max(sides) == size
    default = ShapesSource(question="colour", colours=("red", "green"), size=size)
    explicit = ShapesSource(question="colour", colours=("red", "green"), size=size, side_frac=(0.25, 0.5))
    for seed in range(20):
        assert np.array_equal(default.draw(seed)[0], explicit.draw(seed)[0])


def test_a_demonstrator_of_some_colours_answers_them_and_guesses_the_others() -> None:
    """``demo_colours``: the warm-up's demonstrator knows those colours; for the others it draws any
    colour of ``colours``, the right one about as often as each wrong one."""
    colours = ("red", "green", "blue", "yellow")
    src = envs.make_source("shapes", colours=list(colours), demo_colours=["red", "green"])
    rng = random.Random(0)
    said: dict[str, list[str]] = {c: [] for c in colours}
    for _ in range(800):
        p = src.sample(rng)
        said[p.reference].append(src.demonstration(p, rng))
    assert all(len(v) > 100 for v in said.values()), {c: len(v) for c, v in said.items()}
    assert set(said["red"]) == {"red"} and set(said["green"]) == {"green"}
    for c in ("blue", "yellow"):
        shares = [said[c].count(x) / len(said[c]) for x in colours]
        assert min(shares) > 0.1 and max(shares) < 0.4, (c, shares)
    full = envs.make_source("shapes", colours=list(colours))
    p = full.sample(rng)
    assert full.demonstration(p, rng) == p.reference
