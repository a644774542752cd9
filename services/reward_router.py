"""The reward router: ``generations`` -> verifier by domain -> ``scored``, exactly once (by default).

Each ``Generation`` is routed by its task's domain to the verifier configured for that domain
(``data.domains[].verifier``, or the task source's default), run with a time bound on a verifier
thread that the event loop awaits (:func:`envs.run_verifier_async`), and turned into a self-contained ``ScoredSample``.
A verifier that crashes or hangs yields reward 0 with the error in ``details``: the sample is still
trained on and the error is on the record. A judged domain's sample goes on to ``judge.requests``
instead (:mod:`services.judge_worker` adds the judge's score); a multi-turn episode is scored by
its own step rewards (:func:`score_episode`); a generation with impossible values
(:func:`schemas.sanity.check_generation`) is dead-lettered naming its sample and group.

It is transactional by default (outputs and consumed offsets commit together: a generation is
scored exactly once across crashes); ``reward.delivery: at_least_once`` runs it on the
per-record loop instead. docs/architecture.md, "Services", tells more.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import msgspec

import envs
from envs.latency import draw_latency_s
from runtime.bus import Record
from runtime.runner import Context, Service, ServiceSettings, run_service
from runtime.settings import Consume, Delivery, Handling, Subscription
from schemas import events as ev
from schemas.config import RewardConfig, RunConfig, reward_weights
from schemas.sanity import check_generation
from schemas.services import SERVICES
from services import ServiceStart

SPEC = SERVICES["reward"]


class RewardSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Settings of a reward-router instance."""

    run_id: str
    """The run whose ``generations`` are scored."""
    config: RunConfig
    """The run config (domains -> verifiers, ``reward`` section, Kafka settings)."""
    transactional_id: str = ""
    """Transactional id; empty = the group id (``rs-reward-<run_id>``), stable across restarts: a restarted
    instance fences the one it replaces and aborts the transaction that one left open at once
    (with a per-start id, ``read_committed`` readers of ``scored`` would wait for the broker's
    transaction timeout). A second instance running at the same time needs its own id."""
    concurrency: int = 4
    """Verifier calls at once (each in a worker thread, bounded by ``reward.timeout_s``). Records of a
    polled batch are handled concurrently beyond it (up to the feeder's in-flight bound) when
    ``reward.latency`` simulates a slow reward."""


@dataclasses.dataclass(frozen=True)
class DomainScoring:
    """How one domain's responses are scored (from its ``data.domains[]`` entry)."""

    verifier: str
    kwargs: dict[str, Any]
    answer: str = "raw"
    format_reward: float = 0.0
    judge: str = ""
    """The domain's judge (empty = none): the sample goes on to ``judge.requests``."""
    weights: dict[str, float] = dataclasses.field(default_factory=dict)
    """``{component: weight}`` when the domain sets ``rewards`` or has a judge; empty = the
    verifier's reward as is."""


VerifierTable = dict[str, DomainScoring]
"""domain -> how its responses are scored."""


def verifier_table(cfg: RunConfig) -> VerifierTable:
    """domain -> :class:`DomainScoring` from the run config (verifier: the domain's, else its source's default)."""
    table: VerifierTable = {}
    for d in cfg.data.domains:
        name = d.verifier or envs.make_source(d.source, **d.kwargs).default_verifier
        weights = reward_weights(d) if (d.rewards or d.judge) else {}
        table[d.name] = DomainScoring(name, dict(d.verifier_kwargs), d.answer, d.format_reward, d.judge, weights)
    return table


