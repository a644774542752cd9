"""Shared-memory weight segments: written whole and sealed, read back as views, refused when not
sealed, truncated, foreign or of another checksum; pruned to the newest versions; and which copy
an engine picks (weights.handoff)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from weights import copy_weights_, read_weights, write_state_dir
from weights.handoff import pick_copy, wait_for_dir
from weights.shm import (
    SegmentError,
    check_segment,
    new_segment_path,
    node_id,
    prune_segments,
    read_segment,
    remove_segments,
    segment_prefix,
    write_segment,
)


def tied_state() -> dict[str, torch.Tensor]:
    """A state like a tied-embedding model's: two names of one tensor, mixed dtypes, a scalar."""
    emb = torch.randn(10, 4)
    return {"embed.weight": emb, "proj.weight": torch.randn(3, 5).to(torch.bfloat16), "head.weight": emb,
            "scale": torch.tensor(2.5, dtype=torch.float64), "steps": torch.arange(6, dtype=torch.int64).view(2, 3),
            "empty": torch.zeros(0)}


def test_a_segment_reads_back_bitwise_as_views_with_tied_names_shared(tmp_path: Path) -> None:
    state = tied_state()
    seg = write_segment(tmp_path / "run-v00001-ab", state)
    assert [p.name for p in tmp_path.iterdir()] == ["run-v00001-ab"]  # no temporary file left
    assert seg.num_bytes == seg.path.stat().st_size and len(seg.checksum) == 64
    back = read_segment(seg.path, seg.checksum)
    assert back.keys() == state.keys()
    for k, v in state.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k], v), k
    assert back["head.weight"] is back["embed.weight"]  # stored once
    assert back["proj.weight"].data_ptr() % 64 == back["embed.weight"].data_ptr() % 64 == 0
    assert check_segment(seg.path, seg.checksum) == seg
    assert read_weights(seg.path).keys() == state.keys()  # the weight-set reader takes segments too


def test_a_segment_swaps_into_a_live_model(tmp_path: Path) -> None:
    src, dst = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    seg = write_segment(tmp_path / "m-v00002-cd", dict(src.state_dict()))
    weight = dst.weight
    copy_weights_(dst, read_segment(seg.path))
    assert dst.weight is weight and torch.equal(dst.weight, src.weight) and torch.equal(dst.bias, src.bias)


def test_an_unsealed_segment_is_refused(tmp_path: Path) -> None:
    """What a writer killed before its seal leaves is a temporary file; even renamed into place by
    hand it is never applied."""
    final = tmp_path / "run-v00003-ef"
    write_segment(final, tied_state(), seal=False)
    assert not final.exists()
    (tmp,) = tmp_path.iterdir()
    assert tmp.name == f".{final.name}.tmp-{os.getpid()}"
    os.replace(tmp, final)
    with pytest.raises(SegmentError, match="is not sealed"):
        read_segment(final)
    with pytest.raises(SegmentError, match="is not sealed"):
        check_segment(final)
    uri, why = pick_copy(str(tmp_path / "dir"), str(final), node_id())
    assert uri == str(tmp_path / "dir") and "is not sealed" in why


def test_truncated_foreign_and_other_checksum_segments_are_refused(tmp_path: Path) -> None:
    seg = write_segment(tmp_path / "run-v00004-aa", tied_state())
    with pytest.raises(SegmentError, match="expected 000000000000"):
        read_segment(seg.path, "0" * 64)
    cut = tmp_path / "cut"
    cut.write_bytes(seg.path.read_bytes()[:-64])
    with pytest.raises(SegmentError, match=f"has {seg.num_bytes - 64} bytes, its header says {seg.num_bytes}"):
        read_segment(cut)
    foreign = tmp_path / "foreign"
    foreign.write_bytes(b"x" * 4096)
    with pytest.raises(SegmentError, match="is not a weights segment"):
        read_segment(foreign)
    tampered = tmp_path / "tampered"
    data = bytearray(seg.path.read_bytes())
    data[140] ^= 1  # inside the manifest
    tampered.write_bytes(bytes(data))
    with pytest.raises(SegmentError, match="does not match its checksum"):
        read_segment(tampered)


def test_a_full_shared_memory_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match=r"no room for \d+ MiB of weights"):
        write_segment(tmp_path / "run-v00005-bb", tied_state())
    assert list(tmp_path.iterdir()) == []


def test_prune_keeps_the_newest_versions_and_remove_takes_all(tmp_path: Path) -> None:
    prefix = segment_prefix(tmp_path / "runs" / "r1")
    assert prefix.startswith("rollstream-r1-") and prefix != segment_prefix(tmp_path / "other" / "r1")
    state = {"w": torch.ones(4)}
    paths = [write_segment(new_segment_path(prefix, v, tmp_path), state).path for v in (1, 2, 3)]
    stale = tmp_path / f".{prefix}-v00004-aa.tmp-999999999"  # a writer that is gone
    stale.write_bytes(b"x")
    mine = tmp_path / f".{prefix}-v00004-bb.tmp-{os.getpid()}"  # a writer still at work
    mine.write_bytes(b"x")
    other = write_segment(new_segment_path("rollstream-r2-00000000", 1, tmp_path), state).path
    assert sorted(prune_segments(prefix, root=tmp_path)) == sorted([paths[0], stale])
    assert all(p.exists() for p in [*paths[1:], mine, other])
    size = sum(p.stat().st_size for p in [*paths[1:], mine])
    assert remove_segments(prefix, root=tmp_path) == size
    assert sorted(tmp_path.iterdir()) == [other]


def test_pick_copy_reads_memory_only_here_and_sealed(tmp_path: Path) -> None:
    seg = write_segment(tmp_path / "run-v00006-cc", {"w": torch.ones(2)})
    d = str(tmp_path / "v6")
    assert pick_copy(d, str(seg.path), node_id(), seg.checksum) == (str(seg.path), "")
    assert pick_copy(d) == (d, "")
    assert pick_copy(d, str(seg.path), "elsewhere", seg.checksum) == (d, f"the memory copy is on elsewhere, this is {node_id()}")
    assert "expected" in pick_copy(d, str(seg.path), node_id(), "f" * 64)[1]
    seg.path.unlink()
    assert pick_copy(d, str(seg.path), node_id(), seg.checksum) == (d, f"the memory copy {seg.path} is gone")
    assert not wait_for_dir(d, 0.0)
    Path(d).mkdir()
    assert wait_for_dir(d, 0.0)


def test_a_directory_written_from_a_segment_is_like_the_export(tmp_path: Path) -> None:
    like = tmp_path / "v0"
    like.mkdir()
    (like / "config.json").write_text("{}")
    (like / "tokenizer.json").write_text("{}")
    (like / "model.safetensors").write_bytes(b"old")
    (like / "model.safetensors.index.json").write_text("{}")
    state = tied_state()
    seg = write_segment(tmp_path / "run-v00007-dd", state)
    path, checksum = write_state_dir(tmp_path / "v7", read_segment(seg.path), like=like)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    back = read_weights(path)
    assert "head.weight" not in back  # a tied name written once, as save_pretrained does
    assert all(torch.equal(back[k], state[k]) for k in back) and back.keys() == state.keys() - {"head.weight"}
    assert len(checksum) == 64
