"""Where the model services run: ``rollout.device`` / ``train.device`` resolved against this machine."""

from __future__ import annotations

import pytest
import torch

from schemas.config import ConfigError, parse_config, resolve_dtype
from schemas.devices import describe, placement, resolve_device


def test_resolve_dtype_follows_the_device() -> None:
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("auto", "cuda:0") == "bfloat16"
    assert resolve_dtype("float16", "cpu") == "float16"


def test_cpu_and_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == "cpu"
    with pytest.raises(ConfigError, match=r"^config: train.device='cuda:1' but this machine has no CUDA device"):
        resolve_device("cuda:1", "train.device")


def test_cuda_index_beyond_the_visible_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == "cuda:0"
    assert resolve_device("cuda") == "cuda:0"
    assert resolve_device("cuda:1") == "cuda:1"
    with pytest.raises(ConfigError, match=r"rollout.device='cuda:2' but this machine has 2 CUDA device\(s\)"):
        resolve_device("cuda:2", "rollout.device")


def test_placement_and_the_line_run_prints(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    shared = parse_config("rollout: {device: cuda:0, workers: 2}\ntrain: {device: auto}")
    assert placement(shared) == {"rollout": ("cuda:0", "bfloat16"), "trainer": ("cuda:0", "bfloat16")}
    assert describe(shared) == ("devices: rollout ×2 on cuda:0 (bfloat16), trainer on cuda:0 (bfloat16) "
                                "(one shared GPU)")
    split = parse_config("rollout: {device: cuda:1}\ntrain: {device: cuda:0}\nmodel: {dtype: float32}")
    assert describe(split) == "devices: rollout on cuda:1 (float32), trainer on cuda:0 (float32)"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert describe(parse_config("{}")) == "devices: rollout on cpu (float32), trainer on cpu (float32)"


def test_releasing_between_steps_needs_one_device_for_both(monkeypatch: pytest.MonkeyPatch) -> None:
    """``rollout.release_between_steps`` is refused, naming both keys, when the devices resolve apart."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    shared = parse_config("rollout: {async_ratio: 0, release_between_steps: kv, device: cuda}\ntrain: {device: auto}")
    assert placement(shared)["rollout"] == placement(shared)["trainer"] == ("cuda:0", "bfloat16")
    split = parse_config("rollout: {async_ratio: 0, release_between_steps: kv_and_weights, device: cuda:1}")
    with pytest.raises(ConfigError, match=r"^config: rollout.release_between_steps=kv_and_weights shares one device, "
                                          r"but rollout.device='cuda:1' is cuda:1 and train.device='auto' is cuda:0; "):
        placement(split)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert placement(parse_config("rollout: {async_ratio: 0, release_between_steps: kv}"))["rollout"][0] == "cpu"


def test_the_line_names_the_judge_device_when_a_domain_has_a_judge(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    judged = parse_config("rollout: {device: cuda:0}\ntrain: {device: cuda:0}\n"
                          "judge: {device: cuda:1, workers: 2, models: {q: {path: m}}}\n"
                          "data: {domains: [{name: w, source: instruct, judge: q}]}")
    assert describe(judged).endswith("(one shared GPU), judge ×2 on cuda:1 (bfloat16)")
    unjudged = parse_config("judge: {device: cuda:1, models: {q: {path: m}}}")
    assert "judge" not in describe(unjudged)


def test_describe_names_servers_and_ranks() -> None:
    cfg = parse_config("{rollout: {engine: server, server_urls: ['http://h:8000']}, "
                       "train: {strategy: megatron, ranks: 4, tensor_parallel: 2, device: cpu}}")
    assert describe(cfg) == ("devices: rollout via server servers (http://h:8000), "
                             "trainer megatron x4 ranks (TP 2 x DP 2) from cpu (float32)")


def test_services_without_a_device_skip_the_device_check_and_never_import_torch() -> None:
    """``rollstream service feeder|reward|recorder|env`` checks the config without importing torch
    (the device check would: ``auto`` asks torch for CUDA); rollout, trainer and judge check it."""
    import subprocess
    import sys

    from schemas.services import SERVICES

    assert {s.name for s in SERVICES.values() if s.runs_model} == {"rollout", "trainer", "judge"}
    code = ("import sys\n"
            "from schemas.config import parse_config\n"
            "from cli import run\n"
            "run.check_backends(parse_config('{}'), devices=False)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "run.check_backends(parse_config('{}'))\n"
            "assert 'torch' in sys.modules\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