class RewardRouter(Service):
    name = "reward"

    def __init__(self, settings: RewardSettings) -> None:
        self.settings = settings
        self.table = verifier_table(settings.config)
        self.verifier_slots = asyncio.Semaphore(max(1, settings.concurrency))

    async def handle(self, rec: Record, ctx: Context) -> None:
        gen: ev.Generation = rec.event
        why = check_generation(gen)
        if why is not None:
            raise ValueError(why)
        # off the event loop: a slow or hanging verifier (bounded by reward.timeout_s) must not stop
        # the consumer's heartbeats or the other calls
        # the verifier runs on a worker thread (bounded by reward.timeout_s): a slow or hanging one
        # must not stop the consumer's heartbeats or the other calls
        async with self.verifier_slots:
            scored = await score_async(gen, self.table, self.settings.config.reward)
        r = self.settings.config.reward
        if r.latency != "none":  # benchmarks: a reward that takes long, without holding a verifier thread
            await asyncio.sleep(draw_latency_s(r.latency, r.latency_mean_s, r.latency_sigma, gen.task.sample_id))
            scored = msgspec.structs.replace(scored, ts=time.time())  # scored_ts: when the reward was ready
        judge = judge_of(gen, self.table)
        if judge:
            ctx.emit("judge.requests", ev.JudgeRequest(run_id=gen.run_id, scored=scored, judge=judge),
                     key=gen.task.sample_id)
        else:
            ctx.emit("scored", scored, key=gen.task.group_id)


def judge_of(gen: ev.Generation, table: VerifierTable) -> str:
    """The judge that still has to score ``gen`` (empty = none: it is scored)."""
    if gen.episode_id:
        return ""
    scoring = table.get(gen.task.domain)
    return scoring.judge if scoring is not None else ""


def weighted_reward(components: dict[str, float], weights: dict[str, float]) -> float:
    """``sum(weight * components[name])``; a component the sample lacks counts 0 (``format`` of a
    response without the format, ``judge`` before the judge)."""
    return float(sum(w * components.get(name, 0.0) for name, w in weights.items()))


def with_verdict(scored: ev.ScoredSample, judge: str, weights: dict[str, float], *, score: float, answer: str,
                 error: str, judge_s: float) -> ev.ScoredSample:
    """``scored`` (as the router made it) completed by its judge's verdict: component ``judge``
    (0 when the verdict has an ``error``), ``reward`` from ``weights``, the verdict in ``details``,
    ``ts`` now (so ``scored_ts`` in the record is when the judge finished)."""
    value = 0.0 if error else float(score)
    rewards = {**scored.rewards, "judge": value}
    note = f"judge {judge}: " + (f"unscored: {error}" if error else f"{value:.3f} ({answer})")
    details = f"{scored.details}; {note}" if scored.details else note
    return msgspec.structs.replace(scored, rewards=rewards, reward=weighted_reward(rewards, weights), judge=judge,
                                   judge_s=judge_s, judge_error=error, details=details, ts=time.time())


def score(gen: ev.Generation, table: VerifierTable, reward: RewardConfig) -> ev.ScoredSample:
    """Score one generation as the router does (``replay rescore``; the router awaits
    :func:`score_async`, which gives the same result).

    The verifier is the task's own ``env`` spec when it has one, else ``table[task.domain]``; it
    runs through :func:`envs.score_response` (the domain's answer extraction and format reward)
    bounded by ``reward.timeout_s`` with ``reward.isolation``. A domain without a verifier, or a
    verifier error, scores 0 with the reason in ``details``.
    """
    t0 = time.perf_counter()
    scoring = None if gen.episode_id else scoring_of(gen, table)  # an episode brings its own rewards
    if gen.episode_id or scoring is None or not scoring.verifier:
        return unverified(gen, scoring, t0)
    result = envs.score_response(
        scoring.verifier, gen.response_text, gen.task.reference, scoring.kwargs, answer=scoring.answer,
        format_reward=scoring.format_reward, timeout_s=reward.timeout_s, isolation=reward.isolation,
    )
    return scored_sample(gen, scoring, result, t0)


async def score_async(gen: ev.Generation, table: VerifierTable, reward: RewardConfig) -> ev.ScoredSample:
    """:func:`score` for the router's event loop: the verifier through
    :func:`envs.score_response_async` (one hop to a verifier thread)."""
    t0 = time.perf_counter()
    scoring = None if gen.episode_id else scoring_of(gen, table)  # an episode brings its own rewards
    if gen.episode_id or scoring is None or not scoring.verifier:
        return unverified(gen, scoring, t0)
    result = await envs.score_response_async(
        scoring.verifier, gen.response_text, gen.task.reference, scoring.kwargs, answer=scoring.answer,
        format_reward=scoring.format_reward, timeout_s=reward.timeout_s, isolation=reward.isolation,
    )
    return scored_sample(gen, scoring, result, t0)


