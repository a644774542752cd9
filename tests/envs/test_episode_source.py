"""Task sources draw the same problems in every version: the episodes of the multi-turn sources
(``frozenlake``, ``sokoban``, ``tool_use``, ``webshop``: problem, expert and the episode the expert
plays) and the problems of the single-turn ones are pinned; and every source's loops give up with
one clear error after their bound instead of running forever."""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

import pytest

from envs import TaskSource, make_env, make_source
from envs.base import episode_ref


def drawn(src: TaskSource) -> tuple[list[str], list[str], list[Any]]:
    """Four training problems drawn from ``Random(0)``, the first three held-out ones, all problems."""
    rng = random.Random(0)
    train = [src.sample(rng) for _ in range(4)]
    held = src.heldout(3)
    return [p.prompt_id for p in train], [p.prompt_id for p in held], [*train, *held]


def digest(record: list[Any]) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


TRAIN_IDS = ["1654615998", "1806341205", "173879092", "1112038970"]


@pytest.mark.parametrize(
    ("source", "kwargs", "train", "held", "pinned"),
    [
        ("frozenlake", {}, TRAIN_IDS, ["11", "46", "66"], "1fab07e0f7933b5f"),
        ("frozenlake", {"size": 3, "heldout_fraction": 0.2},  # small maps repeat: held out by map
         ["1806341205", "173879092", "1112038970", "2087043557"], ["0", "2", "3"], "51bf9d40dc8fe05e"),
        ("frozenlake", {"neighbors": True, "board": False, "letters": True, "demo": "safe_random", "slippery": True},
         TRAIN_IDS, ["11", "46", "66"], "6e985165e787c44f"),
        ("sokoban", {}, TRAIN_IDS, ["11", "25", "32"], "215e043a74d0bd3f"),
        ("sokoban", {"boxes": 2, "letters": True, "positions": True}, TRAIN_IDS, ["12", "41", "47"],
         "0a5d28464b2e4036"),
        ("tool_use", {}, ["173879092", "2087043557", "1739178872", "1302718217"], ["11", "27", "51"],
         "76a3028d966306c0"),
        ("tool_use", {"families": "mul", "demo": "mixed", "difficulty": 1},
         ["173879092", "2087043557", "1739178872", "1302718217"], ["11", "27", "51"], "54220c9a9b7093d3"),
        ("webshop", {}, TRAIN_IDS, ["45", "62", "75"], "5e083ee931db3e9e"),
        ("webshop", {"n_products": 20, "results_per_page": 3}, TRAIN_IDS, ["45", "62", "75"], "eaa148c2fe3ceaf3"),
    ],
)
def test_multi_turn_sources_draw_the_pinned_episodes(source: str, kwargs: dict[str, Any], train: list[str],
                                                     held: list[str], pinned: str) -> None:
    """Pinned before the sources shared one ``EpisodeSource``: the reference is compared parsed
    (its JSON key order is not part of the episode)."""
    src = make_source(source, **kwargs)
    train_ids, held_ids, problems = drawn(src)
    assert train_ids == [f"{source}:{s}" for s in train] and held_ids == [f"{source}:{s}" for s in held]
    record = []
    for p in problems:
        ref = episode_ref(p.reference)
        env = make_env(ref.env, prompt="", reference="", **ref.kwargs)
        first = env.reset(ref.seed)
        steps: list[list[Any]] = []
        for action in ["nonsense", *src.expert_actions(ref.seed)]:  # type: ignore[attr-defined]
            steps.append(list(env.step(action)))
            if steps[-1][2] or steps[-1][3]:
                break
        record.append([p.prompt_id, p.prompt, p.verifier, ref.env, ref.seed, sorted(ref.kwargs.items()),
                       src.demonstration(p, random.Random(0)), src.is_heldout(p), list(first), steps])
    assert digest(record) == pinned


@pytest.mark.parametrize(
    ("source", "kwargs", "train", "held", "pinned"),
    [
        ("arith", {}, ["97-53", "33+65", "51-38", "74-45"], ["51-30", "89-78", "41+45"], "2a9efc927b324c81"),
        ("arith", {"ops": "+-*", "max_value": 9, "heldout_fraction": 0.2}, ["8-7", "7-4", "9-3", "9-8"],
         ["6-0", "5+1", "6*1"], "89a369b495c9752e"),
        ("code", {}, ["poly:[[-8,-1,7]]", "caesar:[13]", "clip:[-5,11]", "fibonacci:[8,3]"],
         ["poly:[[8,-6,7,5]]", 'count_letters:["dlopr"]', "clip:[0,14]"], "db54c73bafce5550"),
        ("instruct", {}, TRAIN_IDS, ["0", "18", "24"], "5df2051aa34ac527"),
    ],
)
def test_single_turn_sources_draw_the_pinned_problems(source: str, kwargs: dict[str, Any], train: list[str],
                                                      held: list[str], pinned: str) -> None:
    src = make_source(source, **kwargs)
    train_ids, held_ids, problems = drawn(src)
    assert train_ids == [f"{source}:{s}" for s in train] and held_ids == [f"{source}:{s}" for s in held]
    record = [[p.prompt_id, p.prompt, p.reference, p.verifier, src.demonstration(p, random.Random(0)),
               src.is_heldout(p)] for p in problems]
    assert digest(record) == pinned
