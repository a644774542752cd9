"""``--launcher ray``: the placement checks (pure), the fit check against a real local Ray instance
(one per module), the actor-backed service processes (signals, exit codes, a dead actor, the
supervisor's spawn into the run's placement group), and the CLI's one-line refusals (subprocesses)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from launch import ray_launcher as rl
from schemas import events as ev
from schemas.config import ConfigError, parse_config

CPU2 = [("10.0.0.1", {"CPU": 2.0, "memory": 1e9})]


def cfg_of(text: str = "", *overrides: str) -> Any:
    return parse_config(text or "{}", list(overrides))


# --------------------------------------------------------------------------- config values


@pytest.mark.parametrize(("override", "words"), [
    ("placement.trainer.cpus=-1", "placement.trainer.cpus=-1 must be >= 0"),
    ("placement.rollout.gpus=1.5", "placement.rollout.gpus=1.5 must be >= 0 and, above 1, a whole number"),
    ("placement.judge.resources={CPU: 1}", "placement.judge.resources: 'CPU' is not a custom resource name"),
    ("placement.env.resources={fast: 0}", "placement.env.resources.fast=0 must be a finite number > 0"),
    ("placement.ready_timeout_s=0", "placement.ready_timeout_s=0 must be > 0"),
    ("placement.strategy=diagonal", "placement.strategy"),
    ("placement.trainer.nodes=2", "placement.trainer"),
])
def test_bad_placement_values_are_one_line_naming_the_key(override: str, words: str) -> None:
    with pytest.raises(ConfigError) as e:
        cfg_of("", override)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_bundles_follow_the_labels_and_drop_zero_amounts() -> None:
    cfg = cfg_of("", "placement.trainer.cpus=2", "placement.trainer.gpus=1", "placement.rollout.gpus=0.5",
                 "placement.rollout.resources={fast: 1}", "rollout.workers=2")
    labels = ["recorder", "rollout0", "rollout1", "trainer"]
    assert rl.bundles(cfg, labels) == [
        ("recorder", {"CPU": 0.25}), ("rollout0", {"CPU": 0.25, "GPU": 0.5, "fast": 1.0}),
        ("rollout1", {"CPU": 0.25, "GPU": 0.5, "fast": 1.0}), ("trainer", {"CPU": 2.0, "GPU": 1.0})]


def test_a_process_that_reserves_nothing_or_a_cuda_device_without_a_gpu_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"placement.feeder reserves nothing .* set placement.feeder.cpus > 0"):
        rl.check_reserves(cfg_of("", "placement.feeder.cpus=0"), ["recorder", "feeder"])
    with pytest.raises(ConfigError, match=r"train.device='cuda' but placement.trainer.gpus=0 under --launcher ray"):
        rl.check_reserves(cfg_of("", "train.device=cuda"), ["trainer"])
    rl.check_reserves(cfg_of("", "train.device=cuda", "placement.trainer.gpus=1"), ["trainer"])  # fine
    with pytest.raises(ConfigError, match=r"placement.trainer.gpus=1 but train.ranks=2: .* set placement.trainer.gpus=2"):
        rl.check_reserves(cfg_of("", "train.strategy=fsdp2", "train.ranks=2", "placement.trainer.gpus=1"), ["trainer"])
    rl.check_reserves(cfg_of("", "train.strategy=fsdp2", "train.ranks=2", "placement.trainer.gpus=2"), ["trainer"])


# --------------------------------------------------------------------------- fit (pure)


def fit_error(wanted: list[tuple[str, dict[str, float]]], nodes: list[tuple[str, dict[str, float]]],
              strategy: str = "pack") -> str:
    with pytest.raises(ConfigError) as e:
        rl.check_fit(wanted, nodes, strategy)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_a_bundle_no_node_has_names_the_service_and_what_is_missing() -> None:
    msg = fit_error([("recorder", {"CPU": 0.25}), ("trainer", {"CPU": 1.0, "GPU": 1.0})], CPU2)
    assert msg.startswith("config: placement.trainer: trainer needs CPU 1, GPU 1 but no node has GPU 1")
    assert "(nodes: 10.0.0.1: CPU 2, GPU 0)" in msg and "memory" not in msg
    two = [("a", {"CPU": 4.0, "GPU": 0.0}), ("b", {"CPU": 1.0, "GPU": 1.0})]
    msg = fit_error([("rollout1", {"CPU": 2.0, "GPU": 1.0})], two)
    assert "placement.rollout: rollout1 needs CPU 2, GPU 1 but no single node has CPU 2, GPU 1 together" in msg


def test_the_run_in_all_must_fit_the_cluster_and_split_over_its_nodes() -> None:
    wanted = [(f"rollout{i}", {"CPU": 0.5}) for i in range(4)] + [("trainer", {"CPU": 1.0})]
    msg = fit_error(wanted, CPU2)
    assert "the run's 5 processes need CPU 3 in all (rollout CPU 2, trainer CPU 1) but the Ray cluster has CPU 2" in msg
    rl.check_fit(wanted, [("a", {"CPU": 2.0}), ("b", {"CPU": 1.0})], "pack")  # 3 CPUs over two nodes
    # 1.8 CPUs in all fit 2 nodes of 1 CPU in sum, but no node takes two of 0.6
    msg = fit_error([(f"env{i}", {"CPU": 0.6}) for i in range(3)], [("a", {"CPU": 1.0}), ("b", {"CPU": 1.0})])
    assert "cannot be split over the cluster's nodes" in msg


def test_strict_strategies() -> None:
    nodes = [("a", {"CPU": 2.0}), ("b", {"CPU": 2.0})]
    wanted = [("feeder", {"CPU": 1.0}), ("reward", {"CPU": 1.0}), ("trainer", {"CPU": 1.0})]
    rl.check_fit(wanted, nodes, "pack")
    assert "strict_pack puts all 3 processes on one node: they need CPU 3" in fit_error(wanted, nodes, "strict_pack")
    assert "strict_spread puts each of the 3 processes on a node of its own" in fit_error(wanted, nodes,
                                                                                           "strict_spread")
    rl.check_fit(wanted[:2], nodes, "strict_spread")
    rl.check_fit(wanted[:2], nodes, "strict_pack")
    # spread needs a matching, not just enough nodes: the GPU bundle must get the GPU node
    gpu = [("cpu-node", {"CPU": 4.0}), ("gpu-node", {"CPU": 4.0, "GPU": 1.0})]
    rl.check_fit([("feeder", {"CPU": 1.0}), ("trainer", {"CPU": 1.0, "GPU": 1.0})], gpu, "strict_spread")


# --------------------------------------------------------------------------- a real local Ray instance


@pytest.fixture(scope="module")
def ray_instance() -> Iterator[Any]:
    ray = rl.require_ray()
    import logging

    ray.init(address="local", num_cpus=2, resources={"fast": 1}, include_dashboard=False, log_to_driver=False,
             logging_level=logging.ERROR)
    try:
        yield ray
    finally:
        ray.shutdown()


def test_connect_refuses_what_the_cluster_cannot_hold_before_reserving_anything(ray_instance: Any) -> None:
    from ray.util import placement_group_table

    before = len(placement_group_table())
    with pytest.raises(ConfigError) as e:
        rl.connect(cfg_of("", "placement.trainer.gpus=1"))
    assert str(e.value).startswith("config: placement.trainer: trainer needs CPU 0.25, GPU 1 but no node has GPU 1")
    with pytest.raises(ConfigError, match=r"placement.rollout: rollout needs CPU 0.25, fast 2 but no node has fast 2"):
        rl.connect(cfg_of("", "placement.rollout.resources={fast: 2}"))
    assert len(placement_group_table()) == before  # nothing reserved
    assert ray_instance.is_initialized()  # a connection this process had is left alone


def test_resources_other_jobs_hold_time_out_in_one_line_and_release_the_reservation(ray_instance: Any) -> None:
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    other = placement_group([{"fast": 1.0}])  # another job holds the cluster's only `fast`
    ray_instance.get(other.ready(), timeout=30)
    try:
        with pytest.raises(rl.RunError) as e:
            rl.connect(cfg_of("", "placement.rollout.resources={fast: 1}", "placement.ready_timeout_s=1"))
        assert str(e.value) == ("the Ray cluster did not reserve the run's 5 bundles (CPU 1.25, fast 1 in all) within "
                                "placement.ready_timeout_s=1 s: other jobs hold those resources")
        states = [pg["state"] for pg in placement_group_table().values()]
        assert states.count("CREATED") == 1  # only the other job's: the run's reservation was removed
    finally:
        remove_placement_group(other)


def test_the_supervisor_spawns_each_service_in_its_bundle_with_the_run_environment(
        ray_instance: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = cfg_of("", f"run.runs_dir={tmp_path}", "rollout.workers=2", "placement.rollout.resources={fast: 0.5}",
                 "placement.trainer.cpus=0.5")
    cluster = rl.connect(cfg)
    assert cluster.labels == ["recorder", "feeder", "reward", "rollout0", "rollout1", "trainer"]
    script = ("import os, time; print('label', os.environ['ROLLSTREAM_SERVICE_LABEL'], 'bootstrap', "
              "os.environ['ROLLSTREAM_BOOTSTRAP'], 'gpus', repr(os.environ.get('CUDA_VISIBLE_DEVICES')), flush=True); "
              "time.sleep(120)")
    monkeypatch.setattr(rl, "service_command", lambda *a: [sys.executable, "-c", script])
    sup = cluster.supervisor(cfg, "rid", "broker:9092", Console(quiet=True))
    try:
        sup.start_children()
        assert [s.label for s in sup.slots] == cluster.labels and all(s.state == "running" for s in sup.slots)
        started = [e for e in sup.pending if isinstance(e, ev.ServiceStarted)]
        assert len(started) == 6 and {e.host for e in started} == {socket.gethostname()}  # the actor's host
        rollout1 = next(s for s in sup.slots if s.label == "rollout1")
        deadline = time.monotonic() + 30
        while "label" not in rollout1.log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "label rollout1 bootstrap broker:9092 gpus ''" in rollout1.log_path.read_text()
        # the pids are the services' own processes, on this machine
        assert all(Path(f"/proc/{s.pid}").exists() for s in sup.slots)
        # SIGTERM reaches the service; its exit code comes back as from a local process
        sup.terminate(("rollout",), grace_s=20)
        assert {s.label: (s.state, s.last_exit_code) for s in sup.slots if s.service == "rollout"} == {
            "rollout0": ("stopped", -15), "rollout1": ("stopped", -15)}
        # a crashed service is noticed and restarted in its bundle by a new actor
        trainer = next(s for s in sup.slots if s.label == "trainer")
        victim = trainer.pid
        os.kill(victim, signal.SIGKILL)
        sup.healer.backoff_s = 0.0
        deadline = time.monotonic() + 30
        while trainer.restarts == 0 and time.monotonic() < deadline:
            sup.check_children()
            time.sleep(0.2)
        assert trainer.restarts == 1 and trainer.pid != victim and trainer.state == "running"
        assert "killed by SIGKILL (exit code -9)" in trainer.reason
    finally:
        sup.terminate(None, grace_s=20)
        cluster.close()
    assert {s.state for s in sup.slots} == {"stopped"}
    assert ray_instance.is_initialized()


def test_a_dead_actor_counts_as_a_kill_and_its_service_ends_with_it(ray_instance: Any, tmp_path: Path) -> None:
    log = tmp_path / "svc.log"
    actor = ray_instance.remote(rl.ServiceHost).options(num_cpus=0.25).remote()
    script = ("import signal, sys, time; "
              "signal.signal(signal.SIGTERM, lambda *a: (print('SIGTERM received', flush=True), sys.exit(3))); "
              "time.sleep(120)")
    pid, host = ray_instance.get(actor.start.remote(["-c", script], {}, str(log), str(tmp_path), False, ""),
                                 timeout=60)
    proc = rl.RayProcess(ray_instance, actor, "feeder", log, pid, host)
    time.sleep(1.0)
    assert proc.poll() is None
    ray_instance.kill(actor, no_restart=True)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert "error: the Ray actor of feeder on" in log.read_text()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists()  # the service does not outlive its actor


# --------------------------------------------------------------------------- the CLI (subprocesses)


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True,
                          env=env or dict(os.environ), timeout=timeout)


def one_error_line(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 1, res.stdout + res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr
    return errors[0]


def test_the_local_launcher_never_imports_ray() -> None:
    code = ("import sys\n"
            "from schemas.config import parse_config\n"
            "from cli import run\n"
            "from launch import supervisor\n"
            "cfg = parse_config('{}')\n"
            "run.check_launcher(cfg, 'local', '', False)\n"
            "supervisor.Supervisor(cfg, 'r', 'kafka:9092', None).labels()\n"
            "assert 'ray' not in sys.modules, 'ray was imported'\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_cli_refuses_a_bad_launcher_and_placement_without_ray(repo_root: Path, tmp_path: Path) -> None:
    config = str(repo_root / "examples" / "main.yaml")
    assert one_error_line(cli("run", config, "--launcher", "k8s")) == "error: --launcher 'k8s': one of local, ray"
    line = one_error_line(cli("run", config, "--set", "placement.trainer.cpus=2"))
    assert line.startswith("error: the config's placement.* keys are used by --launcher ray only")
    line = one_error_line(cli("run", config, "--address", "head:6379"))
    assert line == "error: --address 'head:6379' is for --launcher ray only; add --launcher ray or leave it out"
    line = one_error_line(cli("run", config, "--launcher", "ray", "--prepare-only"))
    assert line.startswith("error: --prepare-only starts no service")
    # Ray missing: a `ray` package that cannot be imported shadows the installed one
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("raise ImportError(\"No module named 'ray'\")\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    line = one_error_line(cli("run", config, "--launcher", "ray", env=env))
    assert line == "error: --launcher ray needs Ray, which is not installed: pip install 'rollstream[ray]'"


def test_cli_refuses_a_request_no_node_can_satisfy_before_anything_starts(repo_root: Path, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    res = cli("run", str(repo_root / "examples" / "main.yaml"), "--launcher", "ray", "--run-id", "ray-nofit",
              "--set", f"run.runs_dir={runs}", "--set", "placement.trainer.gpus=64",
              env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    line = one_error_line(res)
    assert line.startswith("error: config: placement.trainer: trainer needs CPU 0.25, GPU 64 but no node has GPU 64")
    assert not runs.exists()  # no run directory, no topics: nothing started


def test_cli_joins_an_existing_cluster_at_address_and_leaves_it_running(ray_instance: Any, repo_root: Path,
                                                                        tmp_path: Path) -> None:
    address = ray_instance.get_runtime_context().gcs_address
    runs = tmp_path / "runs"
    res = cli("run", str(repo_root / "examples" / "main.yaml"), "--launcher", "ray", "--address", address,
              "--set", f"run.runs_dir={runs}", "--set", "placement.rollout.resources={fast: 2}")
    line = one_error_line(res)  # this module's instance has 1 `fast`: the check read the cluster at --address
    assert line == ("error: config: placement.rollout: rollout needs CPU 0.25, fast 2 but no node has fast 2 (nodes: "
                    f"{address.rpartition(':')[0]}: CPU 2, fast 1); lower placement.rollout.* or add such a node")
    assert not runs.exists()
    assert ray_instance.cluster_resources()["fast"] == 1  # the cluster is still up
    line = one_error_line(cli("run", str(repo_root / "examples" / "main.yaml"), "--launcher", "ray",
                              "--address", "127.0.0.1:1"))
    assert line.startswith("error: no Ray cluster answers at 127.0.0.1:1 (")
