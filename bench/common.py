"""Helpers shared by the benchmarks (not a benchmark itself).

* :func:`machine` — one line describing this machine (CPU model, cores, torch) and the date.
* :func:`warm_model` / :func:`warm_model_at` — the main example's tiny model after its supervised warm-up
  (``bench/learn_offline.py``'s ``warm_up``), exported as an HF directory; every benchmark that
  compares two ways of training starts both from this same directory.
* :func:`rollstream_run` — ``rollstream run examples/main.yaml`` with ``--set`` overrides, in a
  subprocess (optionally under a profiler command), failing with the tail of its output.
* :func:`sql` — a query against a finished run's record (``rollstream sql --format json``).
* :func:`table` — print rows as an aligned text table.
* :func:`find_broker` — the Kafka a benchmark uses, found as every command finds it.
"""

from __future__ import annotations

import json
import os
import platform
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

DEFAULT_WARM = REPO / ".cache" / "bench" / "warm"
"""Where :func:`warm_model_at` keeps the warmed-up tiny model between benchmark runs (gitignored)."""


def find_broker(given: str = "") -> str | None:
    """The benchmark's Kafka by :func:`runtime.probe.find_bootstrap`: ``given`` (its ``--bootstrap``),
    else ``$ROLLSTREAM_BOOTSTRAP``, else the local broker of ``rollstream stack up`` (in
    ``$ROLLSTREAM_HOME``, else ``./.rollstream``); None when there is none (say
    :data:`runtime.probe.NO_BROKER`)."""
    from infra.kafka.broker import local_bootstrap
    from runtime.probe import find_bootstrap

    return find_bootstrap(given, None, local_bootstrap())


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        return next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def machine() -> str:
    """CPU model, core count, Python and torch versions, and today's date (UTC)."""
    import torch

    return (f"{cpu_name()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


def warm_model(cfg: Any, out: Path) -> Path:
    """The tiny model of ``cfg.model.init`` after ``cfg.train.warmup_sft_steps`` supervised warm-up
    steps on ``cfg``'s first domain (seeded by ``cfg.run.seed``), written to ``out`` as an HF directory."""
    import learn_offline as lo  # bench/learn_offline.py: the warm-up the main example uses
    import torch

    from envs import make_source
    from trainer.strategy import TorchStrategy

    rng = random.Random(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    domain = cfg.data.domains[0]
    source = make_source(domain.source, **domain.kwargs)
    init = lo.init_tiny_model(out.parent / "init", cfg.model.init, seed=cfg.run.seed)
    strategy = TorchStrategy(init, lr=cfg.train.lr, grad_clip=cfg.train.grad_clip,
                             micro_batch_size=cfg.train.micro_rows, temperature=cfg.rollout.temperature,
                             algo=cfg.algorithm, total_steps=cfg.train.steps, min_lr_ratio=cfg.train.min_lr_ratio,
                             lr_warmup_steps=cfg.train.lr_warmup_steps)
    lo.warm_up(strategy, source, cfg, rng)
    path, _ = strategy.export_weights(out)
    return Path(path)


def warm_model_at(path: Path | None) -> Path:
    """The main example's warmed-up model at ``path`` (default :data:`DEFAULT_WARM`), created there
    first (about 20 s on 2 cores) when it does not exist yet."""
    import learn_offline as lo

    from schemas.config import parse_raw

    target = path or DEFAULT_WARM
    if (target / "config.json").is_file():
        return target
    t0 = time.perf_counter()
    made = warm_model(parse_raw(json.loads(json.dumps(lo.TUNED))), target)
    print(f"warm-up done in {time.perf_counter() - t0:.0f}s; model {made}", flush=True)
    return made


def rollstream_run(run_id: str, sets: list[str], env: dict[str, str], *, prefix: list[str] | None = None,
                   timeout_s: float = 1800, config: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``rollstream run CONFIG --run-id RUN_ID --set ...`` (``config``: default ``examples/main.yaml``;
    ``prefix``: a profiler command line to run it under, e.g. ``py-spy record ... --``). Exits with
    the output's tail on failure."""
    cmd = [*(prefix or []), sys.executable, "-m", "cli", "run", str(config or REPO / "examples" / "main.yaml"),
           "--run-id", run_id, *[a for kv in sets for a in ("--set", kv)]]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout_s)
    if res.returncode != 0:
        raise SystemExit(f"rollstream run {run_id} failed (exit {res.returncode}):\n{res.stdout[-2000:]}\n"
                         f"{res.stderr[-2000:]}")
    return res


def sql(query: str, run_id: str, runs: Path, env: dict[str, str]) -> list[dict[str, Any]]:
    """Rows of ``query`` against the record of ``run_id`` under ``runs`` (``rollstream sql``)."""
    out = subprocess.run([sys.executable, "-m", "cli", "sql", query, "--run", run_id, "--runs-dir",
                          str(runs), "--format", "json"], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"rollstream sql failed on {run_id}: {out.stderr.strip()[-500:]}")
    rows: list[dict[str, Any]] = json.loads(out.stdout or "[]")
    return rows


def table(rows: Sequence[tuple[str, ...]]) -> None:
    """Print ``rows`` (the first is the header) left-aligned first column, the others right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for j, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
        print("  ".join(cells).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))
