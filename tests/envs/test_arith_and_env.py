from __future__ import annotations

import random

import pytest

from envs import Env, SingleTurnEnv, TaskSource, make_env, make_source, run_verifier
from envs.arith import ArithSource, scratchpad


def test_is_a_task_source() -> None:
    assert isinstance(make_source("arith"), TaskSource)


def test_heldout_is_deterministic_distinct_and_held_out() -> None:
    a, b = make_source("arith"), make_source("arith")
    held = a.heldout(128)
    assert held == b.heldout(128)
    assert len({p.prompt for p in held}) == 128
    assert all(a.is_heldout(p) for p in held)
    assert a.heldout(16) == held[:16]


def test_training_samples_never_overlap_heldout() -> None:
    src = make_source("arith", ops="+-*", max_value=30)
    held = {p.prompt for p in src.heldout(64)}
    rng = random.Random(0)
    train = [src.sample(rng) for _ in range(20_000)]
    assert not any(src.is_heldout(p) for p in train)
    assert not held & {p.prompt for p in train}


def test_problems_are_correct_and_in_range() -> None:
    src = make_source("arith", ops="+-*", min_value=0, max_value=20, mul_max_value=9)
    rng = random.Random(1)
    for _ in range(2000):
        p = src.sample(rng)
        a, op, b = ArithSource.operands(p)
        assert p.prompt == f"{a}{op}{b}="
        assert int(p.reference) == eval(f"{a}{op}{b}")
        assert int(p.reference) >= 0
        assert 0 <= a <= (9 if op == "*" else 20) and 0 <= b <= (9 if op == "*" else 20)


def test_negative_results_when_allowed_and_template() -> None:
    src = make_source("arith", ops="-", allow_negative=True, template="Q: {a} {op} {b} = ?")
    rng = random.Random(0)
    problems = [src.sample(rng) for _ in range(200)]
    assert any(int(p.reference) < 0 for p in problems)
    assert problems[0].prompt.startswith("Q: ")


def test_scratchpad_is_correct_everywhere() -> None:
    for a in range(0, 130, 3):
        for b in range(0, 130, 7):
            for op in "+-":
                if op == "-" and a < b:
                    continue
                text = scratchpad(a, op, b)
                assert run_verifier("final_number", text, str(eval(f"{a}{op}{b}"))).correct, text
                for step in text.split(";")[:-1]:  # every column is true arithmetic
                    lhs, rhs = step.split("=")
                    assert eval(lhs) == int(rhs), text
    assert scratchpad(47, "+", 38) == "7+8+0=15;4+3+1=8;85"
    assert scratchpad(82, "-", 47) == "12-7-0=5;8-4-1=3;35"


def test_demonstrations_mix_by_share() -> None:
    src = make_source("arith", demo_scratchpad=0.25)
    rng = random.Random(0)
    demos = [src.demonstration(src.sample(rng), rng) for _ in range(2000)]
    share = sum(";" in d for d in demos) / len(demos)
    assert 0.2 < share < 0.3
    assert make_source("arith").demonstration(src.heldout(1)[0], rng) == src.heldout(1)[0].reference


def test_bad_kwargs_are_errors() -> None:
    with pytest.raises(ValueError, match="unknown kwargs"):
        make_source("arith", digits=3)
    with pytest.raises(ValueError, match="ops"):
        make_source("arith", ops="/")
    with pytest.raises(ValueError, match="only"):
        make_source("arith", max_value=2).heldout(50)
    with pytest.raises(KeyError, match="unknown task source"):
        make_source("nope")


def test_single_turn_env() -> None:
    env = make_env("arith", prompt="2+2=", reference="4")
    assert isinstance(env, Env) and isinstance(env, SingleTurnEnv)
    assert env.reset() == ("2+2=", {})
    obs, reward, terminated, truncated, info = env.step("4")
    assert (obs, reward, terminated, truncated) == ("", 1.0, True, False)
    assert info["correct"] and info["error"] == ""
    with pytest.raises(RuntimeError, match="finished"):
        env.step("4")
    env.reset()
    assert env.step("5").reward == 0.0


def test_make_env_by_verifier_name_and_unknown() -> None:
    env = make_env("format", prompt="p", pattern=r"[a-z]+")
    env.reset()
    assert env.step("abc").reward == 1.0
    with pytest.raises(KeyError, match="unknown environment"):
        make_env("nope", prompt="p")
