"""Weights to other nodes over torch.distributed (weights.broadcast): a version arrives whole as a
sealed segment in the receiving node's shared memory, once per node; a version no longer held is
refused; a receiver or a sender killed with SIGKILL mid-transfer leaves no segment, and the sender
serves the next receiver."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from weights.broadcast import Relay, WeightSender, route_address
from weights.handoff import pick_copy
from weights.shm import SegmentError, new_segment_path, read_segment, write_segment

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "rollstream-run-0a1b2c3d"


def state(v: float, numel: int = 1000) -> dict[str, torch.Tensor]:
    w = torch.full((numel,), v)
    return {"embed.weight": w, "lm_head.weight": w, "norm": torch.arange(7, dtype=torch.bfloat16) + v}


@pytest.fixture
def trainer_node(tmp_path: Path) -> Path:
    (tmp_path / "trainer").mkdir()
    return tmp_path / "trainer"


@pytest.fixture
def other_node(tmp_path: Path) -> Path:
    (tmp_path / "other").mkdir()
    return tmp_path / "other"


@pytest.fixture
def sender() -> object:
    s = WeightSender("127.0.0.1", timeout_s=20.0)
    yield s
    s.close()


def test_a_version_arrives_whole_once_per_node_and_the_nodes_engines_find_it(
        sender: WeightSender, trainer_node: Path, other_node: Path) -> None:
    seg = write_segment(new_segment_path(PREFIX, 3, trainer_node), state(3.0))
    sender.offer(3, seg.path)
    got = Relay(other_node, timeout_s=20.0).fetch(sender.url, 3, str(seg.path), seg.checksum)
    assert got == other_node / seg.path.name and sender.sent == 1
    received = read_segment(got, seg.checksum)
    for name, t in state(3.0).items():
        assert torch.equal(received[name], t), name
    assert received["embed.weight"].data_ptr() == received["lm_head.weight"].data_ptr()  # tied: one copy
    # another engine of that node: the copy is there, nothing is sent again
    assert Relay(other_node, timeout_s=20.0).fetch(sender.url, 3, str(seg.path), seg.checksum) == got
    assert sender.sent == 1
    assert pick_copy("/runs/r/weights/v00003", str(seg.path), "trainer-host", seg.checksum, root=other_node) == (
        str(got), "")
    assert pick_copy("/runs/r/weights/v00003", str(seg.path), "trainer-host", "ab" * 32, root=other_node)[0] == (
        "/runs/r/weights/v00003")  # another checksum: not that version


def test_engines_of_one_node_asking_at_once_receive_it_once(sender: WeightSender, trainer_node: Path,
                                                            other_node: Path) -> None:
    seg = write_segment(new_segment_path(PREFIX, 1, trainer_node), state(1.0, numel=2_000_000))
    sender.offer(1, seg.path)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(
        Relay(other_node, timeout_s=20.0).fetch(sender.url, 1, str(seg.path), seg.checksum))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30.0)
    assert results == [other_node / seg.path.name] * 3 and sender.sent == 1


def test_a_version_no_longer_held_is_refused_and_older_received_copies_are_pruned(
        sender: WeightSender, trainer_node: Path, other_node: Path) -> None:
    segs = {v: write_segment(new_segment_path(PREFIX, v, trainer_node), state(float(v))) for v in (1, 2, 3, 4)}
    relay = Relay(other_node, timeout_s=20.0)
    sender.offer(1, segs[1].path)
    relay.fetch(sender.url, 1, str(segs[1].path), segs[1].checksum)
    for v in (2, 3, 4):
        sender.offer(v, segs[v].path)
    with pytest.raises(SegmentError, match="no longer holds weights v2"):
        relay.fetch(sender.url, 2, str(segs[2].path), segs[2].checksum)
    segs[4].path.unlink()  # pruned by the trainer after it was offered
    with pytest.raises(SegmentError, match="no longer holds weights v4"):
        relay.fetch(sender.url, 4, str(segs[4].path), segs[4].checksum)
    relay.fetch(sender.url, 3, str(segs[3].path), segs[3].checksum)
    assert sorted(p.name for p in other_node.iterdir() if not p.name.startswith(".")) == sorted(
        [segs[1].path.name, segs[3].path.name])  # the newest 2 versions stay
    with pytest.raises(SegmentError, match="checksum"):  # another checksum than the event's: not applied
        Relay(other_node, timeout_s=20.0).fetch(sender.url, 3, str(segs[3].path).replace("v00003", "v00005"),
                                                "ab" * 32)
    assert not list(other_node.glob(".*.tmp-*"))


def test_a_new_run_of_the_same_id_starts_again_at_version_0_and_its_copies_stay(
        sender: WeightSender, trainer_node: Path, other_node: Path) -> None:
    relay = Relay(other_node, timeout_s=20.0)
    for v in (7, 8):
        seg = write_segment(new_segment_path(PREFIX, v, trainer_node), state(float(v)))
        sender.offer(v, seg.path)
        relay.fetch(sender.url, v, str(seg.path), seg.checksum)
    again = WeightSender("127.0.0.1", timeout_s=20.0)  # the new run's trainer
    try:
        seg = write_segment(new_segment_path(PREFIX, 1, trainer_node), state(1.0))
        again.offer(1, seg.path)
        got = relay.fetch(again.url, 1, str(seg.path), seg.checksum)
    finally:
        again.close()
    kept = sorted(p.name.split("-")[-2] for p in other_node.glob(f"{PREFIX}-v*"))
    assert got.exists() and kept == ["v00001", "v00008"]  # the newest received and the one before


def test_a_receiver_that_joins_and_goes_silent_holds_up_no_other(sender: WeightSender, trainer_node: Path,
                                                                  other_node: Path) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    host, port = sender.url.removeprefix("gloo://").rsplit(":", 1)
    silent = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=20))
    assert silent.compare_set("join/1", "", "silent") == b"silent"  # joins as number 1, never forms its group
    seg = write_segment(new_segment_path(PREFIX, 1, trainer_node), state(1.0))
    sender.offer(1, seg.path)
    got = Relay(other_node, timeout_s=20.0).fetch(sender.url, 1, str(seg.path), seg.checksum)
    assert got.name == seg.path.name and sender.sent == 1


def test_a_trainer_restarted_on_the_same_port_is_joined_anew_at_once(trainer_node: Path, other_node: Path) -> None:
    relay = Relay(other_node, timeout_s=20.0)
    first = WeightSender("127.0.0.1", timeout_s=20.0)
    seg = write_segment(new_segment_path(PREFIX, 1, trainer_node), state(1.0))
    first.offer(1, seg.path)
    relay.fetch(first.url, 1, str(seg.path), seg.checksum)
    first.close()
    again = WeightSender("127.0.0.1", port=int(first.url.rsplit(":", 1)[1]), timeout_s=20.0)
    try:
        assert again.url == first.url
        seg = write_segment(new_segment_path(PREFIX, 2, trainer_node), state(2.0))
        again.offer(2, seg.path)
        t0 = time.monotonic()
        got = relay.fetch(again.url, 2, str(seg.path), seg.checksum)  # the kept connection fails: a new one
        assert got.name == seg.path.name and time.monotonic() - t0 < 15.0
    finally:
        again.close()


def _wait_for(pattern: str, root: Path, timeout_s: float = 30.0) -> Path:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = list(root.glob(pattern))
        if found:
            return found[0]
        time.sleep(0.0005)
    raise AssertionError(f"no {pattern} in {root} within {timeout_s} s")


BIG = 48_000_000
"""Floats in the kill tests' segments (192 MB): a transfer lasts long enough to land in."""


