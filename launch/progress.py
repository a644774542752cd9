"""What ``rollstream run`` shows while a run goes (:class:`Progress`, from the run's events) and
the summary it computes at the end (:func:`summarize`): from the record, or from the run's topics
when nothing recorded it live (``store.record_live: false``: :func:`tallies_of_topics`, which
counts as the SQL does)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import store as st
from runtime.records import Record
from schemas import events as ev
from schemas.config import KafkaSettings, RunConfig, to_dict
from store.rows import COLUMNS, typed_rows
from store.runs import FINAL_DIR, run_dir_of, store_dsn_of


@dataclass
class Progress:
    """What the supervisor knows from the events (shown live, and part of the summary)."""

    step: int = 0
    steps: int = 0
    reward_mean: float = float("nan")
    eval_acc: dict[str, float] = field(default_factory=dict)
    evals: list[tuple[int, str, float]] = field(default_factory=list)
    staleness_mean: float = 0.0
    samples_trained: int = 0
    gen_tokens: int = 0
    train_tokens: float = 0.0
    started: float = field(default_factory=time.monotonic)
    finished: ev.RunFinished | None = None
    versions: list[int] = field(default_factory=list)
    policy_version: int = -1
    """The newest weights version seen (-1: none yet)."""
    last_progress: float = field(default_factory=time.monotonic)
    """Monotonic time of the last training step or weights version seen (the start before any)."""
    last_progress_ts: float | None = None
    """Unix time of that event (``None`` before the first)."""
    draining: str = ""
    """The reason of the first ``Drain`` seen ("" while none)."""

    def observe(self, event: Any) -> None:
        if isinstance(event, ev.TrainStep | ev.WeightsPublished):
            self.last_progress, self.last_progress_ts = time.monotonic(), event.ts
        if isinstance(event, ev.TrainStep):
            self.step = event.step + 1
            self.reward_mean = event.metrics.get("rollout/reward_mean", self.reward_mean)
            self.staleness_mean = event.metrics.get("rollout/staleness_mean", 0.0)
            self.samples_trained += len(event.sample_ids)
            self.train_tokens += event.metrics.get("train/tokens", 0.0)
            self.gen_tokens += int(event.metrics.get("rollout/response_len_mean", 0.0) * len(event.sample_ids))
        elif isinstance(event, ev.EvalResult):
            acc = event.metrics.get("eval/accuracy", float("nan"))
            self.eval_acc[event.split] = acc
            self.evals.append((event.step, event.split, acc))
        elif isinstance(event, ev.WeightsPublished):
            self.versions.append(event.policy_version)
            self.policy_version = max(self.policy_version, event.policy_version)
        elif isinstance(event, ev.Drain):
            self.draining = self.draining or event.reason or "drain"
        elif isinstance(event, ev.RunFinished):
            self.finished = event

    def idle_s(self) -> float:
        """Seconds since the last training step or weights version (since the start before any)."""
        return time.monotonic() - self.last_progress

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        acc = self.evals[-1][2] if self.evals else float("nan")
        return (
            f"step {self.step}/{self.steps}  reward {self.reward_mean:.3f}  eval acc {acc:.3f}  "
            f"staleness {self.staleness_mean:.2f}  samples/s {self.samples_trained / max(elapsed, 1e-9):.1f}  "
            f"gen tok/s {self.gen_tokens / max(elapsed, 1e-9):.0f}  {elapsed:.0f}s"
            + (f"  draining: {self.draining}" if self.draining and self.finished is None else "")
        )


@dataclass
class Tallies:
    """What the summary counts in the record (:func:`tallies_of_store`, or of the topics:
    :func:`tallies_of_rows`)."""

    by_status: dict[str, int]
    """Rows of the ``samples`` view by status (a sample with several outcomes counts once per outcome)."""
    issued: int
    """Samples issued (``sample_tasks``)."""
    evals: list[tuple[int, str, float, bool, float]]
    """``(step, split, accuracy, has sampled accuracy, sampled accuracy)`` of each evaluation, by time."""
    gen_tokens: int
    """Generated tokens of the samples."""
    gen_span_s: float
    """From the first generation of a sample to the last, seconds."""
    steps: int
    train_tokens: float
    """``train/tokens`` summed over the steps."""
    step_s: float
    """``perf/step_s`` summed over the steps."""


def tallies_of_store(client: Any, run_id: str) -> Tallies:
    """The summary's counts, in SQL over the run's store."""
    p = {"r": run_id}
    status_rows = client.query(
        "SELECT status, count() FROM samples WHERE run_id = {r:String} GROUP BY status", parameters=p).result_rows
    issued = int(client.query("SELECT count() FROM sample_tasks FINAL WHERE run_id = {r:String}",
                              parameters=p).result_rows[0][0])
    evals = client.query(
        "SELECT step, split, metrics['eval/accuracy'], mapContains(metrics, 'eval/accuracy_sampled'), "
        "metrics['eval/accuracy_sampled'] FROM evals FINAL WHERE run_id = {r:String} ORDER BY ts",
        parameters=p).result_rows
    thr = client.query(
        "SELECT sum(response_len), sum(gen_s), min(generated_ts), max(generated_ts) FROM samples "
        "JOIN (SELECT * FROM sample_generations FINAL) AS g USING (run_id, sample_id) WHERE run_id = {r:String}",
        parameters=p).result_rows
    steps = client.query(
        "SELECT count(), sum(metrics['train/tokens']), sum(metrics['perf/step_s']) FROM train_steps FINAL "
        "WHERE run_id = {r:String}", parameters=p).result_rows[0]
    return Tallies(
        by_status={s: int(n) for s, n in status_rows}, issued=issued,
        evals=[(int(s), str(split), float(a), bool(has), float(sa)) for s, split, a, has, sa in evals],
        gen_tokens=int(thr[0][0] or 0) if thr else 0,
        gen_span_s=(thr[0][3] - thr[0][2]).total_seconds() if thr and thr[0][2] and thr[0][3] else 0.0,
        steps=int(steps[0]), train_tokens=float(steps[1] or 0), step_s=float(steps[2] or 0))


def tallies_of_rows(rows: dict[str, list[list[Any]]]) -> Tallies:
    """The summary's counts from the typed rows of the run's events (:func:`store.rows.typed_rows`,
    in topic order), as :func:`tallies_of_store` counts them: a later row replaces an earlier one
    of the same key (``FINAL``), and the ``samples`` view's status is the outcome's, else
    dead_letter, scored, generated, issued."""

    def final(table: str, *key: str) -> list[dict[str, Any]]:
        cols = COLUMNS[table]
        out: dict[tuple[Any, ...], dict[str, Any]] = {}
        for row in rows.get(table, []):
            named = dict(zip(cols, row, strict=True))
            out[tuple(named[k] for k in key)] = named
        return list(out.values())

    tasks = {t["sample_id"]: t for t in final("sample_tasks", "sample_id")}
    gens = {g["sample_id"]: g for g in final("sample_generations", "sample_id")}
    scored = {r["sample_id"] for r in final("sample_rewards", "sample_id")}
    dead = {d["sample_id"] for d in final("dlq", "source_topic", "partition", "offset", "service", "record_index")
            if d["sample_id"]}
    outcomes: dict[str, list[str]] = {}
    for o in final("sample_outcomes", "sample_id", "status", "step"):
        outcomes.setdefault(o["sample_id"], []).append(o["status"])
    by_status: dict[str, int] = {}
    gen_tokens, first, last = 0, None, None
    for sid in tasks:
        statuses = outcomes.get(sid) or ["dead_letter" if sid in dead else "scored" if sid in scored
                                          else "generated" if sid in gens else "issued"]
        for status in statuses:  # the view has a row per outcome
            by_status[status] = by_status.get(status, 0) + 1
            g = gens.get(sid)
            if g is not None:
                gen_tokens += int(g["response_len"])
                first = g["generated_ts"] if first is None else min(first, g["generated_ts"])
                last = g["generated_ts"] if last is None else max(last, g["generated_ts"])
    evals = sorted(final("evals", "split", "step"), key=lambda e: e["ts"])
    steps = final("train_steps", "step")
    return Tallies(
        by_status=by_status, issued=len(tasks),
        evals=[(int(e["step"]), e["split"], float(e["metrics"].get("eval/accuracy", 0.0)),
                "eval/accuracy_sampled" in e["metrics"], float(e["metrics"].get("eval/accuracy_sampled", 0.0)))
               for e in evals],
        # the rows' times are DateTime64(6) ticks (store.rows.dt): microseconds
        gen_tokens=gen_tokens, gen_span_s=(last - first) / 1e6 if first and last else 0.0,
        steps=len(steps), train_tokens=sum(float(s["metrics"].get("train/tokens", 0.0)) for s in steps),
        step_s=sum(float(s["metrics"].get("perf/step_s", 0.0)) for s in steps))


SUMMARY_TOPICS = ("tasks", "generations", "scored", "metrics", "dlq")
"""The topics the summary of a run without a live record reads."""


async def tallies_of_topics(kafka: KafkaSettings, bootstrap: str, run_id: str) -> Tallies:
    """The summary's counts from the run's topics (a run with ``store.record_live: false``)."""
    from launch.record import read_run, run_topics

    rows: dict[str, list[list[Any]]] = {}

    def take(records: list[Record]) -> None:
        for rec in records:
            if rec.event is not None:
                for table, got in typed_rows(rec.event).items():
                    rows.setdefault(table, []).extend(got)

    await read_run(kafka, bootstrap, await run_topics(kafka, bootstrap, run_id, SUMMARY_TOPICS), take)
    return tallies_of_rows(rows)


def summarize(cfg: RunConfig, run_id: str, progress: Progress, wall_s: float, tallies: Tallies | None = None
              ) -> dict[str, Any]:
    """The run's summary from ``tallies``, else computed from the record (SQL over the run's store);
    ``final_model`` is the absolute path of the trained model (``runs/<id>/final``, ``None`` when
    the trainer wrote none)."""
    t = tallies if tallies is not None else tallies_of_store(st.connect(store_dsn_of(cfg, run_id)), run_id)
    by_status = t.by_status
    heldout = [(s, a, sa if has else None) for s, split, a, has, sa in t.evals if split == "heldout"]
    init = [(a, sa if has else None) for s, split, a, has, sa in t.evals if split == "init"]

    def point(e: tuple[int, float, float | None] | None) -> dict[str, Any]:
        out: dict[str, Any] = {"accuracy": e[1] if e else None, "step": e[0] if e else None}
        if e is not None and e[2] is not None:  # with train.eval_samples
            out["accuracy_sampled"] = e[2]
        return out

    summary: dict[str, Any] = {
        "run_id": run_id,
        "config": to_dict(cfg),
        "steps": t.steps,
        "wall_s": round(wall_s, 1),
        "eval": {
            "init": {"accuracy": init[0][0] if init else None,
                     **({"accuracy_sampled": init[0][1]} if init and init[0][1] is not None else {})},
            "start": point(heldout[0] if heldout else None),
            "final": point(heldout[-1] if heldout else None),
            "curve": [point(e) for e in heldout],
        },
        "samples": {
            "issued": t.issued,
            "trained": by_status.get("trained", 0),
            "dropped_stale": by_status.get("dropped_stale", 0),
            "filtered": by_status.get("filtered", 0),
            "dead_letter": by_status.get("dead_letter", 0),
            "unaccounted": sum(n for s, n in by_status.items()
                               if s not in ("trained", "dropped_stale", "filtered", "dead_letter")),
        },
        "throughput": {
            "gen_tokens_per_s": round(t.gen_tokens / t.gen_span_s, 1) if t.gen_span_s > 0 else None,
            "train_tokens_per_s": round(t.train_tokens / t.step_s, 1) if t.step_s else None,
        },
        "weights_versions": progress.versions,
        "final_model": str(final) if (final := run_dir_of(cfg, run_id) / FINAL_DIR).is_dir() else None,
    }
    return summary
