"""Answer extraction from instruct-model responses: which part of a response a verifier judges.

:func:`extract_answer` ``(response, mode) -> (answer | None, reason)``; ``None`` means the asked-for
format is absent, and ``reason`` says why in a few words (it ends up in ``VerifyResult.details``).

Modes (``DomainConfig.answer``): ``raw`` (the whole response, never ``None``); ``tag`` (the last
``<answer>…</answer>``, innermost when nested; absent when unclosed, empty, or when an ``<answer>``
is opened after the last ``</answer>``: a truncated final answer is not replaced by a draft);
``boxed`` (the last ``\\boxed{…}`` or ``\\fbox{…}`` with balanced braces, as written; absent
when unclosed or empty); ``auto`` (``tag``, else ``boxed``). The exact rules are in
docs/rewards.md, "Verifiers". Pure functions, no state.
"""

from __future__ import annotations

import re
from typing import Literal

AnswerMode = Literal["raw", "tag", "boxed", "auto"]
ANSWER_MODES: tuple[str, ...] = ("raw", "tag", "boxed", "auto")

_OPEN_TAG = re.compile(r"<\s*answer\s*>", re.IGNORECASE)
_CLOSE_TAG = re.compile(r"<\s*/\s*answer\s*>", re.IGNORECASE)
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")


def _last(pattern: re.Pattern[str], text: str, end: int | None = None) -> re.Match[str] | None:
    last = None
    for m in pattern.finditer(text, 0, len(text) if end is None else end):
        last = m
    return last


def extract_tag(response: str) -> tuple[str | None, str]:
    """The content of the last ``<answer>…</answer>`` (see the module doc)."""
    close = _last(_CLOSE_TAG, response)
    if close is None:
        if _OPEN_TAG.search(response):
            return None, "unclosed <answer> tag (truncated?)"
        return None, "no <answer> tag"
    if _OPEN_TAG.search(response, close.end()):
        return None, "unclosed <answer> tag after the last </answer> (truncated?)"
    open_ = _last(_OPEN_TAG, response, close.start())
    if open_ is None:
        return None, "</answer> without <answer>"
    content = response[open_.end() : close.start()].strip()
    if not content:
        return None, "empty <answer> tag"
    return content, "<answer> tag"


def _braced(text: str, start: int) -> int | None:
    """Index just past the ``}`` matching the ``{`` at ``text[start - 1]``, or None if unclosed."""
    depth, i = 1, start
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2  # an escaped character (``\{``, ``\}``, ``\\``) never opens or closes
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def extract_boxed(response: str) -> tuple[str | None, str]:
    """The content of the last ``\\boxed{…}`` / ``\\fbox{…}`` (see the module doc)."""
    box = _last(_BOX, response)
    if box is None:
        return None, "no \\boxed{}"
    end = _braced(response, box.end())
    if end is None:
        return None, "unclosed \\boxed{ (truncated?)"
    content = response[box.end() : end - 1].strip()
    if not content:
        return None, "empty \\boxed{}"
    return content, "\\boxed{}"


def extract_answer(response: str, mode: AnswerMode | str) -> tuple[str | None, str]:
    """``(answer, reason)`` for ``mode`` in ``raw|tag|boxed|auto``; ``answer`` is ``None`` when the
    format is absent (see the module doc). Raises ``ValueError`` for an unknown mode."""
    if mode == "raw":
        return response, "raw response"
    if mode == "tag":
        return extract_tag(response)
    if mode == "boxed":
        return extract_boxed(response)
    if mode == "auto":
        tagged, why_tag = extract_tag(response)
        if tagged is not None:
            return tagged, why_tag
        boxed, why_box = extract_boxed(response)
        if boxed is not None:
            return boxed, why_box
        return None, f"{why_tag}; {why_box}"
    raise ValueError(f"unknown answer mode {mode!r}; expected one of {', '.join(ANSWER_MODES)}")
