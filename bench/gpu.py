"""The trainer strategies and the generation engine on one CUDA GPU: agreement, step time, memory.

    python bench/gpu.py [--models tiny,smollm2-shape,qwen2.5-0.5b-shape,qwen2.5-1.5b-shape]
                        [--dtypes float32,bfloat16] [--steps 4] [--batch 32] [--prompt-len 96]
                        [--response-len 64] [--response-len-max 0] [--strategies torch,fsdp2,megatron]
                        [--micro-sweep M,M,..] [--peak-tflops 989] [--bandwidth-gbs 3350] [--device cuda:0]
                        [--no-trainers] [--no-engine] [--no-serve] [--features] [--profile DIR]
                        [--prompts 128] [--max-new-tokens 64] [--max-batch 64] [--repeats 2]
                        [--sharing] [--out results.jsonl]

Run it on a GPU machine before training there (the project's CI has no GPU); ``--device cpu``
makes a smoke run. For each model (``tiny``: the main example's; ``smollm2-shape``: SmolLM2-135M's
architecture with random weights) and dtype:

* **Trainers**: ``train.strategy`` ``torch``, ``fsdp2`` and ``megatron`` (needs ``megatron-core``;
  else its rows carry the one-line error) each train ``--steps`` steps on the same fixed batch in
  a process of its own: median step time, peak GPU memory and, against ``torch``, the largest
  difference of step 1's metrics and of the final weights (``PASS`` within 1e-4 in float32).
  ``--features`` adds the KL loss, a GAE critic, LoRA and a checkpoint resume on the tiny model.
* **Engine**: ``TorchEngine`` with the slot decoder (CUDA graphs, and eager) and with transformers'
  forward, against ``model.generate()``: tokens/s and the largest logprob difference from a
  teacher-forced forward pass. ``--profile DIR`` writes a ``torch.profiler`` table of one pass.
* **Server**: ``rollstream serve`` with the rollout client, greedy, against the in-process engine.
* **Issue 41**: each trainer row's tokens/s, MFU (``6 · N · tokens / s`` over ``--peak-tflops``)
  and peak GiB; ``--micro-sweep`` the ``torch`` strategy at growing micro-batches, padded and packed
  (``train.micro_batch_tokens``), up to the largest that fits; each engine row's fraction of the
  bandwidth bound (``--bandwidth-gbs`` / weight bytes × slots).
* **Sharing** (``--sharing``, issue 36): the engine's device memory while idle as it is, after
  ``release(kv)`` and after ``release(kv_and_weights)`` (``rollout.release_between_steps``), the
  seconds of each release and of the pass that takes the memory back, against a pass without.

Prints one JSON line per row (versions first); ``--out`` also appends each row to a file as it is
measured. bench/README.md ("gpu.py") says what each row measures and keeps the measured runs.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/engine.py

import torch

STRATEGIES = ("torch", "fsdp2", "megatron")
TOL_FP32 = 1e-4
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048, rope_theta=100000.0,
                     rms_norm_eps=1e-5, tie_word_embeddings=True)
QWEN_SHAPES = {  # Qwen2.5-0.5B / -1.5B's architectures (Qwen2: biased q/k/v projections, tied embeddings)
    "qwen2.5-0.5b-shape": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                               num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096,
                               rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen2.5-1.5b-shape": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                               num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096,
                               rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
}


OUT: list[Path] = []
"""Where :func:`emit` appends its rows (``--out``), if anywhere."""


def emit(row: dict[str, Any]) -> None:
    """Print one result row, and append it to ``--out`` at once (a run cut short by a time limit
    keeps every row measured before it)."""
    line = json.dumps(row)
    print(line, flush=True)
    for path in OUT:
        with path.open("a") as f:
            f.write(line + "\n")


def make_models(root: Path, names: list[str]) -> dict[str, Path]:
    """Create the benchmark's model directories under ``root``."""
    import shutil

    from transformers import AutoModelForCausalLM, LlamaConfig

    from rollout.model_init import init_tiny_model
    from schemas.config import TinyModelSpec

    spec = TinyModelSpec(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=384,
                         max_position_embeddings=256)  # examples/main.yaml's shape, longer positions
    tiny = init_tiny_model(root / "tiny", spec)
    out = {"tiny": tiny}
    if "smollm2-shape" in names:
        d = root / "smollm2-shape"
        shutil.copytree(tiny, d, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
        cfg = LlamaConfig(**SMOLLM2_SHAPE, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # type: ignore[arg-type]
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
        out["smollm2-shape"] = d
    for name, shape in QWEN_SHAPES.items():
        if name in names:
            from transformers import Qwen2Config

            d = root / name
            shutil.copytree(tiny, d, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
            qcfg = Qwen2Config(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # type: ignore[arg-type]
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(qcfg, dtype=torch.bfloat16).save_pretrained(d)
            out[name] = d
    return {k: v for k, v in out.items() if k in names}


def batch(n: int, prompt_len: int, response_len: int, vocab: int, response_len_max: int = 0) -> list[Any]:
    """A fixed training batch: ``n`` samples in groups of 8, random tokens, rewards ±1; responses of
    ``response_len`` tokens, or uniform in ``response_len..response_len_max`` when that is larger."""
    from trainer.batch import TrainSample

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        p = [1, *torch.randint(4, vocab, (prompt_len - 1,), generator=g).tolist()]
        n_r = int(torch.randint(response_len, response_len_max + 1, (1,), generator=g)) \
            if response_len_max > response_len else response_len
        r = torch.randint(4, vocab, (n_r,), generator=g).tolist()
        lp = (-3 * torch.rand(n_r, generator=g)).tolist()
        out.append(TrainSample(p, r, lp, [1] * n_r, float(i % 3 == 0), f"s{i}", group_id=f"g{i // 8}"))
    return out


# --------------------------------------------------------------------------- one strategy (a child process)


def one_strategy(a: argparse.Namespace) -> dict[str, Any]:
    from schemas.config import parse_config
    from trainer.factory import make_strategy
    from weights import read_weights

    sets = [f"train.strategy={a.one}", f"model.dtype={a.dtype}", "train.lr=1e-5",
            "algorithm.entropy_loss_coef=0.01", f"rollout.max_new_tokens={max(a.response_len, a.response_len_max)}",
            "train.dist_timeout_s=300",  # the model is --model-dir's; model.init only has to admit the lengths
            f"model.init.max_position_embeddings={max(256, a.prompt_len + max(a.response_len, a.response_len_max) + 1)}"]
    if a.one != "torch":
        sets += ["train.ranks=1"] + (["train.tensor_parallel=1"] if a.one == "megatron" else [])
    sets += json.loads(a.sets or "[]")
    if not any(x.startswith(("train.micro_batch_size=", "train.micro_batch_tokens=")) for x in sets):
        sets.append("train.micro_batch_size=16")
    cfg = parse_config("", sets)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    def build() -> Any:
        """The strategy, with the reference model and the critic its algorithm needs."""
        new = make_strategy(cfg, a.model_dir, device=a.device)
        if cfg.algorithm.use_kl_loss:
            new.init_reference()
        if cfg.algorithm.adv_estimator == "gae":
            new.init_critic()
        return new

    s = build()
    model_mib = torch.cuda.memory_allocated(dev) / 2**20 if cuda else 0.0
    vocab = json.loads((Path(a.model_dir) / "config.json").read_text())["vocab_size"]
    data = batch(a.batch, a.prompt_len, a.response_len, vocab, a.response_len_max)
    n_params = sum(p.numel() for p in s.model.parameters()) if hasattr(s, "model") else 0
    metrics, times = [], []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        metrics.append(s.train_step(data))
        if cuda:
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    peak_mib = torch.cuda.max_memory_allocated(dev) / 2**20 if cuda else 0.0
    resumed: dict[str, float] = {}
    if a.checkpoint:  # save, one more step; a new strategy resumes from the checkpoint and repeats it
        ckpt = s.save_checkpoint(Path(a.export) / "ckpt")
        again = s.train_step(data)
        getattr(s, "close", lambda: None)()
        s = build()
        s.load_checkpoint(ckpt)
        repeat = s.train_step(data)
        resumed = {"resume_diff": max_metric_diff(repeat, again)[0]}
    path, sha = s.export_weights(Path(a.export))
    close = getattr(s, "close", None)
    if close:
        close()
    weights = {k: v.float() for k, v in read_weights(path).items()}
    torch.save(weights, Path(a.export) / "weights.pt")
    return {"metrics": metrics, "times_s": times, "model_mib": model_mib, "peak_mib": peak_mib, "sha": sha,
            "params": n_params, "tokens": sum(len(x.prompt_ids) + len(x.response_ids) for x in data)} | resumed


def run_child(a: argparse.Namespace, model: str, model_dir: Path, dtype: str, strategy: str,
              work: Path, sets: list[str] | None = None, checkpoint: bool = False, tag: str = "") -> dict[str, Any]:
    """Run :func:`one_strategy` in a subprocess; its result (or its error)."""
    export = work / f"{model}-{dtype}-{strategy}{tag}"
    export.mkdir(parents=True, exist_ok=True)
    out = export / "result.json"
    cmd = [sys.executable, __file__, "--one", strategy, "--model-dir", str(model_dir), "--dtype", dtype,
           "--export", str(export), "--result", str(out), "--device", a.device, "--steps", str(a.steps),
           "--batch", str(a.batch), "--prompt-len", str(a.prompt_len), "--response-len", str(a.response_len),
           "--response-len-max", str(a.response_len_max), "--sets", json.dumps(sets or [])] + (["--checkpoint"] if checkpoint else [])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.child_timeout_s)
    took = time.perf_counter() - t0
    if proc.returncode != 0 or not out.exists():
        lines = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()]
        return {"error": lines[-1] if lines else f"exit code {proc.returncode}", "log": proc.stderr[-4000:],
                "wall_s": took}
    res: dict[str, Any] = json.loads(out.read_text())
    res["wall_s"] = took
    res["weights"] = str(export / "weights.pt")
    return res


def max_metric_diff(got: dict[str, float], want: dict[str, float]) -> tuple[float, str]:
    keys = [k for k in want if k in got and "time" not in k and not k.startswith("perf/")]
    worst = max(keys, key=lambda k: abs(got[k] - want[k]))
    return abs(got[worst] - want[worst]), worst


def max_weight_diff(got_file: str, want_file: str) -> float:
    got, want = torch.load(got_file), torch.load(want_file)
    assert sorted(got) == sorted(want), "exported tensor names differ"
    return max((got[k] - want[k]).abs().max().item() for k in want)


def trainers(a: argparse.Namespace, models: dict[str, Path], work: Path) -> list[dict[str, Any]]:
    rows = []
    for model, model_dir in models.items():
        for dtype in a.dtypes.split(","):
            results = {s: run_child(a, model, model_dir, dtype, s, work) for s in a.strategies.split(",")}
            ref = results.get("torch", {"error": "not run"})
            for s, r in results.items():
                row: dict[str, Any] = {"model": model, "dtype": dtype, "strategy": s, "wall_s": round(r["wall_s"], 1)}
                if "error" in r:
                    row["error"] = r["error"]
                    print(f"--- {model} {dtype} {s} failed:\n{r['log']}", file=sys.stderr)
                else:
                    row |= {"step_s": statistics.median(r["times_s"][1:] or r["times_s"]),
                            "first_step_s": r["times_s"][0], "model_mib": r["model_mib"], "peak_mib": r["peak_mib"],
                            "loss_step1": r["metrics"][0].get("loss/policy"),
                            "grad_norm_step1": r["metrics"][0].get("actor/grad_norm")} | throughput(a, r)
                    if s != "torch" and "error" not in ref:
                        d, key = max_metric_diff(r["metrics"][0], ref["metrics"][0])
                        w = max_weight_diff(r["weights"], ref["weights"])
                        row |= {"metric_diff": d, "metric_diff_key": key, "weight_diff": w}
                        if dtype == "float32":
                            row["agree"] = "PASS" if max(d, w) <= TOL_FP32 else "FAIL"
                rows.append(row)
                emit(row)
    return rows


def throughput(a: argparse.Namespace, r: dict[str, Any]) -> dict[str, Any]:
    """Trained tokens/s and MFU of a trainer result: ``6 · N · tokens / step_s`` over the device's
    peak (``--peak-tflops``: dense bf16; for float32 rows it is the bf16 peak too, as the issue's table)."""
    step_s = statistics.median(r["times_s"][1:] or r["times_s"])
    flops = 6 * r["params"] * r["tokens"] / step_s
    return {"tokens": r["tokens"], "params": r["params"], "tokens_per_s": r["tokens"] / step_s,
            "mfu": flops / (a.peak_tflops * 1e12), "peak_gib": r["peak_mib"] / 1024}


MICRO_VARIANTS = {
    "padded": lambda m, mean_len: [f"train.micro_batch_size={m}"],
    "packed": lambda m, mean_len: [f"train.micro_batch_tokens={round(m * mean_len)}"],
}
"""``--micro-sweep``: a micro-batch of ``m`` samples, padded, or packed (by tokens: ``m`` mean samples)."""


def micro_sweep(a: argparse.Namespace, models: dict[str, Path], work: Path) -> list[dict[str, Any]]:
    """``train.strategy: torch`` at each micro-batch of ``--micro-sweep`` (samples), padded and packed:
    s/step, MFU and peak memory, until one does not fit (out of memory: the row carries the error);
    then a row per model, dtype and variant with the largest micro-batch that fitted."""
    rows = []
    mean_len = a.prompt_len + (a.response_len + max(a.response_len, a.response_len_max)) / 2
    for model, model_dir in models.items():
        for dtype in a.dtypes.split(","):
            for variant, sets in MICRO_VARIANTS.items():
                fits = 0
                for m in (int(x) for x in a.micro_sweep.split(",")):
                    r = run_child(a, model, model_dir, dtype, "torch", work, sets(m, mean_len), tag=f"-{variant}{m}")
                    row: dict[str, Any] = {"sweep": variant, "model": model, "dtype": dtype, "micro_batch": m}
                    if "error" in r:
                        rows.append(row | {"error": r["error"]})
                        emit(rows[-1])
                        break
                    fits = m
                    row |= {"step_s": statistics.median(r["times_s"][1:] or r["times_s"])} | throughput(a, r)
                    rows.append(row)
                    emit(row)
                rows.append({"sweep": variant, "model": model, "dtype": dtype, "largest_micro_batch_that_fits": fits,
                             "of": a.micro_sweep})
                emit(rows[-1])
    return rows


FEATURES: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "checkpoint": ([], STRATEGIES),
    "kl_loss": (["algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.1", "algorithm.old_logprobs=recompute"],
                STRATEGIES),
    "gae_critic": (["algorithm.adv_estimator=gae", "algorithm.critic=separate"], ("torch", "fsdp2")),
    "lora": (["train.lora_rank=8", "train.lr=1e-3"], ("torch",)),
}
"""``--features``: config sets and the strategies that support them (megatron refuses a critic and
LoRA, fsdp2 LoRA). Every row also saves a checkpoint, steps, resumes a new strategy from it and
repeats that step."""


def features(a: argparse.Namespace, models: dict[str, Path], work: Path) -> list[dict[str, Any]]:
    """Each feature on the first model, fp32, 2 steps: it runs on the device, ``fsdp2`` / ``megatron``
    agree with ``torch``, and a resumed strategy repeats the step after the checkpoint."""
    model, model_dir = next(iter(models.items()))
    rows = []
    for name, (sets, strategies) in FEATURES.items():
        results = {s: run_child(a, model, model_dir, "float32", s, work, sets, True, f"-{name}") for s in strategies}
        ref = results["torch"]
        for strat, r in results.items():
            row: dict[str, Any] = {"feature": name, "model": model, "strategy": strat}
            if "error" in r:
                row["error"] = r["error"]
                print(f"--- {name} {strat} failed:\n{r['log']}", file=sys.stderr)
            else:
                row["resume_diff"] = r["resume_diff"]
                if strat != "torch" and "error" not in ref:
                    row["metric_diff"], row["metric_diff_key"] = max_metric_diff(r["metrics"][0], ref["metrics"][0])
                    row["weight_diff"] = max_weight_diff(r["weights"], ref["weights"])
                worst = max(row["resume_diff"], row.get("metric_diff", 0.0), row.get("weight_diff", 0.0))
                row["agree"] = "PASS" if worst <= TOL_FP32 else "FAIL"
            rows.append(row)
            emit(row)
    return rows


# --------------------------------------------------------------------------- the engine


def token_range(model_dir: Path) -> int:
    """Prompt token ids are drawn below this: ids the model and its tokenizer both know."""
    from rollout.model_init import load_tokenizer

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return min(int(vocab), len(load_tokenizer(model_dir)))


def profile_pass(a: argparse.Namespace, eng: Any, reqs: list[Any], tag: str) -> None:
    """One more engine pass under ``torch.profiler``: the ops that take the most host time, and how
    much of the pass the device was busy (a GPU engine whose device is mostly idle is host-bound)."""
    from torch.profiler import ProfilerActivity, profile

    from rollout.engine import generate_all

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device.startswith("cuda") else [])
    t0 = time.perf_counter()
    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)  # the engine steps in its own thread
    with profile(activities=acts, experimental_config=every_thread) as prof:
        asyncio.run(generate_all(eng, reqs))
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    device_s = sum(getattr(e, "self_device_time_total", 0.0) for e in events) / 1e6
    table = events.table(sort_by="self_cpu_time_total", row_limit=25)
    out = Path(a.profile) / f"engine-profile-{tag}.txt"
    out.write_text(f"{tag}: pass {wall:.3f} s under the profiler, device busy {device_s:.3f} s\n{table}\n")
    print(f"{tag}: profiled pass {wall:.3f} s, device busy {device_s:.3f} s ({out})", flush=True)


