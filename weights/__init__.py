"""rollstream: weights — the one place that reads, checks, publishes and loads model weights.

A weight set is a safetensors directory (one ``*.safetensors`` file or several shards, read in
name order; a Hugging Face model directory is one), a single ``.safetensors`` file or a sealed
shared-memory segment, and in memory a ``dict[str, torch.Tensor]`` keyed by the model's parameter
names. The trainer publishes and checkpoints with it, rollout hot-swaps with it; it imports
nothing of ours.

* :mod:`weights.files`: :func:`read_weights`, :func:`weights_sha256`, :func:`publish_dir` /
  :func:`replace_dir` (write a directory aside, then rename it into place) and
  :func:`write_state_dir` (a state as a directory like an earlier export).
* :mod:`weights.inplace`: :func:`copy_state_` / :func:`copy_weights_` / :func:`load_weights_into`
  copy a state into live tensors in place; :func:`weights_match` compares files with them. Tied
  parameters may be left out; unknown keys, untied missing ones and wrong shapes are one
  ``KeyError`` line, raised before anything is copied.
* :mod:`weights.shm`: the same-node handoff: a version in a sealed ``/dev/shm`` segment
  (:func:`write_segment`, :func:`read_segment`, :func:`prune_segments`, :func:`remove_segments`).
* :mod:`weights.handoff`: which copy an engine reads (:func:`pick_copy`, :func:`wait_for_dir`).
* :mod:`weights.broadcast`: segments sent to other nodes over ``torch.distributed`` (gloo):
  :class:`WeightSender` on the trainer, :class:`Relay` in each engine process.
"""

from weights.broadcast import Relay, WeightSender
from weights.files import publish_dir, read_weights, replace_dir, weights_sha256, write_state_dir
from weights.handoff import pick_copy, wait_for_dir
from weights.inplace import copy_state_, copy_weights_, load_weights_into, weights_match
from weights.shm import (
    Segment,
    SegmentError,
    new_segment_path,
    node_id,
    prune_segments,
    read_segment,
    remove_segments,
    segment_prefix,
    write_segment,
)

__all__ = [
    "Relay",
    "Segment",
    "SegmentError",
    "WeightSender",
    "copy_state_",
    "copy_weights_",
    "load_weights_into",
    "new_segment_path",
    "node_id",
    "pick_copy",
    "prune_segments",
    "publish_dir",
    "read_segment",
    "read_weights",
    "remove_segments",
    "replace_dir",
    "segment_prefix",
    "wait_for_dir",
    "weights_match",
    "weights_sha256",
    "write_segment",
    "write_state_dir",
]
