"""Preparing a run (steps 1-3 of :mod:`launch.supervisor`): its id, its topics,
``runs/<run_id>/config.yaml``, the model and the judge models (a packaged ``judge.models.<name>.source``
converted into its ``path``); ``rollstream run --prepare-only`` stops here.
Also :func:`load_run_config`, the config a service of a run uses, and :func:`check_judge_model`,
what a judge model directory must be (the CLI checks it before anything starts)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import yaml
from rich.console import Console

from runtime.bus import TopicAdmin, message_count
from schemas.config import JudgeModelConfig, RunConfig, to_dict
from schemas.topics import check_run_id
from store.runs import run_dir_of


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
        from launch.models import default_path

        return Path(default_path(cfg.model.source))
    return run_dir / "model"


def prepare_model(cfg: RunConfig, run_dir: Path, progress: Callable[[str], None] = lambda _: None) -> Path:
    """The model directory of the run: a packaged model (``model.source``) is converted into it once,
    the tiny model is created when ``model.path`` is empty; its chat-template setting is checked."""
    path = model_dir_of(cfg, run_dir)
    if cfg.model.source:
        from launch.models import ModelSourceError, ensure_model

        try:
            ensure_model(cfg.model.source, path, progress)
        except ModelSourceError as e:
            raise RunError(f"model.source={cfg.model.source!r}: {e}") from None
    elif cfg.model.path:
        if not (path / "config.json").exists():
            raise RunError(f"model.path {path} is not a Hugging Face model directory (no config.json)")
    elif not (path / "config.json").exists():
        from rollout.model_init import init_tiny_model
        from rollout.vlm import init_tiny_vlm

        (init_tiny_vlm if cfg.model.init.vision else init_tiny_model)(path, cfg.model.init, seed=cfg.run.seed)
    check_vision(cfg, path)
    from rollout.model_init import load_tokenizer, use_chat_template

    try:
        use_chat_template(load_tokenizer(path), cfg.model.chat_template)
    except ValueError as e:
        raise RunError(str(e)) from None
    return path


def check_vision(cfg: RunConfig, model_dir: Path) -> None:
    """A :class:`RunError` (one line naming the key) unless the run's tasks and model agree: visual
    domains (:func:`envs.is_visual`) need a vision-language model (and the torch engine and strategy,
    no critic), whose processor keeps their images' size; a vision-language model needs visual
    domains only, and ``train.freeze_vision`` needs a vision-language model."""
    import envs
    from rollout.vlm import VLMError, check_image_size, check_vlm_dir, is_vlm_dir, load_image_processor

    visual = [(i, d) for i, d in enumerate(cfg.data.domains) if envs.is_visual(d.source)]
    vlm = is_vlm_dir(model_dir)
    if not visual:
        if vlm:
            raise RunError(f"model {model_dir} is a vision-language model but no data.domains entry shows images "
                           f"(visual sources: {', '.join(sorted(envs.registry.VISUAL_SOURCES))}); use a text model "
                           "(model.init.vision: false) or a visual task")
        if cfg.train.freeze_vision:
            raise RunError("train.freeze_vision: true needs a vision-language model with visual tasks; this run's "
                           "model is a text model (set train.freeze_vision: false)")
        return
    i, d = visual[0]
    if len(visual) != len(cfg.data.domains):
        text = next(x.name for x in cfg.data.domains if not envs.is_visual(x.source))
        raise RunError(f"data.domains: {d.name!r} shows images but {text!r} does not; a run is all visual or all text")
    try:
        check_vlm_dir(model_dir)
    except VLMError as e:
        raise RunError(f"data.domains[{i}] ({d.source}) shows images: {e}; set model.init.vision: true") from None
    needs = {"rollout.engine": (cfg.rollout.engine, "torch"), "train.strategy": (cfg.train.strategy, "torch"),
             "algorithm.critic": (cfg.algorithm.critic, "none")}
    for key, (value, want) in needs.items():
        if value != want:
            raise RunError(f"{key}: {value!r} is not supported with visual tasks yet (use {want!r})")
    processor = load_image_processor(model_dir)
    for i, d in visual:
        source = envs.make_source(d.source, **d.kwargs)
        size = getattr(source, "image_px", getattr(source, "size", None))
        try:
            if isinstance(size, int):
                check_image_size(processor, size, size)
        except VLMError as e:
            key = "size" if not hasattr(source, "image_px") else "size and cell_px"
            raise RunError(f"data.domains[{i}].kwargs.{key}: {e}") from None


def used_judges(cfg: RunConfig) -> dict[str, JudgeModelConfig]:
    """The judges of ``judge.models`` that a domain names (``data.domains[].judge``), by name."""
    names = sorted({d.judge for d in cfg.data.domains if d.judge})
    return {name: cfg.judge.models[name] for name in names if name in cfg.judge.models}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
"""Files of which a saved Hugging Face tokenizer has at least one."""


def _num_labels(config: dict[str, object]) -> int:
    """Outputs of a saved sequence-classification head (transformers' default: 2)."""
    n, id2label = config.get("num_labels"), config.get("id2label")
    if isinstance(n, int):
        return n
    if isinstance(id2label, dict):
        return len(id2label)
    return 2


def check_judge_model(name: str, m: JudgeModelConfig) -> None:
    """``judge.models.<name>`` as it is on disk; ``ValueError`` with one line (``judge.models.<name>...:
    what is wrong; what to do``) when it cannot judge. A path still to be converted from ``source``
    passes (it is checked again once converted, by :func:`prepare_judges`).

    ``path`` is a Hugging Face model directory (``config.json``) of the right kind: a causal LM for
    ``llm``, a sequence-classification model with one output (``num_labels`` 1) for ``reward_model``;
    it holds a tokenizer; ``chat_template: true`` needs a chat template and ``score: logprobs`` each
    label ``min_score..max_score`` to be one token (only these two load the tokenizer: importing
    transformers takes seconds, and every service runs these checks when it starts)."""
    import json

    key = f"judge.models.{name}"
    path = Path(m.path)
    if m.source and not (path / "config.json").is_file():
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise ValueError(f"{key}.path={str(path)!r} exists but holds no model, so {key}.source={m.source!r} "
                             "cannot be converted into it; remove it or pick another path")
        return  # converted when the run is prepared
    if not path.exists():
        raise ValueError(f"{key}.path={str(path)!r} does not exist; point it at a local Hugging Face model "
                         f"directory{'' if m.kind == 'reward_model' else f' (or set {key}.source to convert a packaged model into it)'}")
    if not path.is_dir():
        raise ValueError(f"{key}.path={str(path)!r} is a file; point it at a Hugging Face model directory")
    if not (path / "config.json").is_file():
        raise ValueError(f"{key}.path={str(path)!r} is not a Hugging Face model directory (no config.json); "
                         "point it at one (rollstream init-model creates tiny ones)")
    try:
        config = json.loads((path / "config.json").read_text())
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{key}.path={str(path)!r}: its config.json cannot be read ({e}); "
                         "point it at a Hugging Face model directory") from None
    archs = [str(a) for a in config.get("architectures") or []]
    classifier = any(a.endswith("ForSequenceClassification") for a in archs)
    if m.kind == "reward_model":
        if archs and not classifier:
            raise ValueError(f"{key}: {str(path)!r} is a {'/'.join(archs)}, not a sequence-classification reward "
                             f"model; use a *ForSequenceClassification model with one output (rollstream init-model "
                             f"DIR --reward-model creates a tiny one), or set {key}.kind: llm")
        if (n := _num_labels(config)) != 1:
            raise ValueError(f"{key}: reward model {str(path)!r} has {n} outputs (num_labels={n}); kind: reward_model "
                             "needs exactly one (a model saved with num_labels=1)")
    elif classifier:
        raise ValueError(f"{key}: {str(path)!r} is a {'/'.join(archs)} (a classifier, it cannot write an answer); "
                         f"set {key}.kind: reward_model, or point {key}.path at a causal LM")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"{key}: {str(path)!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                         "point it at a model directory saved with its tokenizer")
    if m.chat_template is not True and not (m.kind == "llm" and m.score == "logprobs"):
        return
    from rollout.model_init import has_chat_template, load_tokenizer

    try:
        tokenizer = load_tokenizer(path)
    except Exception as e:  # whatever a broken tokenizer raises: one line
        raise ValueError(f"{key}: the tokenizer of {str(path)!r} cannot be loaded ({type(e).__name__}); "
                         "point it at a model directory saved with its tokenizer") from None
    if m.chat_template is True and not has_chat_template(tokenizer):
        raise ValueError(f"{key}.chat_template=true but the tokenizer of {str(path)!r} has no chat template; "
                         f"set {key}.chat_template: auto (or false), or add a chat_template to tokenizer_config.json")
    if m.kind == "llm" and m.score == "logprobs":
        from rollout.judge import label_token_ids

        try:
            label_token_ids(tokenizer, m.min_score, m.max_score)
        except ValueError as e:
            raise ValueError(f"{key}: min_score={m.min_score}..max_score={m.max_score} with score: logprobs: "
                             f"{e}") from None


