from __future__ import annotations

import asyncio
import builtins
import multiprocessing
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from envs import VerifyResult, get_verifier, register_verifier, run_verifier
from envs.verifiers import sympy_equivalent


def crashing(response: str, reference: str, **kwargs: Any) -> VerifyResult:
    raise ZeroDivisionError("boom")


def hanging(response: str, reference: str, **kwargs: Any) -> VerifyResult:
    while True:
        time.sleep(0.01)


def wrong_type(response: str, reference: str, **kwargs: Any) -> VerifyResult:
    return 1.0  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("name", "response", "reference", "ok"),
    [
        ("exact", " 46\n", "46", True),
        ("exact", "46.0", "46", False),
        ("final_number", "6+8+0=14;3+4+1=8;84", "84", True),
        ("final_number", "84;85", "84", False),
        ("final_number", "no number", "84", False),
        ("math", "46.0", "46", True),
        ("math", "The answer is $\\frac{1}{2}$", "0.5", True),
        ("math", "47", "46", False),
        ("format", "-12", "", True),
        ("format", "12 apples", "", False),
    ],
)
def test_builtin_verifiers(name: str, response: str, reference: str, ok: bool) -> None:
    res = run_verifier(name, response, reference)
    assert (res.correct, res.reward, res.error) == (ok, float(ok), "")
    assert res.details


def test_format_pattern_kwarg() -> None:
    assert run_verifier("format", "<a>3</a>", "", {"pattern": r"<a>\d+</a>"}).correct


def test_math_falls_back_to_sympy_without_math_verify(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_math_verify(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "math_verify":
            raise ImportError("not installed")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_math_verify)
    res = get_verifier("math")("so it is 1/2", "0.5")
    assert res.correct and "sympy fallback" in res.details and "math-verify failed" in res.details
    assert sympy_equivalent("x = 3", "4") == (False, "sympy fallback: got 3, want 4")


@pytest.mark.parametrize("isolation", ["inline", "thread", "process"])
def test_crash_is_an_error_result(isolation: str) -> None:
    res = run_verifier(crashing, "1", "1", isolation=isolation)  # type: ignore[arg-type]
    assert res.reward == 0.0 and not res.correct
    assert res.error == "verifier raised ZeroDivisionError: boom"


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_hang_is_a_bounded_timeout(isolation: str) -> None:
    t0 = time.perf_counter()
    res = run_verifier(hanging, "1", "1", timeout_s=0.3, isolation=isolation)  # type: ignore[arg-type]
    assert time.perf_counter() - t0 < 2.0
    assert res.reward == 0.0 and res.error.startswith("timeout: verifier did not finish within 0.3s")


def on_thread(response: str, reference: str, **kwargs: Any) -> VerifyResult:
    """Says which thread ran it; sleeps ``response`` seconds first."""
    time.sleep(float(response))
    return VerifyResult(reward=1.0, correct=True, details=threading.current_thread().name)


def test_thread_isolation_reuses_its_workers() -> None:
    # idle workers left by earlier tests (a hung call's worker comes back when it ends) may serve too
    idle = {t.name for t in threading.enumerate() if t.name.startswith("verifier-")}
    names = [run_verifier(on_thread, "0", "", isolation="thread").details for _ in range(5)]  # type: ignore[arg-type]
    assert all(n.startswith("verifier-") for n in names) and threading.current_thread().name not in names
    assert len(set(names) - idle) <= 1, (names, idle)  # at most one new worker, not a thread per call


def test_a_hung_verifier_keeps_its_worker_and_the_next_call_gets_another() -> None:
    res = run_verifier(on_thread, "3", "", timeout_s=0.2, isolation="thread")  # type: ignore[arg-type]
    assert res.error.startswith("timeout: verifier did not finish within 0.2s")
    busy = {t.name for t in threading.enumerate() if t.name.startswith("verifier-")}
    t0 = time.perf_counter()
    res = run_verifier(on_thread, "0", "", timeout_s=2.0, isolation="thread")  # type: ignore[arg-type]
    assert res.correct and time.perf_counter() - t0 < 1.0
    assert res.details.startswith("verifier-")
    names = [run_verifier(on_thread, "0", "", isolation="thread").details for _ in range(3)]  # type: ignore[arg-type]
    hung = busy - set(names)
    assert hung, "some worker must still be running the 3 s call"
    assert not hung & set(names)  # the abandoned worker is not given new calls


def test_concurrent_calls_run_on_their_own_workers() -> None:
    with ThreadPoolExecutor(4) as pool:
        t0 = time.perf_counter()
        results = list(pool.map(lambda _: run_verifier(on_thread, "0.3", "", isolation="thread"), range(4)))  # type: ignore[arg-type]
        elapsed = time.perf_counter() - t0
    assert all(r.correct for r in results)
    assert len({r.details for r in results}) == 4 and elapsed < 1.0  # side by side, not one after another


def _in_child(conn: Any) -> None:
    conn.send(run_verifier(on_thread, "0", "", timeout_s=2.0, isolation="thread").correct)  # type: ignore[arg-type]


def test_thread_isolation_works_in_a_forked_child() -> None:
    assert run_verifier(on_thread, "0", "", isolation="thread").correct  # type: ignore[arg-type]
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_in_child, args=(child,))
    proc.start()
    assert parent.poll(10) and parent.recv() is True  # the parent's workers are not in the child
    proc.join(10)


def test_wrong_return_type_and_unknown_name_are_errors() -> None:
    assert "returned float" in run_verifier(wrong_type, "1", "1").error  # type: ignore[arg-type]
    res = run_verifier("no-such-verifier", "1", "1")
    assert res.error.startswith("unknown verifier 'no-such-verifier'") and "exact" in res.error


def test_process_isolation_returns_the_result() -> None:
    assert run_verifier("exact", "7", "7", isolation="process").correct


def test_registering_a_name_twice_is_an_error() -> None:
    register_verifier("test-dup")(crashing)
    register_verifier("test-dup")(crashing)  # same object: fine
    with pytest.raises(ValueError, match="already registered"):
        register_verifier("test-dup")(hanging)


@pytest.mark.parametrize("isolation", ["inline", "thread", "process"])
def test_the_linear_builtins_run_on_the_callers_thread_in_every_isolation(
        isolation: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import envs.verifiers as v

    assert v.inline_safe(get_verifier("exact")) and v.inline_safe(get_verifier("final_number"))
    assert not v.inline_safe(get_verifier("math")) and not v.inline_safe(get_verifier("format"))  # may hang

    def no_hop(*_: Any, **__: Any) -> Any:
        raise AssertionError("a linear built-in went to a worker thread or a child process")

    monkeypatch.setattr(v, "_run_process", no_hop)
    monkeypatch.setattr(v._Workers, "submit", no_hop)
    r = run_verifier("final_number", "so 3/4", "0.75", isolation=isolation)  # type: ignore[arg-type]
    assert r.correct and r.details == "got 3/4, want 0.75"
    crashed = asyncio.run(v.run_verifier_async("final_number", "1", "no number", isolation=isolation))  # type: ignore[arg-type]
    assert crashed.error == "verifier raised ValueError: reference 'no number' has no number"
    with pytest.raises(AssertionError, match="went to a worker thread"):  # the patch holds for the others
        run_verifier("math", "1", "1", isolation="thread" if isolation == "inline" else isolation)  # type: ignore[arg-type]
