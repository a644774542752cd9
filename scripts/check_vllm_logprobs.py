"""Check that a vLLM server reports the behaviour logprobs rollstream trains with (needs a CUDA GPU).

``rollout.engine: vllm`` trusts the logprobs a ``vllm serve`` server returns to be
``log_softmax(logits / T)`` of the chosen token (tempered, untruncated: :mod:`rollout.sampling`),
the quantity the trainer recomputes. This script measures it on your model and prompts:

1. **Greedy** (``temperature: 0``): the server's tokens and logprobs next to rollstream's
   ``TorchEngine`` on the same model: the tokens up to the first divergence, max |Δ logprob| there.
2. **Teacher-forced, greedy and sampled** (``--temperature``, default 0.7): every token the server
   returned is scored by a forward pass of the model here (``log_softmax(logits / T)``); max
   |Δ logprob| against the server's. This catches a server in vLLM's default ``raw_logprobs`` mode
   (which ignores the temperature): start it with ``--logprobs-mode processed_logprobs``.

It prints one JSON line with the numbers and exits 1 when a max |Δ| exceeds ``--tolerance``
(default 0.02: vLLM in bfloat16 against torch in float32 differs by about 1e-2; ``--dtype
float32`` on both sides gives ~1e-4), else 0. On a machine with a GPU and vLLM in its own
environment::

    # let the script start vLLM (its own python environment) on a free port:
    python scripts/check_vllm_logprobs.py MODEL_DIR --start-vllm /path/to/vllm-env/bin/vllm --dtype float32
    # or check a server you started yourself:
    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL_DIR --port 8000 --logprobs-mode processed_logprobs &
    python scripts/check_vllm_logprobs.py MODEL_DIR --url http://127.0.0.1:8000

``--url`` may also name a ``rollstream serve`` server (how this script is checked on a CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["12+34=", "The capital of France is", "def fibonacci(n):", "Once upon a time", "7*8=",
           "Translate to French: good morning", "import numpy as np\n", "Q: What is 2+2?\nA:"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model_dir", type=Path, help="The model (Hugging Face directory) the server serves.")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="Base URL of a running server (vllm serve or rollstream serve).")
    where.add_argument("--start-vllm", metavar="VLLM", help="Start `VLLM serve MODEL_DIR` (the vllm executable "
                       "of its own environment) on a free port with --logprobs-mode processed_logprobs.")
    p.add_argument("--max-tokens", type=int, default=32, help="Tokens generated per prompt (default 32).")
    p.add_argument("--temperature", type=float, default=0.7, help="Temperature of the sampled check (default 0.7).")
    p.add_argument("--tolerance", type=float, default=0.02, help="Largest acceptable max |Δ logprob| (default 0.02).")
    p.add_argument("--device", default="auto", help="Torch device of the reference here (default: auto).")
    p.add_argument("--dtype", default="float32", help="dtype of the reference (and of --start-vllm), default float32.")
    p.add_argument("--chat-template", action="store_true", help="Render the prompts through the chat template.")
    p.add_argument("--start-timeout-s", type=float, default=900.0, help="How long --start-vllm may take to come up.")
    args = p.parse_args(argv)
    if args.max_tokens < 1 or args.temperature <= 0 or args.tolerance <= 0:
        p.error("--max-tokens >= 1, --temperature > 0 and --tolerance > 0")
    if not (args.model_dir / "config.json").is_file():
        p.error(f"{args.model_dir} is not a model directory (no config.json)")
    return args


def start_vllm(vllm: str, model_dir: Path, dtype: str, timeout_s: float) -> tuple[subprocess.Popen[bytes], str]:
    """``vllm serve`` in its own environment, as ``rollout.engine: vllm`` expects it; waits for /health."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [vllm, "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
           "--logprobs-mode", "processed_logprobs", "--enable-prefix-caching"]
    proc = subprocess.Popen(cmd, env=dict(os.environ, VLLM_SERVER_DEV_MODE="1"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"error: `{' '.join(cmd)}` exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(2)
    proc.terminate()
    raise SystemExit(f"error: vLLM did not come up within {timeout_s:g}s (--start-timeout-s)")


def teacher_forced(model: Any, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    """``log_softmax(logits / T)`` of ``tokens`` after ``prompt``, one forward pass."""
    import torch

    if not tokens:
        return []
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + tokens], device=device)  # (1, P + N)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature  # (N, V)
    lp = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(tokens, device=device)[:, None])  # (N, 1)
    return [float(x) for x in lp[:, 0].cpu()]


