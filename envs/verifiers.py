"""Single-turn verifiers (``exact``, ``math``, ``format``) and :func:`run_verifier`, which runs any
verifier with a time bound and turns crashes and hangs into error results.

Verifiers themselves may raise; callers go through :func:`run_verifier`, which never raises for
a verifier's fault and never blocks longer than ``timeout_s`` (plus process start-up with
``isolation="process"``).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import queue
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from fractions import Fraction
from typing import Any, Literal, TypeVar

from envs.base import Verifier, VerifyResult
from envs.registry import get_verifier, register_verifier
from schemas.errors import to_thread

Isolation = Literal["inline", "thread", "process"]

F = TypeVar("F", bound=Callable[..., Any])


def runs_inline(fn: F) -> F:
    """Mark a verifier that :func:`run_verifier` calls on the caller's thread whatever the
    isolation: its time is linear in the response (bounded by ``max_new_tokens``) and it can
    neither hang nor crash the process. A thread hop costs about ten times such a call."""
    fn.runs_inline = True  # type: ignore[attr-defined]
    return fn


def inline_safe(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is marked :func:`runs_inline`."""
    return bool(getattr(fn, "runs_inline", False))

_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def _judged(ok: bool, details: str, **components: float) -> VerifyResult:
    return VerifyResult(reward=float(ok), correct=ok, details=details, components=components)


@register_verifier("exact")
@runs_inline
def exact_match(response: str, reference: str, **kwargs: Any) -> VerifyResult:
    """Reward 1 iff the response equals the reference after stripping surrounding whitespace."""
    got, want = response.strip(), reference.strip()
    return _judged(got == want, f"got {got[:80]!r}, want {want[:80]!r}", correct=float(got == want))


@register_verifier("final_number")
@runs_inline
def final_number(response: str, reference: str, **kwargs: Any) -> VerifyResult:
    """Reward 1 iff the last number (integer, decimal or ``p/q``) in the response equals the
    reference's last number exactly (as fractions). Text around it is ignored, so worked
    solutions that end in the answer are accepted."""
    got, want = _NUMBER_RE.findall(response), _NUMBER_RE.findall(reference)
    if not want:
        raise ValueError(f"reference {reference[:80]!r} has no number")
    ok = bool(got) and Fraction(got[-1]) == Fraction(want[-1])
    return _judged(ok, f"got {got[-1] if got else None}, want {want[-1]}", correct=float(ok))


@register_verifier("format")
def format_check(response: str, reference: str = "", pattern: str = r"-?\d+", **kwargs: Any) -> VerifyResult:
    """Reward 1 iff the stripped response fully matches the regex ``pattern`` (default: an integer).
    The reference is ignored."""
    ok = re.fullmatch(pattern, response.strip()) is not None
    return _judged(ok, f"{'matches' if ok else 'does not match'} {pattern!r}", format=float(ok))


def sympy_equivalent(response: str, reference: str) -> tuple[bool, str]:
    """Compare the last number (integer, decimal or ``p/q``) of each text with sympy.

    Only numbers are extracted (with a regex) before ``sympy.Rational`` sees them, so no model
    text is ever evaluated. Returns ``(equal, details)``.
    """
    import sympy

    got, want = _NUMBER_RE.findall(response), _NUMBER_RE.findall(reference)
    if not want:
        raise ValueError(f"reference {reference[:80]!r} has no number for the sympy fallback")
    if not got:
        return False, "sympy fallback: no number in the response"
    ok = sympy.Rational(got[-1]) == sympy.Rational(want[-1])
    return bool(ok), f"sympy fallback: got {got[-1]}, want {want[-1]}"


