"""The whole run on one GPU, through Kafka: the one prepared script for a GPU machine (issue 36).

    python bench/gpu_run.py --out DIR [--bundle BUNDLE] [--device cuda] [--steps 60]
                            [--shape-steps 4] [--shapes smollm2-shape,qwen2.5-0.5b-shape]
    python bench/gpu_run.py --out DIR --device cpu --smoke        # the script end to end, here

It starts its own broker in a temporary home (``rollstream stack up``, from ``--bundle`` when given:
``stack up --from BUNDLE``, for a node without Java or Maven), runs with ``store.record_live=false``
(no chDB on the node), and measures on ``--device``:

1. **The main example** (examples/main.yaml, ``--steps`` RL steps after its warm-up): ``rollstream
   run`` against ``bench/learn_offline.py``'s in-process loop (a process of its own) on the same
   device. s/step of each (pipeline: its first ``WeightsPublished`` to its last ``TrainStep``, over
   the steps; learn_offline: its step-0 evaluation to its last, over the steps), their ratio, and
   both held-out curves (pipeline: its ``EvalResult`` events).
2. **Two shapes with random weights** (``--shapes``; ``bench/gpu.py``'s SmolLM2-135M and
   Qwen2.5-0.5B architectures), ``--shape-steps`` steps each through Kafka: generated tokens/s in the
   pipeline (its ``Generation`` events over their span) against the engine alone (``TorchEngine``,
   same prompts, lengths and batch, in this process), trained tokens/s (``perf/train_tokens_per_s``
   of its ``TrainStep`` events, the first left out) against the strategy alone (``bench/gpu.py``'s
   ``run_child``: a process, the same batch size and lengths), the weight handoff (from
   ``WeightsPublished.ts`` to the rollout worker's log line "now at policy version"), the GPU busy
   share and each process's peak GPU memory while the run ran.

GPU busy share and per-process memory are sampled every 0.5 s by NVML (``pynvml``) when it imports,
else ``nvidia-smi``, else not at all (CPU); ``results.json`` says which. Each run's events are read
back from the broker's log directory (``infra/kafka/logdir.py``), and the run is exported there
(``rollstream runs export-log``) as ``<run>.tar.xz`` under ``--out``: on the CPU machine
``rollstream record RUN --from-log DIR/<run>.tar.xz`` builds its record. ``--out`` gets at most 8
flat files of at most 16 MiB (an archive over that is left out and said so in results.json).
A shape not started within ``--budget-s`` (300) is skipped and named in results.json.
``--smoke``: the main example's tiny model for both parts, 2 steps, small batches (minutes on a CPU).
bench/README.md ("gpu_run.py") keeps the measured runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import common  # noqa: E402  (bench/common.py)

REPO = common.REPO
MAX_FILES, MAX_BYTES = 8, 16 * 2**20
"""What ``--out`` may hold: flat files, each at most this large."""


# --------------------------------------------------------------------------- GPU sampling


class Sampler(threading.Thread):
    """GPU utilisation and per-process GPU memory every ``every_s`` (NVML, else nvidia-smi)."""

    def __init__(self, device: str, every_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.every_s, self.samples = every_s, list[tuple[float, float, dict[int, float]]]()
        self.index = int(device.split(":")[1]) if device.startswith("cuda:") else 0
        self.how, self._stop, self._nvml = "none (not a CUDA device)", threading.Event(), None
        self.names: dict[int, str] = {}
        """pid -> label, taken when the pid is first seen (the process may be gone by the report)."""
        if device.startswith("cuda"):
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml.nvmlDeviceGetHandleByIndex(self.index)
                self.how = "nvml"
            except Exception:  # no pynvml, or no driver library: try the command
                self.how = "nvidia-smi" if shutil.which("nvidia-smi") else "none (neither pynvml nor nvidia-smi)"

    def sample(self) -> tuple[float, dict[int, float]] | None:
        """``(utilisation %, {pid: MiB})`` now, or None."""
        if self._nvml is not None:
            import pynvml

            util = float(pynvml.nvmlDeviceGetUtilizationRates(self._nvml).gpu)
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(self._nvml)
            return util, {p.pid: (p.usedGpuMemory or 0) / 2**20 for p in procs}
        if self.how == "nvidia-smi":
            smi = ["nvidia-smi", f"--id={self.index}", "--format=csv,noheader,nounits"]
            util = subprocess.run([*smi, "--query-gpu=utilization.gpu"], capture_output=True, text=True, timeout=10)
            apps = subprocess.run([*smi, "--query-compute-apps=pid,used_memory"], capture_output=True, text=True,
                                  timeout=10)
            mem = {int(p): float(m) for p, m in (ln.split(",") for ln in apps.stdout.splitlines() if "," in ln)}
            return float(util.stdout.strip().splitlines()[0]), mem
        return None

    def run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                got = self.sample()
            except Exception:  # a failed sample is a gap, not the end of the run
                continue
            if got is not None:
                self.samples.append((time.time(), *got))
                for pid in got[1]:
                    if pid not in self.names:
                        self.names[pid] = _proc_name(pid)

    def stop(self) -> None:
        self._stop.set()

    def window(self, t0: float, t1: float, names: dict[int, str]) -> dict[str, Any]:
        """Busy share and peak MiB per process between two Unix times (``names``: pid -> label)."""
        got = [s for s in self.samples if t0 <= s[0] <= t1]
        if not got:
            return {"gpu_sampler": self.how, "gpu_busy_share": None, "peak_gpu_mib_by_process": {}}
        peak: dict[str, float] = {}
        for _, _, mem in got:
            for pid, mib in mem.items():
                name = names.get(pid) or self.names.get(pid) or f"pid {pid}"
                peak[name] = max(peak.get(name, 0.0), mib)
        return {"gpu_sampler": self.how, "gpu_busy_share": round(statistics.mean(u for _, u, _ in got) / 100, 3),
                "samples": len(got), "peak_gpu_mib_by_process": {k: round(v) for k, v in sorted(peak.items())}}


def _proc_name(pid: int) -> str:
    """A process's label: the rollstream service it runs, else its script, else its pid."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode("utf-8", "replace").split("\0")
    except OSError:
        return f"pid {pid} (gone)"
    if "service" in argv and argv.index("service") + 1 < len(argv):
        return f"{argv[argv.index('service') + 1]} ({pid})"
    script = next((Path(a).name for a in argv if a.endswith(".py")), argv[0] if argv else "?")
    return f"{script} ({pid})"