def engine_rows(a: argparse.Namespace, models: dict[str, Path]) -> list[dict[str, Any]]:
    from engine import hf_generate  # bench/engine.py: model.generate() in left-padded chunks

    from rollout.engine import GenerationRequest, TorchEngine, generate_all
    from rollout.sampling import SamplingParams

    def sync() -> None:
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()

    rows = []
    for model, model_dir in models.items():
        vocab = token_range(model_dir)
        g = torch.Generator().manual_seed(1)
        prompts = [[1, *torch.randint(4, vocab, (int(torch.randint(16, 48, (1,), generator=g)),), generator=g).tolist()] for _ in range(a.prompts)]
        for dtype in a.dtypes.split(","):
            engines = {kind: TorchEngine(model_dir, max_batch=a.max_batch, device=a.device, dtype=dtype,
                                         chat_template=False, decoder="hf" if kind == "hf" else "slots",
                                         cuda_graphs=kind == "slots") for kind in ("slots", "eager", "hf")}
            params = SamplingParams(max_new_tokens=a.max_new_tokens)
            reqs = [GenerationRequest(str(i), p, params) for i, p in enumerate(prompts)]
            model_obj = engines["slots"].model
            # model.generate() on the same model and prompts (sampled; each row's tokens up to and
            # including its first EOS; pad id 0)
            hf_args = (model_obj, prompts, a.max_batch, a.max_new_tokens, False, 0, engines["slots"].eos_ids)

            def timed(kind: str, engines: dict[str, Any] = engines, reqs: list[Any] = reqs,
                      hf_args: tuple[Any, ...] = hf_args, label: str = f"{a.device} ({dtype})") -> tuple[int, float, list[Any]]:
                sync()
                t0 = time.perf_counter()
                if kind == "generate":
                    out = hf_generate(*hf_args)
                    sync()
                    return sum(len(r) for r in out), time.perf_counter() - t0, []
                done = asyncio.run(generate_all(engines[kind], reqs))
                sync()
                took = time.perf_counter() - t0
                errors = [c.error for c in done if c.error]
                if errors:
                    raise RuntimeError(f"engine/{kind} on {label}: {len(errors)} completions failed: {errors[0]}")
                return sum(len(c.token_ids) for c in done), took, done

            kinds = ["slots", "eager", "hf", "generate"]
            for kind in kinds:
                timed(kind)  # warm-up: the whole timed workload once (kernels, allocator)
            tok_s: dict[str, list[float]] = {k: [] for k in kinds}
            last: dict[str, list[Any]] = {}
            for rep in range(a.repeats):  # the order rotates
                for kind in kinds[rep % len(kinds):] + kinds[: rep % len(kinds)]:
                    n, sec, done = timed(kind)
                    tok_s[kind].append(n / sec)
                    last[kind] = done
            if a.profile:
                profile_pass(a, engines["slots"], reqs, f"{model}-{dtype}")
            # the same tokens teacher-forced through the same model: the trainer's recomputed logprobs
            worst = {}
            for kind in ("slots", "eager", "hf"):
                worst[kind] = 0.0
                with torch.inference_mode():
                    for c, p in zip(last[kind][:32], prompts[:32], strict=True):
                        ids = torch.tensor([p + list(c.token_ids)], device=a.device)
                        logits = model_obj(input_ids=ids).logits[0, len(p) - 1 : -1].float()  # (T, V)
                        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(p):, None])[:, 0]
                        worst[kind] = max(worst[kind], (lp.cpu() - torch.tensor(c.logprobs)).abs().max().item())
            med = {k: statistics.median(v) for k, v in tok_s.items()}
            graphed = engines["slots"]._slots.decoder
            weight_bytes = sum(p.numel() * p.element_size() for p in model_obj.parameters())
            bound = a.bandwidth_gbs * 1e9 / weight_bytes * min(a.max_batch, len(prompts))  # tok/s reading the weights once per step
            row = {"model": model, "dtype": dtype, "engine_tok_s": med["slots"], "engine_eager_tok_s": med["eager"],
                   "engine_hf_tok_s": med["hf"], "generate_tok_s": med["generate"],
                   "engine_over_generate": med["slots"] / med["generate"],
                   "engine_eager_over_generate": med["eager"] / med["generate"],
                   "engine_hf_over_generate": med["hf"] / med["generate"], "logprob_max_diff": worst["slots"],
                   "weight_bytes": weight_bytes, "bandwidth_bound_tok_s": bound,
                   "engine_fraction_of_bound": med["slots"] / bound,
                   "logprob_max_diff_eager": worst["eager"], "logprob_max_diff_hf": worst["hf"],
                   "cuda_graphs": bool(getattr(graphed, "cuda_graphs", False)),
                   "graph_captures": int(getattr(graphed, "graph_captures", 0)),
                   "passes_tok_s": tok_s, "prompts": len(prompts),
                   "max_new_tokens": a.max_new_tokens, "max_batch": a.max_batch}
            rows.append(row)
            emit(row)
            engines.clear()
            del model_obj
            if a.device.startswith("cuda"):
                torch.cuda.empty_cache()
    return rows


