"""The blob store: content-addressed names, write-once by rename, checked reads."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from blobs import BlobError, BlobStore, blob_dir_of, is_digest, sha256_hex, share_blobs


def test_put_names_a_blob_by_the_sha256_of_its_bytes(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    digest = store.put(b"\x89PNG fake image")
    assert digest == hashlib.sha256(b"\x89PNG fake image").hexdigest()
    assert store.path(digest) == tmp_path / "blobs" / digest[:2] / digest[2:]
    assert store.has(digest) and store.get(digest) == b"\x89PNG fake image"


def test_put_is_write_once_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    digest = store.put(b"abc")
    mtime = store.path(digest).stat().st_mtime_ns
    assert store.put(b"abc") == digest
    assert store.path(digest).stat().st_mtime_ns == mtime
    assert store.put(b"abd") != digest
    assert sorted(p.name.startswith(".") for p in tmp_path.rglob("*") if p.is_file()) == [False, False]


def test_a_missing_blob_is_an_error_naming_it(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    digest = sha256_hex(b"never stored")
    assert not store.has(digest)
    with pytest.raises(BlobError, match=f"blob {digest}: missing"):
        store.get(digest)


def test_a_corrupt_blob_is_an_error_naming_it(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    digest = store.put(b"original")
    store.path(digest).write_bytes(b"tampered")
    with pytest.raises(BlobError, match=f"blob {digest}: corrupt .*{sha256_hex(b'tampered')}"):
        store.get(digest)


@pytest.mark.parametrize("bad", ["", "abc", "A" * 64, "g" * 64, "../" + "0" * 61])
def test_a_malformed_digest_is_refused(tmp_path: Path, bad: str) -> None:
    assert not is_digest(bad)
    with pytest.raises(BlobError, match="not a sha256 hex digest"):
        BlobStore(tmp_path).get(bad)


def test_the_blob_store_of_a_run_is_beside_its_record(tmp_path: Path) -> None:
    assert blob_dir_of(tmp_path / "run1") == tmp_path / "run1" / "blobs"


def test_share_blobs_gives_a_new_run_the_source_runs_blobs(tmp_path: Path) -> None:
    src, dst = BlobStore(tmp_path / "a" / "blobs"), BlobStore(tmp_path / "b" / "blobs")
    digests = [src.put(b"image one"), src.put(b"image two")]
    dst.put(b"image two")  # held already: left alone
    (src.root / digests[0][:2] / f".{digests[0][2:]}.tmp-1").write_bytes(b"a writer's partial file")
    assert share_blobs(src.root, dst.root) == 1
    assert [dst.get(d) for d in digests] == [b"image one", b"image two"]
    assert not any(p.name.startswith(".") for p in dst.root.rglob("*"))
    assert share_blobs(src.root, dst.root) == 0
    assert share_blobs(tmp_path / "no run" / "blobs", dst.root) == 0  # a text run has no blob store


def test_threads_writing_the_same_blob_at_once_all_get_it(tmp_path: Path) -> None:
    """Episodes of one group reset together in an env worker's threads and store the same frame."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    store, start = BlobStore(tmp_path), threading.Barrier(6)
    data = [bytes([i]) * 4096 for i in range(4)]

    def put(i: int) -> str:
        start.wait()
        return store.put(data[i % 4])

    with ThreadPoolExecutor(6) as pool:
        digests = list(pool.map(put, range(6)))
    assert digests == [sha256_hex(data[i % 4]) for i in range(6)]
    assert sorted(p.name.startswith(".") for p in tmp_path.rglob("*") if p.is_file()) == [False] * 4
