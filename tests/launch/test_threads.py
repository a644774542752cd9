"""Torch threads per service process (run.torch_threads)."""

from __future__ import annotations

import pytest
from rich.console import Console

from launch.supervisor import Supervisor
from launch.threads import torch_threads
from schemas.config import parse_config

LABELS = ["recorder", "feeder", "reward", "judge0", "judge1", "rollout0", "rollout1", "trainer"]


def test_auto_divides_the_cores_among_the_model_processes() -> None:
    cfg = parse_config("{}")
    got = torch_threads(cfg, LABELS, cores=16)
    assert got == {"recorder": 1, "feeder": 1, "reward": 1, "judge0": 3, "judge1": 3, "rollout0": 3,
                   "rollout1": 3, "trainer": 3}
    assert torch_threads(cfg, ["feeder", "rollout", "trainer"], cores=2) == {"feeder": 1, "rollout": 1, "trainer": 1}
    assert torch_threads(cfg, ["rollout", "trainer"], cores=1) == {"rollout": 1, "trainer": 1}  # at least one


def test_on_policy_gives_the_trainer_every_core() -> None:
    """With async_ratio 0 the trainer and the generating processes take turns."""
    cfg = parse_config("{rollout: {async_ratio: 0}}")
    assert torch_threads(cfg, ["feeder", "rollout", "trainer"], cores=2) == {"feeder": 1, "rollout": 2, "trainer": 2}
    got = torch_threads(cfg, LABELS, cores=16)
    assert got == {"recorder": 1, "feeder": 1, "reward": 1, "judge0": 4, "judge1": 4, "rollout0": 4,
                   "rollout1": 4, "trainer": 16}
    fixed = parse_config("{rollout: {async_ratio: 0}, run: {torch_threads: 1}}")
    assert torch_threads(fixed, LABELS, cores=16)["trainer"] == 1  # a set value wins


def test_a_set_value_and_ray_placement() -> None:
    fixed = parse_config("{run: {torch_threads: 4}}")
    assert torch_threads(fixed, LABELS, cores=2)["rollout1"] == 4 and torch_threads(fixed, LABELS)["reward"] == 1
    placed = parse_config("{placement: {rollout: {cpus: 6}, trainer: {cpus: 0.5}}}")
    got = torch_threads(placed, ["recorder", "rollout", "trainer"], ray=True)
    assert got == {"recorder": 1, "rollout": 6, "trainer": 1}
    with pytest.raises(ValueError, match=r"run\.torch_threads=-1"):
        parse_config("{run: {torch_threads: -1}}")


def test_supervisor_sets_omp_threads_unless_the_environment_has_them(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path) -> None:
    cfg = parse_config(f"{{run: {{runs_dir: '{tmp_path}', torch_threads: 3}}}}")
    sup = Supervisor(cfg, "r1", "127.0.0.1:1", Console(quiet=True))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert sup.threads_env("trainer") == {"ROLLSTREAM_SERVICE_LABEL": "trainer", "OMP_NUM_THREADS": "3"}
    assert sup.threads_env("feeder")["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert sup.threads_env("trainer") == {"ROLLSTREAM_SERVICE_LABEL": "trainer"}  # inherited as is
