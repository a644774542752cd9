"""The one scoring path for a response: answer extraction, the guarded verifier, the format reward.

:func:`score_response` is what the reward router, the trainer's held-out evaluation and
``replay rescore`` call, so a response scores the same everywhere.
"""

from __future__ import annotations

from typing import Any

from envs.base import Verifier, VerifyResult
from envs.extract import ANSWER_MODES, extract_answer
from envs.verifiers import Isolation, run_verifier, run_verifier_async


def score_response(
    verifier: str | Verifier,
    response: str,
    reference: str,
    kwargs: dict[str, Any] | None = None,
    *,
    answer: str = "raw",
    format_reward: float = 0.0,
    timeout_s: float = 5.0,
    isolation: Isolation = "thread",
) -> VerifyResult:
    """Score ``response`` against ``reference``.

    1. Extract the answer per ``answer`` (``raw|tag|boxed|auto``, :func:`envs.extract.extract_answer`).
    2. Format absent: the verifier is not called; ``reward=0``, ``correct=False``,
       ``details="format missing: <reason>"`` (e.g. ``no <answer> tag``), ``components={"format": 0.0}``.
    3. Otherwise run the verifier on the extracted answer through :func:`envs.verifiers.run_verifier`
       (bounded by ``timeout_s`` with ``isolation``; it never raises for the verifier's fault) and
       return its result with ``reward = verifier reward + format_reward`` and, when ``answer`` is
       not ``raw``, the component ``format=1.0`` added to the verifier's components. A verifier
       error keeps ``error`` and scores ``reward=0`` (no format reward either), as
       :class:`~envs.base.VerifyResult` promises.

    Raises ``ValueError`` for an unknown ``answer`` mode, or a non-zero ``format_reward`` with
    ``answer="raw"`` (every response would earn it; the run config rejects this too).
    """
    extracted, missing = _extract(response, answer, format_reward)
    if extracted is None:
        return missing
    result = run_verifier(verifier, extracted, reference, kwargs, timeout_s=timeout_s, isolation=isolation)
    return _with_format(result, answer, format_reward)


async def score_response_async(
    verifier: str | Verifier,
    response: str,
    reference: str,
    kwargs: dict[str, Any] | None = None,
    *,
    answer: str = "raw",
    format_reward: float = 0.0,
    timeout_s: float = 5.0,
    isolation: Isolation = "thread",
) -> VerifyResult:
    """:func:`score_response` for a coroutine (the reward router): the same result, the verifier
    run through :func:`envs.verifiers.run_verifier_async` (one thread hop, the loop free meanwhile)."""
    extracted, missing = _extract(response, answer, format_reward)
    if extracted is None:
        return missing
    result = await run_verifier_async(verifier, extracted, reference, kwargs, timeout_s=timeout_s,
                                      isolation=isolation)
    return _with_format(result, answer, format_reward)


_NO_FORMAT = VerifyResult(reward=0.0, correct=False)


def _extract(response: str, answer: str, format_reward: float) -> tuple[str | None, VerifyResult]:
    """``(answer, _)`` to verify, or ``(None, result)`` when the format is missing (steps 1-2)."""
    if answer not in ANSWER_MODES:
        raise ValueError(f"unknown answer mode {answer!r}; expected one of {', '.join(ANSWER_MODES)}")
    if answer == "raw" and format_reward:
        raise ValueError(f"format_reward={format_reward:g} needs an answer format other than 'raw'")
    extracted, why = extract_answer(response, answer)
    if extracted is None:
        return None, VerifyResult(reward=0.0, correct=False, details=f"format missing: {why}",
                                  components={"format": 0.0})
    return extracted, _NO_FORMAT


def _with_format(result: VerifyResult, answer: str, format_reward: float) -> VerifyResult:
    """The verifier's ``result`` with the format's component and reward (step 3)."""
    if answer == "raw":
        return result
    components = {**result.components, "format": 1.0}
    reward = 0.0 if result.error else result.reward + format_reward
    return VerifyResult(
        reward=reward, correct=result.correct and not result.error, details=result.details,
        error=result.error, components=components,
    )
