"""``tool_use``: a multi-turn environment where a calculator or a Python sandbox makes the task easy.

Each episode is one arithmetic task from a family of :data:`FAMILIES` (``mul``, ``sum``,
``powmod``, ``primes``) at a difficulty (1-3), a function of the kwargs and the ``reset`` seed
only. Actions, one per turn (the first in the text counts):

* ``calc: <expression>``: :func:`safe_calc` (parsed with ``ast``, never ``eval``; results bounded
  to :data:`MAX_BITS` bits), with ``allow_calc``;
* ``python: <code>`` or a fenced ```` ```python ```` block: :func:`envs.sandbox.run_python` (wall
  ``python_wall_s``, memory ``python_memory_mb``, no network), what it prints is the observation
  (:func:`describe_python`), with ``allow_python``;
* ``answer: <integer>``: ends the episode, reward 1 if correct (else 0) plus ``tool_bonus`` when a
  tool was called.

Anything else is an invalid action (reward 0). The episode truncates after ``max_turns``.
``info``: ``state_hash`` (""), ``success``, ``invalid_action``, ``turn``, ``tool_calls``,
``tool``; ``reset`` adds ``seed`` and ``family``. :class:`envs.sandbox.SandboxError` propagates,
so the worker fails the episode with that reason instead of scoring it.

Task source ``tool_use`` (:class:`ToolUseSource`, an :class:`envs.gym_text.EpisodeSource`): the
expert calls a tool once then answers (``demo: mixed``: half the episodes answer at once).
Details: docs/agentic.md, "The environments".
"""

from __future__ import annotations

import ast
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from envs.base import StepResult, check_heldout_fraction, is_heldout_key, reject_unknown
from envs.gym_text import EpisodeSource, turns_left
from envs.registry import register_env, register_source
from envs.sandbox import SandboxLimits, SandboxResult, run_python

NAME = "tool_use"
FAMILIES = ("mul", "sum", "powmod", "primes")
DEMOS = ("tool", "mixed")
"""Source kwarg ``demo``: who demonstrates for the warm-up: ``tool`` (every episode calls a tool,
then answers) or ``mixed`` (half answer at once, without a tool: RL has to find out that the tool
pays)."""
PYTHON_ONLY = frozenset({"primes"})
"""Families the calculator cannot solve (left out of ``families="all"`` without python)."""
DEMO_SEP = "\n---\n"
MAX_BITS = 10_000
"""Largest integer (in bits, ~3000 digits) the calculator computes."""
MAX_EXPR_CHARS = 500
MAX_EXPR_NODES = 200
MAX_CODE_CHARS = 4000


# =========================================================================== the calculator


class CalcError(ValueError):
    """Why an expression was refused or failed (the message goes into the observation)."""


_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a // b if isinstance(a, int) and isinstance(b, int) and a % b == 0 else a / b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
    ast.Pow: lambda a, b: a**b,
}
_TRANSLATE = str.maketrans({"×": "*", "÷": "/", "−": "-"})


def _bits(x: int | float) -> int:
    return abs(x).bit_length() if isinstance(x, int) else 0


def _check(x: Any) -> int | float:
    if isinstance(x, complex):
        raise CalcError("complex result")
    if isinstance(x, float) and not math.isfinite(x):
        raise CalcError("result is not finite")
    if isinstance(x, int) and _bits(x) > MAX_BITS:
        raise CalcError(f"result too large (over {MAX_BITS} bits)")
    return x


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalcError(f"only numbers are allowed, not {node.value!r}")
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        v = _eval(node.operand)
        return v if isinstance(node.op, ast.UAdd) else -v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if isinstance(a, int) and isinstance(b, int) and b >= 0 and abs(a) > 1 and (_bits(a) - 1) * b > MAX_BITS:
                raise CalcError(f"power too large (over {MAX_BITS} bits)")
            if isinstance(b, int | float) and abs(b) > 1e6 and not (isinstance(a, int) and abs(a) <= 1):
                raise CalcError("exponent too large")
        if isinstance(node.op, ast.Mult) and _bits(a) + _bits(b) > MAX_BITS + 1:
            raise CalcError(f"result too large (over {MAX_BITS} bits)")
        try:
            return _check(_BINOPS[type(node.op)](a, b))
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        except OverflowError:
            raise CalcError("number too large") from None
    if isinstance(node, ast.Name):
        raise CalcError(f"names are not allowed ({node.id})")
    if isinstance(node, ast.Attribute):
        raise CalcError(f"attributes are not allowed (.{node.attr})")
    if isinstance(node, ast.Call):
        raise CalcError("function calls are not allowed")
    raise CalcError(f"{type(node).__name__} is not allowed; use numbers, ( ) and + - * / // % **")


