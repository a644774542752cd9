"""``rollstream serve MODEL_DIR``: a checkpoint behind an OpenAI-style completions API
(:mod:`rollout.serve`; the server behind ``rollout.engine: server``)."""

from __future__ import annotations

from pathlib import Path

import typer

from cli.app import app, friendly, quiet_transformers


@app.command("serve")
@friendly
def serve(
    model_dir: Path = typer.Argument(..., help="Model directory (Hugging Face format: config.json, safetensors, "
                                     "tokenizer)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0 = every interface)."),
    port: int = typer.Option(8000, "--port", help="TCP port; 0 = a free port (printed)."),
    device: str = typer.Option("auto", "--device", help="Torch device: auto, cpu, cuda, cuda:N."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (bfloat16 on CUDA, float32 on CPU), float32, "
                              "bfloat16, float16."),
    max_batch: int = typer.Option(64, "--max-batch", help="Sequences decoded together (continuous batching)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the sampling generator."),
    served_model_name: str = typer.Option("", "--served-model-name", help="Model name in the API "
                                          "(default: the directory's name)."),
    cuda_graphs: bool = typer.Option(True, "--cuda-graphs/--no-cuda-graphs", help="On a CUDA device: replay "
                                     "each decode step as a CUDA graph (Llama-family models; no effect on the CPU)."),
) -> None:
    """Serve MODEL_DIR over HTTP: POST /v1/completions (token-id prompts, logprobs, vLLM's dialect),
    POST /v1/load_weights {"path", "version"} (hot-swap weights), GET /v1/models, GET /health.
    The rollout engine of `rollout.engine: server`. Stops on SIGTERM / Ctrl-C."""
    import asyncio

    from cli.app import console
    from rollout import serve as server

    settings = server.ServeSettings(model_dir=str(model_dir), host=host, port=port, device=device, dtype=dtype,
                                    max_batch=max_batch, seed=seed, served_model_name=served_model_name,
                                    cuda_graphs=cuda_graphs)
    server.check_settings(settings)
    quiet_transformers()
    try:
        asyncio.run(server.run(settings))
    except KeyboardInterrupt:
        pass
    console.print("stopped")