def sharing_rows(a: argparse.Namespace, models: dict[str, Path]) -> list[dict[str, Any]]:
    """``rollout.release_between_steps`` on the device: what an idle engine holds, resident and after
    each release, and what taking it back costs (module doc, "Sharing")."""
    from rollout.engine import GenerationRequest, TorchEngine, generate_all
    from rollout.sampling import SamplingParams

    cuda = a.device.startswith("cuda")

    def held_gib() -> float | None:  # what this process holds on the device now
        if not cuda:
            return None
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated(a.device) / 2**30

    rows = []
    for model, model_dir in models.items():
        vocab = token_range(model_dir)
        g = torch.Generator().manual_seed(2)
        prompts = [[1, *torch.randint(4, vocab, (32,), generator=g).tolist()] for _ in range(a.prompts)]
        reqs = [GenerationRequest(str(i), p, SamplingParams(max_new_tokens=a.max_new_tokens)) for i, p in enumerate(prompts)]
        for dtype in a.dtypes.split(","):
            eng = TorchEngine(model_dir, max_batch=a.max_batch, device=a.device, dtype=dtype, chat_template=False)

            def timed_pass(eng: Any = eng, reqs: list[Any] = reqs, model: str = model) -> float:
                t0 = time.perf_counter()
                done = asyncio.run(generate_all(eng, reqs))
                if cuda:
                    torch.cuda.synchronize()
                if any(c.error for c in done):
                    raise RuntimeError(f"sharing/{model}: {next(c.error for c in done if c.error)}")
                return time.perf_counter() - t0

            timed_pass()  # warm-up: kernels, graphs, the KV cache at its working size
            row: dict[str, Any] = {"model": model, "dtype": dtype, "section": "sharing", "resident_gib": held_gib(),
                                   "pass_s": timed_pass()}
            for mode in ("kv", "kv_and_weights"):
                t0 = time.perf_counter()
                asyncio.run(eng.release(weights=mode == "kv_and_weights"))
                row[f"release_{mode}_s"] = time.perf_counter() - t0
                row[f"after_{mode}_gib"] = held_gib()
                row[f"pass_after_{mode}_s"] = timed_pass()  # takes everything back first
            row["peak_gib"] = torch.cuda.max_memory_allocated(a.device) / 2**30 if cuda else None
            rows.append(row)
            emit(row)
            del eng
            if cuda:
                torch.cuda.empty_cache()
    return rows