def safe_calc(expr: str) -> int | float:
    """Evaluate an arithmetic expression without ``eval``: numbers, parentheses, unary ``+ -``,
    ``+ - * / // % **`` (``^`` ``×`` ``÷`` ``−`` read as ``** * / -``; a trailing ``=`` is
    ignored). ``/`` of integers that divide exactly is an integer. Raises :class:`CalcError`
    for anything else, on errors, and when a result would exceed :data:`MAX_BITS` bits."""
    text = expr.strip().rstrip("=").strip().replace("^", "**").translate(_TRANSLATE)
    if not text:
        raise CalcError("empty expression")
    if len(text) > MAX_EXPR_CHARS:
        raise CalcError(f"expression too long (over {MAX_EXPR_CHARS} characters)")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalcError("syntax error") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_EXPR_NODES:
        raise CalcError("expression too complex")
    try:
        return _eval(tree)
    except RecursionError:
        raise CalcError("expression too deeply nested") from None


def _format_number(x: int | float, limit: int) -> str:
    s = repr(x) if isinstance(x, float) else str(x)
    return s if len(s) <= limit else f"{s[:limit]}... ({len(s)} characters)"


# =========================================================================== tasks


@dataclass(frozen=True)
class Task:
    family: str
    question: str
    answer: int
    calc_expr: str
    """An expression the calculator evaluates to the answer ("" when it cannot)."""
    python_code: str
    """One line of Python that prints the answer."""


def _digits(rng: random.Random, lo: int, hi: int) -> int:
    """A number with between ``lo`` and ``hi`` digits."""
    d = rng.randint(lo, hi)
    return rng.randint(10 ** (d - 1), 10**d - 1)


def _count_primes_below(n: int) -> int:
    sieve = bytearray([1]) * max(n, 2)
    sieve[0:2] = b"\x00\x00"
    for p in range(2, math.isqrt(n - 1) + 1 if n > 1 else 0):
        if sieve[p]:
            sieve[p * p :: p] = bytearray(len(range(p * p, n, p)))
    return sum(sieve[:n])


def _task(family: str, difficulty: int, rng: random.Random) -> Task:
    d = difficulty
    if family == "mul":
        lo, hi = {1: (2, 3), 2: (3, 4), 3: (4, 5)}[d]
        a, b = _digits(rng, lo, hi), _digits(rng, lo, hi)
        return Task(family, f"What is {a} * {b}?", a * b, f"{a} * {b}", f"print({a} * {b})")
    if family == "sum":
        k, lo, hi = {1: (6, 2, 3), 2: (8, 3, 4), 3: (10, 4, 5)}[d]
        xs = [_digits(rng, lo, hi) for _ in range(k)]
        expr = " + ".join(map(str, xs))
        return Task(family, f"What is the sum of {', '.join(map(str, xs))}?", sum(xs), expr,
                    f"print(sum([{', '.join(map(str, xs))}]))")
    if family == "powmod":
        bmax, elo, ehi, mlo, mhi = {1: (20, 5, 20, 7, 100), 2: (99, 10, 60, 11, 1000),
                                    3: (999, 20, 200, 101, 10000)}[d]
        a, e, m = rng.randint(2, bmax), rng.randint(elo, ehi), rng.randint(mlo, mhi)
        return Task(family, f"What is {a}**{e} mod {m} (the remainder of {a} to the power {e} divided by {m})?",
                    pow(a, e, m), f"{a}**{e} % {m}", f"print(pow({a}, {e}, {m}))")
    if family == "primes":
        lo, hi = {1: (50, 300), 2: (300, 3000), 3: (3000, 30000)}[d]
        n = rng.randint(lo, hi)
        code = f"print(sum(all(k % p for p in range(2, int(k ** 0.5) + 1)) for k in range(2, {n})))"
        return Task(family, f"How many prime numbers are less than {n}?", _count_primes_below(n), "", code)
    raise ValueError(f"tool_use: unknown family {family!r}")


