from __future__ import annotations

import json
import random
import re
import sys
import time
from typing import Any

import pytest

import envs.code
from envs import SingleTurnEnv, TaskSource, get_verifier, make_env, make_source, run_verifier
from envs.code import FAMILIES, CodeSource, code_tests, extract_code

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only")


def test_is_a_task_source_with_code_tests_by_default() -> None:
    src = make_source("code")
    assert isinstance(src, TaskSource)
    assert src.default_verifier == "code_tests"
    assert get_verifier("code_tests") is code_tests
    p = src.sample(random.Random(0))
    assert p.verifier == "code_tests" and p.prompt_id.startswith("code:")
    assert "```python" in p.prompt


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_familys_demonstration_passes_its_tests(family: str) -> None:
    src = CodeSource(families=family)
    rng = random.Random(family)
    for _ in range(2):
        p = src.sample(rng)
        ref = json.loads(p.reference)
        assert ref["function"] == FAMILIES[family].function and len(ref["tests"]) == src.n_tests
        assert f"`{ref['function']}" in p.prompt
        demo = src.demonstration(p, rng)
        assert demo.startswith("```python\n") and demo.endswith("```")
        res = code_tests(demo, p.reference)
        assert res.correct and res.reward == 1.0, (p.prompt, demo, res)
        assert res.components == {"passed": 1.0, "correct": 1.0}


def test_prompts_are_many_and_examples_are_right() -> None:
    src = make_source("code")
    rng = random.Random(1)
    problems = [src.sample(rng) for _ in range(600)]
    assert len({p.prompt for p in problems}) > 350
    assert {CodeSource.parse(p)[0].name for p in problems} == set(FAMILIES)
    p = problems[0]
    fam, params = CodeSource.parse(p)
    solve = fam.solve(*params)
    for t in json.loads(p.reference)["tests"]:
        assert solve(*t["args"]) == t["expected"]
    # the same problem id always gives the same tests
    key = p.prompt_id.split(":", 1)[1]
    assert CodeSource().problem(key) == p


def test_wrong_answers_fail() -> None:
    src = CodeSource(families="clip")
    p = src.problem("clip:[-5,12]")
    wrong = "```python\ndef clip(x: int) -> int:\n    return max(-5, min(11, x))\n```"
    res = code_tests(wrong, p.reference)
    assert not res.correct and res.reward == 0.0
    assert res.details.startswith("failed test 2/8: clip(12) returned 11, expected 12")
    assert 0 < res.components["passed"] < 1
    other = src.demonstration(src.problem("clip:[-5,13]"), random.Random(0))
    assert code_tests(other, p.reference).reward == 0.0
    named_wrong = "```python\ndef clamp(x):\n    return x\n```"
    res = code_tests(named_wrong, p.reference)
    assert res.reward == 0.0 and "no function 'clip'" in res.details
    raising = "```python\ndef clip(x):\n    raise ValueError('nope')\n```"
    res = code_tests(raising, p.reference)
    assert res.reward == 0.0 and "raised ValueError: nope" in res.details
    cheat = "```python\nclass Any:\n    def __eq__(self, other):\n        return True\ndef clip(x):\n    return Any()\n```"
    res = code_tests(cheat, p.reference)
    assert res.reward == 0.0 and "not a plain value" in res.details


def test_types_must_match() -> None:
    p = CodeSource().problem("count_letters:[\"abc\"]")
    as_float = "```python\ndef count_letters(s):\n    return float(sum(c in 'abc' for c in s))\n```"
    assert code_tests(as_float, p.reference).reward == 1.0  # 3.0 == 3 numerically
    as_str = "```python\ndef count_letters(s):\n    return str(sum(c in 'abc' for c in s))\n```"
    assert code_tests(as_str, p.reference).reward == 0.0
    as_bool = "```python\ndef count_letters(s):\n    return sum(c in 'abc' for c in s) > 0\n```"
    assert code_tests(as_bool, p.reference).reward == 0.0


def test_responses_without_code_or_with_broken_code() -> None:
    p = CodeSource().problem("clip:[0,10]")
    res = code_tests("", p.reference)
    assert res.reward == 0.0 and res.details == "no code in the response"
    res = code_tests("I am not sure how to do this.", p.reference)
    assert res.reward == 0.0 and res.details.startswith("syntax error")
    res = code_tests("```python\ndef clip(x)\n    return x\n```", p.reference)
    assert res.reward == 0.0 and "syntax error" in res.details and "line 1" in res.details
    res = code_tests("```python\nimport numpy_does_not_exist\n```", p.reference)
    assert res.reward == 0.0 and "ModuleNotFoundError" in res.details


