"""The report's page: the headline, the plots with their captions, and the tables (from the data
:mod:`store.report` extracts; no store access here).

* **Steps** are counted as *steps done*, as ``rollstream status`` and ``summary.json`` count them:
  evaluations and weights are stamped with the steps done (0: before the first update), and a
  ``train_steps`` row (``step`` k, a 0-based index) is drawn at k + 1, where its update is done.
* **Headline**: accuracy before the warm-up, after it and at the end, steps, samples, wall time;
  for a run with multi-turn episodes, their success rate.
* **Plots** in reading order (:data:`FIGURES`), each with a written caption; the agentic plots
  (success rate, turns per episode, how episodes ended) only for runs with episodes.
* **Config** as its difference from the defaults (``parse_config("")``), weights as a summary.
* **Held-out answers** of a visual run (:func:`answers_html`): the last evaluation's recorded greedy
  answers, each with its image, question, expected answer and whether it was right; only for runs
  whose recorded answers show images (a text run's page has no such section).
"""

from __future__ import annotations

import base64
import html
import json
import math
from datetime import UTC, datetime
from typing import Any

LINESTYLES = ("-", "--", ":", "-.")
STAGES: dict[str, str] = {
    "queue_s": "waiting in queue",
    "gen_s": "generation",
    "env_s": "environment",
    "reward_s": "reward (verification)",
    "train_wait_s": "waiting for the trainer",
}
"""Stage column of the ``samples`` view -> the name the report shows."""
ENDINGS: dict[str, str] = {
    "terminated": "ended by the environment",
    "truncated": "cut by the environment's turn limit",
    "max_turns": "reached rollout.max_turns",
    "context": "reached rollout.max_context_tokens",
    "env_error": "environment error",
}
"""``env_finish`` -> how the report says it."""

# train_steps metric -> (figure stem, title, y label, caption)
STEP_METRICS: list[tuple[str, str, str, str, str]] = [
    ("rollout/reward_mean", "reward_mean", "Mean reward of the trained batch", "reward",
     "Mean reward of the samples each training step trained on."),
    ("actor/entropy", "entropy", "Policy entropy", "entropy (nats/token)",
     "Mean entropy of the trained policy over the batch's response tokens (actor/entropy)."),
    ("rollout/response_len_mean", "response_len", "Mean response length", "tokens",
     "Mean length of the trained responses, in tokens."),
    ("loss/clipfrac", "clipfrac", "PPO clip fraction", "fraction clipped",
     "Share of response tokens whose probability ratio was clipped (loss/clipfrac)."),
    ("rollout/staleness_mean", "staleness_mean", "Mean staleness of the trained batch", "policy versions behind",
     "How many policy versions behind the trainer the batch's samples were generated, on average."),
    ("perf/train_tokens_per_s", "train_tokens_per_s", "Trainer throughput", "tokens / s",
     "Tokens the trainer processed per second of its step."),
]
ORDER = ("eval_accuracy", "reward_mean", "eval_accuracy_by_domain", "reward_by_domain", "success_rate", "turns",
         "episode_endings", "kl", "entropy", "response_len", "clipfrac", "staleness_mean", "staleness_hist",
         "train_tokens_per_s", "latency", "status")
"""Every figure stem, in the order of the page."""
AGENTIC = ("success_rate", "turns", "episode_endings")
STEPS_DONE = "training steps done"


def is_agentic(run: dict[str, Any]) -> bool:
    """The run has multi-turn episodes."""
    return bool((run.get("episodes") or {}).get("turns"))


# --------------------------------------------------------------------------- headline


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.1f}%"


def _duration(s: float | None) -> str:
    if s is None:
        return "—"
    s = round(s)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def accuracy_curve(run: dict[str, Any], split: str = "heldout", key: str = "eval/accuracy") -> list[tuple[int, float]]:
    """``(steps done, value)`` of one split's evaluations (the last of a step counts)."""
    pts = {e["step"]: e["metrics"].get(key) for e in run["evals"] if e["split"] == split}
    return sorted((s, v) for s, v in pts.items() if v is not None)


