"""The ``shapes`` visual task source: its images say what its references say, its split is fixed and
disjoint, and bad kwargs are refused in one line."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
from PIL import Image

import envs
from envs.vision import COLOURS, ShapesSource


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


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
    ({"shape": "circle"}, "unknown kwargs ['shape']"),
])
def test_bad_kwargs_are_one_clear_error(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=None) as e:
        envs.make_source("shapes", **kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value)
