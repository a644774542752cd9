"""``rollstream replay rescore RUN``: re-score a recorded run under a changed config.

:func:`rescore` runs the reward verifiers again over the recorded generations with the run's
recorded config plus ``--set`` overrides (scoring exactly as the reward router does,
:func:`services.reward_router.score`), and recomputes each recorded training batch's per-sample
advantages with the old and the new config (:func:`trainer.algorithm.sample_advantages`); it
reports per domain how rewards and advantages would change (:func:`rescore_lines` prints it).
Judged domains (``data.domains[].judge`` in the new config) are judged again in this process
(:func:`rollout.judge.load_judge`, on ``judge.device``), so ``--set judge.models.<name>.rubric=...``
or another ``path`` shows how a different rubric or judge model would have scored the run; the
report then adds per domain the mean judge score old/new and the responses the new judge could
not score. Nothing is published.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replay.record import (
    Progress,
    ReplayError,
    ReplaySettings,
    check_settings,
    events_of,
    no_progress,
    open_record,
    recorded_config,
    run_config,
    step_slice,
    train_steps,
)
from schemas import events as ev
from schemas.config import RunConfig

__all__ = ["ADV_TOL", "rescore", "rescore_lines"]

ADV_TOL = 1e-6
"""An advantage moved when ``|new - old|`` exceeds this."""


@dataclass
class _Rescored:
    scored: ev.ScoredSample
    new: ev.ScoredSample
    step: int = -1
    adv_old: float | None = None
    adv_new: float | None = None

    @property
    def reward_changed(self) -> bool:
        return not _same(self.scored.reward, self.new.reward)


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _advantages(cfg: RunConfig, rewards: list[float], groups: list[str],
                baselines: list[float] | None = None) -> list[float]:
    """Per-sample advantages of one batch under ``cfg.algorithm`` (the trainer's estimator);
    ``baselines``: each sample's ReMax greedy reward, when its group has one."""
    import torch

    from trainer.algorithm import sample_advantages

    index = {g: i for i, g in enumerate(dict.fromkeys(groups))}
    adv = sample_advantages(cfg.algorithm, torch.tensor(rewards, dtype=torch.float),
                            torch.tensor([index[g] for g in groups]),
                            None if baselines is None else torch.tensor(baselines, dtype=torch.float))
    return [float(a) for a in adv]


def _domain_stats(items: list[_Rescored], groups: dict[Any, list[_Rescored]]) -> dict[str, Any]:
    """Report numbers of ``items`` (rescored samples) and ``groups`` (trained (step, group) -> members)."""
    n = len(items)
    trained = [r for r in items if r.adv_old is not None]
    deltas = [abs((r.adv_new or 0.0) - (r.adv_old or 0.0)) for r in trained]
    return {
        "samples": n,
        "reward_mean_old": sum(r.scored.reward for r in items) / n if n else None,
        "reward_mean_new": sum(r.new.reward for r in items) / n if n else None,
        "rewards_changed": sum(r.reward_changed for r in items),
        "trained_samples": len(trained),
        "groups": len(groups),
        "groups_adv_changed": sum(
            any(abs((r.adv_new or 0.0) - (r.adv_old or 0.0)) > ADV_TOL for r in members)
            for members in groups.values()),
        "max_abs_delta_adv": max(deltas, default=0.0),
        **_judge_stats(items),
    }


def _judge_stats(items: list[_Rescored]) -> dict[str, Any]:
    """Mean ``judge`` component old/new and the new judge's unscored responses (only when a judge
    scored the domain, then or now)."""
    old = [r.scored.rewards["judge"] for r in items if "judge" in r.scored.rewards]
    new = [r.new.rewards["judge"] for r in items if "judge" in r.new.rewards]
    if not old and not new:
        return {}
    return {"judge_mean_old": sum(old) / len(old) if old else None,
            "judge_mean_new": sum(new) / len(new) if new else None,
            "judge_unscored_new": sum(bool(r.new.judge_error) for r in items)}


def _judge_again(cfg: RunConfig, table: Any, items: list[_Rescored], progress: Progress) -> None:
    """Replace ``r.new`` of every item of a judged domain by its judged version (in place)."""
    import asyncio

    from rollout.judge import load_judge
    from schemas.config import resolve_dtype
    from schemas.devices import resolve_device
    from services.reward_router import judge_of, with_verdict

    todo = [(r, judge_of(r.new.generation, table)) for r in items]
    todo = [(r, j) for r, j in todo if j]
    if not todo:
        return
    device = resolve_device(cfg.judge.device, "judge.device")
    dtype = resolve_dtype(cfg.judge.dtype, device)
    names = sorted({j for _, j in todo})
    progress(f"loading judge(s) {', '.join(names)} on {device}...")
    try:
        judges = {n: load_judge(n, cfg.judge.models[n], device=device, dtype=dtype, max_batch=cfg.judge.max_batch,
                                batch_wait_s=cfg.judge.batch_wait_s) for n in names}
    except (OSError, ValueError) as e:
        raise ReplayError(f"judge: {e}") from None

    async def judge_all() -> None:
        done = 0
        sem = asyncio.Semaphore(cfg.judge.max_batch * 2)

        async def one(r: _Rescored, name: str) -> None:
            nonlocal done
            async with sem:
                gen = r.new.generation
                v = await judges[name].judge(gen.task.prompt, gen.response_text)
            r.new = with_verdict(r.new, name, table[gen.task.domain].weights, score=v.score, answer=v.answer,
                                 error=v.error, judge_s=v.judge_s)
            done += 1
            if done % 50 == 0:
                progress(f"judging: {done}/{len(todo)} samples")

        await asyncio.gather(*(one(r, j) for r, j in todo))

    asyncio.run(judge_all())


def _example(r: _Rescored) -> dict[str, Any]:
    task = r.scored.generation.task
    return {
        "sample_id": task.sample_id, "domain": task.domain, "step": r.step,
        "verifier_old": r.scored.verifier, "verifier_new": r.new.verifier,
        "reward_old": r.scored.reward, "reward_new": r.new.reward,
        "adv_old": r.adv_old, "adv_new": r.adv_new,
        "response": r.scored.generation.response_text[:120], "reference": task.reference[:80],
        "details_new": r.new.details[:160],
    }


def rescore(s: ReplaySettings, progress: Progress = no_progress, examples: int = 5) -> dict[str, Any]:
    """Re-score the run's recorded generations with its config plus ``s.overrides``.

    Every recorded ``ScoredSample`` (of the step slice, if one is given) is scored again by
    :func:`services.reward_router.score` with the new config; every recorded ``TrainStep`` batch (its
    ``sample_ids``, in batch order, as the trainer assembled it) gets its per-sample advantages
    computed from the old and from the new rewards, each with its config's ``algorithm``. The
    batch composition is held as recorded (a changed reward does not re-run the staleness or
    dynamic filters). Returns the report as JSON-able data: ``total`` and ``domains`` (per task
    domain: samples, mean reward old/new, rewards changed, trained samples, groups, groups
    whose advantages changed, max |Δadvantage|) and up to ``examples`` changed samples.
    """
    from envs.registry import VERIFIERS
    from services.reward_router import score, verifier_table

    check_settings(s)
    client = open_record(s)
    progress(f"reading the record of {s.run_id}...")
    raw = recorded_config(client, s.run_id, Path(s.runs_dir))
    old_cfg = run_config(raw, [], s.run_id)
    new_cfg = run_config(raw, s.overrides, s.run_id)
    table = verifier_table(new_cfg)
    for domain, scoring in table.items():
        if scoring.verifier not in VERIFIERS:
            raise ReplayError(f"domain {domain!r}: unknown verifier {scoring.verifier!r}; registered: "
                              f"{', '.join(sorted(VERIFIERS))}")
    sl = step_slice(client, s.run_id, s.from_step, s.to_step) if s.sliced else None
    steps = train_steps(client, s.run_id)
    if sl is not None:
        steps = {k: v for k, v in steps.items() if k in sl.steps}

    items: dict[str, _Rescored] = {}
    recorded = [e for e in events_of(client, s.run_id, "scored")
                if isinstance(e, ev.ScoredSample) and (sl is None or sl.contains(e))]
    for i, smp in enumerate(recorded):
        sid = smp.generation.task.sample_id
        if sid not in items:
            items[sid] = _Rescored(smp, score(smp.generation, table, new_cfg.reward))
        if i % 200 == 0:
            progress(f"rescoring {s.run_id}: {i}/{len(recorded)} samples")
    _judge_again(new_cfg, table, list(items.values()), progress)

    groups: dict[str, dict[Any, list[_Rescored]]] = defaultdict(dict)
    missing = 0
    for step in sorted(steps):
        batch = [items[sid] for sid in steps[step].sample_ids if sid in items]
        missing += len(steps[step].sample_ids) - len(batch)
        if not batch:
            continue
        gids = [r.scored.generation.task.group_id for r in batch]
        tasks = [r.scored.generation.task for r in batch]
        greedy = [items.get(ev.sample_id_of(t.group_id, t.baseline_index)) if t.baseline_index >= 0 else None
                  for t in tasks]  # ReMax: each sample's greedy baseline, as recorded and rescored
        has = all(b is not None for b in greedy)
        old = _advantages(old_cfg, [r.scored.reward for r in batch], gids,
                          [b.scored.reward for b in greedy if b is not None] if has else None)
        new = _advantages(new_cfg, [r.new.reward for r in batch], gids,
                          [b.new.reward for b in greedy if b is not None] if has else None)
        for r, g, a_old, a_new in zip(batch, gids, old, new, strict=True):
            r.step, r.adv_old, r.adv_new = step, a_old, a_new
            groups[r.scored.generation.task.domain].setdefault((step, g), []).append(r)

    by_domain: dict[str, list[_Rescored]] = defaultdict(list)
    for r in items.values():
        by_domain[r.scored.generation.task.domain].append(r)
    all_groups: dict[Any, list[_Rescored]] = {(d, k): v for d, gs in groups.items() for k, v in gs.items()}
    def shift(r: _Rescored) -> float:
        return abs((r.adv_new or 0.0) - (r.adv_old or 0.0))

    # examples: changed rewards first, those that moved an advantage most at the top; then
    # samples whose advantage moved without a reward change (an algorithm override, a group mate)
    changed = sorted((r for r in items.values() if r.reward_changed), key=lambda r: -shift(r))
    moved = sorted((r for r in items.values() if not r.reward_changed and shift(r) > ADV_TOL),
                   key=lambda r: -shift(r))
    return {
        "run_id": s.run_id,
        "overrides": list(s.overrides),
        "steps": [sl.first, sl.last] if sl else None,
        "adv_estimator": {"old": old_cfg.algorithm.adv_estimator, "new": new_cfg.algorithm.adv_estimator},
        "verifiers": {d: sc.verifier for d, sc in table.items()},
        "judges": {d: sc.judge for d, sc in table.items() if sc.judge},
        "train_steps": len(steps),
        "trained_samples_missing": missing,
        "total": _domain_stats(list(items.values()), all_groups),
        "domains": {d: _domain_stats(rs, groups.get(d, {})) for d, rs in sorted(by_domain.items())},
        "examples": [_example(r) for r in (changed + moved)[:examples]],
    }


def rescore_lines(report: dict[str, Any]) -> list[str]:
    """The report of :func:`rescore` as plain text lines: a table per domain, then examples."""

    def num(v: Any, fmt: str = ".4f") -> str:
        return "-" if v is None else format(v, fmt) if isinstance(v, float) else str(v)

    head = f"rescore of {report['run_id']}"
    if report["steps"]:
        head += f" (steps {report['steps'][0]}..{report['steps'][1]})"
    head += f" with {' '.join(report['overrides'])}" if report["overrides"] else " with the recorded config"
    verifiers = ", ".join(f"{d}={v}" for d, v in report["verifiers"].items())
    est = report["adv_estimator"]
    lines = [head, f"verifiers: {verifiers}; advantages: {est['old']}"
             + (f" -> {est['new']}" if est["new"] != est["old"] else "")
             + f"; {report['train_steps']} training steps", ""]
    cols = ("domain", "samples", "reward old", "reward new", "changed", "trained", "groups", "groups Δadv",
            "max |Δadv|")
    rows = [[d, str(x["samples"]), num(x["reward_mean_old"]), num(x["reward_mean_new"]), str(x["rewards_changed"]),
             str(x["trained_samples"]), str(x["groups"]), str(x["groups_adv_changed"]), num(x["max_abs_delta_adv"])]
            for d, x in [*report["domains"].items(), ("all", report["total"])]]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cols, widths, strict=True))))
    for r in rows:
        lines.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths, strict=True))))
    judged = {d: x for d, x in report["domains"].items() if "judge_mean_new" in x}
    if judged:
        lines += ["", "judges: " + ", ".join(f"{d}={j}" for d, j in report.get("judges", {}).items())]
        for d, x in judged.items():
            lines.append(f"  {d}: judge score {num(x['judge_mean_old'])} -> {num(x['judge_mean_new'])}, "
                         f"{x['judge_unscored_new']} response(s) the new judge could not score")
    if report["trained_samples_missing"]:
        lines.append(f"note: {report['trained_samples_missing']} trained samples have no recorded score")
    if report["examples"]:
        lines += ["", "examples:"]
        for x in report["examples"]:
            verifier = x["verifier_old"] if x["verifier_old"] == x["verifier_new"] else \
                f"{x['verifier_old']} -> {x['verifier_new']}"
            lines.append(f"  {x['sample_id']}  step {x['step']}  {verifier}  reward {num(x['reward_old'], 'g')} -> "
                         f"{num(x['reward_new'], 'g')}  advantage {num(x['adv_old'], '.3f')} -> "
                         f"{num(x['adv_new'], '.3f')}")
            lines.append(f"    response {x['response']!r}  reference {x['reference']!r}  new: {x['details_new']}")
    return lines
