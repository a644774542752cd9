"""The ``tool_use`` environment: tasks, the calculator, the python tool against hostile programs,
invalid actions, truncation, the task source's split and expert."""

from __future__ import annotations

import json
import os
import random
import sys
import time
import uuid
from pathlib import Path

import pytest

from envs import Env, TaskSource, make_env, make_source
from envs.registry import get_env_factory
from envs.sandbox import UID_BASE, UID_SPAN
from envs.tool_use import DEMO_SEP, CalcError, ToolUseSource, parse_action, parse_answer, safe_calc

INFO_KEYS = {"state_hash", "success", "invalid_action", "turn", "tool_calls", "tool"}
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only")


def new_env(**kwargs: object) -> Env:
    return make_env("tool_use", prompt="ignored", reference="ignored", **kwargs)


def answer_of(seed: int, **kwargs: object) -> int:
    return int(make_source("tool_use", **kwargs).expert_actions(seed)[-1].split(":", 1)[1])  # type: ignore[attr-defined]


def check_info(info: dict[str, object]) -> None:
    assert INFO_KEYS <= set(info)
    assert all(isinstance(v, str | int | float | bool) for v in info.values())  # EnvObservation.info


# --------------------------------------------------------------------------- registry and kwargs


def test_registered_env_and_source() -> None:
    env = new_env()
    assert isinstance(env, Env) and isinstance(make_source("tool_use"), TaskSource)
    assert get_env_factory("tool_use")(max_turns=3, prompt="p", reference="r") is not None


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"bogus": 1}, "bogus"),
        ({"families": "mul,nope"}, "families"),
        ({"families": ""}, "families"),
        ({"difficulty": 4}, "difficulty"),
        ({"difficulty": "2"}, "difficulty"),
        ({"max_turns": 0}, "max_turns"),
        ({"max_turns": True}, "max_turns"),
        ({"allow_python": 1}, "allow_python"),
        ({"tool_bonus": 5.0}, "tool_bonus"),
        ({"python_wall_s": 0}, "python_wall_s"),
        ({"python_memory_mb": 16}, "python_memory_mb"),
        ({"max_output_chars": 1}, "max_output_chars"),
        ({"instructions": "no"}, "instructions"),
    ],
)
def test_bad_kwargs_are_one_line_errors_naming_them(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=name) as e:
        new_env(**kwargs)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=name):
        make_source("tool_use", **kwargs)
    with pytest.raises(ValueError, match="heldout_fraction"):
        make_source("tool_use", heldout_fraction=1.5)


# --------------------------------------------------------------------------- episodes


def test_reset_is_determined_by_the_seed_and_shows_the_syntax() -> None:
    a, b = new_env(), new_env()
    obs, info = a.reset(seed=7)
    assert b.reset(seed=7)[0] == obs and a.reset(seed=7)[0] == obs
    assert len({new_env().reset(seed=s)[0] for s in range(40)}) == 40
    assert "calc:" in obs and "python:" in obs and "answer:" in obs
    check_info(info)
    assert info["turn"] == 0 and info["tool_calls"] == 0 and info["seed"] == 7
    # replaying the same actions gives the same observations
    actions = ["calc: 2**10", "hmm", "calc: 1/0"]
    assert [a.step(x).observation for x in actions] == [b.step(x).observation for x in actions]
    # the kwargs choose the task too
    obs_mul, info_mul = new_env(families="mul", difficulty=1).reset(seed=7)
    assert info_mul["family"] == "mul" and "*" in obs_mul
    obs_nopy, _ = new_env(allow_python=False).reset(seed=7)
    assert "python:" not in obs_nopy and "calc:" in obs_nopy


def test_calc_then_correct_answer() -> None:
    env = new_env(families="mul")
    obs, _ = env.reset(seed=3)
    want = answer_of(3, families="mul")
    expr = obs.split("What is ", 1)[1].split("?", 1)[0]
    r = env.step(f"I will use the calculator.\ncalc: {expr}")
    assert r.observation.startswith(f"calc result: {want}\n") and "3 turns left" in r.observation
    assert (r.reward, r.terminated, r.truncated) == (0.0, False, False)
    assert r.info["tool"] == "calc" and r.info["tool_calls"] == 1 and not r.info["invalid_action"]
    r = env.step(f"answer: {want:,}")  # thousands separators are fine
    assert (r.reward, r.terminated, r.truncated) == (1.0, True, False)
    assert r.info["success"] and r.info["turn"] == 2 and r.info["tool_calls"] == 1 and r.info["tool"] == ""
    check_info(r.info)
    with pytest.raises(RuntimeError):
        env.step("answer: 1")


