"""weights.files: reading a weight set (directory, shards, one file), its checksum, and publishing a
directory by rename."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from weights import publish_dir, read_weights, weights_sha256


def shards(root: Path) -> Path:
    """A directory with two shards (written out of name order), a shard index and a config."""
    root.mkdir(parents=True, exist_ok=True)
    save_file({"b": torch.arange(4.0).to(torch.bfloat16)}, str(root / "model-00002-of-00002.safetensors"))
    save_file({"a": torch.ones(2, 3)}, str(root / "model-00001-of-00002.safetensors"))
    (root / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (root / "config.json").write_text("{}")
    return root


def test_reads_every_shard_of_a_directory_or_one_file_in_its_dtype(tmp_path: Path) -> None:
    root = shards(tmp_path / "w")
    state = read_weights(root)
    assert set(state) == {"a", "b"}
    assert state["b"].dtype == torch.bfloat16 and torch.equal(state["b"].float(), torch.arange(4.0))
    assert state["a"].device.type == "cpu" and torch.equal(state["a"], torch.ones(2, 3))
    one = read_weights(root / "model-00001-of-00002.safetensors")
    assert set(one) == {"a"}


def test_nothing_to_read_names_the_path(tmp_path: Path) -> None:
    (tmp_path / "only-config").mkdir()
    (tmp_path / "only-config" / "config.json").write_text("{}")
    for missing in (tmp_path / "absent", tmp_path / "only-config"):
        with pytest.raises(FileNotFoundError, match=re.escape(f"no *.safetensors files in {missing}") + "$"):
            read_weights(missing)
    (tmp_path / "empty").mkdir()
    save_file({}, str(tmp_path / "empty" / "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="no tensors"):
        read_weights(tmp_path / "empty")


def test_checksum_is_over_the_safetensors_bytes_in_name_order(tmp_path: Path) -> None:
    root = shards(tmp_path / "w")
    files = sorted(root.glob("*.safetensors"))
    want = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()
    assert weights_sha256(root) == want
    assert weights_sha256(files[0]) == hashlib.sha256(files[0].read_bytes()).hexdigest()
    (root / "config.json").write_text('{"other": 1}')  # not a weight file
    assert weights_sha256(root) == want
    save_file({"a": torch.zeros(2, 3)}, str(files[0]))
    assert weights_sha256(root) != want
    (tmp_path / "none").mkdir()
    assert weights_sha256(tmp_path / "none") == hashlib.sha256(b"").hexdigest()


def test_publish_dir_replaces_the_directory_only_when_the_block_succeeds(tmp_path: Path) -> None:
    final = tmp_path / "out" / "v1"
    final.mkdir(parents=True)
    (final / "old.txt").write_text("old")
    with publish_dir(final) as tmp:
        assert tmp.parent == final.parent and tmp.name.startswith(".v1.tmp-") and list(tmp.iterdir()) == []
        (tmp / "new.txt").write_text("new")
        assert (final / "old.txt").exists()  # readers still see the old directory
    assert sorted(p.name for p in final.iterdir()) == ["new.txt"] and not tmp.exists()

    with pytest.raises(RuntimeError, match="boom"), publish_dir(final) as tmp:
        (tmp / "half.txt").write_text("half")
        raise RuntimeError("boom")
    assert sorted(p.name for p in final.iterdir()) == ["new.txt"] and tmp.exists()
    with publish_dir(final) as again:  # the leftover is cleared
        assert again == tmp and list(again.iterdir()) == []
    assert list(final.iterdir()) == [] and not tmp.exists()

    fresh = tmp_path / "deep" / "er" / "v2"  # parents are created
    with publish_dir(fresh) as tmp:
        (tmp / "x").write_text("x")
    assert (fresh / "x").read_text() == "x"
