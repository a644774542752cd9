"""``code``: procedurally generated small programming tasks, and the ``code_tests`` verifier.

Task source ``code`` (:class:`CodeSource`): each problem asks for one Python function of one of
the :data:`FAMILIES`, with constants drawn at random into the instruction; the prompt shows
``show_examples`` examples and asks for a ```` ```python ```` block. The reference is JSON
``{"function": name, "tests": [{"args": [...], "expected": value}, ...]}`` (``n_tests`` cases
computed by a trusted implementation); ``prompt_id`` is ``code:<family>:<constants as JSON>``.
A problem is held out iff ``sha256(salt|family:constants)`` in ``[0, 1)`` is below
``heldout_fraction``; :meth:`CodeSource.demonstration` is a correct solution.

Verifier ``code_tests`` (:func:`code_tests`), for any reference of that shape: runs the response's
code once in :mod:`envs.sandbox` under a harness that prints the function's *outputs* after a
per-run random marker, and compares them with the expected values in the trusted process (they
never enter the sandbox, so a faked result line cannot pass). Reward 1 iff every test passes;
components ``passed`` (fraction passed) and ``correct``. Details: docs/rewards.md.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from envs.base import (
    Problem,
    VerifyResult,
    check_heldout_fraction,
    draw_training,
    first_heldout,
    is_heldout_key,
    reject_unknown,
)
from envs.registry import register_source, register_verifier
from envs.sandbox import SandboxLimits, run_python

Params = tuple[Any, ...]


@dataclass(frozen=True)
class Family:
    """One kind of task. ``draw`` picks the constants that go into the instruction; the rest are
    functions of those constants (and, for ``inputs``, a seeded generator)."""

    name: str
    function: str
    signature: str
    draw: Callable[[random.Random], Params]
    describe: Callable[..., str]
    solve: Callable[..., Callable[..., Any]]
    """Trusted reference implementation, from the constants."""
    source: Callable[..., str]
    """A correct solution's source, from the constants."""
    inputs: Callable[..., list[list[Any]]]
    """``inputs(rng, *constants)``: argument lists, edge cases first."""


def _ints(rng: random.Random, k: int, lo: int, hi: int) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(k)]


# --------------------------------------------------------------------------- families


def _digit_sum(b: int, p: int) -> Callable[[int], int]:
    def f(n: int) -> int:
        n, total = abs(n), 0
        while n:
            n, d = divmod(n, b)
            total += d**p
        return total

    return f


def _fib(a: int, b: int) -> Callable[[int], int]:
    def f(k: int) -> int:
        x, y = a, b
        for _ in range(k):
            x, y = y, x + y
        return x

    return f


def _shift(k: int) -> Callable[[str], str]:
    def f(s: str) -> str:
        return "".join(chr((ord(c) - 97 + k) % 26 + 97) if "a" <= c <= "z" else c for c in s)

    return f


def _poly_text(coeffs: list[int]) -> str:
    terms = []
    deg = len(coeffs) - 1
    for i, c in enumerate(coeffs):
        e = deg - i
        if c == 0:
            continue
        mag = abs(c)
        var = "" if e == 0 else ("x" if e == 1 else f"x**{e}")
        body = str(mag) if not var else (var if mag == 1 else f"{mag}*{var}")
        sign = "-" if c < 0 else "+"
        terms.append((sign, body))
    if not terms:
        return "0"
    first_sign, first = terms[0]
    out = ("-" if first_sign == "-" else "") + first
    for sign, body in terms[1:]:
        out += f" {sign} {body}"
    return out


def _poly_draw(rng: random.Random) -> Params:
    deg = rng.randint(1, 3)
    coeffs = [rng.choice([c for c in range(-9, 10) if c]), *(rng.randint(-9, 9) for _ in range(deg))]
    return (coeffs,)


