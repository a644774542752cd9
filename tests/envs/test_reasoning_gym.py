from __future__ import annotations

import json
import math
import random
import time
import warnings
from typing import Any

import pytest
import reasoning_gym  # noqa: F401  (a core dependency: its absence is a failure, not a skip)
from hypothesis import given
from hypothesis import strategies as st

from envs import TaskSource, get_verifier, make_source, run_verifier, score_response
from envs.reasoning_gym import ReasoningGymSource, from_json_safe, to_json_safe

# dataset -> (source kwargs, a wrong answer)
CHECKED: dict[str, tuple[dict[str, Any], str]] = {
    "basic_arithmetic": ({}, "123456789"),
    "chain_sum": ({}, "123456789"),
    "simple_equations": ({}, "123456789"),
    "gsm_symbolic": ({}, "123456789"),
    "countdown": ({"heldout_size_max": 40}, "1 + 1"),  # ~10 ms per entry
    "leg_counting": ({}, "123456789"),
}


def _rg(**kwargs: Any) -> ReasoningGymSource:
    src = make_source("reasoning_gym", **kwargs)
    assert isinstance(src, ReasoningGymSource) and isinstance(src, TaskSource)
    return src


@pytest.fixture(scope="module", params=sorted(CHECKED))
def source(request: pytest.FixtureRequest) -> ReasoningGymSource:
    return _rg(dataset=request.param, **{"heldout_size_max": 128, **CHECKED[request.param][0]})


def test_problem_shape(source: ReasoningGymSource) -> None:
    p = source.sample(random.Random(0))
    ref = json.loads(p.reference)
    assert set(ref) == {"dataset", "answer", "metadata", "config"}
    assert ref["dataset"] == source.dataset and isinstance(ref["answer"], str) and ref["answer"]
    assert ref["metadata"]["source_dataset"] == source.dataset
    assert p.prompt_id.startswith(f"{source.dataset}:") and len(p.prompt_id) == len(source.dataset) + 17
    assert p.verifier == source.default_verifier == "reasoning_gym"
    assert len(p.reference) < 4096