def steps_done(run: dict[str, Any]) -> int:
    """Training steps done (the last ``train_steps.step`` + 1)."""
    return max((s["step"] for s in run["train_steps"]), default=-1) + 1


def config_value(run: dict[str, Any], *path: str) -> Any:
    node: Any = run.get("config")
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node


def wall_s(run: dict[str, Any]) -> float | None:
    """summary.json's ``wall_s``, else RunStarted -> RunFinished (or the last train step) on the record."""
    summary = run.get("summary") or {}
    if isinstance(summary.get("wall_s"), int | float):
        return float(summary["wall_s"])
    times = run.get("times") or {}
    start = times.get("started")
    end = times.get("finished") or times.get("last_step")
    return end - start if start is not None and end is not None else None


def headline(run: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The headline of one run: ``(label, value, note)`` cards."""
    init, held = accuracy_curve(run, "init"), accuracy_curve(run)
    cards = []
    if init:
        cards.append(("accuracy before warm-up", _pct(init[0][1]), "the initial model"))
    if held:
        first = held[0]
        label = "accuracy after warm-up" if init or (config_value(run, "train", "warmup_sft_steps") or 0) > 0 \
            else "accuracy at the start"
        cards.append((label, _pct(first[1]), f"at step {first[0]}"))
        best = max(held, key=lambda p: p[1])
        end = f"at step {held[-1][0]}" + (f"; best {_pct(best[1])} at step {best[0]}" if best[1] > held[-1][1] else "")
        cards.append(("accuracy at the end", _pct(held[-1][1]), end))
    else:
        cards.append(("held-out accuracy", "—", "no evaluation recorded"))
    if is_agentic(run):
        by_step = run["episodes"]["by_step"]
        n = sum(r["episodes"] for r in by_step)
        won = sum(r["succeeded"] for r in by_step)
        tail = by_step[-10:]
        tail_n = sum(r["episodes"] for r in tail)
        cards.append(("episode success (training)", _pct(won / n if n else None),
                      f"last {len(tail)} steps: {_pct(sum(r['succeeded'] for r in tail) / tail_n if tail_n else None)}"))
    total = config_value(run, "train", "steps")
    cards.append(("steps", f"{steps_done(run)}/{total}" if total else str(steps_done(run)),
                  f"batch of {config_value(run, 'train', 'batch_size')} samples" if config_value(run, "train", "batch_size")
                  else "training steps done"))
    status = run["status"]
    cards.append(("samples", f"{sum(status.values()):,}", f"{status.get('trained', 0):,} trained"))
    cards.append(("wall time", _duration(wall_s(run)), "start to finish"))
    return cards


# --------------------------------------------------------------------------- figures


def _new_fig(title: str, xlabel: str, ylabel: str) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _finish(fig: Any, ax: Any, plotted: bool, *, int_x: bool = False, int_y: bool = False) -> Any:
    from matplotlib.ticker import MaxNLocator

    if plotted:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", fontsize=14, color="gray")
    if int_x:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if int_y:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    return fig


def _step_series(run: dict[str, Any], key: str) -> tuple[list[int], list[float]]:
    """``train_steps`` metric ``key`` against the steps done (index + 1)."""
    pts = [(s["step"] + 1, s["metrics"].get(key)) for s in run["train_steps"]]
    return [x for x, y in pts if y is not None], [y for _, y in pts if y is not None]


def _xy(pts: list[tuple[Any, Any]]) -> tuple[list[Any], list[Any]]:
    return [p[0] for p in pts], [p[1] for p in pts]


def _line(ax: Any, i: int, xs: list[Any], ys: list[Any], label: str, marker: str | None = None) -> bool:
    if not xs:
        return False
    ax.plot(xs, ys, LINESTYLES[i % 4], marker=marker or ("." if len(xs) < 50 else None), label=label)
    return True


def _kl_caption(runs: list[dict[str, Any]]) -> str:
    old = {str(config_value(r, "algorithm", "old_logprobs") or "behaviour") for r in runs}
    denominators = {"behaviour": "the policy that generated the samples (the rollout engine's log-probs, "
                    "some versions behind: algorithm.old_logprobs = behaviour)",
                    "recompute": "the trainer's policy at the start of the step (its recomputed log-probs: "
                    "algorithm.old_logprobs = recompute)"}
    which = " or ".join(denominators.get(o, o) for o in sorted(old))
    return (f"KL(π_old ‖ π), the k3 estimate of actor/approx_kl, between π_old, {which}, and π, the policy "
            "being trained. Where a KL penalty is on, KL(π ‖ π_ref) to the reference model (the policy after "
            "the warm-up, actor/kl) is drawn too.")


def make_figures(runs: list[dict[str, Any]]) -> dict[str, tuple[Any, str]]:
    """Every plot of the report as ``{stem: (matplotlib Figure, caption)}`` in page order (one line
    style per run)."""
    figs: dict[str, tuple[Any, str]] = {}
    multi = len(runs) > 1

    def name(run: dict[str, Any], what: str = "") -> str:
        """A line's legend label: the run (when there are several) and what the line shows."""
        return " ".join(p for p in ((run["run_id"] if multi else ""), what) if p)

    # held-out accuracy: every split; the initial model (before the warm-up) as a point at 0
    fig, ax = _new_fig("Held-out accuracy", STEPS_DONE, "accuracy")
    plotted = False
    for i, run in enumerate(runs):
        for split in sorted({e["split"] for e in run["evals"]}):
            pts = accuracy_curve(run, split)
            label = {"init": "before warm-up", "heldout": "held-out (greedy)"}.get(split, split)
            if pts:
                plotted |= _line(ax, i, *_xy(pts), name(run, label), marker="o")
            sampled = accuracy_curve(run, split, "eval/accuracy_sampled")
            if sampled:
                plotted |= _line(ax, i, *_xy(sampled), name(run, f"{label}, sampled"), marker="x")
    figs["eval_accuracy"] = (_finish(fig, ax, plotted, int_x=True),
                             "Accuracy on the fixed held-out set at each evaluation (greedy decoding), against "
                             "the training steps done: step 0 is the model after the warm-up, 'before warm-up' "
                             "the initial model.")

    fig, ax = _new_fig("Held-out accuracy by domain", STEPS_DONE, "accuracy")
    plotted = False
    for i, run in enumerate(runs):
        domains = sorted({k.split("/")[1] for e in run["evals"] if e["split"] == "heldout" for k in e["metrics"]
                          if k.startswith("eval/") and k.endswith("/accuracy") and k.count("/") == 2})
        for dom in domains:
            pts = accuracy_curve(run, "heldout", f"eval/{dom}/accuracy")
            if pts:
                plotted |= _line(ax, i, *_xy(pts), name(run, dom), marker="o")
    figs["eval_accuracy_by_domain"] = (_finish(fig, ax, plotted, int_x=True),
                                       "Held-out accuracy of each task domain (greedy decoding).")

    for key, stem, title, ylabel, caption in STEP_METRICS[:1]:
        figs[stem] = _metric_figure(runs, key, title, ylabel, caption, name)

    fig, ax = _new_fig("Reward by domain (trained samples)", STEPS_DONE, "mean reward")
    plotted = False
    for i, run in enumerate(runs):
        for dom in sorted({d["domain"] for d in run["domain_reward"]}):
            pts = [(d["step"] + 1, d["reward"]) for d in run["domain_reward"]
                   if d["domain"] == dom and d["reward"] is not None]
            if pts:
                plotted |= _line(ax, i, *_xy(pts), name(run, dom))
    figs["reward_by_domain"] = (_finish(fig, ax, plotted, int_x=True),
                                "Mean reward of the trained samples of each task domain, per training step.")

    if any(is_agentic(r) for r in runs):
        figs.update(_agentic_figures(runs, name))

    fig, ax = _new_fig("KL between the sampling policy and the trained policy", STEPS_DONE, "KL (nats/token)")
    plotted = False
    for i, run in enumerate(runs):
        plotted |= _line(ax, i, *_step_series(run, "actor/approx_kl"), name(run, "KL(π_old ‖ π)"))
        plotted |= _line(ax, i, *_step_series(run, "actor/kl"), name(run, "KL(π ‖ π_ref)"))
    figs["kl"] = (_finish(fig, ax, plotted, int_x=True), _kl_caption(runs))

    for key, stem, title, ylabel, caption in STEP_METRICS[1:]:
        figs[stem] = _metric_figure(runs, key, title, ylabel, caption, name)

    width = 0.8 / max(1, len(runs))
    fig, ax = _new_fig("Staleness of the trained samples (all steps)", "policy versions behind", "samples")
    plotted = False
    for i, run in enumerate(runs):
        hist = [(int(k), int(v)) for k, v in run["staleness_hist"]]
        if hist:
            ax.bar([k + (i - (len(runs) - 1) / 2) * width for k, _ in hist], [v for _, v in hist], width=width,
                   label=name(run))
            plotted = True
    figs["staleness_hist"] = (_finish(fig, ax, plotted, int_x=True, int_y=True),
                              "How many policy versions behind the trainer each trained sample was generated, "
                              "summed over the run (0: by the weights being trained).")

    fig, ax = _new_fig("Time per stage of a sample's life", "stage", "seconds")
    bars = [(run, stat) for run in runs for stat in ("mean", "p50", "p95")]
    bw = 0.8 / len(bars)
    plotted = False
    for j, (run, stat) in enumerate(bars):
        vals = [run["latency"].get(c, {}).get(stat) for c in STAGES]
        if any(v is not None for v in vals):
            ax.bar([k + (j - (len(bars) - 1) / 2) * bw for k in range(len(STAGES))],
                   [v or 0.0 for v in vals], width=bw, label=name(run, {"p50": "median"}.get(stat, stat)))
            plotted = True
    ax.set_xticks(range(len(STAGES)), [s.replace(" (", "\n(") for s in STAGES.values()], fontsize=8)
    figs["latency"] = (_finish(fig, ax, plotted),
                       "Seconds each sample spent in each stage: waiting in the queue for a rollout worker, "
                       "generating, in the environment (multi-turn), being verified, and waiting for the "
                       "trainer's decision (mean, median and 95th percentile).")

    fig, ax = _new_fig("Samples by status", "status", "samples (log scale)")
    statuses = sorted({s for run in runs for s in run["status"]}, key=_status_order)
    plotted = False
    for i, run in enumerate(runs):
        if run["status"]:
            xs = [k + (i - (len(runs) - 1) / 2) * width for k in range(len(statuses))]
            counts = [run["status"].get(s, 0) for s in statuses]
            bars_ = ax.bar(xs, counts, width=width, label=name(run))
            ax.bar_label(bars_, labels=[f"{c:,}" if c else "" for c in counts], fontsize=8)
            plotted = True
    if statuses:
        ax.set_xticks(range(len(statuses)), [s.replace("_", " ") for s in statuses])
        ax.set_yscale("log")
        ax.margins(y=0.15)
    figs["status"] = (_finish(fig, ax, plotted),
                      "Where every issued sample ended: trained, dropped as too stale, filtered (e.g. a group "
                      "whose rewards were all equal), dead-lettered, or still in flight (issued, generated, "
                      "scored). Log scale, so that a few hundred show next to thousands.")
    return {stem: figs[stem] for stem in ORDER if stem in figs}


def _status_order(status: str) -> tuple[int, str]:
    order = ("trained", "dropped_stale", "filtered", "dead_letter", "scored", "generated", "issued")
    return (order.index(status) if status in order else len(order), status)


def _metric_figure(runs: list[dict[str, Any]], key: str, title: str, ylabel: str, caption: str,
                   name: Any) -> tuple[Any, str]:
    fig, ax = _new_fig(title, STEPS_DONE, ylabel)
    plotted = False
    for i, run in enumerate(runs):
        plotted |= _line(ax, i, *_step_series(run, key), name(run))
    return _finish(fig, ax, plotted, int_x=True), caption


def _agentic_figures(runs: list[dict[str, Any]], name: Any) -> dict[str, tuple[Any, str]]:
    figs: dict[str, tuple[Any, str]] = {}
    fig, ax = _new_fig("Success rate of the training episodes", STEPS_DONE, "episodes that succeeded")
    plotted = False
    for i, run in enumerate(runs):
        pts = [(r["step"] + 1, r["succeeded"] / r["episodes"]) for r in (run.get("episodes") or {}).get("by_step", [])
               if r["episodes"]]
        if pts:
            plotted |= _line(ax, i, *_xy(pts), name(run))
    ax.yaxis.set_major_formatter(lambda v, _pos: f"{100 * v:.0f}%")
    figs["success_rate"] = (_finish(fig, ax, plotted, int_x=True),
                            "Share of the multi-turn episodes each training step trained on that the environment "
                            "reported as a success.")

    width = 0.8 / max(1, len(runs))
    fig, ax = _new_fig("Turns per episode", "agent turns", "episodes")
    plotted = False
    for i, run in enumerate(runs):
        turns = (run.get("episodes") or {}).get("turns", [])
        if turns:
            ax.bar([t["num_turns"] + (i - (len(runs) - 1) / 2) * width for t in turns],
                   [t["episodes"] for t in turns], width=width, label=name(run))
            plotted = True
    figs["turns"] = (_finish(fig, ax, plotted, int_x=True, int_y=True),
                     "How many agent turns the run's multi-turn episodes took.")

    fig, ax = _new_fig("How the episodes ended", "episodes", "")
    endings = sorted({e["env_finish"] for r in runs for e in (r.get("episodes") or {}).get("endings", [])},
                     key=lambda e: (list(ENDINGS).index(e) if e in ENDINGS else len(ENDINGS), e))
    plotted = False
    for i, run in enumerate(runs):
        counts = {e["env_finish"]: e["episodes"] for e in (run.get("episodes") or {}).get("endings", [])}
        if counts:
            ys = [k + (i - (len(runs) - 1) / 2) * width for k in range(len(endings))]
            b = ax.barh(ys, [counts.get(e, 0) for e in endings], height=width, label=name(run))
            ax.bar_label(b, labels=[f"{counts.get(e, 0):,}" for e in endings], fontsize=8)
            plotted = True
    if endings:
        ax.set_yticks(range(len(endings)), [ENDINGS.get(e, e or "(not recorded)") for e in endings], fontsize=8)
        ax.set_ylabel("ending")
    ax.margins(x=0.12)
    figs["episode_endings"] = (_finish(fig, ax, plotted, int_x=True),
                               "Why the multi-turn episodes stopped: the environment ended them (terminated), "
                               "cut them at its own turn limit (truncated), the rollout's turn or context limit "
                               "stopped them, or the environment failed.")
    return figs


# --------------------------------------------------------------------------- HTML


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts (and lists of dicts) as ``{"a.b[0].c": value}``."""
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(d, list) and d and all(isinstance(x, dict) for x in d):
        out = {}
        for i, v in enumerate(d):
            out.update(_flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: d}


def default_config() -> dict[str, Any]:
    """The defaults of every config key, flattened (the config of an empty file)."""
    import msgspec

    from schemas.config import parse_config

    return _flatten(msgspec.to_builtins(parse_config("")))


def config_diff(configs: list[Any]) -> tuple[list[list[Any]], int]:
    """Rows ``[key, default, value of each run]`` for every key where a run differs from the
    default (a key the defaults lack shows ``—``), and the number of keys there are."""
    defaults = default_config()
    flat = [_flatten(c) if isinstance(c, dict) else {} for c in configs]
    keys = list(defaults) + [k for f in flat for k in f if k not in defaults]
    keys = list(dict.fromkeys(keys))
    missing = object()
    rows = [[k, defaults.get(k, "—"), *[f.get(k, "—") for f in flat]] for k in keys
            if any(f.get(k, missing) is not missing and f.get(k) != defaults.get(k, missing) for f in flat)]
    return rows, len(keys)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list | dict):
        return json.dumps(v, default=str)
    return "" if v is None else str(v)


def _table(header: list[str], rows: list[list[Any]], cls: str = "") -> str:
    h = "".join(f"<th>{html.escape(c)}</th>" for c in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table class='{cls}'><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>"


def _versions(versions: list[int]) -> str:
    """``[0, 1, ..., 200]`` -> ``"201 versions, 0–200"`` (gaps named)."""
    if not versions:
        return "none"
    vs = sorted(set(versions))
    runs_: list[list[int]] = [[vs[0], vs[0]]]
    for v in vs[1:]:
        if v == runs_[-1][1] + 1:
            runs_[-1][1] = v
        else:
            runs_.append([v, v])
    spans = ", ".join(f"{a}–{b}" if a != b else str(a) for a, b in runs_[:6]) + (", …" if len(runs_) > 6 else "")
    return f"{len(vs)} version{'s' if len(vs) != 1 else ''}: {spans}"


def weights_rows(runs: list[dict[str, Any]]) -> list[list[Any]]:
    """``[run, published, total size, on disk]`` per run."""
    rows = []
    for r in runs:
        w = r.get("weights") or {}
        size = w.get("bytes_total")
        rows.append([r["run_id"], _versions(list(range(w["first"], w["last"] + 1))) if w.get("versions") else "none",
                     f"{size / 1e6:,.0f} MB" if size else "—", ", ".join(r.get("weights_on_disk") or []) or "—"])
    return rows


def _summary_rows(runs: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    flat = []
    for r in runs:
        s = dict(r.get("summary") or {})
        s.pop("config", None)
        versions = s.pop("weights_versions", None)
        if isinstance(versions, list):
            s["weights_versions"] = _versions([v for v in versions if isinstance(v, int)])
        if isinstance(s.get("eval"), dict):
            s["eval"] = {k: v for k, v in s["eval"].items() if k != "curve"}  # the accuracy plot
        flat.append(_flatten(s))
    keys = list(dict.fromkeys(k for f in flat for k in f))
    return keys, [[k, *[f.get(k) for f in flat]] for k in keys]


def _headline_html(runs: list[dict[str, Any]]) -> str:
    parts = []
    for r in runs:
        cards = "".join(f"<div class='card'><div class='label'>{html.escape(label)}</div>"
                        f"<div class='value'>{html.escape(value)}</div><div class='note'>{html.escape(note)}</div></div>"
                        for label, value, note in headline(r))
        who = f"<div class='who'>{html.escape(r['run_id'])}</div>" if len(runs) > 1 else ""
        parts.append(f"<div class='headline'>{who}{cards}</div>")
    return "".join(parts)


def _subtitle(run: dict[str, Any]) -> str:
    domains = config_value(run, "data", "domains")
    names = ", ".join(str(d.get("name")) for d in domains if isinstance(d, dict)) if isinstance(domains, list) else ""
    init = config_value(run, "model", "init") or {}
    model = config_value(run, "model", "path") or config_value(run, "model", "source") or (
        f"tiny, made here ({init.get('num_layers')} layers, {init.get('hidden_size')} wide)" if init else "")
    algo = "/".join(str(x) for x in (config_value(run, "algorithm", "adv_estimator"), config_value(run, "algorithm", "pg_variant"))
                    if x)
    bits = [f"name {config_value(run, 'run', 'name')}" if config_value(run, "run", "name") else "",
            f"domains {names}" if names else "", f"model {model}" if model else "",
            f"algorithm {algo}" if algo else ""]
    return " · ".join(b for b in bits if b)


CSS = ("body{font-family:system-ui,'DejaVu Sans',sans-serif;margin:1.2em 2em;max-width:1500px;color:#222}"
       "h1{font-size:22px;margin:0 0 .2em}h2{font-size:18px;margin:1.2em 0 .4em}.sub{color:#666;margin-bottom:.8em}"
       ".headline{display:flex;flex-wrap:wrap;gap:10px;margin:.4em 0 1em;align-items:stretch}"
       ".who{width:100%;font-weight:600}.card{border:1px solid #d0d7de;border-radius:8px;padding:8px 14px;"
       "background:#f6f8fa;min-width:110px}.label{font-size:12px;color:#555}.value{font-size:24px;font-weight:600}"
       ".note{font-size:11px;color:#777}.figs{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));"
       "gap:14px}figure{margin:0}img{width:100%;max-width:700px;border:1px solid #ddd}"
       "figcaption{font-size:13px;color:#444;max-width:700px}"
       "table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:2px 8px;"
       "font-size:13px;text-align:left;vertical-align:top}th{background:#f3f3f3}.note-p{color:#888}"
       ".answers{display:flex;flex-wrap:wrap;gap:10px}.qa{border:1px solid #d0d7de;border-radius:8px;padding:8px;"
       "width:240px;font-size:13px}img.answer{width:168px;max-width:100%;border:1px solid #ddd;image-rendering:pixelated}"
       ".q{margin:.3em 0}.ok{color:#1a7f37;font-weight:600}.bad{color:#cf222e;font-weight:600}"
       ".noimg{color:#cf222e;font-size:12px;word-break:break-all}")


def visual_answers(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's recorded held-out answers when they show images (a visual run), else ``[]``."""
    items = (run.get("answers") or {}).get("items") or []
    return items if any(a.get("image_hashes") for a in items) else []


def answers_html(run: dict[str, Any], images: dict[tuple[str, str], bytes | str], multi: bool = False) -> str:
    """The held-out answers section of a visual run: one card per recorded answer (its images from
    ``images``: ``(run, digest) -> PNG``, or why a blob cannot be shown), empty for other runs."""
    items = visual_answers(run)
    if not items:
        return ""
    rid = run["run_id"]
    cards, missing = [], 0
    for a in items:
        pics = []
        for h in a.get("image_hashes") or []:
            got = images.get((rid, h), "not read")
            if isinstance(got, bytes):
                pics.append(f"<img class='answer' src=\"data:image/png;base64,{base64.b64encode(got).decode()}\" "
                            f"alt=\"held-out image {html.escape(h[:12])}\">")
            else:
                missing += 1
                pics.append(f"<div class='noimg'>image {html.escape(h[:12])}… not shown: {html.escape(got)}</div>")
        mark = "<span class='ok'>✓ right</span>" if a.get("correct") else "<span class='bad'>✗ wrong</span>"
        cards.append(f"<div class='qa'>{''.join(pics)}<div class='q'>{html.escape(str(a.get('prompt', '')))}</div>"
                     f"<div>expected <code>{html.escape(str(a.get('reference', '')))}</code></div>"
                     f"<div>answered <code>{html.escape(str(a.get('response', '')))}</code> {mark}</div>"
                     f"<div class='note'>{html.escape(str(a.get('domain', '')))} · "
                     f"{html.escape(str(a.get('prompt_id', '')))}</div></div>")
    step = (run.get("answers") or {}).get("step")
    right = sum(bool(a.get("correct")) for a in items)
    who = f"{rid}: " if multi else ""
    note = (f"<p class='note-p'>{missing} image(s) could not be read from the run's blob store "
            f"(<code>runs/{html.escape(rid)}/blobs</code>): the reason is in place of each.</p>") if missing else ""
    return (f"<h2>{html.escape(who)}Held-out answers at step {step}</h2>"
            f"<p>The greedy answers of the last evaluation (after {step} training steps) to the first "
            f"{len(items)} held-out problems it recorded ({right} of {len(items)} right), with the images from "
            "the run's blob store.</p>"
            f"{note}<div class='answers'>{''.join(cards)}</div>")


def render_html(runs: list[dict[str, Any]], pngs: dict[str, bytes], captions: dict[str, str],
                images: dict[tuple[str, str], bytes | str] | None = None) -> str:
    """The self-contained page: headline, plots (PNG data URIs) with captions, a visual run's
    held-out answers (``images``: their thumbnails by run and digest), tables."""
    ids = [r["run_id"] for r in runs]
    title = "rollstream report: " + " vs ".join(ids)
    subtitle = "".join(f"<div class='sub'>{html.escape((r['run_id'] + ': ') if len(runs) > 1 else '')}"
                       f"{html.escape(_subtitle(r))}</div>" for r in runs if _subtitle(r))
    imgs = "".join(
        f"<figure><img src=\"data:image/png;base64,{base64.b64encode(b).decode()}\" "
        f"alt=\"{html.escape(captions.get(stem, stem))}\"><figcaption>{html.escape(captions.get(stem, ''))}"
        "</figcaption></figure>" for stem, b in pngs.items())
    statuses = sorted({s for r in runs for s in r["status"]}, key=_status_order)
    status_t = _table(["status", *ids], [[s.replace("_", " "), *[f"{r['status'].get(s, 0):,}" for r in runs]]
                                         for s in statuses]) if statuses else "<p class='note-p'>no samples recorded</p>"
    judge_rows = [[r["run_id"], j["domain"], j["judge"], j["judged"], j["judge_mean"], j["unscored"],
                   j["judge_s_mean"]] for r in runs for j in r.get("judges", [])]
    judges_t = ("<h2>Judges by domain</h2>" + _table(
        ["run", "domain", "judge", "judged", "judge score mean", "unscored (judge_error)", "judge call mean (s)"],
        judge_rows)) if judge_rows else ""
    lat_rows = [[r["run_id"], label, *[r["latency"][c][k] for k in ("mean", "p50", "p95", "n")]]
                for r in runs for c, label in STAGES.items() if c in r["latency"]]
    lat_t = _table(["run", "stage", "mean (s)", "median (s)", "p95 (s)", "samples"], lat_rows)
    diff, n_keys = config_diff([r.get("config") for r in runs])
    config_t = (f"<p>{len(diff)} of {n_keys} keys differ from the defaults (the whole config: "
                "<code>runs/&lt;run&gt;/config.yaml</code>).</p>"
                + (_table(["key", "default", *ids], diff) if diff else "")) \
        if any(isinstance(r.get("config"), dict) for r in runs) else "<p class='note-p'>no config.yaml</p>"
    keys, summary_rows = _summary_rows(runs)
    summary_t = _table(["key", *ids], summary_rows) if keys else "<p class='note-p'>no summary.json</p>"
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>{subtitle}"
            f"{_headline_html(runs)}<div class='figs'>{imgs}</div>"
            f"{''.join(answers_html(r, images or {}, len(runs) > 1) for r in runs)}"
            f"<h2>Samples by status</h2>{status_t}{judges_t}<h2>Time per stage</h2>{lat_t}"
            f"<h2>Weights</h2>{_table(['run', 'published', 'size in all', 'kept on disk'], weights_rows(runs))}"
            f"<h2>Config: what differs from the defaults</h2>{config_t}"
            f"<h2>Summary (summary.json)</h2>{summary_t}"
            f"<p class='note-p'>Steps are counted as steps done (as <code>rollstream status</code> does): "
            f"step 0 is before the first update. Made {datetime.now(UTC):%Y-%m-%d %H:%M} UTC.</p>"
            "</body></html>")


def finite(v: Any) -> float | None:
    """``v`` as a float, None for missing, NaN and infinite values."""
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) or math.isinf(f) else f
