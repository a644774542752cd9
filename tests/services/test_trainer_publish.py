"""The trainer's weight handoff (services.trainer.publish) with a stand-in strategy: by memory the
event names a sealed segment and the directory follows, written from the segment (not from the
model the next step changes); by disk as before; a full /dev/shm falls back to disk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from schemas.config import parse_config
from services.trainer import publish
from services.trainer.publish import WeightsPublisher, resolve_handoff, weight_sender
from weights import publish_dir, read_segment, read_weights, weights_sha256
from weights.broadcast import Relay


class Strategy:
    """What the publisher calls on a strategy: ``export_weights`` and ``export_state``."""

    def __init__(self) -> None:
        self.w = torch.zeros(8)

    def export_state(self) -> dict[str, torch.Tensor]:
        return {"w": self.w}

    def export_weights(self, path: str | Path) -> tuple[Path, str]:
        with publish_dir(path) as tmp:
            (tmp / "config.json").write_text('{"model_type": "x"}')
            save_file({"w": self.w}, str(tmp / "model.safetensors"))
            checksum = weights_sha256(tmp)
        return Path(path), checksum


async def test_memory_announces_the_segment_then_writes_the_directory_from_it(tmp_path: Path, shm_dir: Path) -> None:
    s, pub = Strategy(), WeightsPublisher("r", tmp_path / "run", "memory")
    first = await pub.publish(s, 0, 0)  # a process's first version: the strategy writes the directory
    assert first.memory and first.memory_host and Path(first.uri).is_dir() and len(first.checksum) == 64
    for v in (1, 2, 3):
        s.w.fill_(v)
        e = await pub.publish(s, v, v)
        s.w.fill_(-1)  # the next step changes the model while the directory is written
        assert e.uri.endswith(f"v{v:05d}") and e.checksum == "" and Path(e.memory).parent == shm_dir
        assert torch.equal(read_segment(e.memory, e.memory_checksum)["w"], torch.full((8,), float(v)))
        await pub.settle()
        assert torch.equal(read_weights(e.uri)["w"], torch.full((8,), float(v)))
        assert (Path(e.uri) / "config.json").read_text() == '{"model_type": "x"}'
    assert sorted(p.name[-14:-9] for p in shm_dir.iterdir()) == ["00002", "00003"]  # the newest 2 stay
    assert sorted(p.name for p in (tmp_path / "run" / "weights").iterdir()) == ["v00001", "v00002", "v00003"]
    assert pub.local_ref(3) == Path(e.memory) and pub.local_ref(1) == tmp_path / "run" / "weights" / "v00001"
    pub.close()
    assert list(shm_dir.iterdir()) == []


async def test_disk_and_a_full_shared_memory_publish_the_directory(tmp_path: Path, shm_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    e = await WeightsPublisher("r", tmp_path / "a", "disk").publish(Strategy(), 0, 0)
    assert (e.memory, e.memory_host, e.memory_checksum) == ("", "", "") and Path(e.uri).is_dir() and e.checksum

    def full(path: Path, state: dict[str, torch.Tensor]) -> None:
        raise OSError(28, "no room for 1 MiB of weights in /dev/shm")

    monkeypatch.setattr(publish, "write_segment", full)
    e = await WeightsPublisher("r", tmp_path / "b", "memory").publish(Strategy(), 1, 1)
    assert e.memory == "" and Path(e.uri).is_dir() and e.checksum == weights_sha256(e.uri)
    assert list(shm_dir.iterdir()) == []


def test_auto_is_memory_where_it_can_be(tmp_path: Path) -> None:
    assert resolve_handoff(parse_config("", [])) == "memory"
    assert resolve_handoff(parse_config("", ["train.weights_handoff=disk"])) == "disk"
    assert resolve_handoff(parse_config("", ["train.strategy=fsdp2", "train.ranks=2"])) == "disk"
    assert resolve_handoff(parse_config("", []), shm_dir=tmp_path / "none") == "disk"
    with pytest.raises(RuntimeError, match=r"train\.weights_handoff=memory needs shared memory at"):
        resolve_handoff(parse_config("", ["train.weights_handoff=memory"]), shm_dir=tmp_path / "none")
    with pytest.raises(RuntimeError, match=r"train\.weights_broadcast=gloo sends shared-memory copies, and this node"):
        resolve_handoff(parse_config("", ["train.weights_broadcast=gloo"]), shm_dir=tmp_path / "none")


async def test_with_a_broadcast_the_event_says_where_other_nodes_receive_each_version(
        tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """train.weights_broadcast=gloo: the trainer serves its segments at the address its event
    carries (the route toward the broker unless one is given); a taken port is one line."""
    assert weight_sender(parse_config("", [])) is None
    monkeypatch.setenv("ROLLSTREAM_BOOTSTRAP", "127.0.0.1:9092")
    sender = weight_sender(parse_config("", ["train.weights_broadcast=gloo"]))
    assert sender is not None and sender.url.startswith("gloo://127.0.0.1:")
    s, pub = Strategy(), WeightsPublisher("r", tmp_path / "run", "memory", sender=sender)
    try:
        for v in (0, 1):
            s.w.fill_(v)
            e = await pub.publish(s, v, v)
            assert e.broadcast == sender.url and e.memory
        other = tmp_path / "other-node"
        other.mkdir()
        got = Relay(other).fetch(e.broadcast, 1, e.memory, e.memory_checksum)
        assert torch.equal(read_segment(got, e.memory_checksum)["w"], torch.full((8,), 1.0))
        port = sender.url.rsplit(":", 1)[1]
        with pytest.raises(RuntimeError, match=rf"train\.weights_broadcast_port={port}: cannot serve weights at "):
            weight_sender(parse_config("", ["train.weights_broadcast=gloo", f"train.weights_broadcast_port={port}",
                                            "train.weights_broadcast_host=127.0.0.1"]))
    finally:
        pub.close()
    assert list(shm_dir.iterdir()) == []
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_gloo_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"needs torch\.distributed with gloo, which this torch build lacks"):
        weight_sender(parse_config("", ["train.weights_broadcast=gloo"]))
