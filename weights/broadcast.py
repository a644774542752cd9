"""Weights to engines on other nodes over ``torch.distributed``: a sealed segment sent whole,
relayed into that node's shared memory.

* The trainer's :class:`WeightSender` listens at ``gloo://host:port`` (a ``TCPStore``). It serves
  the segments it is offered (:meth:`WeightSender.offer`; the newest :data:`KEEP_SEGMENTS`).
* An engine on another node joins it with a :class:`WeightReceiver`. Each receiver gets its own
  two-rank gloo group with the sender, so a receiver that dies breaks only its own group. It asks
  for a version by number; the sender answers with the version and its size (``-1``: no longer
  held), then sends the segment's bytes, :data:`CHUNK_BYTES` at a time.
* The receiver writes them into a temporary ``.NAME.tmp-PID`` file in its node's ``/dev/shm``. It
  checks the seal and the checksum, then renames the file to the trainer's segment name.
  A version is applied whole or not at all: a transfer cut off leaves a temporary file that no
  reader opens.
* :class:`Relay` is one engine process's side. The other engines of the node find a received
  segment through :func:`weights.pick_copy`. A file lock lets one of them receive a version while
  the others wait for it.
* A dead peer, a timeout or a version no longer held is an ``OSError`` / ``RuntimeError`` /
  :class:`SegmentError` line. The engine then reads the version's directory.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import secrets
import socket
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import weights.shm as shm
from weights.shm import (
    KEEP_SEGMENTS,
    POPULATE,
    Segment,
    SegmentError,
    check_segment,
    open_reserved,
    prune_received,
)

log = logging.getLogger("rollstream.weights")

__all__ = ["Relay", "WeightReceiver", "WeightSender", "route_address"]

SCHEME = "gloo://"
IDLE = timedelta(minutes=10)
"""A receiver silent this long is dropped by the sender; a :class:`Relay` joins anew after half of it."""
CHUNK_BYTES = 16 << 20
"""A segment goes in pieces of this size, each within the timeout of its sender and receiver."""
_NAME = re.compile(r"^(?P<prefix>.+)-v\d+-[0-9a-f]+$")


def route_address(toward: str) -> str:
    """This node's address on the route to ``toward`` (``host:port[,...]``, e.g. the Kafka
    bootstrap, which the other nodes reach too); the host name when there is no such route."""
    host, _, port = toward.split(",")[0].strip().rpartition(":")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host.strip("[]") or "127.0.0.1", int(port or 9)))  # UDP: nothing is sent
            return str(s.getsockname()[0])
    except (OSError, ValueError):
        return socket.gethostname()


def _group(store: dist.Store, rank: int, timeout: timedelta) -> Any:
    """A two-rank gloo group over ``store`` (the sender is rank 0; a gloo backend, whose collectives
    the type stubs do not declare)."""
    return dist.ProcessGroupGloo(store, rank, 2, timeout)


def _broadcast(group: Any, tensor: torch.Tensor, timeout: timedelta) -> None:
    """Rank 0's flat ``tensor`` into rank 1's (the same shape), :data:`CHUNK_BYTES` at a time, each
    piece within ``timeout`` (gloo notices a peer's death by a reset connection, not always by its
    closing: this bounds the wait for a peer that is gone)."""
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, timeout
    step = max(1, CHUNK_BYTES // tensor.element_size())
    for start in range(0, tensor.numel(), step):
        group.broadcast([tensor[start:start + step]], opts).wait()


class WeightSender:
    """The trainer's side: serves the offered segments to every receiver that joins (module doc).

    ``host`` is the address announced (the server listens on every interface); ``port`` 0 takes a
    free one; ``timeout_s`` bounds each piece of a transfer (:data:`CHUNK_BYTES`). Threads of its
    own accept receivers and send, each with its own connection to the store, blocked until there
    is something to do (no polling); :meth:`close` stops them."""

    def __init__(self, host: str, port: int = 0, timeout_s: float = 10.0) -> None:
        self.timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=self.timeout)
        self.url = f"{SCHEME}{host}:{self.store.port}"
        """What ``WeightsPublished.broadcast`` carries."""
        self._segments: dict[int, Path] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._serving: dict[int, threading.Thread] = {}
        """The threads serving receivers, by number."""
        self._next = 1
        """The number the next receiver to join gets."""
        self.sent = 0
        """Versions sent so far (all receivers)."""
        self._acceptor = threading.Thread(target=self._accept, args=(self._client(),), name="weights-accept",
                                          daemon=True)
        self._acceptor.start()

    def _client(self) -> dist.TCPStore:
        """A connection of one thread's own to the store (one connection serves one call at a time)."""
        return dist.TCPStore("127.0.0.1", self.store.port, is_master=False, timeout=self.timeout)

    def offer(self, version: int, segment: Path) -> None:
        """Serve ``segment`` as ``version`` (the newest :data:`KEEP_SEGMENTS` versions are served)."""
        with self._lock:
            self._segments[version] = segment
            for old in sorted(self._segments)[:-KEEP_SEGMENTS]:
                del self._segments[old]

    def close(self) -> None:
        """Stop accepting and serving (a transfer under way ends with its receiver's error); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            serving, nxt = dict(self._serving), self._next
        for k in serving:  # wake every waiting thread: it sees the sender closed
            self.store.set(f"r{k}/want", "-2")
        self.store.set(f"join/{nxt}", "")
        deadline = time.monotonic() + 2.0
        for t in [self._acceptor, *serving.values()]:  # one in a transfer ends with an error later
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        del self.store  # the server stops: the port is free again

    def _accept(self, store: dist.Store) -> None:
        while True:
            with self._lock:
                k = self._next
            try:
                store.wait([f"join/{k}"], IDLE)
            except RuntimeError:  # nobody joined meanwhile (DistStoreError), or the store went away
                if self._closed:
                    return
                continue
            with self._lock:
                if self._closed:
                    return
                self._next = k + 1
                t = self._serving[k] = threading.Thread(target=self._serve, args=(k,), name=f"weights-send-{k}",
                                                        daemon=True)
            t.start()

    def _serve(self, k: int) -> None:
        """Answer receiver ``k``'s requests until it goes away, stays idle :data:`IDLE`, or the
        sender closes."""
        store = dist.PrefixStore(f"r{k}", self._client())
        try:
            group = _group(store, 0, self.timeout)
            while True:
                store.wait(["want"], IDLE)
                want = int(store.get("want"))
                store.delete_key("want")
                with self._lock:
                    if self._closed:
                        return
                    path = self._segments.get(want)
                self._send(group, want, path)
        except (RuntimeError, OSError, ValueError) as e:  # the receiver went away (or sent garbage)
            log.info("weights receiver %d left: %s", k, str(e).splitlines()[0] if str(e) else type(e).__name__)
        finally:
            with self._lock:
                self._serving.pop(k, None)

    def _send(self, group: Any, version: int, path: Path | None) -> None:
        try:
            fd = os.open(path, os.O_RDONLY) if path is not None else -1
        except FileNotFoundError:  # pruned meanwhile
            fd = -1
        if fd < 0:
            _broadcast(group, torch.tensor([-1, 0], dtype=torch.int64), self.timeout)
            return
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | POPULATE, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        _broadcast(group, torch.tensor([version, size], dtype=torch.int64), self.timeout)
        with warnings.catch_warnings():  # read-only memory: the root of a broadcast only sends
            warnings.filterwarnings("ignore", "The given buffer is not writable")
            buf = torch.frombuffer(mm, dtype=torch.uint8)
        _broadcast(group, buf, self.timeout)
        del buf
        del mm  # unmapped once nothing views it
        with self._lock:
            self.sent += 1


class WeightReceiver:
    """One engine's connection to a :class:`WeightSender` at ``url``; ``timeout_s`` bounds the wait
    to connect, for an answer and for each piece of a transfer. After any error it is broken: make
    a new one (:class:`Relay` does)."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        if not url.startswith(SCHEME):
            raise ValueError(f"weights broadcast address {url!r}: only {SCHEME}host:port is supported")
        host, _, port = url.removeprefix(SCHEME).rpartition(":")
        self.timeout = timeout = timedelta(seconds=timeout_s)
        self.url = url
        self.store = dist.TCPStore(host.strip("[]"), int(port), is_master=False, timeout=timeout)
        # claim the lowest free number: setting join/k is the claim itself, so the numbers the
        # sender waits for, one after the other, have no gap (``joined`` only says where to start)
        k, me = self.store.add("joined", 0) + 1, f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}"
        while self.store.compare_set(f"join/{k}", "", me) != me.encode():
            k += 1
        self.store.add("joined", 1)
        self._store = dist.PrefixStore(f"r{k}", self.store)
        self._group = _group(self._store, 1, timeout)

    def receive(self, version: int, dest: Path, checksum: str = "") -> Segment:
        """Version ``version`` as a sealed segment at ``dest`` (see the module doc); ``checksum``
        (non-empty) must be its checksum."""
        try:
            return self._receive(version, dest, checksum)
        except RuntimeError as e:  # gloo's: "[file:line] what happened. This is typically ..."
            what = re.sub(r"^\[[^]]*\]\s*", "", str(e).splitlines()[0] if str(e) else "").split(". This is")[0]
            raise RuntimeError(f"receiving weights v{version} from {self.url}: {what or type(e).__name__}") from None

    def _receive(self, version: int, dest: Path, checksum: str) -> Segment:
        self._store.set("want", str(version))
        head = torch.zeros(2, dtype=torch.int64)
        _broadcast(self._group, head, self.timeout)
        got, size = (int(x) for x in head.tolist())
        if got != version:
            raise SegmentError(f"the trainer at {self.url} no longer holds weights v{version}")
        tmp, fd = open_reserved(dest, size)  # all of it now: never a SIGBUS mid-transfer
        try:
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            _broadcast(self._group, torch.frombuffer(mm, dtype=torch.uint8), self.timeout)
            del mm  # unmapped once nothing views it
            seg = check_segment(tmp, checksum)
            os.replace(tmp, dest)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        return Segment(dest, seg.checksum, size)


