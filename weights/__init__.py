"""rollstream: weights — the one place that reads, checks, publishes and loads model weights.

A weight set is a safetensors directory (one ``*.safetensors`` file or several shards, read in
name order; a Hugging Face model directory is one) or a single ``.safetensors`` file, and in
memory a ``dict[str, torch.Tensor]`` keyed by the model's parameter names. The trainer publishes
and checkpoints with it, rollout hot-swaps with it; it imports nothing of ours.

* :mod:`weights.files`: :func:`read_weights`, :func:`weights_sha256`, and :func:`publish_dir` /
  :func:`replace_dir` (write a directory aside, then rename it into place).
* :mod:`weights.inplace`: :func:`copy_state_` / :func:`copy_weights_` / :func:`load_weights_into`
  copy a state into live tensors in place; :func:`weights_match` compares files with them. Tied
  parameters may be left out; unknown keys, untied missing ones and wrong shapes are one
  ``KeyError`` line, raised before anything is copied.
"""

from weights.files import publish_dir, read_weights, replace_dir, weights_sha256
from weights.inplace import copy_state_, copy_weights_, load_weights_into, weights_match

__all__ = [
    "copy_state_",
    "copy_weights_",
    "load_weights_into",
    "publish_dir",
    "read_weights",
    "replace_dir",
    "weights_match",
    "weights_sha256",
]
