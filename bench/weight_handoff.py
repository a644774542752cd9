"""The weight handoff: from a version's export to an engine generating with it, disk against memory
(same node) and against a broadcast (another node).

    python bench/weight_handoff.py [--models tiny,smollm2-shape,qwen2.5-0.5b-shape] [--reps 3]
                            [--device cpu|cuda] [--dtype auto|float32|bfloat16] [--out results.jsonl]

For each model (``tiny``: the main example's shape; ``smollm2-shape`` and ``qwen2.5-0.5b-shape``:
SmolLM2-135M's and Qwen2.5-0.5B's architectures with random weights) a ``TorchStrategy`` holds the
trainer's model and a ``TorchEngine`` the rollout's, both on ``--device``. Each repetition changes
every trainer weight in place (a stand-in for an optimizer step; not timed), then times what the
services do, side by side, the two handoffs alternating:

* ``export_s``: the trainer's :class:`services.trainer.publish.WeightsPublisher` from the new
  state to the announcing event (``disk``: the strategy writes and hashes the HF directory;
  ``memory``: the tensors go into a sealed ``/dev/shm`` segment);
* ``load_s``: the rollout worker's choice of copy (:func:`weights.pick_copy`, the directory
  waited for) and the engine's in-place swap (``TorchEngine.load_weights``); ``broadcast``: the
  segment received as an engine on another node receives it (``train.weights_broadcast: gloo``,
  :class:`weights.broadcast.Relay`; here over the loopback, into a folder standing for that
  node's ``/dev/shm``), then swapped in;
* ``first_token_s``: one request of 1 new token on the new weights;
* ``total_s``: the three, export to generating; ``dir_s`` (memory): the directory written after
  the event, off the critical path (it competes for the same cores on a CPU).

Prints one JSON line per model and handoff (medians over ``--reps``) and the ratios disk ÷ memory
and disk ÷ broadcast of ``total_s``. bench/README.md ("weight_handoff.py") keeps the measured runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import transformers

HANDOFFS = ("disk", "memory", "broadcast")
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-shape": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048,
                          rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "qwen2.5-0.5b-shape": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                               num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                               max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                               tie_word_embeddings=True),
}


def make_model(root: Path, name: str) -> Path:
    """The model directory of ``name`` (random weights; the tiny model's tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollout.model_init import init_tiny_model
    from schemas.config import TinyModelSpec

    tiny = init_tiny_model(root / "tiny", TinyModelSpec(hidden_size=128, num_layers=4, num_heads=4,
                                                        intermediate_size=384, max_position_embeddings=256))
    if name == "tiny":
        return tiny
    d = root / name
    shutil.copytree(tiny, d, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    shape = dict(SHAPES[name])
    cfg = AutoConfig.for_model(shape.pop("model_type"), **shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return d


async def one(handoff: str, pub: Any, strategy: Any, engine: Any, version: int, relay: Any) -> dict[str, float]:
    """One version handed over: the timings of the module doc."""
    from rollout.engine import GenerationRequest
    from rollout.sampling import SamplingParams
    from weights import pick_copy, wait_for_dir

    t0 = time.perf_counter()
    event = await pub.publish(strategy, version, version)
    t1 = time.perf_counter()
    if handoff == "broadcast":  # as on another node: received into that node's shared memory
        ref = str(relay.fetch(event.broadcast, version, event.memory, event.memory_checksum))
    else:
        ref, _ = pick_copy(event.uri, event.memory, event.memory_host, event.memory_checksum)
    if ref == event.uri:
        wait_for_dir(ref, 600.0)
    await engine.load_weights(ref, version)
    t2 = time.perf_counter()
    req = GenerationRequest(f"v{version}", [1, 5, 6, 7, 8], SamplingParams(max_new_tokens=1, greedy=True))
    async for c in engine.generate([req]):
        assert c.policy_version == version and not c.error, c
    t3 = time.perf_counter()
    await pub.settle()
    row = {"export_s": t1 - t0, "load_s": t2 - t1, "first_token_s": t3 - t2, "total_s": t3 - t0}
    if handoff != "disk":
        row["dir_s"] = time.perf_counter() - t3
    return row


async def bench_model(a: argparse.Namespace, name: str, work: Path) -> list[dict[str, Any]]:
    from rollout.engine import TorchEngine
    from schemas.config import parse_config
    from schemas.devices import resolve_device
    from services.trainer.publish import WeightsPublisher
    from trainer.factory import make_strategy
    from weights.broadcast import Relay, WeightSender

    device = resolve_device(a.device, "--device")
    dtype = a.dtype if a.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    model_dir = make_model(work / "models", name)
    cfg = parse_config("", [f"model.dtype={dtype}"])
    strategy = make_strategy(cfg, model_dir, device=device)
    engine = TorchEngine(model_dir, max_batch=2, device=device, dtype=dtype)
    pubs = {h: WeightsPublisher(f"bench-{h}", work / "runs" / f"{name}-{h}", "disk" if h == "disk" else "memory",
                                sender=WeightSender("127.0.0.1") if h == "broadcast" else None)
            for h in HANDOFFS}
    (work / "other-node").mkdir()
    relay = Relay(work / "other-node")
    params = [p for p in strategy.model.parameters()]
    n_bytes = sum(p.numel() * p.element_size() for p in params)
    times: dict[str, list[dict[str, float]]] = {h: [] for h in HANDOFFS}
    version = 0
    try:
        for h, pub in pubs.items():  # each publisher's first version also writes its directory: not timed
            await one(h, pub, strategy, engine, version, relay)
        for _ in range(a.reps):
            for h, pub in pubs.items():
                version += 1
                with torch.no_grad():
                    for p in params:
                        p.add_(1e-3)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                times[h].append(await one(h, pub, strategy, engine, version, relay))
    finally:
        for pub in pubs.values():
            pub.close()
    rows = []
    for h, reps in times.items():
        row: dict[str, Any] = {"model": name, "handoff": h, "device": device, "dtype": dtype,
                               "weights_mb": round(n_bytes / 2**20, 1), "reps": len(reps)}
        row.update({k: round(statistics.median(r[k] for r in reps), 4) for k in reps[0]})
        rows.append(row)
    rows.append({"model": name, "disk_over_memory": round(rows[0]["total_s"] / rows[1]["total_s"], 2),
                 "disk_over_broadcast": round(rows[0]["total_s"] / rows[2]["total_s"], 2)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,smollm2-shape,qwen2.5-0.5b-shape")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    transformers.utils.logging.disable_progress_bar()
    names = [m for m in a.models.split(",") if m]
    unknown = [m for m in names if m != "tiny" and m not in SHAPES]
    if unknown:
        raise SystemExit(f"error: unknown --models {unknown}; known: tiny, {', '.join(SHAPES)}")
    print(json.dumps({"torch": torch.__version__, "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available()
                      else None, "threads": torch.get_num_threads()}), flush=True)
    for name in names:
        with tempfile.TemporaryDirectory(prefix="rs-bench-weights-") as tmp:
            for row in asyncio.run(bench_model(a, name, Path(tmp))):
                print(json.dumps(row), flush=True)
                if a.out:
                    with a.out.open("a") as f:
                        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
