"""What the trainer writes under the run directory: checkpoints and exported weights.

* ``checkpoints/step_<k>``: the state before training step ``k``: the strategy's files (model,
  optimizer, critic, algorithm state, RNG, step) and ``stream_state.msgpack``, the whole
  :class:`~services.trainer.state.TrainerState`. A checkpoint counts once its state file is
  written (the last thing written). Older ones beyond ``train.keep_checkpoints`` are removed
  (step 0, the RL start, is always kept).
* ``weights/v<version>``: the policy's weights of each published version; versions older than the
  last :data:`KEEP_WEIGHT_VERSIONS` are removed (slow rollout workers may still be loading one).
* ``final/``: the policy when the trainer finished (after its last step, or a drain), written by
  :func:`export_final`: the run's trained model, a plain Hugging Face directory with its tokenizer.

Version ``k`` of the weights is the policy after ``k`` training steps, the model of checkpoint
``step_<k>``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec

from services.trainer.state import TrainerState
from store.runs import FINAL_DIR
from trainer.strategy import Strategy

__all__ = ["FINAL_DIR", "KEEP_WEIGHT_VERSIONS", "STATE_FILE", "Checkpoints", "export_final", "export_weights",
           "weights_dir"]

STATE_FILE = "stream_state.msgpack"
"""The :class:`TrainerState` of a checkpoint."""
KEEP_WEIGHT_VERSIONS = 3
"""Exported weight versions kept on disk."""


class Checkpoints:
    """The checkpoints of one run directory (see the module doc)."""

    def __init__(self, run_dir: Path, keep: int) -> None:
        self.root = run_dir / "checkpoints"
        self.keep = keep
        """``train.keep_checkpoints``: how many besides step 0 (0: all)."""

    def dir(self, step: int) -> Path:
        """Where the checkpoint of the state *before* training step ``step`` lives."""
        return self.root / f"step_{step:06d}"

    def steps(self) -> list[int]:
        """Steps that have a complete checkpoint, ascending."""
        if not self.root.exists():
            return []
        return sorted(int(p.name[5:]) for p in self.root.glob("step_*")
                      if p.name[5:].isdigit() and (p / STATE_FILE).exists())

    def save(self, strategy: Strategy, state: TrainerState) -> Path:
        """Checkpoint the strategy and ``state`` (before step ``state.step``); prune old ones."""
        path = self.dir(state.step)
        strategy.save_checkpoint(path)
        (path / STATE_FILE).write_bytes(msgspec.msgpack.encode(state))
        if self.keep > 0:
            for old in [st for st in self.steps() if st != 0][:-self.keep]:
                shutil.rmtree(self.dir(old), ignore_errors=True)
        return path

    def find(self, step: int | None = None) -> Path | None:
        """The latest checkpoint (``None`` when there is none), or the one of ``step`` (which must exist)."""
        steps = self.steps()
        if step is None and not steps:
            return None
        path = self.dir(steps[-1] if step is None else step)
        if not (path / STATE_FILE).exists():
            raise FileNotFoundError(f"no checkpoint at {path}")
        return path

    @staticmethod
    def load(path: Path, strategy: Strategy) -> TrainerState:
        """Restore the strategy from the checkpoint at ``path``; its state."""
        state = read_state(path)
        step = strategy.load_checkpoint(path)
        if step != state.step:
            raise ValueError(f"checkpoint {path}: the strategy is at step {step}, {STATE_FILE} at step {state.step}")
        return state


def read_state(path: Path) -> TrainerState:
    """The :class:`TrainerState` of the checkpoint at ``path``."""
    return msgspec.msgpack.decode((path / STATE_FILE).read_bytes(), type=TrainerState)


def weights_dir(run_dir: Path, version: int) -> Path:
    """Where the weights of policy ``version`` are exported."""
    return run_dir / "weights" / f"v{version:05d}"


def export_weights(strategy: Strategy, run_dir: Path, version: int) -> tuple[Path, str, int]:
    """Export the policy as ``version``: ``(directory, checksum, bytes)``; versions older than the
    last :data:`KEEP_WEIGHT_VERSIONS` are removed from disk."""
    path, checksum = strategy.export_weights(weights_dir(run_dir, version))
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    old = weights_dir(run_dir, version - KEEP_WEIGHT_VERSIONS)
    if version >= KEEP_WEIGHT_VERSIONS and old.exists():
        shutil.rmtree(old, ignore_errors=True)
    return path, checksum, size


def export_final(strategy: Strategy, run_dir: Path) -> Path:
    """Export the policy as the run's final model, ``<run_dir>/final`` (replaced when there is one):
    a complete Hugging Face directory with its tokenizer (merged weights with LoRA)."""
    path, _ = strategy.export_weights(run_dir / FINAL_DIR)
    return path
