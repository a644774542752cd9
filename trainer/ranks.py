"""Multi-rank training (``train.strategy: fsdp2 | megatron`` over ``train.ranks`` processes).

:class:`MultiRankStrategy` is the :class:`~trainer.strategy.Strategy` the trainer service holds;
its process is rank 0 (the only one that consumes ``scored``, commits and publishes). On
construction it opens a ``TCPStore`` on a free localhost port, starts ranks ``1 .. N-1`` as
subprocesses (``python -m trainer.rank_worker``: the config as JSON on stdin, secrets redacted;
``MASTER_ADDR`` / ``MASTER_PORT`` / ``RANK`` / ``WORLD_SIZE``; on the CPU ``OMP_NUM_THREADS =
cpu_count // N``), joins the default process group (``gloo`` on the CPU, ``nccl`` on CUDA,
timeout ``train.dist_timeout_s``) and builds its local strategy with :func:`rank_strategy`, as
every worker does.

Every protocol call is published as a command (pickled into the store under a sequence number)
that every rank runs in the same order with the same arguments (the whole batch); a barrier ends
it and rank 0 returns its own result. A lock serialises calls. Workers poll the store for the
next command (not a collective), so an idle trainer does not time them out.

A worker whose call raises writes its one-line error to the store and exits; rank 0 then raises
:class:`RankError` with that line, and after any failure the strategy is closed (the supervisor
restarts the service from its checkpoint). Workers exit when rank 0's process dies. On CUDA rank
``r`` uses ``cuda:(i + r)`` (``cuda:i`` the trainer's device); too few GPUs is a
:class:`~schemas.config.ConfigError` before any process starts. User view: docs/scaling.md.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from schemas.config import ConfigError, RunConfig, to_dict
from schemas.errors import one_line

if TYPE_CHECKING:
    from trainer.batch import TrainSample
    from trainer.sft import SFTExample
    from trainer.strategy import Strategy

__all__ = ["MultiRankStrategy", "RankError", "rank_devices", "rank_strategy"]

COMMAND_KEY = "rollstream/cmd/{}"
"""Store key of command number ``n`` (pickled ``(name, args, kwargs)``)."""
ERROR_KEY = "rollstream/error/{}"
"""Store key where rank ``r`` writes its one-line error before it exits."""
JOINED_KEY = "rollstream/joined/{}"
"""Store key rank ``r`` sets once it is connected."""
CLOSE = "close"
"""The command that ends the workers' loop."""
CLOSE_GRACE_S = 10.0
"""How long :meth:`MultiRankStrategy.close` waits for the workers to exit before killing them."""
ERROR_GRACE_S = 2.0
"""After a failure, how long rank 0 waits for a worker's error line (or exit) to report it."""


class RankError(RuntimeError):
    """A rank of a multi-rank trainer failed; the message is its one-line error."""


def rank_strategy(cfg: RunConfig, model_dir: str | Path, *, device: str) -> Strategy:
    """This rank's local strategy for ``cfg.train.strategy`` (``torch.distributed`` is initialised,
    world size ``cfg.train.ranks``)."""
    if cfg.train.strategy == "fsdp2":
        from trainer.fsdp2 import FSDP2Strategy

        return FSDP2Strategy(cfg, model_dir, device=device)
    if cfg.train.strategy == "megatron":
        from trainer.megatron.strategy import MegatronStrategy  # type: ignore[import-not-found,unused-ignore]

        return MegatronStrategy(cfg, model_dir, device=device)  # type: ignore[no-any-return,unused-ignore]
    raise ConfigError(f"config: train.strategy={cfg.train.strategy!r} is not a multi-rank strategy "
                      "(use fsdp2 or megatron)")


