"""Evaluation of a policy on held-out problems: the metrics of ``EvalResult``.

:func:`evaluate` runs a greedy pass over every domain's problems, and optionally a sampled pass of
``k`` answers per problem, and returns:

* ``eval/<domain>/accuracy`` (greedy), ``eval/accuracy`` (over every domain), ``eval/response_len``
  (mean model tokens per greedy answer or episode);
* for multi-turn domains, in the greedy pass, ``eval/<domain>/return`` and ``eval/<domain>/turns``
  (means per episode);
* with a sampled pass, ``eval/<domain>/accuracy_sampled`` and ``eval/accuracy_sampled``: the mean
  correctness of the ``k`` answers (episodes) per problem.

A single-turn domain's answers are generated all at once and each is scored with the domain's
``score`` callable; a multi-turn domain's episodes are played all at once with its ``play``
callable (success is the episode's). This module imports no engine and no environment: the caller
passes an :class:`Engine` (the two calls evaluation makes) and, per domain, its problems and
callables; the sampling parameters are the engine's own, opaque here. Given an ``answers`` list,
the greedy pass also appends every single-turn answer to it (:class:`Answered`: the problem, the
text, whether it was right), for the record.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

__all__ = ["Answer", "Answered", "Domain", "Engine", "Episode", "Problem", "evaluate"]

P = TypeVar("P")
"""The engine's sampling parameters (opaque to evaluation)."""
P_contra = TypeVar("P_contra", contravariant=True)


class Problem(Protocol):
    """A held-out problem (``envs.Problem``)."""

    @property
    def prompt_id(self) -> str: ...
    @property
    def prompt(self) -> str: ...
    @property
    def reference(self) -> str: ...
    @property
    def system_prompt(self) -> str:
        """The problem's own system turn; empty = its domain's."""
        ...
    @property
    def images(self) -> tuple[bytes, ...]:
        """A visual problem's images (encoded bytes), shown before the prompt; empty = text only."""
        ...


class Answer(Protocol):
    """A finished generation (``rollout.engine.Completion``)."""

    @property
    def request_id(self) -> str: ...
    @property
    def text(self) -> str: ...
    @property
    def token_ids(self) -> Sequence[int]: ...


class Episode(Protocol):
    """A finished multi-turn episode (``rollout.agent.Trajectory``)."""

    @property
    def success(self) -> bool: ...
    @property
    def episode_return(self) -> float: ...
    @property
    def num_turns(self) -> int: ...
    @property
    def loss_mask(self) -> Sequence[int]:
        """1 on model tokens (their count is the episode's response length)."""
        ...


class Engine(Protocol[P_contra]):
    """What evaluation calls on a generation engine."""

    def encode(self, prompt: str, system_prompt: str | None = None, images: Sequence[bytes] = ()) -> list[int]:
        """Prompt token ids as the engine renders them (``system_prompt``: the system turn; ``images``:
        shown before the text, their image tokens included)."""
        ...

    def generate(self, prompts: list[tuple[str, list[int], Sequence[bytes]]], params: P_contra
                 ) -> AsyncIterator[Answer]:
        """Complete every ``(request_id, prompt_ids, images)`` with ``params``; answers in any order."""
        ...


@dataclass(frozen=True)
class Domain(Generic[P]):
    """One domain's held-out problems and how to judge them: ``score`` (single-turn: a response
    text and the problem's reference -> correct) or ``play`` (multi-turn: the problem, an episode
    id and the sampling parameters -> the finished episode)."""

    name: str
    problems: Sequence[Problem]
    system_prompt: str = ""
    score: Callable[[str, str], Awaitable[bool]] | None = None
    play: Callable[[Problem, str, P], Awaitable[Episode]] | None = None


@dataclass(frozen=True)
class Answered:
    """A greedy answer of a single-turn domain, judged."""

    domain: str
    problem: Problem
    text: str
    correct: bool


