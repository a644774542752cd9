from __future__ import annotations

from typing import Any

import pytest
from gymnasium.envs.toy_text.cliffwalking import CliffWalkingEnv
from gymnasium.envs.toy_text.taxi import TaxiEnv

from envs import Env
from envs.gym_text import GymTextEnv, check_kwargs, check_seed, state_hash, word_action_parser

CLIFF_ACTIONS = ("up", "right", "down", "left")  # CliffWalking's action order


def _render_cliff(obs: Any) -> str:
    r, c = divmod(int(obs), 12)
    rows = []
    for i in range(4):
        row = ["C" if i == 3 and 0 < j < 11 else "." for j in range(12)]
        if i == 3:
            row[11] = "G"
        if i == r:
            row[c] = "@"
        rows.append("".join(row))
    return "\n".join(rows)


def cliff_env(max_turns: int = 50) -> GymTextEnv:
    return GymTextEnv(
        CliffWalkingEnv(),
        _render_cliff,
        word_action_parser({w: i for i, w in enumerate(CLIFF_ACTIONS)}),
        instructions="Reach G without stepping on the cliff C.",
        max_turns=max_turns,
        success=lambda obs, reward, terminated: terminated,
    )


def test_parser_takes_last_whole_word_case_insensitive() -> None:
    parse = word_action_parser({"left": 0, "down": 1, "right": 2, "up": 3}, {"l": 0, "d": 1, "r": 2, "u": 3})
    assert parse("left") == 0
    assert parse("I go LEFT, no wait: Right.") == 2
    assert parse("<answer>up</answer>") == 3
    assert parse("think: down\n\nAction: up") == 3
    assert parse("upright uptown leftover") is None  # not whole words
    assert parse("R") == 2
    assert parse(" d. ") == 1
    assert parse("I'd say a") is None  # single letters only as the whole reply
    assert parse("") is None
    assert parse("jump") is None


def test_cliffwalking_through_the_adapter() -> None:
    env = cliff_env()
    assert isinstance(env, Env)
    obs, info = env.reset(seed=0)
    assert obs.startswith("Reach G") and "@" in obs.splitlines()[-1]
    assert info["turn"] == 0 and info["success"] is False and info["seed"] == 0
    start_hash = info["state_hash"]
    # stepping onto the cliff: -100 and back to the start (not terminal in Gymnasium 1.x)
    res = env.step("right")
    assert res.reward == -100.0 and not res.terminated and res.info["state_hash"] == start_hash
    total = 0.0
    for a in ["up"] + ["right"] * 11 + ["down"]:
        res = env.step(f"I move {a}")
        total += res.reward
    assert res.terminated and not res.truncated and res.info["success"] is True
    assert total == -13.0
    assert all(isinstance(v, str | int | float | bool) for v in res.info.values())
    with pytest.raises(RuntimeError):
        env.step("up")


def test_invalid_action_consumes_a_turn_and_changes_nothing() -> None:
    env = cliff_env()
    _, info = env.reset(seed=1)
    res = env.step("fly away")
    assert res.reward == 0.0 and not res.terminated and not res.truncated
    assert res.info["invalid_action"] is True and res.info["turn"] == 1
    assert res.info["state_hash"] == info["state_hash"]
    assert res.observation.startswith("Invalid action")
    assert env.step("up").info["invalid_action"] is False


def test_truncates_at_max_turns() -> None:
    env = cliff_env(max_turns=3)
    env.reset(seed=0)
    assert not env.step("left").truncated
    assert not env.step("nothing").truncated
    res = env.step("left")
    assert res.truncated and not res.terminated and res.info["turn"] == 3
    assert "Turn limit" in res.observation


def test_factory_form_and_taxi_seeding() -> None:
    made: list[int] = []

    def make(seed: int) -> TaxiEnv:
        made.append(seed)
        return TaxiEnv()

    env = GymTextEnv(make, str, word_action_parser({"south": 0, "north": 1, "east": 2, "west": 3}))
    first = [env.reset(seed=s)[0] for s in range(8)]
    assert made == list(range(8))
    assert first == [env.reset(seed=s)[0] for s in range(8)]  # determined by the seed
    assert len(set(first)) > 1  # and the seed matters
    _, info = env.reset()
    assert isinstance(info["seed"], int) and made[-1] == info["seed"]  # a drawn seed is reported


def test_helpers_validate() -> None:
    assert state_hash("a") == state_hash("a") != state_hash("b") and len(state_hash("a")) == 12
    assert check_seed(5) == 5
    for bad in (-1, 2**31, True, 1.5):
        with pytest.raises(ValueError, match="seed"):
            check_seed(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'bogus'"):
        check_kwargs("x", {"bogus": 1}, {"size": int})
    with pytest.raises(ValueError, match="size"):
        check_kwargs("x", {"size": True}, {"size": int})
    with pytest.raises(ValueError, match="p="):
        check_kwargs("x", {"p": "0.5"}, {"p": float})
    check_kwargs("x", {"p": 1, "flag": False}, {"p": float, "flag": bool})
    with pytest.raises(ValueError, match="max_turns"):
        GymTextEnv(CliffWalkingEnv(), str, lambda s: None, max_turns=0)