def max_gap(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


async def check(args: argparse.Namespace, url: str) -> dict[str, Any]:
    from rollout.engine import GenerationRequest, TorchEngine, generate_all
    from rollout.sampling import SamplingParams
    from rollout.server_engine import ServerEngine
    from schemas.config import resolve_dtype
    from schemas.devices import resolve_device

    device = resolve_device(args.device, "--device")
    chat = bool(args.chat_template)
    server = ServerEngine(args.model_dir, url, flavor="vllm", chat_template=chat)
    local = TorchEngine(args.model_dir, max_batch=len(PROMPTS), device=device,
                        dtype=resolve_dtype(args.dtype, device), chat_template=chat)
    greedy = SamplingParams(max_new_tokens=args.max_tokens, greedy=True)
    sampled = SamplingParams(max_new_tokens=args.max_tokens, temperature=args.temperature)
    try:
        prompts = [server.encode(p) for p in PROMPTS]
        remote = await generate_all(server, [GenerationRequest(f"g{i}", p, greedy) for i, p in enumerate(prompts)])
        mine = await generate_all(local, [GenerationRequest(f"g{i}", p, greedy) for i, p in enumerate(prompts)])
        hot = await generate_all(server, [GenerationRequest(f"s{i}", p, sampled) for i, p in enumerate(prompts)])
    finally:
        await server.close()
    errors = [c.error for c in remote + hot if c.error]
    if errors:
        raise SystemExit(f"error: the server failed: {errors[0]}")
    agree, compared, greedy_gap = 0, 0, 0.0
    for r, m in zip(remote, mine, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(r.token_ids, m.token_ids, strict=False)) if x != y),
                 min(len(r.token_ids), len(m.token_ids)))
        agree += n == len(r.token_ids) == len(m.token_ids)
        compared += n
        greedy_gap = max(greedy_gap, max_gap(r.logprobs[:n], m.logprobs[:n]))
    tf_greedy = max(max_gap(c.logprobs, teacher_forced(local.model, c.prompt_ids, c.token_ids, 1.0)) for c in remote)
    tf_sampled = max(max_gap(c.logprobs, teacher_forced(local.model, c.prompt_ids, c.token_ids, args.temperature))
                     for c in hot)
    return {"url": url, "prompts": len(PROMPTS), "greedy_identical": agree, "greedy_tokens_compared": compared,
            "greedy_max_abs_dlogprob": greedy_gap, "teacher_forced_greedy_max_abs_dlogprob": tf_greedy,
            "teacher_forced_sampled_max_abs_dlogprob": tf_sampled, "temperature": args.temperature,
            "tolerance": args.tolerance}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    proc = None
    url = args.url
    if args.start_vllm:
        proc, url = start_vllm(args.start_vllm, args.model_dir, args.dtype, args.start_timeout_s)
    try:
        report = asyncio.run(check(args, url.rstrip("/")))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    print(json.dumps(report))
    worst = max(report["greedy_max_abs_dlogprob"], report["teacher_forced_greedy_max_abs_dlogprob"],
                report["teacher_forced_sampled_max_abs_dlogprob"])
    verdict = "ok" if worst <= args.tolerance else "FAILED"
    print(f"{verdict}: max |Δ logprob| {worst:.3g} (tolerance {args.tolerance:g}); greedy tokens identical on "
          f"{report['greedy_identical']}/{report['prompts']} prompts", file=sys.stderr)
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