@register_verifier("math")
def math_equivalence(response: str, reference: str, **kwargs: Any) -> VerifyResult:
    """Mathematical equivalence of the response's final answer and the reference.

    Uses math-verify (``parse`` both, ``verify(gold, pred)``) with its signal-based timeouts
    switched off (they only work in the main thread; :func:`run_verifier` bounds the time
    instead). When math-verify is missing, raises, or extracts nothing from either side, falls
    back to :func:`sympy_equivalent` (numbers only).
    """
    note = ""
    try:
        import math_verify

        # We switched its timeouts off on purpose (run_verifier bounds the time); silence the
        # one-time warning math-verify logs about that.
        logging.getLogger("math_verify").setLevel(logging.ERROR)

        gold = math_verify.parse(reference, parsing_timeout=None)
        pred = math_verify.parse(response, parsing_timeout=None)
        if gold and pred:
            ok = bool(math_verify.verify(gold, pred, timeout_seconds=None))
            return _judged(ok, f"math-verify: got {pred[-1]!s:.80}, want {gold[-1]!s:.80}", correct=float(ok))
        note = "math-verify extracted nothing; "
    except Exception as e:
        note = f"math-verify failed ({type(e).__name__}: {e}); "
    ok, details = sympy_equivalent(response, reference)
    return _judged(ok, note + details, correct=float(ok))


# --------------------------------------------------------------------------- guarded execution


def _error(message: str) -> VerifyResult:
    return VerifyResult(reward=0.0, correct=False, error=message)


def _call(fn: Verifier, response: str, reference: str, kwargs: dict[str, Any]) -> VerifyResult:
    """Call ``fn``; exceptions and wrong return types become error results."""
    try:
        result = fn(response, reference, **kwargs)
    except Exception as e:
        return _error(f"verifier raised {type(e).__name__}: {e}")
    if not isinstance(result, VerifyResult):
        return _error(f"verifier returned {type(result).__name__}, not VerifyResult")
    return result


class _Workers:
    """Daemon threads that run verifier calls for :func:`run_verifier` with ``isolation="thread"``,
    reused from call to call: starting a thread per call cost about 70 µs against 2 µs for the call
    itself (``exact``), 256 times a step in the main example.

    A call takes an idle worker, or starts one when none is idle. A call that outlives its timeout
    keeps its worker, which is then abandoned (Python cannot kill threads): it is never counted idle
    again, so later calls start other workers. Workers are daemon threads, so a hung verifier does
    not hold up the interpreter's exit. There are as many as calls ever ran at once, plus the
    abandoned ones."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], VerifyResult], Future[VerifyResult]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self.started = 0
        """Worker threads started so far."""

    def submit(self, call: Callable[[], VerifyResult]) -> Future[VerifyResult]:
        """Start ``call()`` on a worker; its future (never cancelled by a worker)."""
        result: Future[VerifyResult] = Future()
        with self._lock:
            if self._idle:
                self._idle -= 1  # that worker takes this job (or another queued one: there is one per job)
            else:
                self.started += 1
                threading.Thread(target=self._work, daemon=True, name=f"verifier-{self.started}").start()
        self._jobs.put((call, result))
        return result

    def run(self, call: Callable[[], VerifyResult], timeout_s: float) -> VerifyResult | None:
        """``call()``'s result, or ``None`` if it did not finish within ``timeout_s``."""
        try:
            return self.submit(call).result(timeout_s)
        except FutureTimeout:
            return None

    async def run_async(self, call: Callable[[], VerifyResult], timeout_s: float) -> VerifyResult | None:
        """:meth:`run` for a coroutine: the event loop waits without a thread of its own."""
        done = asyncio.wrap_future(self.submit(call))
        finished, _ = await asyncio.wait({done}, timeout=timeout_s)  # a late result is dropped, not cancelled
        return done.result() if finished else None

    def _work(self) -> None:
        while True:
            call, result = self._jobs.get()
            value = call()  # ``_call`` never raises
            with self._lock:
                self._idle += 1
            try:
                result.set_result(value)
            except InvalidStateError:  # its waiter cancelled the future (a late result nobody reads)
                pass


_workers: tuple[int, _Workers] | None = None
"""This process's id and its workers (a forked child has none of its parent's threads)."""


def _thread_workers() -> _Workers:
    """This process's verifier workers (a forked child starts its own)."""
    global _workers
    if _workers is None or _workers[0] != os.getpid():
        _workers = (os.getpid(), _Workers())
    return _workers[1]