# =========================================================================== kwargs


@dataclass(frozen=True)
class ToolUseConfig:
    """The environment's kwargs (JSON scalars), validated."""

    families: str = "all"
    """Comma-separated subset of :data:`FAMILIES`, or ``all`` (every family the enabled tools can
    solve: ``primes`` only with ``allow_python``)."""
    difficulty: int = 2
    max_turns: int = 4
    allow_python: bool = True
    allow_calc: bool = True
    tool_bonus: float = 0.0
    """Added to the final reward when a tool was called in the episode (negative: a penalty)."""
    python_wall_s: float = 2.0
    python_memory_mb: int = 256
    max_output_chars: int = 400
    instructions: bool = True
    """False: the first observation is the task alone, without the tool syntax (for a model trained
    from scratch, which learns the syntax from the warm-up's demonstrations, not from the text)."""
    family_list: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _typed(self, {"families": str, "difficulty": int, "max_turns": int, "allow_python": bool,
                      "allow_calc": bool, "tool_bonus": float, "python_wall_s": float,
                      "python_memory_mb": int, "max_output_chars": int, "instructions": bool})
        if self.families.strip() == "all":
            fams = tuple(f for f in FAMILIES if self.allow_python or f not in PYTHON_ONLY)
        else:
            fams = tuple(dict.fromkeys(f.strip() for f in self.families.split(",") if f.strip()))
            if not fams or set(fams) - set(FAMILIES):
                raise ValueError(f"tool_use: families={self.families!r} must be 'all' or a comma-separated "
                                 f"subset of {','.join(FAMILIES)}")
        object.__setattr__(self, "family_list", fams)
        _bound("difficulty", self.difficulty, 1, 3)
        _bound("max_turns", self.max_turns, 1, 100)
        _bound("tool_bonus", self.tool_bonus, -1.0, 1.0)
        _bound("python_wall_s", self.python_wall_s, 0.1, 30.0)
        _bound("python_memory_mb", self.python_memory_mb, 64, 8192)
        _bound("max_output_chars", self.max_output_chars, 20, 100_000)

    def as_kwargs(self) -> dict[str, str | int | float | bool]:
        return {k: getattr(self, k) for k in _KWARGS}


_KWARGS = ("families", "difficulty", "max_turns", "allow_python", "allow_calc", "tool_bonus",
           "python_wall_s", "python_memory_mb", "max_output_chars", "instructions")


def _typed(obj: Any, types: dict[str, type]) -> None:
    for name, want in types.items():
        v = getattr(obj, name)
        ok = isinstance(v, bool) if want is bool else (
            isinstance(v, int | float) and not isinstance(v, bool) if want is float else
            isinstance(v, want) and not isinstance(v, bool))
        if not ok:
            raise ValueError(f"{NAME}: {name}={v!r} must be a {want.__name__}")


def _bound(name: str, v: float, lo: float, hi: float) -> None:
    if not lo <= v <= hi:
        raise ValueError(f"{NAME}: {name}={v!r} must be in [{lo}, {hi}]")


def _config(kwargs: dict[str, Any]) -> ToolUseConfig:
    kwargs = {k: v for k, v in kwargs.items() if k not in ("prompt", "reference")}
    reject_unknown(NAME, kwargs, _KWARGS)
    return ToolUseConfig(**kwargs)


# =========================================================================== actions