def _word(rng: random.Random, alphabet: str, lo: int, hi: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def _clip_draw(rng: random.Random) -> Params:
    lo, hi = sorted(rng.sample(range(-50, 51), 2))
    return lo, hi


def _revf_draw(rng: random.Random) -> Params:
    m = rng.randint(2, 9)
    return m, rng.randint(0, m - 1)


def _mult_draw(rng: random.Random) -> Params:
    a, b = sorted(rng.sample(range(2, 13), 2))
    return a, b


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family(
            name="digit_sum",
            function="digit_power_sum",
            signature="(n: int) -> int",
            draw=lambda rng: (rng.randint(2, 16), rng.randint(1, 3)),
            describe=lambda b, p: (
                f"returns the sum of the digits of abs(n) written in base {b}"
                + ("" if p == 1 else f", each digit raised to the power {p}")
                + " (0 for n == 0)"
            ),
            solve=_digit_sum,
            source=lambda b, p: (
                "def digit_power_sum(n: int) -> int:\n"
                "    n, total = abs(n), 0\n"
                "    while n:\n"
                f"        n, d = divmod(n, {b})\n"
                f"        total += d{'' if p == 1 else f' ** {p}'}\n"
                "    return total\n"
            ),
            inputs=lambda rng, b, p: [[0], [b - 1], [b], [-(b**3) - 1], *([x] for x in _ints(rng, 6, -10**9, 10**9))],
        ),
        Family(
            name="reverse_filter",
            function="reversed_matching",
            signature="(xs: list[int]) -> list[int]",
            draw=_revf_draw,
            describe=lambda m, r: (
                f"returns the elements x of xs with x % {m} == {r} (Python's % operator), in reverse "
                "order (a new list; xs is left unchanged)"
            ),
            solve=lambda m, r: (lambda xs: [x for x in reversed(xs) if x % m == r]),
            source=lambda m, r: (
                "def reversed_matching(xs: list[int]) -> list[int]:\n"
                f"    return [x for x in reversed(xs) if x % {m} == {r}]\n"
            ),
            inputs=lambda rng, m, r: [[[]], [[r]], [list(range(-m, 2 * m))],
                                      *([_ints(rng, rng.randint(1, 12), -50, 50)] for _ in range(6))],
        ),
        Family(
            name="count_letters",
            function="count_letters",
            signature="(s: str) -> int",
            draw=lambda rng: ("".join(sorted(rng.sample(string.ascii_lowercase, rng.randint(3, 6)))),),
            describe=lambda letters: (
                f"returns how many characters of s are one of the letters {letters!r} (lowercase only: "
                "uppercase letters do not count)"
            ),
            solve=lambda letters: (lambda s: sum(1 for c in s if c in letters)),
            source=lambda letters: (
                "def count_letters(s: str) -> int:\n"
                f"    return sum(1 for c in s if c in {letters!r})\n"
            ),
            inputs=lambda rng, letters: [[""], [letters], [letters.upper()],
                                         *([_word(rng, string.ascii_letters + "  ", 1, 30)] for _ in range(6))],
        ),
        Family(
            name="fibonacci",
            function="sequence",
            signature="(k: int) -> int",
            draw=lambda rng: (rng.randint(0, 9), rng.randint(1, 9)),
            describe=lambda a, b: (
                f"returns f(k) for k >= 0, where f(0) = {a}, f(1) = {b} and f(k) = f(k - 1) + f(k - 2) "
                "(k can be up to 90)"
            ),
            solve=_fib,
            source=lambda a, b: (
                "def sequence(k: int) -> int:\n"
                f"    x, y = {a}, {b}\n"
                "    for _ in range(k):\n"
                "        x, y = y, x + y\n"
                "    return x\n"
            ),
            inputs=lambda rng, a, b: [[0], [1], [2], [90], *([k] for k in _ints(rng, 5, 3, 60))],
        ),
        Family(
            name="clip",
            function="clip",
            signature="(x: int) -> int",
            draw=_clip_draw,
            describe=lambda lo, hi: f"returns x clipped to the range [{lo}, {hi}]: {lo} if x < {lo}, {hi} if x > {hi}, "
            "else x",
            solve=lambda lo, hi: (lambda x: max(lo, min(hi, x))),
            source=lambda lo, hi: f"def clip(x: int) -> int:\n    return max({lo}, min({hi}, x))\n",
            inputs=lambda rng, lo, hi: [[lo], [hi], [lo - 1], [hi + 1], [(lo + hi) // 2],
                                        *([x] for x in _ints(rng, 4, -200, 200))],
        ),
        Family(
            name="stretch",
            function="stretch",
            signature="(s: str) -> str",
            draw=lambda rng: (rng.randint(2, 5), rng.choice(["", "-", "_", " ", ".", "|", "+"])),
            describe=lambda k, sep: (
                f"returns s with every character repeated {k} times"
                + (f", the groups joined by {sep!r} (e.g. 'ab' -> {sep.join(c * k for c in 'ab')!r})" if sep
                   else f" (e.g. 'ab' -> {''.join(c * k for c in 'ab')!r})")
            ),
            solve=lambda k, sep: (lambda s: sep.join(c * k for c in s)),
            source=lambda k, sep: f"def stretch(s: str) -> str:\n    return {sep!r}.join(c * {k} for c in s)\n",
            inputs=lambda rng, k, sep: [[""], ["a"], *([_word(rng, string.ascii_letters + string.digits, 2, 10)]
                                                       for _ in range(6))],
        ),
        Family(
            name="poly",
            function="poly",
            signature="(x: int) -> int",
            draw=_poly_draw,
            describe=lambda coeffs: f"returns the value of {_poly_text(coeffs)}",
            solve=lambda coeffs: (lambda x: sum(c * x ** (len(coeffs) - 1 - i) for i, c in enumerate(coeffs))),
            source=lambda coeffs: f"def poly(x: int) -> int:\n    return {_poly_text(coeffs)}\n",
            inputs=lambda rng, coeffs: [[0], [1], [-1], *([x] for x in _ints(rng, 5, -20, 20))],
        ),
        Family(
            name="caesar",
            function="shift",
            signature="(s: str) -> str",
            draw=lambda rng: (rng.randint(1, 25),),
            describe=lambda k: (
                f"shifts every lowercase letter a-z of s forward by {k} places in the alphabet, wrapping "
                "around from z to a; every other character is unchanged"
            ),
            solve=_shift,
            source=lambda k: (
                "def shift(s: str) -> str:\n"
                "    return ''.join(\n"
                f"        chr((ord(c) - 97 + {k}) % 26 + 97) if 'a' <= c <= 'z' else c for c in s\n"
                "    )\n"
            ),
            inputs=lambda rng, k: [[""], ["xyz"], ["Hello, World!"],
                                   *([_word(rng, string.ascii_letters + " .!", 1, 20)] for _ in range(5))],
        ),
        Family(
            name="count_multiples",
            function="count_multiples",
            signature="(n: int) -> int",
            draw=_mult_draw,
            describe=lambda a, b: f"returns how many integers in 1..n (inclusive) are divisible by {a} or by {b} "
            "(0 when n < 1)",
            solve=lambda a, b: (lambda n: 0 if n < 1 else n // a + n // b - n // (a * b // math.gcd(a, b))),
            source=lambda a, b: (
                "def count_multiples(n: int) -> int:\n"
                f"    return sum(1 for i in range(1, n + 1) if i % {a} == 0 or i % {b} == 0)\n"
            ),
            inputs=lambda rng, a, b: [[0], [-5], [a], [b], [a * b], *([n] for n in _ints(rng, 3, 1, 5000))],
        ),
    ]
}


# --------------------------------------------------------------------------- the source


def _call_text(function: str, args: list[Any]) -> str:
    return f"{function}({', '.join(repr(a) for a in args)})"


@dataclass(frozen=True)
class CodeSource:
    """Programming tasks; see the module doc. Registered as ``code``."""

    families: str = ",".join(FAMILIES)
    """Comma-separated family names to draw from (uniformly)."""
    n_tests: int = 8
    show_examples: int = 2
    heldout_fraction: float = 0.1
    salt: str = "code"
    name: str = "code"
    default_verifier: str = "code_tests"

    def __post_init__(self) -> None:
        names = self.family_names
        unknown = sorted(set(names) - set(FAMILIES))
        if not names or unknown:
            raise ValueError(f"code: families={self.families!r} must name some of {sorted(FAMILIES)}")
        if not 1 <= self.n_tests <= 100:
            raise ValueError(f"code: n_tests={self.n_tests} must be in [1, 100]")
        if not 0 <= self.show_examples <= self.n_tests:
            raise ValueError(f"code: show_examples={self.show_examples} must be in [0, n_tests]")
        check_heldout_fraction("code", self.heldout_fraction)

    @property
    def family_names(self) -> list[str]:
        return [f.strip() for f in self.families.split(",") if f.strip()]

    # ------------------------------------------------------------------ problems

    def _draw(self, rng: random.Random) -> str:
        fam = FAMILIES[rng.choice(self.family_names)]
        return f"{fam.name}:{json.dumps(list(fam.draw(rng)), separators=(',', ':'))}"

    def _heldout_key(self, key: str) -> bool:
        return is_heldout_key(self.salt, key, self.heldout_fraction)

    @staticmethod
    def parse(problem: Problem) -> tuple[Family, Params]:
        """The family and constants of a problem of this source."""
        try:
            _, family, params = problem.prompt_id.split(":", 2)
            return FAMILIES[family], tuple(json.loads(params))
        except (ValueError, KeyError) as e:
            raise ValueError(f"not a code problem id: {problem.prompt_id!r}") from e

    def problem(self, key: str) -> Problem:
        """The problem ``family:constants`` (whichever split it belongs to)."""
        family, raw = key.split(":", 1)
        fam = FAMILIES[family]
        params = tuple(json.loads(raw))
        rng = random.Random(f"{self.salt}|tests|{key}")
        solve = fam.solve(*params)
        cases = [list(args) for args in fam.inputs(rng, *params)][: self.n_tests]
        while len(cases) < self.n_tests:  # families give 8+ cases; pad with repeats of fresh draws
            cases.append(list(fam.inputs(rng, *params)[-1]))
        tests = [{"args": args, "expected": solve(*args)} for args in cases]
        examples = "".join(
            f"    {_call_text(fam.function, t['args'])} == {t['expected']!r}\n" for t in tests[len(tests) - self.show_examples:]
        )
        prompt = (
            f"Write a Python function `{fam.function}{fam.signature}` that {fam.describe(*params)}.\n"
            + (f"\nExamples:\n{examples}" if examples else "")
            + "\nAnswer with the complete function in a ```python code block."
        )
        return Problem(
            prompt_id=f"{self.name}:{key}",
            prompt=prompt,
            reference=json.dumps({"function": fam.function, "tests": tests}),
            verifier=self.default_verifier,
        )

    def is_heldout(self, problem: Problem) -> bool:
        return self._heldout_key(problem.prompt_id.split(":", 1)[1])

    def sample(self, rng: random.Random) -> Problem:
        """A training problem (held-out ones are rejected and redrawn)."""
        return self.problem(draw_training("code", lambda: self._draw(rng), self._heldout_key))

    def heldout(self, n: int) -> list[Problem]:
        """``n`` distinct held-out problems, always the same for the same kwargs."""
        rng = random.Random(f"{self.salt}|heldout")
        draws = (self._draw(rng) for _ in itertools.count())
        keys = first_heldout("code", n, self.heldout_fraction, draws, self._heldout_key,
                             "add families or raise heldout_fraction")
        return [self.problem(key) for key in keys]

    def demonstration(self, problem: Problem, rng: random.Random) -> str:
        """A correct solution in a ```` ```python ```` block."""
        fam, params = self.parse(problem)
        return f"```python\n{fam.source(*params)}```"


@register_source("code")
def make_code(**kwargs: str | int | float | bool) -> CodeSource:
    """Build a :class:`CodeSource` from domain kwargs (unknown keys are an error)."""
    reject_unknown("code", kwargs, set(CodeSource.__dataclass_fields__) - {"name", "default_verifier"})
    return CodeSource(**kwargs)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the verifier

_FENCE_RE = re.compile(r"```[ \t]*([\w+.-]*)[^\n]*\n(.*?)```", re.DOTALL)
_OPEN_RE = re.compile(r"```[ \t]*(?:python3?|py)\b[^\n]*\n", re.IGNORECASE)


def extract_code(response: str) -> str:
    """The code of a response: the last ```` ```python ```` (or ``py``) block, else the last fenced
    block, else an unterminated ```` ```python ```` block at the end, else the whole response."""
    blocks = _FENCE_RE.findall(response)
    python = [body for lang, body in blocks if lang.lower() in ("python", "python3", "py")]
    if python:
        return str(python[-1])
    if blocks:
        return str(blocks[-1][1])
    opened = list(_OPEN_RE.finditer(response))
    if opened:
        return response[opened[-1].end():]
    return response


_HARNESS = '''\
import json as _json
import sys as _sys

_MARK = {mark!r}
_FUNC = {function!r}
_CASES = {cases!r}
_out = _sys.stdout
_dumps = _json.dumps


def _report(result):
    try:
        _sys.stdout.flush()
    except BaseException:
        pass
    _out.write("\\n" + _MARK + _dumps(result) + "\\n")
    _out.flush()


def _describe(e):
    return (type(e).__name__ + ": " + str(e))[:300]


try:
    import solution
except SyntaxError as e:
    _report({{"error": "syntax error: " + _describe(e)}})
    raise SystemExit(0)
except BaseException as e:
    _report({{"error": "the code raised " + _describe(e) + " when loaded"}})
    raise SystemExit(0)
_fn = getattr(solution, _FUNC, None)
if not callable(_fn):
    _report({{"error": "no function " + repr(_FUNC) + " is defined"}})
    raise SystemExit(0)
_outputs = []
for _args in _CASES:
    try:
        _value = _fn(*_json.loads(_args))
    except BaseException as e:
        _outputs.append({{"raised": _describe(e)}})
        continue
    try:
        _outputs.append({{"value": _json.loads(_dumps(_value))}})
    except BaseException as e:
        _outputs.append({{"unserializable": type(_value).__name__}})
_report({{"outputs": _outputs}})
'''


def _same(got: Any, want: Any) -> bool:
    if isinstance(got, float | int) and isinstance(want, float | int) and not isinstance(got, bool) \
            and not isinstance(want, bool) and (isinstance(got, float) or isinstance(want, float)):
        return math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)
    return json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)


