"""Preparing a run (steps 1-3 of :mod:`services.launch.supervisor`): its id, its topics,
``runs/<run_id>/config.yaml`` and the model; ``rollstream run --prepare-only`` stops here.
Also :func:`load_run_config`, the config a service of a run uses."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import yaml
from rich.console import Console

from schemas.config import RunConfig, to_dict
from schemas.topics import check_run_id
from services.kafka.bus import TopicAdmin, message_count
from services.launch.runs import run_dir_of


class RunError(RuntimeError):
    """The run could not start or a service failed; one line for the user."""


def new_run_id(cfg: RunConfig) -> str:
    return check_run_id(f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid() % 1000:03d}")


def config_text(cfg: RunConfig) -> str:
    """The run's ``config.yaml`` as written."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def write_run_config(cfg: RunConfig, run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    path.write_text(config_text(cfg))
    return path


def model_dir_of(cfg: RunConfig, run_dir: Path) -> Path:
    """The model directory of a run: ``model.path``; else ``models/<model.source>`` for a packaged
    model; else the tiny model at ``runs/<id>/model``."""
    if cfg.model.path:
        return Path(cfg.model.path)
    if cfg.model.source:
        from services.launch.models import default_path

        return Path(default_path(cfg.model.source))
    return run_dir / "model"


def prepare_model(cfg: RunConfig, run_dir: Path, progress: Callable[[str], None] = lambda _: None) -> Path:
    """The model directory of the run: a packaged model (``model.source``) is converted into it once,
    the tiny model is created when ``model.path`` is empty; its chat-template setting is checked."""
    path = model_dir_of(cfg, run_dir)
    if cfg.model.source:
        from services.launch.models import ModelSourceError, ensure_model

        try:
            ensure_model(cfg.model.source, path, progress)
        except ModelSourceError as e:
            raise RunError(f"model.source={cfg.model.source!r}: {e}") from None
    elif cfg.model.path:
        if not (path / "config.json").exists():
            raise RunError(f"model.path {path} is not a Hugging Face model directory (no config.json)")
    elif not (path / "config.json").exists():
        from rollout.model_init import init_tiny_model

        init_tiny_model(path, cfg.model.init, seed=cfg.run.seed)
    from rollout.model_init import load_tokenizer, use_chat_template

    try:
        use_chat_template(load_tokenizer(path), cfg.model.chat_template)
    except ValueError as e:
        raise RunError(str(e)) from None
    return path


async def prepare_run(cfg: RunConfig, run_id: str, bootstrap: str, console: Console, *,
                      on_run_dir: Callable[[Path], None] | None = None,
                      allow_prepared: bool = False) -> Path:
    """Steps 2-3 of the module doc: the run's topics, ``runs/<run_id>/config.yaml`` and the model.
    Returns the model directory; starts no service.

    A run id whose topics already hold messages is refused unless the run directory has a
    checkpoint to resume from, or it already holds this very config: the same run, started
    before (an earlier ``--prepare-only``, or a run that died before its first checkpoint, e.g.
    in the warm-up: it starts again from the beginning, and the trainer, which reads what the
    earlier instance published, publishes no step, evaluation or drain twice). ``allow_prepared``
    is kept for callers; the rule no longer depends on it.
    ``on_run_dir(run_dir)`` is called once the run directory exists.
    """
    run_dir = run_dir_of(cfg, run_id)
    if (run_dir / "summary.json").exists():
        raise RunError(f"run {run_id} already finished ({run_dir / 'summary.json'}); pick another --run-id")
    resuming = any((run_dir / "checkpoints").glob("step_*/stream_state.msgpack"))
    config_path = run_dir / "config.yaml"
    prepared = config_path.is_file() and config_path.read_text() == config_text(cfg)
    async with TopicAdmin(cfg.kafka, bootstrap) as admin:
        existing = {info.topic: info.partitions for info in (await admin.describe(run_id)).values()}
        if not (resuming or prepared) and existing and (held := await message_count(cfg.kafka, bootstrap, existing)):
            raise RunError(f"run id {run_id} already has {held} messages on the broker (an earlier run with this id) "
                           "and neither a checkpoint nor the same config.yaml here to resume from; pick another --run-id")
        await admin.ensure_run_topics(run_id)
    write_run_config(cfg, run_dir)
    if on_run_dir is not None:
        on_run_dir(run_dir)
    console.print(f"run {run_id}: dir {run_dir}, kafka {bootstrap}")
    with console.status("preparing the model...") as status:
        model_dir = prepare_model(cfg, run_dir, progress=lambda msg: status.update(msg))
    from services.devices import describe

    console.print(f"model: {model_dir}")
    console.print(describe(cfg))
    return model_dir


def load_run_config(runs_dir: str, run_id: str, overrides: list[str]) -> RunConfig:
    """The config a service of ``run_id`` uses: ``runs/<run_id>/config.yaml`` plus overrides."""
    from schemas.config import parse_config

    path = Path(runs_dir) / run_id / "config.yaml"
    if not path.exists():
        raise RunError(f"run {run_id} has no config at {path} (start runs with `rollstream run`)")
    return parse_config(path.read_text(), overrides, source=str(path))