_FENCE_RE = re.compile(r"```(?:python3?|py)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
_DIRECTIVE_RE = re.compile(r"^[ \t>*#-]*(calc|python|answer)[ \t]*:[ \t]*", re.IGNORECASE | re.MULTILINE)
_ANSWER_NUM_RE = re.compile(r"-?\d+(?:\.\d+)?")


def parse_action(text: str) -> tuple[str, str]:
    """``(kind, argument)`` of the first action in ``text``: kind is ``calc``, ``python``,
    ``answer`` or ``""`` (none found). ``python:`` takes the rest of the text as code; a fenced
    ```` ```python ```` block its contents; ``calc:`` and ``answer:`` the rest of their line."""
    fence = _FENCE_RE.search(text)
    directive = _DIRECTIVE_RE.search(text)
    if fence is not None and (directive is None or fence.start() < directive.start()):
        return "python", fence.group(1).strip("\n")
    if directive is None:
        return "", ""
    kind, rest = directive.group(1).lower(), text[directive.end():]
    if kind == "python":
        inner = _FENCE_RE.search(rest)  # "python:" followed by a fenced block
        if inner is not None and not rest[: inner.start()].strip():
            return kind, inner.group(1).strip("\n")
        return kind, rest.strip("\n").rstrip()
    return kind, rest.split("\n", 1)[0].strip()


def parse_answer(arg: str) -> int | float | None:
    """The first number of an answer (thousands separators allowed), or ``None``."""
    m = _ANSWER_NUM_RE.search(re.sub(r"(?<=\d),(?=\d{3}\b)", "", arg))
    if m is None:
        return None
    s = m.group(0)
    return float(s) if "." in s else int(s)


_KILLED = {"wall time": "the time limit", "cpu time": "the CPU time limit", "memory": "the memory limit",
           "file size": "the file size limit", "output limit": "the output limit"}


def _clip(text: str, limit: int, tail: bool = False) -> str:
    if len(text) <= limit:
        return text
    return "..." + text[-limit:] if tail else text[:limit] + f"... [{len(text) - limit} more characters]"


def describe_python(r: SandboxResult, limit: int) -> str:
    """The observation for a python run: its output, or what went wrong."""
    out = _clip(r.stdout.rstrip("\n"), limit)
    if r.ok:
        return f"python output:\n{out}" if out.strip() else "python output: (nothing printed; use print())"
    if r.timed_out or r.killed in _KILLED:
        head = f"python error: stopped by {_KILLED.get(r.killed, 'the time limit')}"
    elif r.killed:
        head = f"python error: killed by {r.killed.removeprefix('signal ')}"
    else:
        head = f"python error (exit code {r.exit_code})"
        lines = [ln.strip() for ln in r.stderr.splitlines() if ln.strip()]
        if lines:
            head += f": {_clip(lines[-1], limit, tail=True)}"
    return f"{head}\noutput before the error:\n{out}" if out.strip() else head


# =========================================================================== the environment


def _instructions(cfg: ToolUseConfig) -> str:
    tools = []
    if cfg.allow_calc:
        tools.append('"calc: <expression>" computes arithmetic (+ - * / // % ** and parentheses)')
    if cfg.allow_python:
        tools.append('"python: <code>" runs Python and shows what it prints')
    how = ("Tools, one per turn: " + "; ".join(tools) + ". ") if tools else "No tools are available. "
    return f'{how}Finish with "answer: <integer>". You have {cfg.max_turns} turn{"s" * (cfg.max_turns != 1)}.'


class ToolUseEnv:
    """The ``tool_use`` environment (see the module doc)."""

    def __init__(self, cfg: ToolUseConfig) -> None:
        self.cfg = cfg
        self.limits = SandboxLimits(wall_s=cfg.python_wall_s, cpu_s=cfg.python_wall_s,
                                    memory_mb=cfg.python_memory_mb, file_size_mb=1, max_processes=8,
                                    max_open_files=64, max_output_bytes=max(4096, 4 * cfg.max_output_chars))
        self.task: Task | None = None
        self.seed = 0
        self.turn = 0
        self.tool_calls = 0
        self.done = True

    @staticmethod
    def task_for(cfg: ToolUseConfig, seed: int) -> Task:
        rng = random.Random(f"{NAME}|{seed}|{cfg.difficulty}|{','.join(cfg.family_list)}")
        return _task(rng.choice(cfg.family_list), cfg.difficulty, rng)

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.seed = random.SystemRandom().randrange(2**31) if seed is None else int(seed)
        self.task = self.task_for(self.cfg, self.seed)
        self.turn, self.tool_calls, self.done = 0, 0, False
        obs = f"Task: {self.task.question}" + (f"\n{_instructions(self.cfg)}" if self.cfg.instructions else "")
        return obs, {**self._info(False, False, ""), "seed": self.seed, "family": self.task.family}

    def _info(self, success: bool, invalid: bool, tool: str) -> dict[str, Any]:
        return {"state_hash": "", "success": success, "invalid_action": invalid, "turn": self.turn,
                "tool_calls": self.tool_calls, "tool": tool}

    def step(self, action: str) -> StepResult:
        if self.done or self.task is None:
            raise RuntimeError("tool_use: step() on a finished episode; call reset() first")
        self.turn += 1
        kind, arg = parse_action(action if isinstance(action, str) else str(action))
        tool, invalid, body = "", False, ""
        if kind == "answer":
            value = parse_answer(arg)
            if value is not None:
                self.done = True
                correct = value == self.task.answer
                reward = float(correct) + (self.cfg.tool_bonus if self.tool_calls else 0.0)
                body = f"Correct: {self.task.answer}." if correct else f"Wrong: the answer is {self.task.answer}."
                return StepResult(body, reward, True, False, self._info(correct, False, ""))
            invalid, body = True, 'Invalid action: the answer must be a number, e.g. "answer: 42".'
        elif (kind == "calc" and not self.cfg.allow_calc) or (kind == "python" and not self.cfg.allow_python):
            invalid, body = True, f"Invalid action: the {kind} tool is not available here."
        elif kind in ("calc", "python") and not arg.strip():
            invalid, body = True, f"Invalid action: empty {kind} call."
        elif kind == "calc":
            tool = kind
            self.tool_calls += 1
            try:
                body = f"calc result: {_format_number(safe_calc(arg), self.cfg.max_output_chars)}"
            except CalcError as e:
                body = f"calc error: {e}"
        elif kind == "python":
            tool = kind
            self.tool_calls += 1
            if len(arg) > MAX_CODE_CHARS:
                body = f"python error (code longer than {MAX_CODE_CHARS} characters)"
            else:
                body = describe_python(run_python(arg, limits=self.limits), self.cfg.max_output_chars)
        else:
            invalid = True
            body = ('Invalid action: write one of ' + ", ".join(
                s for s, on in (('"calc: <expression>"', self.cfg.allow_calc),
                                ('"python: <code>"', self.cfg.allow_python),
                                ('"answer: <integer>"', True)) if on) + ".")
        footer, self.done = turns_left(self.turn, self.cfg.max_turns)
        return StepResult(body + footer, 0.0, False, self.done, self._info(False, invalid, tool))


@register_env(NAME)
def make_tool_use_env(**kwargs: Any) -> ToolUseEnv:
    """Build a :class:`ToolUseEnv` from JSON-scalar kwargs (``prompt``/``reference`` are ignored)."""
    return ToolUseEnv(_config(kwargs))


# =========================================================================== the task source


class ToolUseSource(EpisodeSource):
    """Episodes of ``tool_use`` as problems (:class:`envs.gym_text.EpisodeSource`: every seed its
    own task). Registered as ``tool_use``."""

    name = NAME
    salt = NAME
    demo_sep = DEMO_SEP

    def __init__(self, heldout_fraction: float = 0.05, demo: str = "tool", **env_kwargs: Any) -> None:
        self.heldout_fraction = check_heldout_fraction(NAME, heldout_fraction)
        if demo not in DEMOS:
            raise ValueError(f"{NAME}: demo={demo!r} must be one of {', '.join(DEMOS)}")
        self.demo = demo
        self.cfg = _config(env_kwargs)

    def env_kwargs(self) -> dict[str, Any]:
        return self.cfg.as_kwargs()

    def env(self) -> ToolUseEnv:
        return ToolUseEnv(self.cfg)

    def expert_actions(self, seed: int) -> list[str]:
        """One tool call (``calc`` where it can, else ``python``; none when no tool is enabled)
        then the answer. With ``demo: mixed`` half the episodes (by seed) answer at once, without a
        tool."""
        task = ToolUseEnv.task_for(self.cfg, seed)
        if self.demo == "mixed" and is_heldout_key(f"{NAME}/direct", seed, 0.5):
            return [f"answer: {task.answer}"]
        actions = []
        if self.cfg.allow_calc and task.calc_expr:
            actions.append(f"calc: {task.calc_expr}")
        elif self.cfg.allow_python:
            actions.append(f"python: {task.python_code}")
        if len(actions) >= self.cfg.max_turns:
            actions = []
        return [*actions, f"answer: {task.answer}"]


@register_source(NAME)
def make_tool_use_source(**kwargs: Any) -> ToolUseSource:
    """Build a :class:`ToolUseSource`: the env kwargs plus ``heldout_fraction`` (default 0.05)."""
    return ToolUseSource(**kwargs)
