"""Copying a weight state into live tensors in place: the trainer's loads and the engine's hot swap.

Every copy writes into the existing tensors (``Tensor.copy_``, converting dtype and device), so
anything holding a view of a parameter sees the new values: the slot decoder's fused projections
(:func:`rollout.slot_decoder.fuse_linears`) and its CUDA graphs follow a swap without a rebuild.
A state may leave out a tensor tied to one it has (tied embeddings: ``save_pretrained`` writes
one name). Keys the target lacks, untied tensors the state lacks and wrong shapes are checked
first and reported in one ``KeyError`` line; nothing is copied then. A model whose files name its
tensors otherwise than its modules do (Qwen2-VL: ``model.embed_tokens`` on disk for the live
``model.language_model.embed_tokens``) gets a state under the file names renamed to the live ones,
as transformers itself renames them when it saves (:func:`live_names`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from weights.files import read_weights, safetensors_files


def _storage(t: torch.Tensor) -> tuple[torch.device, int]:
    """Where ``t``'s data starts: two names with the same place are one (tied) tensor."""
    return t.device, t.data_ptr()


def untied_missing(missing: Iterable[str], present: Iterable[str], targets: Mapping[str, torch.Tensor]) -> list[str]:
    """The keys of ``missing`` whose tensor is not shared with (tied to) one of ``present``."""
    have = {_storage(targets[k]) for k in present if k in targets}
    return [k for k in missing if _storage(targets[k]) not in have]


@torch.no_grad()
def copy_state_(targets: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor], where: str = "") -> None:
    """Copy ``state`` into the tensors ``targets`` (same names and shapes) in place. A target
    missing from ``state`` is allowed only when tied to one that is present. ``where`` names
    the weights in the error (e.g. their path)."""
    unknown = sorted(set(state) - set(targets))
    missing = untied_missing(sorted(set(targets) - set(state)), state, targets)
    bad = [k for k in state if k in targets and tuple(state[k].shape) != tuple(targets[k].shape)]
    if unknown or missing or bad:
        problems = [f"{what} {keys[:5]}" for what, keys in
                    (("keys the model lacks", unknown), ("missing", missing), ("wrong shape", bad)) if keys]
        raise KeyError(f"{where or 'weights'} do not fit the model: {'; '.join(problems)}")
    for key, value in state.items():
        targets[key].copy_(value.to(device=targets[key].device, dtype=targets[key].dtype))


def live_names(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """``state`` with the names ``save_pretrained`` gives ``model``'s tensors on disk renamed to the
    model's own (transformers' reverse weight conversion, matched by tensor); unchanged when the
    model has no such conversion or ``state`` already uses live names."""
    live = dict(model.state_dict(keep_vars=True))
    if set(state) <= set(live):
        return state
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # an older transformers: files and modules share their names
        return state
    if not isinstance(model, PreTrainedModel):
        return state
    by_id = {id(t): k for k, t in reversed(live.items())}  # a tied tensor: its first live name
    on_disk = revert_weight_conversion(model, dict(live))
    rename = {disk: by_id[id(t)] for disk, t in on_disk.items() if id(t) in by_id and disk not in live}
    return {rename.get(k, k): v for k, v in state.items()}


def copy_weights_(model: torch.nn.Module, state: Mapping[str, torch.Tensor], where: str = "") -> None:
    """Copy ``state`` into ``model``'s parameters in place (and into the persistent buffers it
    names; a buffer it leaves out keeps its value); file names are mapped to live ones
    (:func:`live_names`). See :func:`copy_state_`."""
    state = live_names(model, state)
    params: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    buffers = {k: v for k, v in model.state_dict(keep_vars=True).items() if k in state and k not in params}
    copy_state_({**params, **buffers}, state, where)


def load_weights_into(model: torch.nn.Module, path: str | Path) -> None:
    """Copy the weight set at ``path`` (:func:`weights.files.read_weights`) into ``model`` in place."""
    copy_weights_(model, read_weights(path), f"weights at {path}")


def weights_match(path: str | Path, targets: Mapping[str, torch.Tensor]) -> bool:
    """Whether the weight set at ``path`` holds exactly the values of ``targets`` (bitwise, same
    dtypes; targets absent from the files must be tied to present ones). Reads one tensor at a time."""
    files = safetensors_files(path)
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    seen: list[str] = []
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for key in fh.keys():
                if key not in targets:
                    return False
                t = targets[key]
                v = fh.get_tensor(key)
                if v.shape != t.shape or v.dtype != t.dtype or not torch.equal(v.to(t.device), t):
                    return False
                seen.append(key)
    return not untied_missing(sorted(set(targets) - set(seen)), seen, targets)