def test_heldout_deterministic_distinct_and_disjoint(source: ReasoningGymSource) -> None:
    n = 32
    held = source.heldout(n)
    assert len(held) == n and len({p.prompt_id for p in held}) == n
    again = make_source("reasoning_gym", dataset=source.dataset, heldout_size_max=source.heldout_size_max).heldout(n)
    assert held == again  # a second instance: same problems, same references
    assert source.heldout(n // 2) == held[: n // 2]
    assert all(source.is_heldout(p) for p in held)
    rng = random.Random(7)
    trained = [source.sample(rng) for _ in range(40 if source.dataset == "countdown" else 400)]
    all_held = {p.prompt for p in source.heldout(source.heldout_count)}
    assert not any(source.is_heldout(p) for p in trained)
    assert not {p.prompt for p in trained} & all_held
    assert len({p.prompt_id for p in trained}) > len(trained) // 2  # actually random


def test_sample_is_a_function_of_the_rng(source: ReasoningGymSource) -> None:
    other = make_source("reasoning_gym", dataset=source.dataset, heldout_size_max=source.heldout_size_max)
    a = [source.sample(random.Random(3)) for _ in range(3)]
    b = [other.sample(random.Random(3)) for _ in range(3)]
    assert a == b
    assert source.sample(random.Random(4)) != a[0]


def test_demonstration_scores_one_and_wrong_answers_less(source: ReasoningGymSource) -> None:
    rng = random.Random(1)
    problems = source.heldout(10) + [source.sample(rng) for _ in range(10)]
    wrong = CHECKED[source.dataset][1]
    for p in problems:
        demo = source.demonstration(p, rng)
        assert demo == json.loads(p.reference)["answer"]
        if source.dataset == "gsm_symbolic" and demo.startswith("-"):
            continue  # reasoning-gym's gsm_symbolic scorer drops the sign of negative answers (upstream bug)
        r = run_verifier("reasoning_gym", demo, p.reference, isolation="inline")
        assert (r.reward, r.correct, r.error, r.components) == (1.0, True, "", {"correct": 1.0}), r
        # the full path: instruct-style response, answer tag, format reward
        r = score_response("reasoning_gym", f"Let me think.\n<answer>{demo}</answer>", p.reference,
                           answer="tag", format_reward=0.1)
        assert r.correct and r.reward == pytest.approx(1.1)
        bad = run_verifier("reasoning_gym", wrong, p.reference, isolation="inline")
        assert bad.error == "" and bad.reward < 1.0 and not bad.correct


def test_partial_credit_is_not_correct() -> None:
    src = make_source("reasoning_gym", dataset="gsm_symbolic", heldout_size_max=8)
    p = next(p for p in src.heldout(8) if not p.reference.startswith('{"dataset":"gsm_symbolic","answer":"-'))
    r = run_verifier("reasoning_gym", "123456789", p.reference, isolation="inline")
    assert r.reward == pytest.approx(0.01) and not r.correct and r.components == {"correct": 0.0}


def test_generator_kwargs_pass_through() -> None:
    src = make_source("reasoning_gym", dataset="chain_sum", min_terms=4, max_terms=4, min_digits=1, max_digits=1,
                      heldout_size_max=8)
    rng = random.Random(0)
    for p in [*src.heldout(8), *(src.sample(rng) for _ in range(20))]:
        expr = p.prompt.rsplit(":", 1)[1].strip().rstrip("=")
        assert len(expr.replace("+", " ").replace("-", " ").split()) == 4, p.prompt
        assert json.loads(p.reference)["config"] == {"min_terms": 4, "max_terms": 4, "min_digits": 1, "max_digits": 1}
    src = make_source("reasoning_gym", dataset="basic_arithmetic", operators=["+"], heldout_size_max=4)
    assert all("*" not in p.prompt and "/" not in p.prompt for p in src.heldout(4))


def test_verifier_builds_the_scorer_from_the_reference_config() -> None:
    p = make_source("reasoning_gym", dataset="chain_sum", heldout_size_max=1).heldout(1)[0]
    ref = json.loads(p.reference)
    ref["config"] = {"no_such_field": 1}
    r = run_verifier("reasoning_gym", ref["answer"], json.dumps(ref), isolation="inline")
    assert "no_such_field" in r.error and r.reward == 0.0


def test_tiny_problem_space_never_leaks_heldout() -> None:
    # 1-digit, 2-term chain sums: 200 distinct questions; ~50 of them held out
    kw = {"dataset": "chain_sum", "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    src = _rg(heldout_size_max=60, **kw)
    held = {p.prompt for p in src.heldout(src.heldout_count)}
    assert len(held) >= 40  # so unfiltered draws would hit the held-out set within a few samples
    rng = random.Random(0)
    trained = {src.sample(rng).prompt for _ in range(500)}
    assert not trained & held
    assert len(trained | held) > 150
    # held-out covering the whole space: training is impossible, said so
    full = _rg(heldout_size_max=3000, **kw)
    assert full.heldout_count == 200 and len(full.heldout(200)) == 200
    with pytest.raises(ValueError, match="201 held-out problems asked, 200 available"):
        full.heldout(201)
    with pytest.raises(RuntimeError, match="no training problem"):
        full.sample(rng)


def test_reference_encoding_keeps_tuples_for_arc_agi() -> None:
    # arc_agi's scorer compares grids as tuples; plain JSON would turn them into lists and score 0.05
    src = make_source("reasoning_gym", dataset="arc_agi", heldout_size_max=2, chunk_size=100, train_chunks=1)
    for p in [*src.heldout(2), src.sample(random.Random(0))]:
        r = run_verifier("reasoning_gym", src.demonstration(p, random.Random(0)), p.reference, timeout_s=30)
        assert r.correct and r.reward == 1.0, r


def test_dataset_without_answers_has_no_demonstration() -> None:
    src = make_source("reasoning_gym", dataset="rush_hour", heldout_size_max=2, chunk_size=100, train_chunks=1)
    p = src.heldout(1)[0]
    assert json.loads(p.reference)["answer"] is None
    with pytest.raises(ValueError, match="no reference answer"):
        src.demonstration(p, random.Random(0))
    r = run_verifier("reasoning_gym", "nonsense", p.reference, isolation="inline")
    assert r.error == "" and not r.correct


@pytest.mark.filterwarnings("ignore:.*PYTHONHASHSEED")
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "kwarg 'dataset' is required"),
        ({"dataset": "chain_summ"}, "unknown dataset 'chain_summ'; close names: chain_sum"),
        ({"dataset": "composite"}, "'composite' is not supported"),
        ({"dataset": "chain_sum", "min_term": 2, "bogus": 1}, r"unknown kwargs \['bogus', 'min_term'\]"),
        ({"dataset": "chain_sum", "size": 10}, r"unknown kwargs \['size'\]"),
        ({"dataset": "chain_sum", "min_terms": 0}, "generator rejected kwargs {'min_terms': 0}: min_terms must be positive"),
        ({"dataset": "chain_sum", "min_terms": "two"}, "generator rejected kwargs"),
        ({"dataset": "word_ladder", "chunk_size": 50_000}, "Dataset size too large"),
        ({"dataset": "chain_sum", "heldout_size_max": -1}, "heldout_size_max=-1 must be an integer >= 0"),
        ({"dataset": "chain_sum", "train_chunks": 0}, "train_chunks=0 must be an integer >= 1"),
    ],
)
def test_bad_kwargs(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        make_source("reasoning_gym", **kwargs)
    assert "\n" not in str(info.value)


def test_hash_seed_dependent_generators_warn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.warns(UserWarning, match="depends on PYTHONHASHSEED"):
        make_source("reasoning_gym", dataset="ransom_note", heldout_size_max=1)
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_source("reasoning_gym", dataset="ransom_note", heldout_size_max=1)
        make_source("reasoning_gym", dataset="chain_sum", heldout_size_max=1)


def test_registered() -> None:
    assert get_verifier("reasoning_gym") is not None
    src = make_source("reasoning_gym", dataset="leg_counting", heldout_size_max=0)
    assert src.heldout(0) == [] and not src.is_heldout(src.sample(random.Random(0)))


def test_sampling_is_fast() -> None:
    # a regression guard against rebuilding a generator per sample (a gsm_symbolic chunk of
    # 100,000 entries costs ~20 ms to build; a sample ~0.1 ms)
    src = make_source("reasoning_gym", dataset="gsm_symbolic")
    rng = random.Random(0)
    src.sample(rng)
    t0 = time.perf_counter()
    for _ in range(2000):
        src.sample(rng)
    assert time.perf_counter() - t0 < 5.0


_leaf = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5)
_values = st.recursive(
    _leaf,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(inner, max_size=3).map(tuple)
        | st.frozensets(st.integers() | st.text(max_size=3), max_size=3)
        | st.sets(st.integers(), max_size=3)
        | st.dictionaries(st.text(max_size=5), inner, max_size=3)
        | st.dictionaries(st.integers() | st.tuples(st.integers(), st.integers()), inner, max_size=3)
    ),
    max_leaves=12,
)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


@given(_values)
def test_json_safe_round_trip(value: Any) -> None:
    text = json.dumps(to_json_safe(value), allow_nan=False)
    assert _same(from_json_safe(json.loads(text)), value)


def test_json_safe_escapes_tag_lookalikes() -> None:
    for value in ({"__tuple__": [1]}, {"__repr__": "x"}):
        assert from_json_safe(json.loads(json.dumps(to_json_safe(value)))) == value
    assert from_json_safe(to_json_safe(object()))[:9] == "<object o"
