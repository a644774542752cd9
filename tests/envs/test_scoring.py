from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from envs import VerifyResult, run_verifier, score_response, score_response_async


class Counting:
    """An ``exact``-like verifier that records what it was called with."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any]]] = []

    def __call__(self, response: str, reference: str, **kwargs: Any) -> VerifyResult:
        self.calls.append((response, reference, kwargs))
        ok = response.strip() == reference
        return VerifyResult(reward=float(ok), correct=ok, details=f"got {response!r}", components={"correct": float(ok)})


def crashing(response: str, reference: str, **kwargs: Any) -> VerifyResult:
    raise RuntimeError("boom")


def hanging(response: str, reference: str, **kwargs: Any) -> VerifyResult:
    time.sleep(5)
    return VerifyResult(reward=1.0, correct=True)


def test_raw_is_run_verifier_unchanged() -> None:
    for response in ("46", " 46\n", "47", "<answer>46</answer>"):
        assert score_response("exact", response, "46") == run_verifier("exact", response, "46")
    assert "format" not in score_response("exact", "46", "46").components


def test_tag_correct_adds_format_reward() -> None:
    v = Counting()
    r = score_response(v, "thinking 45? no.\n<answer> 46 </answer>", "46", {"k": 1}, answer="tag", format_reward=0.25)
    assert v.calls == [("46", "46", {"k": 1})]  # the verifier judged the extracted answer, with the kwargs
    assert r.reward == pytest.approx(1.25) and r.correct
    assert r.components == {"correct": 1.0, "format": 1.0}
    assert r.details == "got '46'" and r.error == ""


def test_tag_wrong_keeps_format_reward() -> None:
    r = score_response("exact", "<answer>47</answer>", "46", answer="tag", format_reward=0.25)
    assert r.reward == pytest.approx(0.25) and not r.correct
    assert r.components == {"correct": 0.0, "format": 1.0}


@pytest.mark.parametrize(
    ("answer", "response", "reason"),
    [
        ("tag", "the answer is 46", "no <answer> tag"),
        ("tag", "<answer>46", "unclosed <answer> tag (truncated?)"),
        ("boxed", "46", "no \\boxed{}"),
        ("auto", "46", "no <answer> tag; no \\boxed{}"),
    ],
)
def test_missing_format_scores_zero_without_calling_the_verifier(answer: str, response: str, reason: str) -> None:
    v = Counting()
    r = score_response(v, response, "46", answer=answer, format_reward=0.5)
    assert v.calls == []
    assert r == VerifyResult(reward=0.0, correct=False, details=f"format missing: {reason}", components={"format": 0.0})


def test_boxed_with_math_verifier() -> None:
    r = score_response("math", r"so $\boxed{\frac{1}{2}}$", "0.5", answer="boxed", format_reward=0.1)
    assert r.correct and r.reward == pytest.approx(1.1) and r.components["format"] == 1.0
    # only the box is judged: the raw response's last number is 2
    assert score_response("final_number", r"\boxed{3} is not 2", "3", answer="auto").correct
    assert not score_response("final_number", r"\boxed{3} is not 2", "3").correct


def test_auto_takes_tag_over_box() -> None:
    r = score_response("exact", r"\boxed{1} <answer>2</answer>", "2", answer="auto")
    assert r.correct and r.components == {"correct": 1.0, "format": 1.0}


def test_verifier_errors_keep_error_and_score_zero() -> None:
    r = score_response(crashing, "<answer>46</answer>", "46", answer="tag", format_reward=0.5)
    assert r.reward == 0.0 and not r.correct
    assert r.error == "verifier raised RuntimeError: boom"
    assert r.components == {"format": 1.0}
    t0 = time.perf_counter()
    r = score_response(hanging, "<answer>46</answer>", "46", answer="tag", format_reward=0.5, timeout_s=0.2)
    assert time.perf_counter() - t0 < 2
    assert r.reward == 0.0 and r.error.startswith("timeout")
    r = score_response("no-such-verifier", "46", "46")
    assert r.reward == 0.0 and "unknown verifier 'no-such-verifier'" in r.error


def test_process_isolation() -> None:
    r = score_response("exact", "<answer>46</answer>", "46", answer="tag", format_reward=0.5, isolation="process")
    assert r.correct and r.reward == pytest.approx(1.5)


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="unknown answer mode 'xml'"):
        score_response("exact", "46", "46", answer="xml")
    with pytest.raises(ValueError, match=r"format_reward=0\.5 needs an answer format"):
        score_response("exact", "46", "46", answer="raw", format_reward=0.5)


CASES = [
    ("exact", "46", "46", {}, "raw", 0.0),
    ("exact", "45", "46", {}, "raw", 0.0),
    ("exact", "thinking\n<answer> 46 </answer>", "46", {}, "tag", 0.25),
    ("exact", "no tag here", "46", {}, "tag", 0.25),
    ("final_number", r"so \boxed{3}", "3", {}, "auto", 0.0),
    ("format", "12", "", {"pattern": r"\d+"}, "raw", 0.0),
    ("no-such-verifier", "46", "46", {}, "raw", 0.0),
]


@pytest.mark.parametrize("isolation", ["inline", "thread", "process"])
async def test_the_async_path_scores_as_the_sync_one(isolation: str) -> None:
    for verifier, response, reference, kwargs, answer, fmt in CASES:
        want = score_response(verifier, response, reference, kwargs, answer=answer, format_reward=fmt,
                              isolation=isolation)  # type: ignore[arg-type]
        got = await score_response_async(verifier, response, reference, kwargs, answer=answer, format_reward=fmt,
                                         isolation=isolation)  # type: ignore[arg-type]
        assert got == want, (verifier, response, answer)
    assert (await score_response_async(crashing, "46", "46")).error == "verifier raised RuntimeError: boom"


async def test_the_async_path_bounds_a_hung_verifier_and_keeps_the_loop_running() -> None:
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    t0 = time.perf_counter()
    r = await score_response_async(hanging, "<answer>46</answer>", "46", answer="tag", format_reward=0.5, timeout_s=0.3)
    elapsed = time.perf_counter() - t0
    ticker.cancel()
    assert r.reward == 0.0 and r.error.startswith("timeout: verifier did not finish within 0.3s")
    assert 0.3 <= elapsed < 2
    assert ticks >= 5  # the event loop ran while the verifier hung (every 10 ms over 300 ms)
    with pytest.raises(ValueError, match="unknown answer mode 'xml'"):
        await score_response_async("exact", "46", "46", answer="xml")