def rank_devices(device: str, ranks: int) -> list[str]:
    """The device of every rank (see the module doc); :class:`ConfigError` when CUDA has too few GPUs."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return ["cpu"] * ranks
    if dev.type == "cuda":
        first = dev.index or 0
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if first + ranks > have:
            raise ConfigError(f"config: train.ranks={ranks} needs {first + ranks} CUDA GPUs from cuda:{first}, "
                              f"{have} visible; lower train.ranks or set train.device=cpu")
        return [f"cuda:{first + r}" for r in range(ranks)]
    raise ConfigError(f"config: a multi-rank trainer runs on cpu or cuda, not train.device={device!r}")


def backend_for(device: str) -> str:
    """The process-group backend of ``device``: ``nccl`` on CUDA, ``gloo`` otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def barrier(device: str) -> None:
    """A barrier over the default group (on ``device``'s GPU for nccl)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        dist.barrier(device_ids=[dev.index or 0])
    else:
        dist.barrier()


def worker_threads(ranks: int) -> int:
    """Torch threads per rank on the CPU: the trainer's threads (``OMP_NUM_THREADS``, which
    ``rollstream run`` sets from ``run.torch_threads``; else the cores) shared out."""
    budget = os.environ.get("OMP_NUM_THREADS", "")
    return max(1, (int(budget) if budget.isdigit() else (os.cpu_count() or 1)) // ranks)


class MultiRankStrategy:
    """Rank 0 of a multi-rank trainer (see the module doc). Call :meth:`close` when done."""

    def __init__(self, cfg: RunConfig, model_dir: str | Path, *, device: str) -> None:
        n = cfg.train.ranks
        self.devices = rank_devices(device, n)
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process: one multi-rank trainer "
                               "per process")
        self.timeout_s = cfg.train.dist_timeout_s
        self._lock = threading.RLock()
        self._closed = False
        self._failure = ""
        self._seq = 0
        self._procs: list[subprocess.Popen[bytes]] = []
        timeout = timedelta(seconds=self.timeout_s)
        self._store: Any = dist.TCPStore("127.0.0.1", 0, n, is_master=True, timeout=timeout, wait_for_workers=False)
        try:
            self._spawn(cfg, model_dir)
            self._wait_joined()
            if self.devices[0].startswith("cuda"):
                torch.cuda.set_device(torch.device(self.devices[0]))
            else:  # rank 0 shares the trainer's threads with the other ranks
                torch.set_num_threads(worker_threads(n))
            dist.init_process_group(backend_for(self.devices[0]), store=self._store, rank=0, world_size=n,
                                    timeout=timeout)
            self.local = rank_strategy(cfg, model_dir, device=self.devices[0])
            barrier(self.devices[0])
        except BaseException as e:
            err = self._worker_error()
            self._shutdown(graceful=False)
            if err:
                raise RankError(err) from e
            raise
        self.tokenizer = self.local.tokenizer

    # ----------------------------------------------------------------- processes

    def _spawn(self, cfg: RunConfig, model_dir: str | Path) -> None:
        n = len(self.devices)
        config = json.dumps(to_dict(cfg)).encode()  # secrets redacted: the ranks need none
        root = str(Path(__file__).resolve().parents[1])
        for r in range(1, n):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self._store.port), RANK=str(r),
                       LOCAL_RANK=str(r), WORLD_SIZE=str(n),
                       PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p))
            if self.devices[r] == "cpu":
                env["OMP_NUM_THREADS"] = str(worker_threads(n))
            proc = subprocess.Popen([sys.executable, "-m", "trainer.rank_worker", "--model-dir", str(model_dir),
                                     "--device", self.devices[r]], env=env, stdin=subprocess.PIPE)
            self._procs.append(proc)
            assert proc.stdin is not None
            proc.stdin.write(config)
            proc.stdin.close()

    def _wait_joined(self) -> None:
        """Until every worker is connected to the store (or one exits, or ``dist_timeout_s``)."""
        deadline = time.monotonic() + self.timeout_s
        waiting = set(range(1, len(self.devices)))
        while waiting:
            waiting = {r for r in waiting if not self._store.check([JOINED_KEY.format(r)])}
            err = self._dead_worker()
            if err:
                raise RankError(err)
            if waiting and time.monotonic() > deadline:
                raise RankError(f"trainer rank(s) {sorted(waiting)} did not start within "
                                f"train.dist_timeout_s={self.timeout_s:g}")
            time.sleep(0.02)

    def _dead_worker(self) -> str:
        """The error of a worker that reported one or exited, or ""."""
        for r in range(1, len(self._procs) + 1):
            if self._store.check([ERROR_KEY.format(r)]):
                return f"trainer rank {r} failed: {self._store.get(ERROR_KEY.format(r)).decode()}"
        for r, proc in enumerate(self._procs, start=1):
            if proc.poll() is not None and not self._store.check([ERROR_KEY.format(r)]):
                return f"trainer rank {r} exited with code {proc.returncode}"
        return ""

    def _worker_error(self) -> str:
        """After a failure: a worker's error, waiting up to :data:`ERROR_GRACE_S` for it; "" if none."""
        deadline = time.monotonic() + ERROR_GRACE_S
        while True:
            try:
                err = self._dead_worker()
            except Exception:  # the store itself is gone
                return ""
            if err or time.monotonic() > deadline:
                return err
            time.sleep(0.02)

    def _shutdown(self, graceful: bool) -> None:
        """Workers gone (waited for up to :data:`CLOSE_GRACE_S` when ``graceful``, else killed),
        process group destroyed."""
        self._closed = True
        deadline = time.monotonic() + (CLOSE_GRACE_S if graceful else 0.0)
        for proc in self._procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # pragma: no cover - a broken group is gone either way
                pass

    def close(self) -> None:
        """Tell the workers to exit, wait for them (kill after :data:`CLOSE_GRACE_S`), destroy the
        process group. Idempotent."""
        with self._lock:
            if self._closed:
                return
            try:
                self._publish(pickle.dumps((CLOSE, (), {})))
            except Exception:  # the store is gone: the workers are going too
                pass
            self._shutdown(graceful=True)

    def __enter__(self) -> MultiRankStrategy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- commands

    def _publish(self, payload: bytes) -> None:
        """Make the pickled command ``payload`` the next one."""
        self._seq += 1
        self._store.set(COMMAND_KEY.format(self._seq), payload)  # type: ignore[arg-type]  # (bytes are stored as is)
        if self._seq > 1:  # every rank has read it (the previous command ended with a barrier)
            self._store.delete_key(COMMAND_KEY.format(self._seq - 1))

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``name`` on every rank; rank 0's result (see the module doc)."""
        with self._lock:
            if self._closed:
                raise RankError("the multi-rank trainer is closed" + (f" after: {self._failure}" if self._failure else ""))
            payload = pickle.dumps((name, args, kwargs))  # (unpicklable arguments: nothing was sent)
            try:
                self._publish(payload)
                result = getattr(self.local, name)(*args, **kwargs)
                barrier(self.devices[0])
            except BaseException as e:
                err = self._worker_error()
                self._failure = err or one_line(e)
                self._shutdown(graceful=False)
                if err:
                    raise RankError(f"{err} (in {name})") from e
                raise
            return result

    @property
    def step(self) -> int:
        """Optimizer steps taken (rank 0's local strategy's)."""
        return int(self.local.step)

    @step.setter
    def step(self, value: int) -> None:
        raise AttributeError("MultiRankStrategy.step is the ranks' own: restore it with load_checkpoint")

    def warmup(self, batches: Iterable[list[SFTExample]], *, lr: float, grad_clip: float) -> list[float]:
        """Every rank: the supervised warm-up on all of ``batches`` (materialised here); rank 0's losses."""
        return list(self._call("warmup", [list(b) for b in batches], lr=lr, grad_clip=grad_clip))

    def init_reference(self, path: str | Path | None = None) -> None:
        """Every rank: load the frozen reference policy."""
        self._call("init_reference", path)

    def init_critic(self) -> None:
        """Every rank: create the critic the algorithm asks for."""
        self._call("init_critic")

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        """Every rank gets the whole batch; one optimizer step; rank 0's metrics (the whole batch's)."""
        return dict(self._call("train_step", list(samples)))

    def save_checkpoint(self, path: str | Path) -> Path:
        """Every rank: the local strategy's checkpoint at ``path`` (its layout is the backend's)."""
        return Path(self._call("save_checkpoint", path))

    def load_checkpoint(self, path: str | Path) -> int:
        """Every rank: restore :meth:`save_checkpoint`'s state; the step."""
        return int(self._call("load_checkpoint", path))

    def export_weights(self, path: str | Path) -> tuple[Path, str]:
        """Every rank: export the weights as a complete HF dir at ``path``; it and its sha256."""
        out, checksum = self._call("export_weights", path)
        return Path(out), str(checksum)