async def evaluate(engine: Engine[P], domains: Sequence[Domain[P]], greedy: P,
                   sampled: tuple[P, int] | None = None, answers: list[Answered] | None = None) -> dict[str, float]:
    """Every metric of one evaluation (see the module doc): the greedy pass with ``greedy``, and
    with ``sampled = (params, k)`` the sampled pass of ``k`` answers per problem. ``answers``: the
    greedy pass appends its single-turn answers there, in each domain's problem order."""
    metrics: dict[str, float] = {}
    correct, total, length = await _pass(engine, domains, greedy, 1, "accuracy", metrics, answers)
    metrics["eval/accuracy"] = correct / max(1, total)
    metrics["eval/response_len"] = length / max(1, total)
    if sampled is not None and sampled[1] > 0:
        params, k = sampled
        correct, total, _ = await _pass(engine, domains, params, k, "accuracy_sampled", metrics)
        metrics["eval/accuracy_sampled"] = correct / max(1, total)
    return metrics


async def _pass(engine: Engine[P], domains: Sequence[Domain[P]], params: P, k: int, name: str,
                metrics: dict[str, float], answers: list[Answered] | None = None) -> tuple[int, int, int]:
    """``k`` answers (or episodes) per problem of every domain; sets ``eval/<domain>/<name>``.
    Returns (correct, answers, model tokens generated)."""
    correct = total = length = 0
    for domain in domains:
        if domain.play is not None:
            ok, tokens = await _episodes(domain, params, k, name, metrics)
            total += k * len(domain.problems)
        else:
            ok, tokens, n = await _answers(engine, domain, params, k, name, metrics, answers)
            total += n
        correct += ok
        length += tokens
    return correct, total, length


async def _answers(engine: Engine[P], domain: Domain[P], params: P, k: int, name: str,
                   metrics: dict[str, float], answers: list[Answered] | None = None) -> tuple[int, int, int]:
    """A single-turn domain: ``k`` answers per problem, each scored (and appended to ``answers``, in
    problem order, when given). Returns (correct, tokens, answers)."""
    if domain.score is None:
        raise ValueError(f"domain {domain.name}: neither score nor play given")
    prompts: list[tuple[str, list[int], Sequence[bytes]]] = []
    by_id: dict[str, Problem] = {}
    for p in domain.problems:
        # once per problem, shared by its k
        prompt_ids = engine.encode(p.prompt, p.system_prompt or domain.system_prompt, p.images)
        for j in range(k):
            rid = f"{p.prompt_id}#{j}" if k > 1 else p.prompt_id
            prompts.append((rid, prompt_ids, p.images))
            by_id[rid] = p
    done = [a async for a in engine.generate(prompts, params)]
    results = await asyncio.gather(*(domain.score(a.text, by_id[a.request_id].reference) for a in done))
    ok = sum(int(r) for r in results)
    if answers is not None:
        order = {rid: i for i, (rid, _, _) in enumerate(prompts)}
        judged = sorted(zip(done, results, strict=True), key=lambda ar: order[ar[0].request_id])
        answers += [Answered(domain.name, by_id[a.request_id], a.text, bool(r)) for a, r in judged]
    metrics[f"eval/{domain.name}/{name}"] = ok / max(1, len(prompts))
    return ok, sum(len(a.token_ids) for a in done), len(prompts)


async def _episodes(domain: Domain[P], params: P, k: int, name: str, metrics: dict[str, float]) -> tuple[int, int]:
    """A multi-turn domain: ``k`` episodes per problem, all at once (the greedy pass also sets
    ``return`` and ``turns``). Returns (successes, model tokens)."""
    assert domain.play is not None
    play = domain.play
    episodes = await asyncio.gather(*(play(p, f"eval/{p.prompt_id}" + (f"#{j}" if k > 1 else ""), params)
                                      for p in domain.problems for j in range(k)))
    n = max(1, len(episodes))
    ok = sum(int(e.success) for e in episodes)
    metrics[f"eval/{domain.name}/{name}"] = ok / n
    if name == "accuracy":  # the greedy pass
        metrics[f"eval/{domain.name}/return"] = sum(e.episode_return for e in episodes) / n
        metrics[f"eval/{domain.name}/turns"] = sum(e.num_turns for e in episodes) / n
    return ok, sum(sum(e.loss_mask) for e in episodes)
