"""Write the example data set of docs/data.md: arithmetic word problems as JSON lines.

    python scripts/make_word_problems.py            # writes examples/data/word_problems{,_eval}.jsonl

Each problem adds or subtracts two numbers from 0 to 99 (never a negative result) in one of
:data:`TEMPLATES` (the verb says which), with a name and a kind of thing. A row holds ``prompt``,
``answer`` (the result) and ``solution``: the equation, then the column-by-column working of
:func:`envs.arith.scratchpad`, then the answer (``"47+38;7+8+0=15;4+3+1=8;85"``), for the warm-up.
The held-out file's problems share no ``(a, op, b)`` with the training file. Deterministic: the
same ``--seed`` writes the same bytes.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from envs.arith import scratchpad  # noqa: E402

TEMPLATES: dict[str, tuple[str, ...]] = {
    "+": (
        "{name} has {a} {things} and gets {b} more. How many now?",
        "{name} had {a} {things}, then found {b}. How many in all?",
        "A box has {a} {things}. {name} adds {b}. How many now?",
        "{name} buys {a} {things} and {b} more. How many in all?",
    ),
    "-": (
        "{name} has {a} {things} and gives away {b}. How many left?",
        "{name} had {a} {things} and lost {b}. How many are left?",
        "A bag has {a} {things}. {name} takes {b}. How many left?",
        "{name} had {a} {things} and used {b}. How many remain?",
    ),
}
NAMES = ("Ann", "Ben", "Cara", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivy", "Jon", "Kim", "Leo", "Mia", "Ned")
THINGS = ("apples", "pens", "coins", "books", "cards", "eggs", "shells", "stamps", "beads", "cups")


def problem(rng: random.Random) -> tuple[tuple[int, str, int], dict[str, str]]:
    """One problem: its ``(a, op, b)`` and its row."""
    op = rng.choice("+-")
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    if op == "-" and a < b:
        a, b = b, a
    prompt = rng.choice(TEMPLATES[op]).format(name=rng.choice(NAMES), things=rng.choice(THINGS), a=a, b=b)
    answer = a + b if op == "+" else a - b
    return (a, op, b), {
        "prompt": prompt,
        "answer": str(answer),
        "solution": f"{a}{op}{b};{scratchpad(a, op, b)}",
    }


def make(n_train: int, n_eval: int, seed: int) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """``n_train`` training rows and ``n_eval`` held-out rows, no equation in both."""
    rng = random.Random(seed)
    held: dict[tuple[int, str, int], dict[str, str]] = {}
    while len(held) < n_eval:
        key, row = problem(rng)
        held.setdefault(key, row)
    train: list[dict[str, str]] = []
    seen: set[tuple[int, str, int]] = set()
    while len(train) < n_train:
        key, row = problem(rng)
        if key not in held and key not in seen:
            seen.add(key)
            train.append(row)
    return train, list(held.values())


def write(rows: list[dict[str, str]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows to {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=800, help="training rows")
    ap.add_argument("--eval", type=int, default=128, help="held-out rows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "examples" / "data", help="output directory")
    args = ap.parse_args()
    train, held = make(args.train, args.eval, args.seed)
    write(train, args.out / "word_problems.jsonl")
    write(held, args.out / "word_problems_eval.jsonl")


if __name__ == "__main__":
    main()
