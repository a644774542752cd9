"""Bad input to the CLI, as a user types it: every case of ``tests/data/bad_input/cases.yaml``
runs ``python -m cli ...`` in a subprocess and must answer with exactly one non-empty
line (stdout and stderr together) that names what was wrong, a non-zero exit status (the one the
case names), no traceback, within 15 s (a responsiveness contract for users, not a benchmark).

The cases run in parallel (a thread pool of one subprocess per core, at most 4: more would make
each case wait for a core and measure the machine, not the answer), once per test session; each case
is one test item so that a failure names its case. ``{tiny}`` in a case is a tiny causal LM (the
tiny test shape, character tokenizer) created once for all cases. No case reaches a real broker or store:
``$ROLLSTREAM_BOOTSTRAP`` is ``127.0.0.1:1`` (nothing listens there) and every case has its own
scratch folder as working directory and ``$ROLLSTREAM_HOME``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

DATA = Path(__file__).parent / "data" / "bad_input"
REPO = Path(__file__).resolve().parents[1]
CASES: list[dict[str, Any]] = yaml.safe_load((DATA / "cases.yaml").read_text())
ANSWER_WITHIN_S = 15.0
WORKERS = max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True)
class Outcome:
    argv: list[str]
    code: int
    lines: list[str]
    wall_s: float


def _expand(text: str, tmp: Path, tiny: Path) -> str:
    return text.replace("{dir}", str(DATA)).replace("{tmp}", str(tmp)).replace("{tiny}", str(tiny))


def _run_case(case: dict[str, Any], tmp: Path, tiny: Path) -> Outcome:
    (tmp / "runs" / "prepared").mkdir(parents=True)
    (tmp / "runs" / "empty").mkdir()
    (tmp / "runs" / "prepared" / "config.yaml").write_text((DATA / "valid.yaml").read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    env.update(ROLLSTREAM_HOME=str(tmp / "home"), ROLLSTREAM_BOOTSTRAP="127.0.0.1:1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p))
    env.update({k: _expand(str(v), tmp, tiny) for k, v in (case.get("env") or {}).items()})
    argv = [_expand(str(a), tmp, tiny) for a in case["argv"]]
    t0 = time.monotonic()
    try:
        res = subprocess.run([sys.executable, "-m", "cli", *argv], capture_output=True, text=True,
                             env=env, cwd=tmp, stdin=subprocess.DEVNULL, timeout=4 * ANSWER_WITHIN_S)
        code, output = res.returncode, res.stdout + res.stderr
    except subprocess.TimeoutExpired as e:
        partial = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr)]
        code, output = -1, f"{''.join(partial)}\n(no answer within {e.timeout:.0f} s)"
    wall = time.monotonic() - t0
    return Outcome(argv, code, [ln for ln in output.splitlines() if ln.strip()], wall)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    """Every case's outcome, run in parallel."""
    from rollout.model_init import init_tiny_model
    from tests.conftest import TINY_SPEC

    root = tmp_path_factory.mktemp("bad_input")
    tiny = init_tiny_model(root / "tiny-model", TINY_SPEC, seed=0)
    with ThreadPoolExecutor(WORKERS) as pool:
        futures = {c["id"]: pool.submit(_run_case, c, root / c["id"], tiny) for c in CASES}
        return {cid: f.result() for cid, f in futures.items()}


def test_the_manifest_is_sound() -> None:
    ids = [c["id"] for c in CASES]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    for c in CASES:
        assert set(c) <= {"id", "argv", "env", "expect", "code"}, c["id"]
        assert c["argv"] and c["expect"], c["id"]
    text = (DATA / "cases.yaml").read_text()
    unused = [p.name for p in DATA.glob("*.yaml") if p.name != "cases.yaml" and p.name not in text]
    assert not unused, f"corpus files no case uses: {unused}"


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_bad_input_is_one_clear_line(case: dict[str, Any], outcomes: dict[str, Outcome]) -> None:
    got = outcomes[case["id"]]
    shown = "\n".join(got.lines)
    assert "Traceback" not in shown, shown
    assert len(got.lines) == 1, f"{got.argv}: expected one line, got {len(got.lines)}:\n{shown}"
    line = got.lines[0]
    assert got.code == case.get("code", 1), f"{got.argv}: exit status {got.code}: {line}"
    assert line.startswith("error:"), line
    assert "unexpected" not in line, f"{got.argv}: a user error reported as an unexpected one: {line}"
    missing = [w for w in case["expect"] if w.lower() not in line.lower()]
    assert not missing, f"{got.argv}: {line!r} does not name {missing}"
    assert got.wall_s < ANSWER_WITHIN_S, f"{got.argv}: answered after {got.wall_s:.1f} s"