class Relay:
    """One engine process's way to versions sent from another node: the node's copy in ``root``
    when an engine there received it, else received now (one receiver per node at a time)."""

    def __init__(self, root: Path | None = None, timeout_s: float = 10.0, wait_s: float = 120.0) -> None:
        self.root = shm.SHM_DIR if root is None else root
        self.timeout_s = timeout_s
        """The longest wait for the sender: to connect, to answer, or for one piece of a transfer."""
        self.wait_s = wait_s
        """The longest wait for another engine of this node that is receiving a version."""
        self._receiver: WeightReceiver | None = None
        self._used = 0.0
        """When the receiver last received (``time.monotonic``)."""

    def fetch(self, url: str, version: int, memory: str, checksum: str) -> Path:
        """The local copy of the trainer's segment ``memory`` (version ``version``, sent from ``url``)."""
        dest = self.root / Path(memory).name
        m = _NAME.match(dest.name)
        if m is None:
            raise SegmentError(f"{memory} is not a weights segment's name")
        lock = self.root / f".{m['prefix']}.lock"
        with lock.open("a") as f:
            deadline = time.monotonic() + self.wait_s
            while True:  # another engine of this node may be receiving it
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"weights v{version}: another engine of this node has been receiving "
                                           f"them for {self.wait_s:g} s") from None
                    time.sleep(0.02)
            try:
                return check_segment(dest, checksum).path
            except (FileNotFoundError, SegmentError):
                pass
            seg = self._receive(url, version, dest, checksum)
            prune_received(m["prefix"], seg.path, root=self.root)
            return seg.path

    def _receive(self, url: str, version: int, dest: Path, checksum: str) -> Segment:
        """Receive with the connection of the last version, or a new one; a connection kept from
        before that fails (say, a trainer restarted on the same port) is replaced once, at once."""
        stale = time.monotonic() - self._used > IDLE.total_seconds() / 2  # the sender may have dropped it
        kept = self._receiver is not None and self._receiver.url == url and not stale
        if not kept:
            self._receiver = None
        try:
            return self._receive_once(url, version, dest, checksum)
        except RuntimeError:
            if not kept:
                raise
            return self._receive_once(url, version, dest, checksum)

    def _receive_once(self, url: str, version: int, dest: Path, checksum: str) -> Segment:
        """Receive with the current connection (a new one when there is none); after an error there is none."""
        try:
            if self._receiver is None:
                self._receiver = WeightReceiver(url, self.timeout_s)
            seg = self._receiver.receive(version, dest, checksum)
        except BaseException:
            self._receiver = None  # broken: the next one joins anew
            raise
        self._used = time.monotonic()
        return seg