def test_hostile_responses_score_zero_with_the_reason() -> None:
    p = CodeSource().problem("clip:[0,10]")
    t0 = time.monotonic()
    res = code_tests("```python\ndef clip(x):\n    while True:\n        pass\n```", p.reference, timeout_s=1.0)
    assert res.reward == 0.0 and not res.correct and res.details.startswith("timeout")
    assert time.monotonic() - t0 < 3.0
    res = code_tests("```python\nwhile True:\n    pass\n```", p.reference, timeout_s=1.0)
    assert res.reward == 0.0 and res.details.startswith("timeout")
    res = code_tests("```python\nimport os\ndef clip(x):\n    os.fork()\n    return x\n```", p.reference)
    assert res.reward == 0.0 and "os.fork is not allowed" in res.details
    hog = "```python\nblob = bytearray(2 * 1024**3)\ndef clip(x):\n    return x\n```"
    res = code_tests(hog, p.reference, memory_mb=256)
    assert res.reward == 0.0 and "MemoryError" in res.details
    loud = "```python\ndef clip(x):\n    print('x' * 10**7)\n    return max(0, min(10, x))\n```"
    res = code_tests(loud, p.reference)
    assert res.reward == 0.0 and "output limit" in res.details
    exits = "```python\nimport os\nos._exit(0)\n```"
    res = code_tests(exits, p.reference)
    assert res.reward == 0.0 and res.details.startswith("no result")


def test_a_faked_result_line_does_not_pass() -> None:
    """The solution reads the harness (so it knows the per-run marker) and prints result lines
    claiming success in every shape it can think of, then exits before the harness reports."""
    p = CodeSource().problem("clip:[0,10]")
    n = len(json.loads(p.reference)["tests"])
    fake = (
        "```python\n"
        "import json, os, re, sys\n"
        "src = open(sys.modules['__main__'].__file__).read()\n"
        "mark = re.search(r\"_MARK = '([^']+)'\", src).group(1)\n"
        f"for claim in [{{'passed': True, 'reward': 1.0}}, {{'outputs': [{{'passed': True}}] * {n}}},\n"
        f"              {{'outputs': [{{'value': None, 'ok': True}}] * {n}}}, {{'error': ''}}]:\n"
        "    print(mark + json.dumps(claim), flush=True)\n"
        "os._exit(0)\n"
        "```"
    )
    res = code_tests(fake, p.reference)
    assert res.reward == 0.0 and not res.correct
    # and one that patches the harness's reporting after the fact
    patch = (
        "```python\n"
        "import sys\n"
        "main = sys.modules['__main__']\n"
        "def clip(x):\n"
        "    main._CASES[:] = []\n"
        "    return x\n"
        "```"
    )
    assert code_tests(patch, p.reference).reward == 0.0


def test_each_run_uses_a_fresh_marker(monkeypatch: pytest.MonkeyPatch) -> None:
    marks: list[str] = []
    real = envs.code.run_python

    def spy(code: str, **kwargs: Any) -> Any:
        found = re.search(r"_MARK = '([^']+)'", code)
        assert found is not None
        marks.append(found.group(1))
        return real(code, **kwargs)

    monkeypatch.setattr(envs.code, "run_python", spy)
    p = CodeSource().problem("clip:[0,10]")
    demo = CodeSource().demonstration(p, random.Random(0))
    assert code_tests(demo, p.reference).reward == code_tests(demo, p.reference).reward == 1.0
    assert len(marks) == 2 and marks[0] != marks[1] and len(marks[0]) > 32


def test_extract_code() -> None:
    assert extract_code("text\n```python\na = 1\n```\nmore\n```python\nb = 2\n```\n") == "b = 2\n"
    assert extract_code("```py\nx = 1\n```\n```text\nhello\n```") == "x = 1\n"
    assert extract_code("```\ny = 2\n```") == "y = 2\n"
    assert extract_code("Here:\n```python\ndef f():\n    return 1\n") == "def f():\n    return 1\n"  # cut off
    assert extract_code("def f():\n    return 1") == "def f():\n    return 1"


def test_heldout_split_is_deterministic_and_disjoint() -> None:
    a, b = make_source("code"), make_source("code")
    held = a.heldout(64)
    assert held == b.heldout(64)
    assert a.heldout(16) == held[:16]
    assert len({p.prompt_id for p in held}) == 64
    assert all(a.is_heldout(p) for p in held)
    rng = random.Random(0)
    train = [a.sample(rng) for _ in range(3000)]
    assert not any(a.is_heldout(p) for p in train)
    assert not {p.prompt_id for p in held} & {p.prompt_id for p in train}
    assert make_source("code", salt="other").heldout(8) != held[:8]


def test_bad_kwargs_are_errors() -> None:
    with pytest.raises(ValueError, match="unknown kwargs"):
        make_source("code", nonsense=1)
    with pytest.raises(ValueError):
        make_source("code", families="clip,nope")
    with pytest.raises(ValueError):
        make_source("code", heldout_fraction=0)
    with pytest.raises(ValueError):
        make_source("code", n_tests=3, show_examples=4)
    with pytest.raises(ValueError, match="only"):
        make_source("code", families="stretch", heldout_fraction=0.01).heldout(5)


def test_through_the_env_and_run_verifier() -> None:
    src = make_source("code", families="caesar,poly")
    p = src.heldout(1)[0]
    env = make_env("code", prompt=p.prompt, reference=p.reference)
    assert isinstance(env, SingleTurnEnv)
    prompt, _ = env.reset()
    assert prompt == p.prompt
    step = env.step("Sure!\n" + src.demonstration(p, random.Random(0)))
    assert step.reward == 1.0 and step.terminated and step.info["correct"]
    res = run_verifier("code_tests", "```python\nwhile True: pass\n```", p.reference, {"timeout_s": 1.0},
                       timeout_s=5.0)
    assert res.reward == 0.0 and res.error == "" and res.details.startswith("timeout")
