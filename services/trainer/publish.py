"""How the trainer hands a new weight version over: by disk, or by shared memory on its node.

``train.weights_handoff`` (:func:`resolve_handoff`) picks one per trainer process:

* ``disk``: the strategy exports the version's directory (:func:`services.trainer.checkpoint.export_weights`),
  then the event announces it; every engine reads it back.
* ``memory``: the version's tensors (``TorchStrategy.export_state``) go into a sealed shared-memory
  segment (:mod:`weights.shm`); the event names the segment, its node and checksum, and the
  directory it will be written to. The directory is then written in a background thread from the
  segment (never from the live model, which the next step changes), beside a copy of the config
  and tokenizer of the previous export (the first version of a process is exported by the
  strategy, as with ``disk``). The next export, an evaluation from disk and the end of the run
  wait for it. The newest :data:`weights.shm.KEEP_SEGMENTS` segments stay; the run's are removed
  when it ends (``launch.supervisor``) or is deleted (``rollstream runs rm``). A ``/dev/shm``
  without room for a version sends that version by disk (a warning).

With ``train.weights_broadcast: gloo`` (:func:`weight_sender`) the trainer also serves each segment
to engines on other nodes (:class:`weights.broadcast.WeightSender`); the event carries its address.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Literal, cast

from runtime.probe import find_bootstrap
from schemas import events as ev
from schemas.config import RunConfig
from schemas.errors import surfaced, to_thread
from services.trainer.checkpoint import KEEP_WEIGHT_VERSIONS, export_weights, weights_dir
from trainer.strategy import Strategy
from weights import (
    Segment,
    new_segment_path,
    node_id,
    prune_segments,
    read_segment,
    segment_prefix,
    shm,
    write_segment,
    write_state_dir,
)
from weights.broadcast import WeightSender, route_address

log = logging.getLogger("rollstream.trainer")

__all__ = ["WeightsPublisher", "resolve_handoff", "weight_sender"]

Handoff = Literal["memory", "disk"]


def resolve_handoff(cfg: RunConfig, shm_dir: Path | None = None) -> Handoff:
    """``train.weights_handoff`` for this trainer: ``auto`` is ``memory`` with the torch strategy,
    the torch engine and a shared-memory folder here, else ``disk``; ``memory`` without that folder
    is a ``RuntimeError`` line (the config rules refused the other combinations)."""
    shm_dir = shm.SHM_DIR if shm_dir is None else shm_dir
    mode, usable = cfg.train.weights_handoff, shm_dir.is_dir()
    if mode == "memory" and not usable:
        raise RuntimeError(f"train.weights_handoff=memory needs shared memory at {shm_dir}, which this node lacks; "
                           "use auto or disk")
    if mode == "auto":
        can = cfg.train.strategy == "torch" and cfg.rollout.engine == "torch" and usable
        mode = "memory" if can else "disk"
    if mode == "disk" and cfg.train.weights_broadcast != "off":
        raise RuntimeError(f"train.weights_broadcast={cfg.train.weights_broadcast} sends shared-memory copies, and "
                           f"this node has no shared memory at {shm_dir}; use train.weights_broadcast=off")
    return mode


def weight_sender(cfg: RunConfig) -> WeightSender | None:
    """The server of ``train.weights_broadcast`` (None when off); a ``RuntimeError`` line when its
    port cannot be taken."""
    t = cfg.train
    if t.weights_broadcast == "off":
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        raise RuntimeError("train.weights_broadcast=gloo needs torch.distributed with gloo, which this torch build "
                           "lacks; use train.weights_broadcast=off")
    host = t.weights_broadcast_host or route_address(find_bootstrap(cfg.kafka.bootstrap) or "")
    try:
        sender = WeightSender(host, t.weights_broadcast_port)
    except RuntimeError as e:
        raise RuntimeError(f"train.weights_broadcast_port={t.weights_broadcast_port}: cannot serve weights at "
                           f"{host}: {str(e).splitlines()[0] if str(e) else e!r}") from None
    log.info("weights served to engines on other nodes at %s", sender.url)
    return sender


class WeightsPublisher:
    """Exports each version of one trainer process and describes it (see the module doc)."""

    def __init__(self, run_id: str, run_dir: Path, handoff: Handoff, shm_dir: Path | None = None,
                 sender: WeightSender | None = None) -> None:
        self.run_id, self.run_dir, self.handoff, self.shm_dir = run_id, run_dir, handoff, shm_dir
        self.sender = sender
        """Serves the segments to engines on other nodes (``train.weights_broadcast``), or None."""
        self.prefix = segment_prefix(run_dir)
        self.template: Path | None = None
        """The newest directory this process exported: the config and tokenizer the next ones copy."""
        self.pending: asyncio.Future[None] | None = None
        """The background write of the newest version's directory."""
        self._writer = concurrent.futures.ThreadPoolExecutor(1, "weights-dir", initializer=_lower_priority)
        """The thread that writes directories, at a lower CPU priority than the engines and the trainer."""
        self.segments: dict[int, Path] = {}
        """The segments this process wrote, by version."""

    async def settle(self) -> None:
        """Wait for the background directory write (its error, if any, is raised here)."""
        if self.pending is not None:
            task, self.pending = self.pending, None
            await task

    def close(self) -> None:
        """Unlink the segments this process wrote (its engines are done with them: the run ended,
        or a restarted trainer publishes again)."""
        self._writer.shutdown(wait=True)
        if self.sender is not None:
            self.sender.close()
        for path in self.segments.values():
            path.unlink(missing_ok=True)
        self.segments = {}

    def local_ref(self, version: int) -> Path:
        """Where this process reads ``version`` fastest: its segment while it is there, else its
        directory (call :meth:`settle` first)."""
        seg = self.segments.get(version)
        return seg if seg is not None and seg.exists() else weights_dir(self.run_dir, version)

    async def publish(self, strategy: Strategy, version: int, step: int) -> ev.WeightsPublished:
        """Export ``version`` (the strategy's current weights) and the event that announces it."""
        await self.settle()
        event = ev.WeightsPublished(run_id=self.run_id, policy_version=version, step=step, uri="")
        if self.handoff == "memory":
            try:
                seg = await to_thread(self._segment, strategy, version)
            except OSError as e:
                log.warning("weights v%d go by disk: %s", version, e)
            else:
                event = ev.WeightsPublished(
                    run_id=self.run_id, policy_version=version, step=step, uri=str(weights_dir(self.run_dir, version)),
                    num_bytes=seg.num_bytes, memory=str(seg.path), memory_host=node_id(),
                    memory_checksum=seg.checksum, broadcast=self.sender.url if self.sender else "")
                if self.sender is not None:
                    self.sender.offer(version, seg.path)
                if self.template is not None and self.template.is_dir():
                    self.pending = asyncio.get_running_loop().run_in_executor(
                        self._writer, surfaced(self._dir_from_segment), seg.path, version)
                    return event
        path, checksum, size = await to_thread(export_weights, strategy, self.run_dir, version)
        self.template = path
        if event.memory:  # the first version of this process: the strategy wrote its directory
            return ev.WeightsPublished(run_id=self.run_id, policy_version=version, step=step, uri=str(path),
                                       checksum=checksum, num_bytes=event.num_bytes, memory=event.memory,
                                       memory_host=event.memory_host, memory_checksum=event.memory_checksum,
                                       broadcast=event.broadcast)
        return ev.WeightsPublished(run_id=self.run_id, policy_version=version, step=step, uri=str(path),
                                   checksum=checksum, num_bytes=size)

    def _segment(self, strategy: Strategy, version: int) -> Segment:
        state = cast(Any, strategy).export_state()  # TorchStrategy's (resolve_handoff)
        seg = write_segment(new_segment_path(self.prefix, version, self.shm_dir), state)
        self.segments[version] = seg.path
        prune_segments(self.prefix, root=self.shm_dir)
        self.segments = {v: p for v, p in self.segments.items() if p.exists()}
        return seg

    def _dir_from_segment(self, segment: Path, version: int) -> None:
        """Write ``version``'s directory from its segment, like the last export; prune old ones."""
        assert self.template is not None
        path, _ = write_state_dir(weights_dir(self.run_dir, version), read_segment(segment), like=self.template)
        self.template = path
        old = weights_dir(self.run_dir, version - KEEP_WEIGHT_VERSIONS)
        if version >= KEEP_WEIGHT_VERSIONS and old.exists():
            shutil.rmtree(old, ignore_errors=True)


def _lower_priority() -> None:
    """Make the calling thread yield the CPU to the others (Linux: a thread's own nice value)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # no per-thread priority here: an ordinary thread
        pass
