"""``arith``: procedurally generated, verifiable integer arithmetic (``a op b``).

Every problem is a triple ``(a, op, b)`` with operands drawn uniformly from
``[min_value, max_value]`` (``mul_max_value`` caps both operands of ``*`` when > 0) and ``op``
uniform over ``ops``. Subtraction swaps the operands when ``allow_negative`` is false, so results
are never negative. The prompt is ``template`` filled with ``a``, ``op``, ``b`` (default
``"{a}{op}{b}="``); the reference is the exact integer result. The default verifier is
``final_number`` (the last number of the response must equal the reference), so both a bare
answer (``"85"``) and a worked solution ending in the answer are accepted.

Held-out split: a problem is held out iff ``sha256(salt|a op b)`` mapped to ``[0, 1)`` is below
``heldout_fraction``. Training samples are redrawn until they are not held out, so the two never
overlap (by problem, hence by prompt). ``heldout(n)`` draws held-out problems from a fixed-seed
generator, so the list depends only on the kwargs.

Warm-up demonstrations (:meth:`ArithSource.demonstration`): the bare answer, or with probability
``demo_scratchpad`` a column-by-column worked solution (:func:`scratchpad`, for ``+`` and ``-``
with non-negative operands).
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass

from envs.base import (
    Problem,
    check_heldout_fraction,
    draw_training,
    first_heldout,
    is_heldout_key,
    reject_unknown,
)
from envs.registry import register_source

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_KEY_RE = re.compile(r"^(-?\d+)([-+*])(-?\d+)$")


def scratchpad(a: int, op: str, b: int) -> str:
    """Worked column solution of ``a + b`` or ``a - b`` (``a >= b >= 0``), least significant column
    first, then the answer: ``47+38`` -> ``"7+8+0=15;4+3+1=8;85"``, ``82-47`` ->
    ``"12-7-0=5;8-4-1=3;35"``. Each column shows its digits and the carry (borrow) coming in;
    a borrowing subtraction column shows the top digit plus 10."""
    if op not in "+-" or a < 0 or b < 0 or (op == "-" and a < b):
        raise ValueError(f"no scratchpad for {a}{op}{b}")
    da, db = str(a)[::-1], str(b)[::-1]
    steps, carry = [], 0
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        if op == "+":
            steps.append(f"{x}+{y}+{carry}={x + y + carry}")
            carry = (x + y + carry) // 10
        else:
            borrow = int(x - y - carry < 0)
            steps.append(f"{x + 10 * borrow}-{y}-{carry}={x + 10 * borrow - y - carry}")
            carry = borrow
    return ";".join([*steps, str(_OPS[op](a, b))])


@dataclass(frozen=True)
class ArithSource:
    """Integer arithmetic problems; see the module doc. Registered as ``arith``."""

    ops: str = "+-"
    min_value: int = 0
    max_value: int = 99
    mul_max_value: int = 0
    allow_negative: bool = False
    template: str = "{a}{op}{b}="
    heldout_fraction: float = 0.05
    salt: str = "arith"
    demo_scratchpad: float = 0.0
    name: str = "arith"
    default_verifier: str = "final_number"

    def __post_init__(self) -> None:
        bad = set(self.ops) - set(_OPS)
        if not self.ops or bad:
            raise ValueError(f"arith: ops={self.ops!r} must be a non-empty subset of '+-*'")
        if self.min_value > self.max_value:
            raise ValueError(f"arith: min_value={self.min_value} > max_value={self.max_value}")
        check_heldout_fraction("arith", self.heldout_fraction)
        if not 0 <= self.demo_scratchpad <= 1:
            raise ValueError(f"arith: demo_scratchpad={self.demo_scratchpad} must be in [0, 1]")

    # ------------------------------------------------------------------ problems

    def _draw(self, rng: random.Random) -> tuple[int, str, int]:
        op = rng.choice(self.ops)
        hi = self.mul_max_value if op == "*" and self.mul_max_value > 0 else self.max_value
        a, b = rng.randint(self.min_value, hi), rng.randint(self.min_value, hi)
        if op == "-" and not self.allow_negative and a < b:
            a, b = b, a
        return a, op, b

    def _heldout_key(self, key: str) -> bool:
        return is_heldout_key(self.salt, key, self.heldout_fraction)

    def _heldout_draw(self, draw: tuple[int, str, int]) -> bool:
        a, op, b = draw
        return self._heldout_key(f"{a}{op}{b}")

    @staticmethod
    def operands(problem: Problem) -> tuple[int, str, int]:
        """``(a, op, b)`` of a problem of this source."""
        m = _KEY_RE.match(problem.prompt_id.split(":", 1)[1])
        if m is None:
            raise ValueError(f"not an arith problem id: {problem.prompt_id!r}")
        return int(m.group(1)), m.group(2), int(m.group(3))

    def problem(self, a: int, op: str, b: int) -> Problem:
        """The problem ``a op b`` (whichever split it belongs to)."""
        return Problem(
            prompt_id=f"{self.name}:{a}{op}{b}",
            prompt=self.template.format(a=a, op=op, b=b),
            reference=str(_OPS[op](a, b)),
            verifier=self.default_verifier,
        )

    def is_heldout(self, problem: Problem) -> bool:
        return self._heldout_key(problem.prompt_id.split(":", 1)[1])

    def sample(self, rng: random.Random) -> Problem:
        """A uniformly drawn training problem (held-out ones are rejected and redrawn)."""
        a, op, b = draw_training("arith", lambda: self._draw(rng), self._heldout_draw)
        return self.problem(a, op, b)

    def heldout(self, n: int) -> list[Problem]:
        """``n`` distinct held-out problems, always the same for the same kwargs."""
        rng = random.Random(f"{self.salt}|heldout")
        draws = (self._draw(rng) for _ in itertools.count())
        found = first_heldout("arith", n, self.heldout_fraction, draws, self._heldout_draw,
                              "widen the value range or raise heldout_fraction")
        return [self.problem(a, op, b) for a, op, b in found]

    def demonstration(self, problem: Problem, rng: random.Random) -> str:
        """A correct response to imitate in the warm-up (see the module doc)."""
        a, op, b = self.operands(problem)
        if op in "+-" and a >= 0 and b >= 0 and (op == "+" or a >= b) and rng.random() < self.demo_scratchpad:
            return scratchpad(a, op, b)
        return problem.reference


@register_source("arith")
def make_arith(**kwargs: str | int | float | bool) -> ArithSource:
    """Build an :class:`ArithSource` from domain kwargs (unknown keys are an error)."""
    reject_unknown("arith", kwargs, set(ArithSource.__dataclass_fields__) - {"name", "default_verifier"})
    return ArithSource(**kwargs)  # type: ignore[arg-type]