def test_a_receiver_killed_mid_transfer_leaves_no_segment_and_the_sender_serves_on(
        sender: WeightSender, trainer_node: Path, other_node: Path) -> None:
    seg = write_segment(new_segment_path(PREFIX, 1, trainer_node), state(1.0, numel=BIG))
    sender.offer(1, seg.path)
    code = ("import sys; from pathlib import Path; from weights.broadcast import Relay; "
            "Relay(Path(sys.argv[1]), 20.0).fetch(sys.argv[2], 1, sys.argv[3], sys.argv[4])")
    proc = subprocess.Popen([sys.executable, "-c", code, str(other_node), sender.url, str(seg.path), seg.checksum],
                            cwd=ROOT)
    try:
        tmp = _wait_for(f".{seg.path.name}.tmp-*", other_node)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)
    assert tmp.exists() and not (other_node / seg.path.name).exists()  # a temporary file no reader opens
    got = Relay(other_node, timeout_s=20.0).fetch(sender.url, 1, str(seg.path), seg.checksum)  # prunes it
    assert torch.equal(read_segment(got, seg.checksum)["norm"], state(1.0)["norm"])
    assert not tmp.exists()


def test_a_sender_killed_mid_transfer_is_an_error_and_leaves_no_segment(trainer_node: Path,
                                                                        other_node: Path) -> None:
    seg = write_segment(new_segment_path(PREFIX, 1, trainer_node), state(1.0, numel=BIG))
    code = ("import sys, time; from pathlib import Path; from weights.broadcast import WeightSender; "
            "s = WeightSender('127.0.0.1', timeout_s=20.0); s.offer(1, Path(sys.argv[1])); "
            "print(s.url, flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(seg.path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    errors: list[BaseException] = []

    def fetch() -> None:
        try:
            Relay(other_node, timeout_s=3.0).fetch(url, 1, str(seg.path), seg.checksum)
        except BaseException as e:
            errors.append(e)

    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        t = threading.Thread(target=fetch)
        t.start()
        _wait_for(f".{seg.path.name}.tmp-*", other_node)
        os.kill(proc.pid, signal.SIGKILL)
        t.join(30.0)
    finally:
        proc.kill()
        proc.wait(30)
    assert not t.is_alive() and len(errors) == 1 and isinstance(errors[0], RuntimeError | OSError)
    assert list(other_node.iterdir()) == [other_node / f".{PREFIX}.lock"]  # no segment, no temporary file


def test_the_announced_address_is_the_route_toward_the_broker() -> None:
    assert route_address("127.0.0.1:9092") == "127.0.0.1"
    assert route_address("localhost:9092,other:9092") == "127.0.0.1"
    assert route_address("") == "127.0.0.1"
    assert route_address("no-such-host.invalid:9092")  # no route: this node's name