def scoring_of(gen: ev.Generation, table: VerifierTable) -> DomainScoring | None:
    """How ``gen`` is scored: its task's own ``env`` spec as the verifier when it has one, else its
    domain's entry (``None``: the domain has none)."""
    task = gen.task
    scoring = table.get(task.domain)
    if task.env is not None:
        base = scoring or DomainScoring("", {})
        scoring = dataclasses.replace(base, verifier=task.env.name, kwargs=dict(task.env.kwargs))
    return scoring


def unverified(gen: ev.Generation, scoring: DomainScoring | None, t0: float) -> ev.ScoredSample:
    """The ``ScoredSample`` of a generation no verifier scores: an episode (its own step rewards), or a
    domain without a verifier (0, with the reason)."""
    if gen.episode_id:
        return score_episode(gen)
    reason = envs.VerifyResult(reward=0.0, correct=False, error=f"no verifier for domain {gen.task.domain!r}")
    return scored_sample(gen, scoring, reason, t0)


def scored_sample(gen: ev.Generation, scoring: DomainScoring | None, result: envs.VerifyResult,
                  t0: float) -> ev.ScoredSample:
    """The ``ScoredSample`` of ``gen`` from its verifier's ``result`` (``t0``: when scoring began)."""
    details = f"error: {result.error}" if result.error else result.details
    rewards = {"correct": float(result.correct), **result.components}
    value = result.reward
    if scoring is not None and scoring.weights:
        rewards["verifier"] = result.reward
        value = weighted_reward(rewards, scoring.weights)
    return ev.ScoredSample(
        run_id=gen.run_id, generation=gen, reward=value,
        rewards=rewards,
        verifier=scoring.verifier if scoring is not None else "", details=details,
        reward_s=time.perf_counter() - t0, policy_version=gen.policy_version,
    )


def score_episode(gen: ev.Generation) -> ev.ScoredSample:
    """Score a multi-turn episode (``gen.episode_id`` set): the environment already rewarded every
    turn, so no verifier runs. ``reward`` is the episode return (the sum of ``step_rewards``);
    ``step_rewards`` go on to the step-level estimators; components: ``correct`` (the environment
    reported success), ``return`` and ``turns``. ``details`` says how the episode ended."""
    ret = float(sum(gen.step_rewards))
    name = gen.task.env.name if gen.task.env is not None else gen.task.domain
    details = f"{gen.env_finish or 'ended'} after {gen.num_turns} turn(s)"
    if gen.env_error:
        details += f"; environment error: {gen.env_error}"
    return ev.ScoredSample(
        run_id=gen.run_id, generation=gen, reward=ret,
        rewards={"correct": float(gen.success), "return": ret, "turns": float(gen.num_turns)},
        verifier=f"env:{name}", details=details, policy_version=gen.policy_version,
        step_rewards=list(gen.step_rewards),
    )


def service_settings(s: RewardSettings) -> ServiceSettings:
    """The runtime settings of a router instance: transactional unless ``reward.delivery`` is
    ``at_least_once``."""
    exactly_once = {"exactly_once": True, "at_least_once": False}[s.config.reward.delivery]
    return ServiceSettings(
        run_id=s.run_id, kafka=s.config.kafka, subscription=Subscription.of(SPEC, s.run_id),
        consume=Consume(batch_max_records=64),
        handling=Handling(
            max_concurrency=max(1, s.concurrency, s.config.max_inflight if s.config.reward.latency != "none" else 0)),
        delivery=Delivery(transactional=exactly_once,
                          transactional_id=(s.transactional_id or SPEC.transactional_id(s.run_id)) if exactly_once else ""),
    )


def settings_from(start: ServiceStart) -> RewardSettings:
    """The reward router's settings in a run (``rollstream service reward``)."""
    return RewardSettings(run_id=start.run_id, config=start.config)


async def run(settings: RewardSettings, stop: object = None) -> object:
    """Score generations until stopped (SIGTERM/SIGINT or ``stop``)."""
    return await run_service(RewardRouter(settings), service_settings(settings), stop=stop)  # type: ignore[arg-type]