def _thread_timeout(timeout_s: float) -> VerifyResult:
    return _error(f"timeout: verifier did not finish within {timeout_s:g}s (its thread was abandoned)")


def _run_thread(
    fn: Verifier, response: str, reference: str, kwargs: dict[str, Any], timeout_s: float
) -> VerifyResult:
    result = _thread_workers().run(lambda: _call(fn, response, reference, kwargs), timeout_s)
    return _thread_timeout(timeout_s) if result is None else result


def _child(conn: Any, fn: Verifier, response: str, reference: str, kwargs: dict[str, Any]) -> None:
    conn.send(_call(fn, response, reference, kwargs))
    conn.close()


def _run_process(
    fn: Verifier, response: str, reference: str, kwargs: dict[str, Any], timeout_s: float
) -> VerifyResult:
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, fn, response, reference, kwargs), daemon=True)
    proc.start()
    child.close()
    try:
        if parent.poll(timeout_s):
            try:
                result: VerifyResult = parent.recv()
                return result
            except EOFError:
                pass
        else:
            return _error(f"timeout: verifier did not finish within {timeout_s:g}s (its process was killed)")
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        parent.close()
    return _error(f"verifier process died (exit code {proc.exitcode})")


def _resolve(verifier: str | Verifier, kwargs: dict[str, Any] | None) -> tuple[Verifier, dict[str, Any]] | VerifyResult:
    """``(fn, kwargs)`` to call, or the error result of an unknown verifier name."""
    try:
        fn = get_verifier(verifier) if isinstance(verifier, str) else verifier
    except KeyError as e:
        return _error(str(e.args[0]))
    return fn, dict(kwargs or {})


def run_verifier(
    verifier: str | Verifier,
    response: str,
    reference: str,
    kwargs: dict[str, Any] | None = None,
    *,
    timeout_s: float = 5.0,
    isolation: Isolation = "thread",
) -> VerifyResult:
    """Run a verifier (by registered name or as a callable) without letting it harm the caller.

    ``isolation``: ``"inline"`` calls it directly (exceptions caught, no time bound), as every
    isolation does for a verifier marked :func:`runs_inline` (``exact``, ``final_number``);
    ``"thread"`` (default) runs it in a daemon worker thread (reused across calls: :class:`_Workers`)
    and gives up after ``timeout_s`` — a hung verifier's thread is abandoned, not killed (Python
    cannot kill threads); ``"process"`` forks
    a child per call and kills it on timeout (also survives segfaults; costs a fork per call).
    An unknown verifier name, an exception, a wrong return type, a timeout or a dead child all
    return a :class:`VerifyResult` with ``reward=0`` and a one-line ``error``.
    """
    found = _resolve(verifier, kwargs)
    if isinstance(found, VerifyResult):
        return found
    fn, args = found
    if isolation == "inline" or inline_safe(fn):
        return _call(fn, response, reference, args)
    if isolation == "thread":
        return _run_thread(fn, response, reference, args, timeout_s)
    return _run_process(fn, response, reference, args, timeout_s)


async def run_verifier_async(
    verifier: str | Verifier,
    response: str,
    reference: str,
    kwargs: dict[str, Any] | None = None,
    *,
    timeout_s: float = 5.0,
    isolation: Isolation = "thread",
) -> VerifyResult:
    """:func:`run_verifier` for a coroutine, with the same results: ``"thread"`` hands the call to
    a verifier worker and awaits it (one thread hop; the event loop runs meanwhile), ``"inline"``
    calls it in the loop, ``"process"`` waits for its child from a thread."""
    found = _resolve(verifier, kwargs)
    if isinstance(found, VerifyResult):
        return found
    fn, args = found
    if isolation == "inline" or inline_safe(fn):
        return _call(fn, response, reference, args)
    if isolation == "thread":
        result = await _thread_workers().run_async(lambda: _call(fn, response, reference, args), timeout_s)
        return _thread_timeout(timeout_s) if result is None else result
    return await to_thread(_run_process, fn, response, reference, args, timeout_s)