# --------------------------------------------------------------------------- the stack and the runs


def cli(env: dict[str, str], *args: str, timeout_s: float = 600) -> str:
    """``rollstream ARGS`` (its stdout); exits with its last lines on failure."""
    res = subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=timeout_s)
    if res.returncode != 0:
        raise SystemExit(f"rollstream {' '.join(args)} failed (exit {res.returncode}): {res.stderr.strip()[-1500:]}")
    return res.stdout


def run_events(home: Path, run_id: str, names: tuple[str, ...] = ("metrics", "weights", "generations")) -> list[Any]:
    """The run's events on topics ``names``, read from the broker's log directory, by time."""
    import msgspec

    from infra.kafka.logdir import read_partition, run_log, run_partitions, split_partition
    from runtime.clients import records_of
    from schemas.topics import spec_for_topic

    out = []
    with run_log(home, run_id) as log_dir:
        for part in run_partitions(log_dir, run_id):
            topic, p = split_partition(part.name)
            spec = spec_for_topic(topic)
            if spec is not None and spec.name in names:
                dec = msgspec.msgpack.Decoder(spec.event_type)
                out += [r.event for r in records_of(topic, p, read_partition(part).messages, dec) if r.event is not None]
    return sorted(out, key=lambda e: e.ts)


def pipeline(a: argparse.Namespace, run_id: str, sets: list[str], env: dict[str, str], work: Path,
             sampler: Sampler, config: Path | None = None) -> dict[str, Any]:
    """``rollstream run`` of ``config`` with ``sets``; its wall time, GPU window and events."""
    sets = [*sets, "store.record_live=false", f"run.runs_dir={work / 'runs'}", f"train.device={a.device}",
            f"rollout.device={a.device}"]
    t0 = time.time()
    common.rollstream_run(run_id, sets, env, config=config, timeout_s=a.run_timeout_s)
    t1 = time.time()
    names = {}
    state = work / "runs" / run_id / "state.json"
    if state.is_file():  # the supervisor's record of its services' pids
        for name, info in (json.loads(state.read_text()).get("services") or {}).items():
            if isinstance(info, dict) and isinstance(info.get("pid"), int):
                names[info["pid"]] = f"{name} ({info['pid']})"
    return {"run_id": run_id, "wall_s": round(t1 - t0, 1), **sampler.window(t0, t1, names)}


