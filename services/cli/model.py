"""``rollstream init-model``: a tiny causal LM to train."""

from __future__ import annotations

from pathlib import Path

import typer

from services.cli.app import UserError, app, friendly, out, quiet_transformers


@app.command("init-model")
@friendly
def init_model(
    out_dir: Path = typer.Argument(..., help="Directory to create (Hugging Face format)."),
    set_: list[str] = typer.Option([], "--set", help="Model shape: hidden_size=, num_layers=, ... (repeatable)."),
    seed: int = typer.Option(0, "--seed", help="Initialisation seed."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing model directory."),
) -> None:
    """Create a tiny causal LM (Llama architecture, own tokenizer, safetensors). Nothing is downloaded."""
    from schemas.config import ConfigError, TinyModelSpec, check_tiny_spec, parse_raw

    if (out_dir / "config.json").exists() and not force:
        raise UserError(f"{out_dir} already holds a model (use --force to overwrite)")
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir} is a file, not a directory")
    spec = parse_raw({}, set_, root=TinyModelSpec)
    try:
        check_tiny_spec(spec)
    except ValueError as e:
        raise ConfigError(f"config: {e}") from None
    quiet_transformers()
    from rollout.model_init import count_parameters, init_tiny_model, load_model

    path = init_tiny_model(out_dir, spec, seed=seed)
    n = count_parameters(load_model(path))
    out.print(f"created {path} ({n / 1e6:.2f}M parameters)")