def test_wrong_answer_ends_with_zero_and_tool_bonus() -> None:
    env = new_env()
    env.reset(seed=11)
    want = answer_of(11)
    r = env.step(f"answer: {want + 1}")
    assert (r.reward, r.terminated, r.info["success"]) == (0.0, True, False)
    assert str(want) in r.observation
    bonus = new_env(tool_bonus=0.1)
    bonus.reset(seed=11)
    assert bonus.step(f"answer: {want}").reward == 1.0  # no tool used: no bonus
    bonus.reset(seed=11)
    bonus.step("calc: 1+1")
    assert bonus.step(f"answer: {want}").reward == pytest.approx(1.1)
    penalty = new_env(tool_bonus=-0.2)
    penalty.reset(seed=11)
    penalty.step("calc: 1+1")
    assert penalty.step(f"answer: {want + 1}").reward == pytest.approx(-0.2)


@pytest.mark.parametrize(
    ("action", "why"),
    [
        ("I think it's about 500.", "calc: <expression>"),
        ("answer: I don't know", "must be a number"),
        ("calc:   ", "empty calc"),
        ("python:\n", "empty python"),
    ],
)
def test_invalid_actions_consume_a_turn(action: str, why: str) -> None:
    env = new_env()
    env.reset(seed=5)
    r = env.step(action)
    assert why in r.observation and r.observation.startswith("Invalid action")
    assert (r.reward, r.terminated, r.truncated) == (0.0, False, False)
    assert r.info["invalid_action"] and r.info["turn"] == 1 and r.info["tool_calls"] == 0 and r.info["tool"] == ""
    check_info(r.info)
    assert env.step(f"answer: {answer_of(5)}").reward == 1.0


def test_disabled_tools_are_invalid() -> None:
    env = new_env(allow_python=False, families="mul")
    env.reset(seed=1)
    r = env.step("python: print(1)")
    assert r.info["invalid_action"] and "python tool is not available" in r.observation
    env = new_env(allow_calc=False)
    env.reset(seed=1)
    r = env.step("calc: 1+1")
    assert r.info["invalid_action"] and "calc tool is not available" in r.observation


def test_truncation_at_max_turns() -> None:
    env = new_env(max_turns=2)
    obs, _ = env.reset(seed=2)
    assert "You have 2 turns" in obs
    r = env.step("calc: 1+1")
    assert not r.truncated and "1 turn left" in r.observation
    r = env.step("nothing")
    assert (r.reward, r.terminated, r.truncated) == (0.0, False, True)
    assert "Out of turns" in r.observation and r.info["turn"] == 2 and not r.info["success"]
    with pytest.raises(RuntimeError):
        env.step("answer: 1")
    # the last turn may still answer
    env.reset(seed=2)
    env.step("calc: 1")
    r = env.step(f"answer: {answer_of(2, max_turns=2)}")
    assert r.terminated and not r.truncated and r.reward == 1.0


# --------------------------------------------------------------------------- parsing and the calculator


def test_parse_action_takes_the_first_action() -> None:
    assert parse_action("calc: 2*3\nanswer: 6") == ("calc", "2*3")
    assert parse_action("Let me think.\nAnswer: 6") == ("answer", "6")
    assert parse_action("python: x = 2\nprint(x)") == ("python", "x = 2\nprint(x)")
    assert parse_action("Use python.\n```python\nprint(3)\n```\nanswer: 3") == ("python", "print(3)")
    assert parse_action("python:\n```python\nprint(4)\n```") == ("python", "print(4)")
    assert parse_action("answer: 5\n```python\nprint(3)\n```") == ("answer", "5")
    assert parse_action("the answer is 5") == ("", "")
    assert parse_answer("3,562,719.") == 3562719 and parse_answer("-12 apples") == -12
    assert parse_answer("2.5") == 2.5 and parse_answer("none") is None