async def serve_row(a: argparse.Namespace, model: str, model_dir: Path, dtype: str) -> dict[str, Any]:
    """``rollstream serve`` (in this process) on the device, and the rollout client against it: greedy
    completions must equal the in-process engine's, token for token."""
    from rollout.engine import GenerationRequest, TorchEngine, generate_all
    from rollout.sampling import SamplingParams
    from rollout.serve import ServeSettings
    from rollout.serve import run as serve
    from rollout.server_engine import ServerEngine

    stop, ready = asyncio.Event(), asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(ServeSettings(model_dir=str(model_dir), port=0, device=a.device, dtype=dtype,
                                                   max_batch=16), stop, ready))
    url = await ready
    client = ServerEngine(model_dir, url, policy_version=0, chat_template=False)
    local = TorchEngine(model_dir, max_batch=16, device=a.device, dtype=dtype, chat_template=False)
    vocab = token_range(model_dir)
    g = torch.Generator().manual_seed(2)
    prompts = [[1, *torch.randint(4, vocab, (12,), generator=g).tolist()] for _ in range(16)]
    params = SamplingParams(max_new_tokens=16, greedy=True)
    try:
        got = await generate_all(client, [GenerationRequest(str(i), p, params) for i, p in enumerate(prompts)])
        want = await generate_all(local, [GenerationRequest(str(i), p, params) for i, p in enumerate(prompts)])
    finally:
        await client.close()
        stop.set()
        await task
    errors = [c.error for c in got + want if c.error]
    if errors:
        raise RuntimeError(f"serve on {a.device} ({dtype}): {len(errors)} completions failed: {errors[0]}")
    same = sum(x.token_ids == y.token_ids for x, y in zip(got, want, strict=True))
    lp = max(abs(u - v) for x, y in zip(got, want, strict=True) for u, v in zip(x.logprobs, y.logprobs, strict=False))
    row = {"model": model, "dtype": dtype, "serve_same_greedy": f"{same}/{len(prompts)}", "serve_logprob_max_diff": lp}
    emit(row)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,smollm2-shape")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--no-engine", action="store_true")
    ap.add_argument("--no-trainers", action="store_true")
    ap.add_argument("--no-serve", action="store_true")
    ap.add_argument("--profile", default="", metavar="DIR",
                    help="engine: profile one more pass per row with torch.profiler, tables into DIR")
    ap.add_argument("--features", action="store_true",
                    help="also: KL reference, GAE critic, LoRA and checkpoint resume per strategy (first model, fp32)")
    ap.add_argument("--prompts", type=int, default=128, help="engine: prompts per model")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="engine: tokens per completion")
    ap.add_argument("--max-batch", type=int, default=64, help="engine: slots = generate() chunk")
    ap.add_argument("--repeats", type=int, default=2, help="engine: timed passes per implementation (median)")
    ap.add_argument("--child-timeout-s", type=float, default=300.0)
    ap.add_argument("--response-len-max", type=int, default=0,
                    help="trainers: responses uniform in --response-len..this (0: all --response-len)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="trainers: which strategies")
    ap.add_argument("--micro-sweep", default="", metavar="M,M,...",
                    help="torch strategy: these micro-batch sizes (samples), padded and packed, until one does not fit")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="MFU's denominator (H100 SXM dense bf16: 989)")
    ap.add_argument("--bandwidth-gbs", type=float, default=3350.0,
                    help="engine: the memory bandwidth of the bound (H100 SXM HBM3: 3350 GB/s)")
    ap.add_argument("--sharing", action="store_true",
                    help="rollout.release_between_steps: the idle engine's memory, resident and released (issue 36)")
    ap.add_argument("--out", default="", help="also append every row to this file as it is measured (JSON lines)")
    # the child side
    ap.add_argument("--one", choices=STRATEGIES, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--export", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--sets", help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.out and not a.one:
        OUT.append(Path(a.out))
    if a.one:
        Path(a.result).write_text(json.dumps(one_strategy(a)))
        return
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("error: --device is CUDA but torch sees no GPU (use --device cpu for a smoke run)")
    info = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
            "transformer_engine": importlib.util.find_spec("transformer_engine") is not None}
    emit(info)
    names = a.models.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        models = make_models(Path(tmp), names)
        if not a.no_trainers:
            trainers(a, models, Path(tmp))
        if a.micro_sweep:
            micro_sweep(a, models, Path(tmp))
        if a.features:
            features(a, models, Path(tmp))
        if not a.no_engine:
            engine_rows(a, models)
        if a.sharing:
            sharing_rows(a, models)
        if not a.no_serve:
            for m, d in models.items():
                for dt in a.dtypes.split(","):
                    asyncio.run(serve_row(a, m, d, dt))


if __name__ == "__main__":
    main()
