"""Judges: answer parsing, the micro-batcher, an LLM judge and a reward model on tiny local models."""

from __future__ import annotations

import asyncio
import math
import threading
from pathlib import Path

import pytest

from rollout.judge import (
    LLMJudge,
    MicroBatcher,
    RewardModelJudge,
    judge_input,
    label_score,
    label_token_ids,
    load_judge,
    parse_choice,
    parse_number,
)
from rollout.model_init import init_tiny_reward_model, load_tokenizer
from schemas.config import JudgeModelConfig


def test_parse_number_takes_the_first_integer_in_range() -> None:
    assert parse_number("Score: 4", 1, 5) == (0.75, "")
    assert parse_number(" 1 because", 1, 5) == (0.0, "")
    assert parse_number("5/5", 1, 5) == (1.0, "")
    score, why = parse_number("7", 1, 5)
    assert score is None and why == "judge answered 7, outside [1, 5]"
    score, why = parse_number("great answer!", 1, 5)
    assert score is None and "no integer" in why and "great answer!" in why


def test_parse_choice_takes_the_earliest_whole_word_label() -> None:
    choices = {"yes": 1.0, "no": 0.0}
    assert parse_choice("Yes, it does.", choices) == (1.0, "")
    assert parse_choice("no. yes would be wrong", choices) == (0.0, "")
    score, why = parse_choice("nothing yesterday", choices)  # neither label as a whole word
    assert score is None and "none of ['no', 'yes']" in why


def test_label_score_is_the_probability_weighted_mean() -> None:
    lp = [math.log(0.1), math.log(0.1), math.log(0.6)]  # labels 1, 2, 3; 80% mass
    score, mass, why = label_score(lp, 1, 0.5)
    assert why == "" and mass == pytest.approx(0.8)
    assert score == pytest.approx(((1 * 0.1 + 2 * 0.1 + 3 * 0.6) / 0.8 - 1) / 2)
    score, mass, why = label_score([math.log(0.01)] * 3, 1, 0.1)
    assert score is None and "3.0%" in why and "min_label_mass" in why


def test_judge_input_holds_rubric_prompt_response_and_format() -> None:
    cfg = JudgeModelConfig(path="x", rubric="Rate the poem.", score="choice", choices={"good": 1.0, "bad": 0.0})
    text = judge_input(cfg, "Write a poem.", "Roses are red.")
    assert text.startswith("Rate the poem.") and "[Request]\nWrite a poem." in text
    assert "[Response]\nRoses are red." in text and text.endswith("Answer with one word: 'good' or 'bad'.")


async def test_micro_batcher_batches_concurrent_calls_and_fails_a_batch_together() -> None:
    seen: list[list[int]] = []
    lock = threading.Lock()

    def double(batch: list[int]) -> list[int]:
        with lock:
            seen.append(list(batch))
        if -1 in batch:
            raise RuntimeError("boom")
        return [2 * x for x in batch]

    b: MicroBatcher[int, int] = MicroBatcher(double, max_batch=4, wait_s=0.05)
    results = await asyncio.gather(*(b.submit(i) for i in range(10)))
    assert [r for r, _ in results] == [2 * i for i in range(10)]
    assert [len(x) for x in seen] == [4, 4, 2] and b.batches == 3
    outcomes = await asyncio.gather(b.submit(-1), b.submit(3), return_exceptions=True)
    assert all(isinstance(o, RuntimeError) for o in outcomes)


def test_logprob_labels_must_be_single_tokens(model_dir: Path) -> None:
    tok = load_tokenizer(model_dir)
    assert len(label_token_ids(tok, 1, 9)) == 9
    with pytest.raises(ValueError, match="score label 10 is 2 tokens"):
        label_token_ids(tok, 1, 10)


async def test_llm_judge_logprobs_scores_in_unit_range_alone_and_batched(model_dir: Path) -> None:
    cfg = JudgeModelConfig(path=str(model_dir), score="logprobs", min_score=1, max_score=5, min_label_mass=0.0)
    judge = LLMJudge("j", cfg, max_batch=8, batch_wait_s=0.05)
    pairs = [("What is 2+3?", "5"), ("Write a word.", "hello there, a longer response than the other"),
             ("Name a colour.", "blue")]
    alone = [await judge.judge(p, r) for p, r in pairs]
    together = await asyncio.gather(*(judge.judge(p, r) for p, r in pairs))
    for a, t in zip(alone, together, strict=True):
        assert a.error == "" and 0.0 <= a.score <= 1.0 and a.answer.startswith("p(1:")
        assert t.score == pytest.approx(a.score, abs=1e-5)  # left padding does not change a row
    assert judge._batcher.batches == len(pairs) + 1


async def test_llm_judge_records_why_an_untrained_model_gives_no_score(model_dir: Path) -> None:
    # an untrained tiny model answers garbage: no score, reason recorded, never an exception
    number = LLMJudge("j", JudgeModelConfig(path=str(model_dir), max_new_tokens=4))
    v = await number.judge("What is 2+3?", "5")
    assert v.score == 0.0 and v.error and ("no integer" in v.error or "outside" in v.error) and v.judge_s > 0
    strict = LLMJudge("j", JudgeModelConfig(path=str(model_dir), score="logprobs", min_label_mass=0.99))
    v = await strict.judge("What is 2+3?", "5")
    assert v.score == 0.0 and "min_label_mass 0.99" in v.error


async def test_reward_model_scores_batched_like_alone(tmp_path: Path) -> None:
    path = init_tiny_reward_model(tmp_path / "rm", seed=3)
    rm = load_judge("rm", JudgeModelConfig(kind="reward_model", path=str(path)), max_batch=8, batch_wait_s=0.05)
    assert isinstance(rm, RewardModelJudge)
    pairs = [("a", "b"), ("What is 2+3?", "5 is the answer to this one"), ("x", "y z")]
    alone = [await rm.judge(p, r) for p, r in pairs]
    together = await asyncio.gather(*(rm.judge(p, r) for p, r in pairs))
    for a, t in zip(alone, together, strict=True):
        assert a.error == "" and 0.0 < a.score < 1.0
        assert a.score == pytest.approx(1 / (1 + math.exp(-float(a.answer))), abs=1e-4)
        assert t.score == pytest.approx(a.score, abs=1e-5)  # right padding does not change a row
    assert len({round(v.score, 6) for v in alone}) == len(pairs)
    raw = load_judge("rm", JudgeModelConfig(kind="reward_model", path=str(path), normalize="none"))
    v = await raw.judge(*pairs[0])
    assert v.score == pytest.approx(float(alone[0].answer), abs=1e-4)


def test_load_judge_refuses_a_directory_without_a_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a Hugging Face model directory"):
        load_judge("j", JudgeModelConfig(path=str(tmp_path)))


def test_a_causal_lm_is_not_a_reward_model(model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"outputs; a reward model needs exactly one \(num_labels=1\)"):
        load_judge("j", JudgeModelConfig(kind="reward_model", path=str(model_dir)))
