"""Task sources draw the same problems in every version: the episodes of the multi-turn sources
(``frozenlake``, ``sokoban``, ``tool_use``, ``webshop``: problem, expert and the episode the expert
plays) and the problems of the single-turn ones are pinned; and every source's loops give up with
one clear error after their bound instead of running forever."""

from __future__ import annotations

import hashlib
import json
import random
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from envs import TaskSource, make_env, make_source, registry
from envs.base import MAX_DRAWS, episode_ref
from envs.gym_text import EpisodeSource


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


class CountingRandom(random.Random):
    """A ``Random`` that counts the seeds drawn from it."""

    draws = 0

    def randrange(self, *args: Any, **kwargs: Any) -> int:
        self.draws += 1
        return super().randrange(*args, **kwargs)


@pytest.mark.parametrize("source", ["tool_use", "webshop", "instruct", "arith", "code"])
def test_a_source_whose_every_draw_is_held_out_gives_up_after_max_draws(source: str) -> None:
    src = make_source(source, heldout_fraction=1 - 1e-12)  # valid, but (almost) nothing left to train on
    rng = CountingRandom(0)
    with pytest.raises(RuntimeError, match=rf"^{source}: every one of {MAX_DRAWS} draws was held out") as e:
        src.sample(rng)
    assert "\n" not in str(e.value) and "heldout_fraction" in str(e.value)
    if source in ("tool_use", "webshop", "instruct"):  # a seed per draw
        assert rng.draws == MAX_DRAWS


@pytest.mark.parametrize("source", ["tool_use", "webshop"])
def test_heldout_of_a_source_with_no_held_out_layout_gives_up_after_its_bound(
        source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_source(source, heldout_fraction=0.5)
    assert isinstance(src, EpisodeSource)
    looked: list[int] = []

    def one_layout(seed: int) -> str:  # every seed the same task, and that one is not held out
        looked.append(seed)
        return "every seed alike"

    monkeypatch.setattr(src, "layout", one_layout)
    assert not src.is_heldout_seed(0)
    looked.clear()
    with pytest.raises(ValueError, match=rf"^{source}: only 0 held-out problems found, 2 asked") as e:
        src.heldout(2)
    assert "\n" not in str(e.value)
    assert looked == list(range(int(200 * 2 / 0.5 + 10_000)))  # seeds 0, 1, ... up to the bound, once each


def test_the_docs_environment_is_an_episode_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """The number-guessing plugin of docs/agentic.md builds on ``EpisodeSource`` as shown there
    (its short run is ``tests/e2e/test_agentic.py``)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "agentic.md").read_text()
    code = re.search(r"```python\n(.*?)```", text[text.index("This whole file ("):], re.S)
    assert code is not None
    module = types.ModuleType("my_envs")
    monkeypatch.setitem(sys.modules, "my_envs", module)
    try:
        exec(compile(code.group(1), "docs/agentic.md", "exec"), module.__dict__)
        src = make_source("guess", high=8)
        assert isinstance(src, EpisodeSource)
        held = src.heldout(5)
        assert all(src.is_heldout(p) for p in held)
        for p in [*held, src.sample(random.Random(0))]:
            ref = episode_ref(p.reference)
            assert (ref.env, ref.kwargs) == ("guess", {"high": 8})
            env = make_env("guess", prompt="", reference="", **ref.kwargs)
            assert env.reset(ref.seed)[0] == p.prompt
            results = [env.step(a) for a in src.demonstration(p, random.Random(0)).split("\n")]
            assert results[-1].info["success"] and not any(r.terminated for r in results[:-1])
    finally:
        registry.ENVS.pop("guess", None)
        registry.SOURCES.pop("guess", None)
