from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from envs import extract_answer
from envs.extract import extract_boxed, extract_tag


@pytest.mark.parametrize(
    ("response", "want"),
    [
        ("think... <answer>42</answer>", "42"),
        ("<answer> 1 </answer> then <answer>\n  2\n</answer> done", "2"),  # last one, stripped
        ("<ANSWER>x</Answer>", "x"),  # case-insensitive
        ("<answer>line one\nline two</answer>", "line one\nline two"),  # multi-line
        ("< answer >7</ answer >", "7"),  # whitespace inside the tag names
        ("<answer>a <answer>b</answer>", "b"),  # innermost pair of the last close
        ("<answer>3</answer> trailing text without tags", "3"),
    ],
)
def test_tag_found(response: str, want: str) -> None:
    assert extract_answer(response, "tag") == (want, "<answer> tag")


@pytest.mark.parametrize(
    ("response", "reason"),
    [
        ("the answer is 42", "no <answer> tag"),
        ("", "no <answer> tag"),
        ("<answer>42", "unclosed <answer> tag (truncated?)"),  # truncated
        ("<answer>1</answer> wait, recheck: <answer>2", "unclosed <answer> tag after the last </answer> (truncated?)"),
        ("<answer>  \n </answer>", "empty <answer> tag"),
        ("42</answer>", "</answer> without <answer>"),
        ("<answer>42<answer>", "unclosed <answer> tag (truncated?)"),
    ],
)
def test_tag_absent(response: str, reason: str) -> None:
    assert extract_answer(response, "tag") == (None, reason)


@pytest.mark.parametrize(
    ("response", "want"),
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces
        (r"\boxed{{a}{b{c}}}", "{a}{b{c}}"),
        (r"first \boxed{1}, finally \boxed{ 2 }", "2"),  # last one, stripped
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces do not count
        (r"\fbox{7}", "7"),
        (r"\boxed {5}", "5"),
        (r"\boxed{\text{yes}}", r"\text{yes}"),  # not unwrapped
        ("\\boxed{a\\\\}", "a\\\\"),  # \\ (a LaTeX line break) escapes nothing
    ],
)
def test_boxed_found(response: str, want: str) -> None:
    assert extract_answer(response, "boxed") == (want, "\\boxed{}")


@pytest.mark.parametrize(
    ("response", "reason"),
    [
        ("42", "no \\boxed{}"),
        (r"\boxed 5", "no \\boxed{}"),
        (r"\boxed{\frac{1}{2}", "unclosed \\boxed{ (truncated?)"),  # truncated inside the nesting
        (r"\boxed{1} and then \boxed{2", "unclosed \\boxed{ (truncated?)"),  # the last one is cut off
        (r"\boxed{ }", "empty \\boxed{}"),
        (r"\boxed{1\}", "unclosed \\boxed{ (truncated?)"),
    ],
)
def test_boxed_absent(response: str, reason: str) -> None:
    assert extract_answer(response, "boxed") == (None, reason)


def test_auto_prefers_tag_then_box() -> None:
    assert extract_answer(r"\boxed{1} <answer>2</answer>", "auto") == ("2", "<answer> tag")
    assert extract_answer(r"<answer>2</answer> \boxed{1}", "auto") == ("2", "<answer> tag")
    assert extract_answer(r"\boxed{1} <answer>2", "auto") == ("1", "\\boxed{}")  # truncated tag -> box
    assert extract_answer("plain 3", "auto") == (None, "no <answer> tag; no \\boxed{}")


def test_raw_is_identity_and_bad_mode_raises() -> None:
    assert extract_answer("  <answer>1</answer> \n", "raw") == ("  <answer>1</answer> \n", "raw response")
    with pytest.raises(ValueError, match="unknown answer mode 'xml'"):
        extract_answer("1", "xml")


# --------------------------------------------------------------------------- properties

_plain = st.text(alphabet=st.characters(exclude_characters="<>\\{}", exclude_categories=["Cs"]), max_size=40)


@given(prefix=_plain, content=_plain.filter(lambda s: s.strip() != ""), suffix=_plain)
def test_tag_property(prefix: str, content: str, suffix: str) -> None:
    response = f"{prefix}<answer>draft</answer>{prefix}<answer>{content}</answer>{suffix}"
    assert extract_tag(response) == (content.strip(), "<answer> tag")
    # cutting the response anywhere after the final <answer> opens and before it closes loses it
    # (never falls back to the draft); a cut inside the opening tag itself is not detected
    for cut in range(response.rindex("<answer>") + len("<answer>"), response.rindex("</answer>") + len("</answer>") - 1):
        assert extract_tag(response[:cut])[0] is None


_balanced = st.recursive(
    _plain,
    lambda inner: st.lists(inner.map(lambda s: "{" + s + "}") | inner, min_size=1, max_size=4).map("".join),
    max_leaves=10,
)


@given(prefix=_plain, content=_balanced.filter(lambda s: s.strip() != ""), suffix=_plain)
def test_boxed_property(prefix: str, content: str, suffix: str) -> None:
    response = f"{prefix}\\boxed{{x}}{prefix}\\boxed{{{content}}}{suffix}"
    assert extract_boxed(response) == (content.strip(), "\\boxed{}")
    # truncating before the final closing brace loses it
    assert extract_boxed(response[: response.rindex("}")])[0] is None
