"""The judge service: ``judge.requests`` -> judge model by domain -> ``scored``, exactly once.

The reward router sends each generation of a judged domain (``data.domains[].judge``) here as a
:class:`~schemas.events.JudgeRequest`, already scored by its verifier. A judge worker loads the
judges of ``judge.models`` that the run's domains name (on ``judge.device``), judges each request
(concurrent requests share one batched forward pass or the engine's continuous batching:
:mod:`rollout.judge`), adds the ``judge`` reward component, computes the reward from the domain's
``rewards`` weights (:func:`services.reward_router.with_verdict`) and emits the sample to
``scored``.

Exactly once: the worker is transactional like the router. Scored outputs and the consumed
offsets they answer commit together in Kafka transactions, so a worker killed mid-batch leaves
visible to ``read_committed`` readers (the trainer) only what it committed, each sample once; the
rest is judged again by the restarted worker or another one. Each worker has its own stable
``transactional_id`` (its group id and its label, ``rs-judge-<run>-<label>``), so a restarted
worker fences the one it replaces.

A judge answer that gives no score (garbage, out of range, no label mass) or a judge model that
fails scores the ``judge`` component 0 with the reason in ``judge_error`` and ``details``: the
sample is still trained on, never lost. A request naming a judge this run does not define is
dead-lettered (it cannot come from this run's router).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

from runtime.bus import Record
from runtime.runner import Context, Runner, Service, ServiceSettings, run_service
from runtime.settings import Consume, Delivery, Handling, Subscription
from schemas import events as ev
from schemas.config import RunConfig, resolve_dtype, reward_weights
from schemas.devices import resolve_device
from schemas.errors import to_thread
from schemas.services import SERVICES
from services import ServiceStart
from services.reward_router import with_verdict

log = logging.getLogger("rollstream.judge")

SPEC = SERVICES["judge"]


class JudgeSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Settings of one judge worker."""

    run_id: str
    """The run whose ``judge.requests`` are judged."""
    config: RunConfig
    """The run config (``judge`` section, domains' ``judge`` and ``rewards``, Kafka settings)."""
    label: str = "judge"
    """This worker's label (``judge``, or ``judge0``, ``judge1``... with several): its transactional id
    is ``rs-judge-<run_id>-<label>``, stable across its restarts."""
    device: str = "cpu"
    """Concrete torch device of the judge models (``judge.device`` resolved for this machine)."""
    dtype: str = "float32"
    """Judge model dtype (``judge.dtype`` resolved for ``device``)."""


def judged_domains(cfg: RunConfig) -> dict[str, str]:
    """domain -> judge name, for the domains that have a judge."""
    return {d.name: d.judge for d in cfg.data.domains if d.judge}


class JudgeWorker(Service):
    name = "judge"

    def __init__(self, settings: JudgeSettings) -> None:
        self.settings = settings
        cfg = settings.config
        self.weights = {d.name: reward_weights(d) for d in cfg.data.domains if d.judge}
        self.judges: dict[str, Any] = {}
        self.judged = 0
        self.unscored = 0

    async def on_start(self, runner: Runner) -> None:

        from rollout.judge import load_judge

        cfg, s = self.settings.config, self.settings
        for name in sorted(set(judged_domains(cfg).values())):
            t0 = time.perf_counter()
            self.judges[name] = await to_thread(
                load_judge, name, cfg.judge.models[name], device=s.device, dtype=s.dtype,
                max_batch=cfg.judge.max_batch, batch_wait_s=cfg.judge.batch_wait_s)
            log.info("judge %s (%s, %s) loaded on %s in %.1f s", name, cfg.judge.models[name].kind,
                     cfg.judge.models[name].path, s.device, time.perf_counter() - t0)

    async def handle(self, rec: Record, ctx: Context) -> None:
        req: ev.JudgeRequest = rec.event
        judge = self.judges.get(req.judge)
        if judge is None:
            raise ValueError(f"judge {req.judge!r} is not a judge of this run ({', '.join(sorted(self.judges)) or 'none'})")
        gen = req.scored.generation
        verdict = await judge.judge(gen.task.prompt, gen.response_text)
        weights = self.weights.get(gen.task.domain, {"judge": 1.0})
        scored = with_verdict(req.scored, req.judge, weights, score=verdict.score, answer=verdict.answer,
                              error=verdict.error, judge_s=verdict.judge_s)
        self.judged += 1
        self.unscored += bool(verdict.error)
        ctx.emit("scored", scored, key=gen.task.group_id)

    async def on_stop(self, runner: Runner) -> None:
        log.info("judge worker %s: %d judged, %d without a score", self.settings.label, self.judged, self.unscored)


def service_settings(s: JudgeSettings) -> ServiceSettings:
    """The runtime settings of a judge worker: transactional, with its own stable transactional id."""
    cfg = s.config
    return ServiceSettings(
        run_id=s.run_id, kafka=cfg.kafka, subscription=Subscription.of(SPEC, s.run_id),
        consume=Consume(batch_max_records=max(cfg.judge.max_batch, 1) * 2),
        handling=Handling(max_concurrency=max(cfg.judge.max_batch, 1) * 2),
        delivery=Delivery(transactional=True, transactional_id=SPEC.transactional_id(s.run_id, s.label)),
    )


def settings_from(start: ServiceStart) -> JudgeSettings:
    """A judge worker's settings in a run (``rollstream service judge``): its label, and
    ``judge.device`` resolved for this machine (a run without a judged domain loads no judge: the
    worker idles on the CPU, whatever the device says)."""
    cfg = start.config
    device = resolve_device(cfg.judge.device, "judge.device") if judged_domains(cfg) else "cpu"
    return JudgeSettings(run_id=start.run_id, config=cfg, label=start.label or SPEC.name, device=device,
                         dtype=resolve_dtype(cfg.judge.dtype, device))


async def run(settings: JudgeSettings, stop: object = None) -> object:
    """Judge requests until stopped (SIGTERM/SIGINT or ``stop``)."""
    return await run_service(JudgeWorker(settings), service_settings(settings), stop=stop)  # type: ignore[arg-type]