def prepare_judges(cfg: RunConfig, progress: Callable[[str], None] = lambda _: None) -> list[Path]:
    """The judge models the run's domains use: a packaged one (``source``) is converted into its
    ``path`` once (:func:`launch.models.ensure_model`, as ``model.source``); each is then
    checked (:func:`check_judge_model`). Returns their directories."""
    from launch.models import ModelSourceError, ensure_model

    paths = []
    for name, m in used_judges(cfg).items():
        if m.source:
            try:
                ensure_model(m.source, m.path, progress)
            except ModelSourceError as e:
                raise RunError(f"judge.models.{name}.source={m.source!r}: {e}") from None
        try:
            check_judge_model(name, m)
        except ValueError as e:
            raise RunError(str(e)) from None
        paths.append(Path(m.path))
    return paths


async def prepare_run(cfg: RunConfig, run_id: str, bootstrap: str, console: Console, *,
                      on_run_dir: Callable[[Path], None] | None = None,
                      allow_prepared: bool = False) -> Path:
    """Steps 2-3 of the module doc: the run's topics, ``runs/<run_id>/config.yaml``, the model and
    the judge models. Returns the model directory; starts no service.

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
        judges = prepare_judges(cfg, progress=lambda msg: status.update(msg))
    from schemas.devices import describe

    console.print(f"model: {model_dir}")
    if judges:
        console.print(f"judges: {', '.join(f'{name} ({p})' for name, p in zip(used_judges(cfg), judges, strict=True))}")
    console.print(describe(cfg))
    return model_dir


def load_run_config(runs_dir: str, run_id: str, overrides: list[str]) -> RunConfig:
    """The config a service of ``run_id`` uses: ``runs/<run_id>/config.yaml`` plus overrides."""
    from schemas.config import parse_config

    path = Path(runs_dir) / run_id / "config.yaml"
    if not path.exists():
        raise RunError(f"run {run_id} has no config at {path} (start runs with `rollstream run`)")
    return parse_config(path.read_text(), overrides, source=str(path))
