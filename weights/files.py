"""Weight files on disk: read a safetensors weight set, checksum it, publish a directory atomically.

A weight set is a directory of ``*.safetensors`` files (one file or several shards; any other file,
such as a Hugging Face shard index or ``config.json``, is ignored), one ``.safetensors`` file, or a
shared-memory segment (:mod:`weights.shm`). Files are read and hashed in name order, so sharded
sets read and hash the same every time.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from weights.shm import is_segment, read_segment


def safetensors_files(path: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of directory ``path`` in name order, ``[path]`` for a file, else ``[]``."""
    p = Path(path)
    if p.is_dir():
        return sorted(p.glob("*.safetensors"))
    return [p] if p.is_file() else []


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the weight set at ``path`` (directory, file or shared-memory segment: then
    views of it, :func:`weights.shm.read_segment`), on the CPU, in its stored dtype. No files, or
    files without a tensor, is a ``FileNotFoundError`` naming ``path``."""
    if not str(path).endswith(".safetensors") and is_segment(path):
        return read_segment(path)
    files = safetensors_files(path)
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    if not state:
        raise FileNotFoundError(f"no tensors in the *.safetensors files of {path}")
    return state


def weights_sha256(path: str | Path) -> str:
    """sha256 (hex) over the bytes of the weight set's files, in name order (the checksum that
    ``WeightsPublished`` carries; a directory without ``*.safetensors`` files hashes no bytes)."""
    digest = hashlib.sha256()
    for f in safetensors_files(path):
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def replace_dir(tmp: Path, final: Path) -> None:
    """Move the finished directory ``tmp`` to ``final`` (replacing an older one)."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


@contextmanager
def publish_dir(final: str | Path) -> Iterator[Path]:
    """A fresh, empty temporary sibling of ``final`` (``.NAME.tmp-PID``) to write into; when the
    block ends without an error it replaces ``final`` by a rename, so readers never see a
    half-written directory. On an error the temporary directory is left (the next call clears it)."""
    dest = Path(final)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    yield tmp
    replace_dir(tmp, dest)


def write_state_dir(final: str | Path, state: dict[str, torch.Tensor], like: str | Path) -> tuple[Path, str]:
    """Publish ``state`` (tied names once) as the directory ``final`` (:func:`publish_dir`): one
    ``model.safetensors`` beside a copy of every other file of the weight directory ``like`` (the
    config and tokenizer an earlier export wrote; its shard index is left out). Returns the
    directory and the sha256 of its safetensors file, as ``Strategy.export_weights`` does."""
    src = Path(like)
    with publish_dir(final) as tmp:
        for f in src.iterdir():
            if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")):
                shutil.copy2(f, tmp / f.name)
        unique: dict[str, torch.Tensor] = {}
        seen: set[tuple[int, tuple[int, ...]]] = set()
        for name, t in state.items():  # tied names share one tensor: written once, as save_pretrained does
            if (key := (t.data_ptr(), tuple(t.shape))) not in seen or not t.numel():
                seen.add(key)
                unique[name] = t.contiguous()
        save_file(unique, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        checksum = weights_sha256(tmp)
    return Path(final), checksum