def test_calc_evaluates_arithmetic() -> None:
    assert safe_calc("4821 * 739") == 3562719
    assert safe_calc("(2 + 3) ** 2 - 10 // 3 % 2") == 24
    assert safe_calc("7 / 2") == 3.5 and safe_calc("8 / 2") == 4 and isinstance(safe_calc("8/2"), int)
    assert safe_calc("2^10 =") == 1024 and safe_calc("3 × 4 − 1") == 11 and safe_calc("9 ÷ 3") == 3
    assert safe_calc("-(-5)") == 5 and safe_calc("2 ** -1") == 0.5
    assert safe_calc("37**45 % 101") == pow(37, 45, 101)
    assert safe_calc("2**9999") == 2**9999


@pytest.mark.parametrize(
    ("expr", "why"),
    [
        ("x + 1", "names are not allowed"),
        ("__import__('os').system('touch /tmp/pwned')", "not allowed"),
        ("(1).__class__", "attributes are not allowed"),
        ("abs(-1)", "function calls are not allowed"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("[1, 2]", "List is not allowed"),
        ("1, 2", "Tuple is not allowed"),
        ("lambda: 1", "Lambda is not allowed"),
        ("9 ** 9 ** 9", "too large"),
        ("10 ** 100000", "too large"),
        ("(2 ** 9000) * (2 ** 9000)", "too large"),
        ("2.0 ** 5000", "too large"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("(-8) ** 0.5", "complex"),
        ("1 +", "syntax error"),
        ("", "empty"),
        ("1" + "+1" * 300, "too long"),
        ("-" * 300 + "1", "too complex"),
        ("(" * 240 + "1" + ")" * 240, "syntax error"),
        ("1 if 1 else 2", "IfExp is not allowed"),
        ("1 < 2", "Compare is not allowed"),
    ],
)
def test_calc_rejects_everything_else(expr: str, why: str) -> None:
    t = time.monotonic()
    with pytest.raises(CalcError, match=why):
        safe_calc(expr)
    assert time.monotonic() - t < 0.5


def test_calc_errors_are_observations_not_exceptions(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    env = new_env()
    env.reset(seed=4)
    r = env.step(f"calc: __import__('os').system('touch {marker}')")
    assert r.observation.startswith("calc error: function calls are not allowed")
    assert r.info["tool"] == "calc" and r.info["tool_calls"] == 1 and not r.info["invalid_action"]
    assert not marker.exists()
    r = env.step("calc: 10**10**10")
    assert r.observation.startswith("calc error: power too large")


# --------------------------------------------------------------------------- the python tool


def _child_pids() -> set[int]:
    out: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                out.update(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def _sandbox_uid_pids() -> set[int]:
    """Live processes of a sandbox uid (only meaningful as root; empty otherwise)."""
    out: set[int] = set()
    if os.geteuid() != 0:
        return out
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        uids = {int(x) for line in lines if line.startswith("Uid:") for x in line.split()[1:]}
        zombie = any(line.startswith("State:") and line.split()[1] == "Z" for line in lines)
        if not zombie and any(UID_BASE <= u < UID_BASE + UID_SPAN for u in uids):
            out.add(int(name))
    return out


def assert_no_leftovers(children_before: set[int]) -> None:
    """No new child process of ours and (as root) no process of a sandbox uid is left."""

    def left() -> set[int]:
        return (_child_pids() - children_before) | _sandbox_uid_pids()

    deadline = time.monotonic() + 3.0
    while left() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left() == set()


@linux_only
def test_python_tool_output_errors_and_truncation() -> None:
    env = new_env(max_turns=6, max_output_chars=50)
    env.reset(seed=9)
    r = env.step("python: print(6 * 7)")
    assert r.observation.startswith("python output:\n42\n") and r.info["tool"] == "python"
    r = env.step("Here is my code:\n```python\nx = [i * i for i in range(4)]\nprint(sum(x))\n```")
    assert r.observation.startswith("python output:\n14\n") and r.info["tool_calls"] == 2
    r = env.step("python: x = 1")
    assert r.observation.startswith("python output: (nothing printed")
    r = env.step("python: print('a' * 1000)")
    assert r.observation.startswith("python output:\n" + "a" * 50 + "... [950 more characters]")
    r = env.step("python: print('partial')\n1/0")
    assert r.observation.startswith("python error (exit code 1): ZeroDivisionError: division by zero")
    assert "output before the error:\npartial" in r.observation
    r = env.step("python: def f(:")
    assert r.truncated and "SyntaxError" in r.observation and r.info["tool_calls"] == 6


HOSTILE = {
    "fork bomb": ("import os\nwhile True:\n    os.fork()\n", "os.fork is not allowed"),
    "fork bomb (subprocess)": (
        "import subprocess, sys\nwhile True:\n    subprocess.Popen([sys.executable, '-c', 'while 1: pass'])\n",
        "subprocess.Popen is not allowed",
    ),
    "infinite loop": ("while True:\n    pass\n", "stopped by the time limit"),
    "sleep forever": ("import time\ntime.sleep(3600)\n", "stopped by the time limit"),
    "huge allocation": ("x = bytearray(8 * 1024 ** 3)\n", "stopped by the memory limit"),
    "growing allocation": ("xs = []\nwhile True:\n    xs.append(bytearray(50 * 1024 ** 2))\n",
                           "stopped by the memory limit"),
    "network": ("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)\nprint('connected')\n",
                "socket.connect is not allowed"),
    "big file": ("with open('big.bin', 'wb') as f:\n    f.write(b'x' * (8 * 1024 ** 2))\n", "file size limit"),
}


@linux_only
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_python_ends_the_turn_and_the_episode_goes_on(name: str) -> None:
    code, expected = HOSTILE[name]
    env = new_env(python_wall_s=1.0)
    env.reset(seed=21)
    before = _child_pids()
    t = time.monotonic()
    r = env.step(f"python: {code}")
    assert time.monotonic() - t < 4.0
    assert r.observation.startswith("python error") and expected in r.observation, r.observation
    assert "connected" not in r.observation
    assert (r.reward, r.terminated, r.truncated) == (0.0, False, False)
    assert r.info["tool"] == "python" and r.info["tool_calls"] == 1 and not r.info["invalid_action"]
    assert_no_leftovers(before)
    r = env.step(f"answer: {answer_of(21, python_wall_s=1.0)}")
    assert (r.reward, r.terminated, r.info["success"]) == (1.0, True, True)


GUARD_FREE_FORK_BOMB = """
import _posixsubprocess, os, sys
n = 0
while True:
    try:
        _posixsubprocess.fork_exec(
            [sys.executable, "-c", "import time; time.sleep(60)"], [os.fsencode(sys.executable)], True, (),
            None, None, -1, -1, -1, -1, -1, -1, *os.pipe(), False, False, -1, None, None, None, -1, None, False)
        n += 1
    except TypeError:
        print("fork_exec signature unknown")
        raise SystemExit(0)
    except OSError as e:
        print("spawned", n, "then", e.strerror, flush=True)
        break
import time
time.sleep(60)
"""


@linux_only
def test_fork_bomb_that_dodges_the_audit_hook_is_bounded_by_the_kernel() -> None:
    """``_posixsubprocess.fork_exec`` raises no audit event: RLIMIT_NPROC and the PID namespace
    (or the reaper) are what bound and clean up this one."""
    env = new_env(python_wall_s=1.0)
    env.reset(seed=23)
    before = _child_pids()
    r = env.step(f"python: {GUARD_FREE_FORK_BOMB}")
    if "fork_exec signature unknown" in r.observation:
        pytest.skip(f"_posixsubprocess.fork_exec has another signature on Python {sys.version.split()[0]}")
    assert r.observation.startswith("python error: stopped by the time limit"), r.observation
    assert "then Resource temporarily unavailable" in r.observation  # RLIMIT_NPROC said no
    spawned = int(r.observation.split("spawned ", 1)[1].split()[0])
    assert 0 < spawned < 8
    assert_no_leftovers(before)
    assert env.step(f"answer: {answer_of(23, python_wall_s=1.0)}").reward == 1.0


@linux_only
def test_python_cannot_write_outside_its_directory(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex
    targets = [tmp_path / f"owned-{tag}", Path(f"/tmp/rollstream-tool-escape-{tag}"),
               Path(f"/dev/shm/rollstream-tool-escape-{tag}"), Path.cwd() / f"escape-{tag}"]
    code = (
        f"for path in {[str(p) for p in targets]!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('pwned')\n"
        "        print('wrote', path)\n"
        "    except OSError as e:\n"
        "        print('refused')\n"
        "open('inside.txt', 'w').write('fine')\n"
        "print('inside ok')\n"
    )
    env = new_env()
    env.reset(seed=22)
    try:
        r = env.step(f"python: {code}")
        assert r.observation.startswith("python output:") and "wrote" not in r.observation, r.observation
        assert r.observation.count("refused") == len(targets) and "inside ok" in r.observation
        assert not any(p.exists() for p in targets)
        r = env.step(f"python: open('{targets[1]}', 'w').write('x')")
        assert r.observation.startswith("python error (exit code 1): PermissionError: sandbox: writing")
        assert not targets[1].exists()
    finally:
        for p in targets:
            p.unlink(missing_ok=True)
    assert env.step(f"answer: {answer_of(22)}").reward == 1.0


# --------------------------------------------------------------------------- the task source


def test_source_problems_and_heldout_split() -> None:
    src = make_source("tool_use", difficulty=1)
    held = src.heldout(50)
    assert held == make_source("tool_use", difficulty=1).heldout(50) and src.heldout(10) == held[:10]
    assert len({p.prompt_id for p in held}) == 50 and all(src.is_heldout(p) for p in held)
    rng = random.Random(0)
    train = [src.sample(rng) for _ in range(2000)]
    assert not any(src.is_heldout(p) for p in train)
    assert not {p.prompt_id for p in held} & {p.prompt_id for p in train}
    p = held[0]
    seed = int(p.prompt_id.split(":")[1])
    assert p.prompt_id == f"tool_use:{seed}" and p.verifier == ""
    ref = json.loads(p.reference)
    assert ref["env"] == "tool_use" and ref["seed"] == seed and ref["kwargs"]["difficulty"] == 1
    env = make_env("tool_use", prompt=p.prompt, reference=p.reference, **ref["kwargs"])
    assert env.reset(seed=seed)[0] == p.prompt


def test_expert_solves_heldout_episodes_with_calc() -> None:
    src = make_source("tool_use", allow_python=False)
    assert isinstance(src, ToolUseSource)
    problems = src.heldout(200)
    solved = 0
    for p in problems:
        seed = json.loads(p.reference)["seed"]
        actions = src.demonstration(p, random.Random(0)).split(DEMO_SEP)
        assert actions == src.expert_actions(seed) and actions[0].startswith("calc: ")
        env = new_env(allow_python=False)
        env.reset(seed=seed)
        for a in actions:
            r = env.step(a)
        solved += r.info["success"]
    assert solved / len(problems) >= 0.95, solved  # 100% when written


@linux_only
def test_expert_solves_heldout_episodes_with_python() -> None:
    src = make_source("tool_use", families="primes,mul")
    seeds = src.heldout_seeds(12)  # type: ignore[attr-defined]
    solved, python_calls = 0, 0
    for seed in seeds:
        env = new_env(families="primes,mul")
        env.reset(seed=seed)
        for a in src.expert_actions(seed):  # type: ignore[attr-defined]
            r = env.step(a)
            python_calls += r.info["tool"] == "python"
        solved += r.info["success"]
    assert python_calls > 0 and solved == len(seeds)


def test_reset_and_calc_steps_are_cheap() -> None:
    env = new_env()
    t = time.perf_counter()
    for s in range(200):
        env.reset(seed=s)
        env.step("calc: 4821 * 739")
        env.step("answer: 1")
    assert (time.perf_counter() - t) / 200 < 0.01


def test_instructions_false_shows_the_task_alone() -> None:
    full, _ = new_env().reset(seed=7)
    bare, _ = new_env(instructions=False).reset(seed=7)
    assert full.startswith(bare + "\n") and bare.startswith("Task: ") and "calc:" not in bare


def test_mixed_demonstrations_answer_half_the_episodes_without_a_tool() -> None:
    tool, mixed = make_source("tool_use", families="mul"), make_source("tool_use", families="mul", demo="mixed")
    seeds = range(200)
    direct = [s for s in seeds if len(mixed.expert_actions(s)) == 1]  # type: ignore[attr-defined]
    assert 70 <= len(direct) <= 130
    for s in seeds:
        with_tool = tool.expert_actions(s)  # type: ignore[attr-defined]
        assert with_tool[0].startswith("calc: ") and len(with_tool) == 2
        assert mixed.expert_actions(s) == (with_tool[1:] if s in direct else with_tool)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="demo"):
        make_source("tool_use", demo="oracle")
