"""Evaluation's metrics (trainer/evaluate.py) with an engine and domains in memory: the greedy pass,
the sampled pass of k answers per problem, multi-turn episodes, and which requests and episodes run."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import pytest

from trainer.evaluate import Answered, Domain, Problem, evaluate


@dataclass(frozen=True)
class Q:
    prompt_id: str
    prompt: str
    reference: str
    system_prompt: str = ""
    images: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class A:
    request_id: str
    text: str
    token_ids: list[int]


@dataclass(frozen=True)
class E:
    success: bool
    episode_return: float
    num_turns: int
    loss_mask: list[int]


@dataclass(frozen=True)
class Mode:
    greedy: bool


class Engine:
    """Answers right when greedy, and for sampled request ``#0`` only; 2 tokens when right, 3 when wrong."""

    def __init__(self, problems: list[Q]) -> None:
        self.reference = {p.prompt_id: p.reference for p in problems}
        self.encoded: list[tuple[str, str | None]] = []
        self.requests: list[tuple[str, list[int], Mode]] = []

    def encode(self, prompt: str, system_prompt: str | None = None, images: Sequence[bytes] = ()) -> list[int]:
        self.encoded.append((prompt, system_prompt))
        return [len(prompt)]

    async def generate(self, prompts: list[tuple[str, list[int], Sequence[bytes]]], params: Mode) -> AsyncIterator[A]:
        for rid, ids, _ in reversed(prompts):  # in any order
            self.requests.append((rid, ids, params))
            pid, _, j = rid.partition("#")
            right = params.greedy or j == "0"
            yield A(rid, self.reference[pid] if right else "no", [1, 2] if right else [1, 2, 3])


async def exact(text: str, reference: str) -> bool:
    return text == reference


GREEDY, SAMPLED = Mode(True), Mode(False)


async def test_the_greedy_pass_and_the_mean_of_k_sampled_answers() -> None:
    problems = [Q(f"p{i}", f"{i}+1=", str(i + 1)) for i in range(4)]
    engine = Engine(problems)
    metrics = await evaluate(engine, [Domain("arith", problems, "be brief", score=exact)], GREEDY, (SAMPLED, 3))
    assert list(metrics) == ["eval/arith/accuracy", "eval/accuracy", "eval/response_len",
                             "eval/arith/accuracy_sampled", "eval/accuracy_sampled"]
    assert metrics["eval/accuracy"] == metrics["eval/arith/accuracy"] == 1.0
    assert metrics["eval/response_len"] == 2.0  # greedy answers only
    assert metrics["eval/accuracy_sampled"] == metrics["eval/arith/accuracy_sampled"] == pytest.approx(1 / 3)
    greedy = [(rid, ids) for rid, ids, m in engine.requests if m is GREEDY]
    sampled = [rid for rid, _, m in engine.requests if m is SAMPLED]
    assert sorted(greedy) == [(f"p{i}", [4]) for i in range(4)]  # one request per problem, its prompt's ids
    assert sorted(sampled) == sorted(f"p{i}#{j}" for i in range(4) for j in range(3))
    assert engine.encoded == [(p.prompt, "be brief") for p in problems] * 2  # once per problem and pass


async def test_a_problem_with_its_own_system_prompt_is_encoded_with_it() -> None:
    problems = [Q("p0", "1+1=", "2"), Q("p1", "2+2=", "4", system_prompt="answer in digits")]
    engine = Engine(problems)
    await evaluate(engine, [Domain("arith", problems, "be brief", score=exact)], GREEDY)
    assert engine.encoded == [("1+1=", "be brief"), ("2+2=", "answer in digits")]


async def test_without_a_sampled_pass_only_greedy_metrics() -> None:
    problems = [Q("a", "x", "1"), Q("b", "y", "2")]
    engine = Engine(problems)

    async def never(text: str, reference: str) -> bool:
        return False

    metrics = await evaluate(engine, [Domain("d", problems, score=never)], GREEDY)
    assert metrics == {"eval/d/accuracy": 0.0, "eval/accuracy": 0.0, "eval/response_len": 2.0}
    assert all(m is GREEDY for _, _, m in engine.requests)
    assert await evaluate(engine, [Domain("d", problems, score=never)], GREEDY, (SAMPLED, 0)) == metrics


async def test_episodes_of_a_multi_turn_domain_and_the_totals_over_domains() -> None:
    rooms = [Q(f"r{i}", "", f"room{i}") for i in range(3)]
    played: list[tuple[str, str, Mode]] = []

    async def play(p: Problem, episode_id: str, params: Mode) -> E:
        played.append((p.reference, episode_id, params))
        win = p.reference == "room0" or (not params.greedy and episode_id.endswith("#1"))
        return E(win, 1.0 if win else -0.5, 2 if win else 4, [1, 1, 0, 1] if win else [1, 0])

    problems = [Q("p0", "1+1=", "2"), Q("p1", "2+2=", "4")]
    metrics = await evaluate(Engine(problems), [Domain("lake", rooms, play=play), Domain("arith", problems, score=exact)],
                             GREEDY, (SAMPLED, 2))
    assert metrics["eval/lake/accuracy"] == pytest.approx(1 / 3)
    assert metrics["eval/lake/return"] == pytest.approx((1.0 - 0.5 - 0.5) / 3)
    assert metrics["eval/lake/turns"] == pytest.approx((2 + 4 + 4) / 3)
    assert metrics["eval/arith/accuracy"] == 1.0  # the greedy answer is the reference
    assert metrics["eval/accuracy"] == pytest.approx((1 + 2) / (3 + 2))
    assert metrics["eval/response_len"] == pytest.approx((3 + 1 + 1 + 2 + 2) / 5)  # model tokens per answer/episode
    # sampled: room0 wins both, the others win their #1 -> 4 of 6; arith: #0 right of 2 per problem -> 2 of 4
    assert metrics["eval/lake/accuracy_sampled"] == pytest.approx(4 / 6)
    assert metrics["eval/accuracy_sampled"] == pytest.approx((4 + 2) / (6 + 4))
    assert "eval/lake/return_sampled" not in metrics and len(metrics) == 9
    assert [(ref, eid) for ref, eid, m in played if m is GREEDY] == [(f"room{i}", f"eval/r{i}") for i in range(3)]
    assert [eid for _, eid, m in played if m is SAMPLED] == [f"eval/r{i}#{j}" for i in range(3) for j in range(2)]


async def test_a_domain_without_a_way_to_judge_it_is_an_error() -> None:
    with pytest.raises(ValueError, match="domain d: neither score nor play"):
        await evaluate(Engine([]), [Domain("d", [Q("a", "x", "1")])], GREEDY)


async def test_the_greedy_answers_are_handed_back_in_problem_order_judged() -> None:
    problems = [Q(f"p{i}", f"{i}+1=", str(i + 1)) for i in range(3)]

    async def odd_only(text: str, reference: str) -> bool:
        return int(reference) % 2 == 1

    answers: list[Answered] = []
    metrics = await evaluate(Engine(problems), [Domain("arith", problems, score=odd_only)], GREEDY, (SAMPLED, 2),
                             answers)
    assert [(a.domain, a.problem.prompt_id, a.text, a.correct) for a in answers] == \
        [("arith", "p0", "1", True), ("arith", "p1", "2", False), ("arith", "p2", "3", True)]  # greedy pass only
    assert metrics["eval/accuracy"] == pytest.approx(2 / 3)
