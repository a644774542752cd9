"""What ``rollstream run`` shows while a run goes (:class:`Progress`, from the run's events) and
the summary it computes from the record at the end (:func:`summarize`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import store as st
from schemas import events as ev
from schemas.config import RunConfig, to_dict
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


def summarize(cfg: RunConfig, run_id: str, progress: Progress, wall_s: float) -> dict[str, Any]:
    """The run's summary, computed from the record (SQL over the run's store); ``final_model`` is the
    absolute path of the trained model (``runs/<id>/final``, ``None`` when the trainer wrote none)."""
    client = st.connect(store_dsn_of(cfg, run_id))
    p = {"r": run_id}
    status_rows = client.query(
        "SELECT status, count() FROM samples WHERE run_id = {r:String} GROUP BY status", parameters=p).result_rows
    by_status = {s: int(n) for s, n in status_rows}
    issued = int(client.query("SELECT count() FROM sample_tasks FINAL WHERE run_id = {r:String}",
                              parameters=p).result_rows[0][0])
    evals = client.query(
        "SELECT step, split, metrics['eval/accuracy'], mapContains(metrics, 'eval/accuracy_sampled'), "
        "metrics['eval/accuracy_sampled'] FROM evals FINAL WHERE run_id = {r:String} ORDER BY ts",
        parameters=p).result_rows
    thr = client.query(
        "SELECT sum(response_len), sum(gen_s), min(generated_ts), max(generated_ts) FROM samples "
        "JOIN sample_generations g USING (run_id, sample_id) WHERE run_id = {r:String}", parameters=p).result_rows
    steps = client.query(
        "SELECT count(), sum(metrics['train/tokens']), sum(metrics['perf/step_s']) FROM train_steps FINAL "
        "WHERE run_id = {r:String}", parameters=p).result_rows[0]
    heldout = [(int(s), float(a), float(sa) if has else None) for s, split, a, has, sa in evals if split == "heldout"]
    init = [(float(a), float(sa) if has else None) for s, split, a, has, sa in evals if split == "init"]

    def point(e: tuple[int, float, float | None] | None) -> dict[str, Any]:
        out: dict[str, Any] = {"accuracy": e[1] if e else None, "step": e[0] if e else None}
        if e is not None and e[2] is not None:  # with train.eval_samples
            out["accuracy_sampled"] = e[2]
        return out

    gen_tokens = int(thr[0][0] or 0) if thr else 0
    gen_span = (thr[0][3] - thr[0][2]).total_seconds() if thr and thr[0][2] and thr[0][3] else 0.0
    summary: dict[str, Any] = {
        "run_id": run_id,
        "config": to_dict(cfg),
        "steps": int(steps[0]),
        "wall_s": round(wall_s, 1),
        "eval": {
            "init": {"accuracy": init[0][0] if init else None,
                     **({"accuracy_sampled": init[0][1]} if init and init[0][1] is not None else {})},
            "start": point(heldout[0] if heldout else None),
            "final": point(heldout[-1] if heldout else None),
            "curve": [point(e) for e in heldout],
        },
        "samples": {
            "issued": issued,
            "trained": by_status.get("trained", 0),
            "dropped_stale": by_status.get("dropped_stale", 0),
            "filtered": by_status.get("filtered", 0),
            "dead_letter": by_status.get("dead_letter", 0),
            "unaccounted": sum(n for s, n in by_status.items()
                               if s not in ("trained", "dropped_stale", "filtered", "dead_letter")),
        },
        "throughput": {
            "gen_tokens_per_s": round(gen_tokens / gen_span, 1) if gen_span > 0 else None,
            "train_tokens_per_s": round(float(steps[1] or 0) / float(steps[2]), 1) if steps[2] else None,
        },
        "weights_versions": progress.versions,
        "final_model": str(final) if (final := run_dir_of(cfg, run_id) / FINAL_DIR).is_dir() else None,
    }
    return summary
