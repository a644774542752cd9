"""The multi-rank driver: devices, the checks, and failures that must reach rank 0 as one clear
error instead of a hang (a rank that raises, a rank that dies, rank 0 that dies)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from schemas.config import ConfigError, parse_config
from tests.trainer.test_strategy import make_samples
from trainer.batch import TrainSample
from trainer.factory import check_strategy, make_strategy
from trainer.ranks import MultiRankStrategy, RankError, rank_devices
from trainer.strategy import Strategy

FSDP2 = ["train.strategy=fsdp2", "train.ranks=2", "train.micro_batch_size=2"]


def test_rank_devices() -> None:
    assert rank_devices("cpu", 3) == ["cpu", "cpu", "cpu"]
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ConfigError) as err:
        rank_devices("cuda", have + 1)
    msg = str(err.value)
    assert "\n" not in msg and f"train.ranks={have + 1}" in msg and "train.device=cpu" in msg
    with pytest.raises(ConfigError, match="cpu or cuda"):
        rank_devices("meta", 2)


def test_check_strategy_accepts_fsdp2() -> None:
    check_strategy(parse_config("", FSDP2))
    check_strategy(parse_config("", ["train.strategy=fsdp2", "algorithm.adv_estimator=gae",
                                     "algorithm.critic=value_head"]))


def explode(*args: Any) -> TrainSample:
    raise ValueError("boom: this sample cannot be rebuilt on rank 1")


class Poisoned(TrainSample):
    """A sample rank 0 trains as is, whose unpickling (on rank 1) raises."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (explode, ())


def test_a_rank_that_raises_fails_rank0_with_its_error(model_dir: Path) -> None:
    multi = make_strategy(parse_config("", [*FSDP2, "train.dist_timeout_s=120"]), model_dir)
    assert isinstance(multi, MultiRankStrategy) and isinstance(multi, Strategy)
    try:
        good = make_samples(4)
        assert multi.train_step(good)["train/samples"] == 4 and multi.step == 1
        with pytest.raises(Exception, match="pickle"):  # nothing sent: the ranks stay in step
            multi.init_reference(lambda: None)  # type: ignore[arg-type]
        assert multi.train_step(good)["train/samples"] == 4 and multi.step == 2
        bad: list[TrainSample] = [Poisoned(**vars(s)) for s in good]
        t0 = time.monotonic()
        with pytest.raises(RankError) as err:
            multi.train_step(bad)
        assert time.monotonic() - t0 < 30  # not the 120 s collective timeout
        msg = str(err.value)
        assert "\n" not in msg and "trainer rank 1 failed: ValueError: boom" in msg and "train_step" in msg
        assert all(p.poll() is not None for p in multi._procs)  # the workers are gone
        with pytest.raises(RankError, match="closed after: trainer rank 1 failed"):
            multi.train_step(good)
    finally:
        multi.close()
    multi.close()


def test_idle_past_the_timeout_then_a_dead_rank(model_dir: Path) -> None:
    multi = make_strategy(parse_config("", [*FSDP2, "train.dist_timeout_s=8"]), model_dir)
    assert isinstance(multi, MultiRankStrategy)
    try:
        time.sleep(9)  # waiting for rollouts longer than the collective timeout is fine
        assert multi.train_step(make_samples(4))["train/samples"] == 4
        worker = multi._procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        t0 = time.monotonic()
        with pytest.raises(RankError, match=r"trainer rank 1 exited with code -9"):
            multi.train_step(make_samples(4))
        assert time.monotonic() - t0 < 8
    finally:
        multi.close()


def test_workers_exit_when_rank0_dies(model_dir: Path, tmp_path: Path, repo_root: Path) -> None:
    script = tmp_path / "rank0.py"
    script.write_text(textwrap.dedent(f"""
        import time
        from schemas.config import parse_config
        from trainer.factory import make_strategy
        s = make_strategy(parse_config("", {FSDP2!r}), {str(model_dir)!r})
        print(*[p.pid for p in s._procs], flush=True)
        time.sleep(600)
    """))
    rank0 = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=repo_root,
                             env=dict(os.environ, PYTHONPATH=str(repo_root)))
    try:
        assert rank0.stdout is not None
        pids = [int(p) for p in rank0.stdout.readline().split()]
        assert len(pids) == 1 and os.path.exists(f"/proc/{pids[0]}")
        rank0.kill()
        rank0.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(pids[0]):
            time.sleep(0.1)
        assert not _alive(pids[0])
    finally:
        rank0.kill()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie — exited, not yet reaped — counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
