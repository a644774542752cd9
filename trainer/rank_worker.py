"""Entry point of ranks ``1 .. N-1`` of a multi-rank trainer (started by
:class:`trainer.ranks.MultiRankStrategy`, never by hand):

``python -m trainer.rank_worker --model-dir DIR --device DEV`` with the run config as JSON on
stdin and ``MASTER_ADDR`` / ``MASTER_PORT`` / ``RANK`` / ``WORLD_SIZE`` in the environment.

It connects to rank 0's store, initialises the default process group, builds its local strategy
(:func:`trainer.ranks.rank_strategy`), then runs the commands rank 0 publishes, in order, until
``close``. An exception writes its one-line error to the store (rank 0 raises it) and exits
with code 1; the worker exits with code 2 when rank 0's process dies.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from schemas.config import RunConfig, parse_raw
from schemas.errors import one_line
from trainer.ranks import (
    CLOSE,
    COMMAND_KEY,
    ERROR_KEY,
    JOINED_KEY,
    backend_for,
    barrier,
    rank_strategy,
)

POLL_S = 0.01
"""How often an idle worker looks for the next command."""


def watch_parent(parent: int, every_s: float = 0.5) -> None:
    """Exit (code 2) as soon as the process that started this one is gone."""

    def loop() -> None:
        while True:
            time.sleep(every_s)
            if os.getppid() != parent:
                os._exit(2)

    threading.Thread(target=loop, name="watch-rank0", daemon=True).start()


def next_command(store: dist.Store, seq: int) -> tuple[str, tuple[object, ...], dict[str, object]]:
    """Command number ``seq`` (waits for it without a timeout: the trainer may idle for long)."""
    key = COMMAND_KEY.format(seq)
    while not store.check([key]):
        time.sleep(POLL_S)
    name, args, kwargs = pickle.loads(store.get(key))
    return name, args, kwargs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.rank_worker")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--device", required=True)
    args = parser.parse_args(argv)
    watch_parent(os.getppid())
    cfg: RunConfig = parse_raw(json.loads(sys.stdin.read()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=cfg.train.dist_timeout_s)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    store.set(JOINED_KEY.format(rank), "1")
    try:
        if args.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(args.device))
        torch.manual_seed(cfg.run.seed)
        random.seed(cfg.run.seed)
        dist.init_process_group(backend_for(args.device), store=store, rank=rank, world_size=world, timeout=timeout)
        strategy = rank_strategy(cfg, args.model_dir, device=args.device)
        barrier(args.device)
        seq = 0
        while True:
            seq += 1
            name, cargs, ckwargs = next_command(store, seq)
            if name == CLOSE:
                break
            getattr(strategy, name)(*cargs, **ckwargs)
            barrier(args.device)
    except BaseException as e:
        traceback.print_exc()
        try:
            store.set(ERROR_KEY.format(rank), one_line(e))
        finally:
            sys.stderr.flush()
            os._exit(1)
    try:
        dist.destroy_process_group()
    except Exception:  # pragma: no cover - exiting anyway
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