def handoff_s(work: Path, run_id: str, published: dict[int, float]) -> list[float]:
    """Per version, seconds from its ``WeightsPublished`` to the rollout log's "now at policy version"."""
    out = []
    for log in (work / "runs" / run_id / "logs").glob("rollout*.log"):
        for line in log.read_text(errors="replace").splitlines():
            m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .* now at policy version (\d+)", line)
            if m and int(m.group(2)) in published and int(m.group(2)) > 0:
                at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                out.append(round(at - published[int(m.group(2))], 3))
    return out


def export(env: dict[str, str], run_id: str, out: Path, results: dict[str, Any]) -> None:
    """The run's topics as ``out/<run>.tar.xz`` (left out, and said so, past :data:`MAX_BYTES`)."""
    path = out / f"{run_id}.tar.xz"
    got = json.loads(cli(env, "runs", "export-log", run_id, str(path), "--format", "json"))
    if path.stat().st_size > MAX_BYTES:
        path.unlink()
        results.setdefault("left_out", []).append(f"{path.name}: {got['bytes']} bytes > {MAX_BYTES}")
        return
    results.setdefault("archives", []).append(path.name)


# --------------------------------------------------------------------------- 1. the main example


def main_example(a: argparse.Namespace, env: dict[str, str], work: Path, sampler: Sampler,
                 out: Path, results: dict[str, Any]) -> dict[str, Any]:
    steps, every = a.steps, max(1, a.steps // 3)
    sets = [f"train.steps={steps}", f"train.eval_every={every}", "train.checkpoint_every=0"]
    if a.smoke:
        sets += ["train.batch_size=32", "train.micro_batch_size=16", "train.warmup_sft_steps=5",
                 "data.heldout_size=16", "rollout.group_size=4"]
    run_id = f"gpurun-main-{os.getpid()}"
    pipe = pipeline(a, run_id, sets, env, work, sampler)
    events = run_events(env_home(env), run_id)
    train = [e for e in events if type(e).__name__ == "TrainStep"]
    v0 = min((e.ts for e in events if type(e).__name__ == "WeightsPublished" and e.policy_version == 0), default=None)
    evals = [(e.step, round(e.metrics.get("eval/accuracy", float("nan")), 4)) for e in events
             if type(e).__name__ == "EvalResult" and e.split == "heldout"]
    pipe_s = (train[-1].ts - v0) / len(train) if train and v0 is not None else None
    export(env, run_id, out, results)
    # learn_offline's in-process loop, same device, same steps and overrides
    t0 = time.time()
    off = subprocess.run([sys.executable, str(HERE / "learn_offline.py"), *[x for kv in sets for x in ("--set", kv)],
                          "--set", f"train.device={a.device}", "--set", f"rollout.device={a.device}"],
                         capture_output=True, text=True, cwd=REPO, timeout=a.run_timeout_s)
    t1 = time.time()
    if off.returncode != 0:
        raise SystemExit(f"learn_offline failed: {off.stderr.strip()[-1500:]}")
    summary = json.loads(off.stdout.strip().splitlines()[-1])
    curve = summary["curve"]
    off_s = (curve[-1][2] - curve[0][2]) / steps
    return {"steps": steps, "pipeline": pipe | {"s_per_step": _r(pipe_s), "heldout_curve": evals},
            "learn_offline": {"wall_s": summary["wall_s"], "s_per_step": _r(off_s),
                              "heldout_curve": [(s, acc) for s, acc, _ in curve],
                              **sampler.window(t0, t1, {})},
            "offline_over_pipeline_step_rate": _r(off_s / pipe_s) if pipe_s else None,
            "final_accuracy_points_behind": _r(100 * (curve[-1][1] - evals[-1][1])) if evals else None}


def env_home(env: dict[str, str]) -> Path:
    return Path(env["ROLLSTREAM_HOME"])


def _r(x: float | None, n: int = 4) -> float | None:
    return None if x is None else round(x, n)


# --------------------------------------------------------------------------- 2. the shapes


async def engine_alone(a: argparse.Namespace, model_dir: Path, n: int, max_new_tokens: int, max_batch: int,
                       dtype: str) -> float:
    """Tokens/s of ``TorchEngine`` alone on ``n`` arith prompts (after one warm-up pass)."""
    import random

    from envs import make_source
    from rollout.engine import GenerationRequest, TorchEngine, generate_all
    from rollout.sampling import SamplingParams

    engine = TorchEngine(model_dir, max_batch=max_batch, device=a.device, dtype=dtype)
    src, rng = make_source("arith"), random.Random(0)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0)
    reqs = [GenerationRequest(str(i), engine.encode(src.sample(rng).prompt), params) for i in range(n)]
    await generate_all(engine, reqs[: max(1, n // 4)])
    t, n0 = time.perf_counter(), engine.tokens_generated
    await generate_all(engine, reqs)
    if a.device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
    rate = (engine.tokens_generated - n0) / (time.perf_counter() - t)
    del engine
    return rate


def shape(a: argparse.Namespace, name: str, model_dir: Path, env: dict[str, str], work: Path, sampler: Sampler,
          out: Path, results: dict[str, Any]) -> dict[str, Any]:
    import gpu  # bench/gpu.py

    dtype = "float32" if a.device == "cpu" else "bfloat16"
    batch, group, new = (16, 4, 8) if a.smoke else (64, 8, 64)
    sets = [f"model.path={model_dir}", f"model.dtype={dtype}", "model.chat_template=false",
            f"train.steps={a.shape_steps}", f"train.batch_size={batch}", f"rollout.group_size={group}",
            f"rollout.max_new_tokens={new}", "train.warmup_sft_steps=0", "train.eval_every=0",
            "train.checkpoint_every=0", "train.micro_batch_size=16", f"rollout.max_batch={batch}",
            "data.heldout_size=8"]
    run_id = f"gpurun-{name.replace('.', '')}-{os.getpid()}"
    pipe = pipeline(a, run_id, sets, env, work, sampler)
    events = run_events(env_home(env), run_id)
    gens = [e for e in events if type(e).__name__ == "Generation"]
    train = [e for e in events if type(e).__name__ == "TrainStep"]
    published = {e.policy_version: e.ts for e in events if type(e).__name__ == "WeightsPublished"}
    span = (gens[-1].ts - min(g.ts - g.gen_s for g in gens)) if gens else 0.0
    gen_tok_s = sum(len(g.response_ids) for g in gens) / span if span > 0 else None
    train_tok_s = statistics.median(t.metrics["perf/train_tokens_per_s"] for t in train[1:] or train) if train else None
    export(env, run_id, out, results)
    alone_gen = asyncio.run(engine_alone(a, model_dir, len(gens) or batch, new, batch, dtype))
    prompt_len = round(statistics.mean(len(g.prompt_ids) for g in gens)) if gens else 16
    ns = argparse.Namespace(device=a.device, steps=max(2, a.shape_steps), batch=batch, prompt_len=prompt_len,
                            response_len=new, response_len_max=0, child_timeout_s=a.run_timeout_s)
    child = gpu.run_child(ns, name, model_dir, dtype, "torch", work / "alone")
    if "error" in child:
        alone_train, alone_peak = None, None
        results.setdefault("errors", []).append(f"{name} strategy alone: {child['error']}")
    else:
        step_s = statistics.median(child["times_s"][1:] or child["times_s"])
        alone_train, alone_peak = child["metrics"][0].get("train/tokens", 0.0) / step_s, round(child["peak_mib"])
    hand = handoff_s(work, run_id, published)
    return {"model": name, "dtype": dtype, "steps": len(train), "generations": len(gens),
            "pipeline": pipe | {"gen_tok_s": _r(gen_tok_s, 1), "train_tok_s": _r(train_tok_s, 1),
                                "handoff_s_median": _r(statistics.median(hand)) if hand else None, "handoff_s": hand},
            "engine_alone_gen_tok_s": _r(alone_gen, 1), "strategy_alone_train_tok_s": _r(alone_train, 1),
            "strategy_alone_peak_gpu_mib": alone_peak,
            "pipeline_over_engine_gen": _r(gen_tok_s / alone_gen) if gen_tok_s and alone_gen else None,
            "pipeline_over_strategy_train": _r(train_tok_s / alone_train) if train_tok_s and alone_train else None}


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="results.json and the runs' archives (flat, at most 8 files)")
    ap.add_argument("--bundle", type=Path, default=None, help="start the broker from `rollstream stack bundle` DIR")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 2 steps, small batches: the script end to end")
    ap.add_argument("--steps", type=int, default=60, help="main example: RL steps of each side")
    ap.add_argument("--shape-steps", type=int, default=4, help="shapes: training steps through Kafka")
    ap.add_argument("--shapes", default="smollm2-shape,qwen2.5-0.5b-shape", help="bench/gpu.py model names")
    ap.add_argument("--run-timeout-s", type=float, default=240, help="the longest one run may take")
    ap.add_argument("--budget-s", type=float, default=300, help="a part not started by then is skipped (said so)")
    a = ap.parse_args()
    if a.smoke:
        a.steps, a.shape_steps, a.shapes = 2, 2, "tiny"
    if a.out.exists() and any(a.out.iterdir()):
        raise SystemExit(f"error: --out {a.out} is not empty: name a new directory")
    a.out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    work = Path(tempfile.mkdtemp(prefix="gpu_run-"))
    home = work / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_") or k == "ROLLSTREAM_CACHE"}
    env |= {"ROLLSTREAM_HOME": str(home), "PYTHONPATH": str(REPO)}
    results: dict[str, Any] = {"machine": common.machine(), "device": a.device, "smoke": a.smoke, "argv": sys.argv[1:]}
    sampler = Sampler(a.device)
    sampler.start()
    try:
        up = ["--home", str(home), "stack", "up"] + (["--from", str(a.bundle)] if a.bundle else [])
        cli(env, *up)
        from infra.kafka.broker import local_bootstrap

        env["ROLLSTREAM_BOOTSTRAP"] = local_bootstrap(home) or ""
        results["main_example"] = main_example(a, env, work, sampler, a.out, results)
        print(json.dumps(results["main_example"]), flush=True)
        import gpu

        models = gpu.make_models(work / "models", a.shapes.split(","))
        results["shapes"] = []
        for name, model_dir in models.items():
            if time.time() - t_start > a.budget_s and not a.smoke:
                results.setdefault("skipped", []).append(f"{name}: --budget-s {a.budget_s:g} spent")
                continue
            row = shape(a, name, model_dir, env, work, sampler, a.out, results)
            results["shapes"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        sampler.stop()
        results["wall_s"] = round(time.time() - t_start, 1)
        (a.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        subprocess.run([sys.executable, "-m", "cli", "--home", str(home), "stack", "down"], env=env, cwd=REPO,
                       capture_output=True, timeout=120)
        shutil.rmtree(work, ignore_errors=True)
    files = sorted(a.out.iterdir())
    assert len(files) <= MAX_FILES and all(f.is_file() and f.stat().st_size <= MAX_BYTES for f in files), files
    print(f"wrote {', '.join(f.name for f in files)} to {a.out} in {results['wall_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
