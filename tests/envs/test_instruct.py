"""The ``instruct`` source and verifier: constraints checked, demonstrations meet them, split disjoint."""

from __future__ import annotations

import json
import random

import pytest

import envs
from envs.instruct import KINDS, check_constraint


@pytest.mark.parametrize(("response", "kind", "arg", "ok"), [
    ("The sky is Blue today.", "contains", "blue", True),
    ("The sky is bluer today.", "contains", "blue", False),
    ("Under the bridge, water runs.", "starts", "under", True),
    ("The bridge is under water.", "starts", "under", False),
    ("one two three four", "max_words", "4", True),
    ("one two three four five", "max_words", "4", False),
    ("", "max_words", "4", False),
    ("all quiet here.", "lowercase", "", True),
    ("All quiet here.", "lowercase", "", False),
    ("Is it raining?  ", "ends", "?", True),
    ("Is it raining.", "ends", "?", False),
])
def test_each_constraint_is_checked(response: str, kind: str, arg: str, ok: bool) -> None:
    assert check_constraint(response, kind, arg)[0] is ok


def test_demonstrations_meet_their_request_and_garbage_does_not() -> None:
    src = envs.make_source("instruct")
    rng = random.Random(1)
    kinds = set()
    for _ in range(200):
        p = src.sample(rng)
        kinds.add(json.loads(p.reference)["kind"])
        assert not src.is_heldout(p)
        good = envs.score_response("instruct", src.demonstration(p, rng), p.reference)
        assert good.correct and good.reward == 1.0, (p.prompt, good)
    assert kinds == set(KINDS)
    assert not envs.score_response("instruct", "", '{"kind": "contains", "arg": "blue"}').correct


def test_heldout_is_fixed_and_disjoint_and_bad_kwargs_are_refused() -> None:
    src = envs.make_source("instruct", kinds=["contains", "ends"])
    held = src.heldout(32)
    assert held == envs.make_source("instruct", kinds=["contains", "ends"]).heldout(32)
    assert all(src.is_heldout(p) for p in held) and len({p.prompt_id for p in held}) == 32
    assert {json.loads(p.reference)["kind"] for p in held} <= {"contains", "ends"}
    with pytest.raises(ValueError, match="kinds"):
        envs.make_source("instruct", kinds=["rhyme"])
    with pytest.raises(ValueError, match="unknown kwargs"):
        envs.make_source("instruct", topic="sea")