def _short(value: Any, n: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def _fail(details: str) -> VerifyResult:
    return VerifyResult(reward=0.0, correct=False, details=details, components={"passed": 0.0, "correct": 0.0})


@register_verifier("code_tests")
def code_tests(
    response: str, reference: str, timeout_s: float = 3.0, memory_mb: int = 512, **kwargs: Any
) -> VerifyResult:
    """Run the response's function on the reference's tests in the sandbox (see the module doc).

    ``timeout_s``: wall-clock and CPU limit of the run; ``memory_mb``: its address-space limit.
    """
    ref = json.loads(reference)
    function, tests = str(ref["function"]), list(ref["tests"])
    if not tests:
        raise ValueError("code_tests: the reference has no tests")
    code = extract_code(response)
    if not code.strip():
        return _fail("no code in the response")
    mark = f"@@rollstream-result-{secrets.token_hex(16)}@@"
    harness = _HARNESS.format(mark=mark, function=function, cases=[json.dumps(t["args"]) for t in tests])
    limits = SandboxLimits(wall_s=float(timeout_s), cpu_s=float(timeout_s), memory_mb=int(memory_mb),
                           max_processes=16, max_output_bytes=4 * 2**20)
    run = run_python(harness, files={"solution.py": code}, limits=limits)
    at = run.stdout.rfind(mark)
    if at < 0:
        if run.timed_out:
            return _fail(f"timeout: the program did not finish within {timeout_s:g}s")
        if run.killed:
            return _fail(f"killed: {run.killed} limit" + (f" ({_last_line(run.stderr)})" if run.stderr else ""))
        return _fail(f"no result: the program exited with status {run.exit_code} before the tests ran"
                     + (f" ({_last_line(run.stderr)})" if run.stderr else ""))
    try:
        result = json.loads(run.stdout[at + len(mark):].split("\n", 1)[0])
    except ValueError:
        return _fail("unreadable result line")
    if "error" in result:
        return _fail(str(result["error"]))
    outputs = list(result.get("outputs", []))
    passed, first = 0, ""
    for i, test in enumerate(tests):
        out = outputs[i] if i < len(outputs) and isinstance(outputs[i], dict) else {}
        call = _call_text(function, test["args"])
        if "value" in out and _same(out["value"], test["expected"]):
            passed += 1
            continue
        if not first:
            if "value" in out:
                first = f"{call} returned {_short(out['value'])}, expected {_short(test['expected'])}"
            elif "raised" in out:
                first = f"{call} raised {out['raised']}"
            elif "unserializable" in out:
                first = f"{call} returned a {out['unserializable']}, not a plain value"
            else:
                first = f"{call} produced no output"
            first = f"failed test {i + 1}/{len(tests)}: {first}"
    ok = passed == len(tests)
    details = f"passed all {passed} tests" if ok else f"{first} ({passed}/{len(tests)} passed)"
    return VerifyResult(reward=float(ok), correct=ok, details=details,
                        components={"passed": passed / len(tests), "correct": float(ok)})


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return _short(lines[-1], 160) if lines else ""
