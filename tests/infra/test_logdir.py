"""A run's log directory read without a broker (:mod:`infra.kafka.logdir`), on record batches made by
aiokafka's own encoder: committed, aborted and still open transactions, a batch torn at the end,
damage elsewhere, and the one-line errors for paths that are not a run's log. The export and the
record built from it against the real broker: tests/launch/test_record.py."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.util import calc_crc32c

from infra.kafka.home import StackError
from infra.kafka.logdir import export_log, find_log_dir, read_partition, run_log, split_partition

COMMIT, ABORT = 1, 0


def batch(base: int, values: list[bytes], *, pid: int = -1, txn: bool = False, marker: int | None = None) -> bytes:
    """One record batch (v2) at offset ``base``; ``marker``: a control batch (COMMIT or ABORT) of ``pid``."""
    b = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=txn or marker is not None,
                                  producer_id=pid, producer_epoch=0 if pid >= 0 else -1,
                                  base_sequence=0 if pid >= 0 else -1, batch_size=1 << 20)
    if marker is not None:
        values = [struct.pack(">hih", 0, 0, 0)]
    for i, v in enumerate(values):
        key = struct.pack(">hh", 0, marker) if marker is not None else b"k"
        b.append(i, timestamp=1_000 + i, key=key, value=v, headers=[])
    raw = bytearray(b.build())
    struct.pack_into(">q", raw, 0, base)
    if marker is not None:  # the control bit (attributes bit 5), and the CRC over attributes onward again
        struct.pack_into(">h", raw, 21, struct.unpack_from(">h", raw, 21)[0] | 0x20)
        struct.pack_into(">I", raw, 17, calc_crc32c(bytes(raw[21:])))
    return bytes(raw)


def log_dir(tmp_path: Path, run: str = "r1", node: int = 1) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    (d / "meta.properties").write_text(f"node.id={node}\nversion=1\ncluster.id=abc\n")
    return d


def partition(d: Path, name: str, *segments: bytes) -> Path:
    part = d / name
    part.mkdir()
    base = 0
    for seg in segments:
        (part / f"{base:020d}.log").write_bytes(seg)
        (part / f"{base:020d}.index").write_bytes(b"\0" * 64)
        base += 100
    return part


def test_a_partition_reads_as_read_committed(tmp_path: Path) -> None:
    d = log_dir(tmp_path)
    part = partition(d, "rs.r1.scored-2",
                     batch(0, [b"a", b"b"])                      # plain: offsets 0, 1
                     + batch(2, [b"t1"], pid=7, txn=True)        # committed below
                     + batch(3, [b"x1", b"x2"], pid=8, txn=True)  # aborted below
                     + batch(5, [b"c"])
                     + batch(6, [], pid=7, marker=COMMIT)
                     + batch(7, [], pid=8, marker=ABORT)
                     + batch(8, [b"open"], pid=9, txn=True)      # no marker yet: the last stable offset
                     + batch(9, [b"after"]))
    got = read_partition(part)
    assert [(m.offset, m.value) for m in got.messages] == [(0, b"a"), (1, b"b"), (2, b"t1"), (5, b"c")]
    assert (got.begin, got.end, got.torn) == (0, 8, 0)
    assert split_partition(part.name) == ("rs.r1.scored", 2)


def test_a_batch_torn_at_the_end_is_cut_and_damage_elsewhere_is_an_error(tmp_path: Path) -> None:
    d = log_dir(tmp_path)
    whole, tail = batch(0, [b"a"]), batch(1, [b"b", b"c"])
    got = read_partition(partition(d, "rs.r1.tasks-0", whole + tail[:-5]))
    assert [m.value for m in got.messages] == [b"a"] and got.torn == len(tail) - 5 and got.end == 1
    bad = bytearray(whole)
    bad[-1] ^= 0xFF  # fails its CRC, and a later segment follows
    part = partition(d, "rs.r1.tasks-1", bytes(bad), batch(100, [b"z"]))
    with pytest.raises(StackError, match=r"00000000000000000000\.log is damaged at byte 0 \(a record batch"):
        read_partition(part)


def test_paths_that_are_not_a_runs_log_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(StackError, match=r"does not exist: name the broker's log directory"):
        find_log_dir(tmp_path / "nope")
    with pytest.raises(StackError, match=r"is not a Kafka log directory \(no meta.properties\)"):
        find_log_dir(tmp_path)
    d = log_dir(tmp_path, node=2)
    with pytest.raises(StackError, match=r"log directory of node 2 of a cluster"):
        find_log_dir(d)
    (d / "meta.properties").write_text("node.id=1\n")
    partition(d, "rs.other.tasks-0", batch(0, [b"a"]))
    assert find_log_dir(tmp_path / "data") == d
    with pytest.raises(StackError, match=r"holds no topic of run r1; runs there: other$"), run_log(d, "r1"):
        pass
    with pytest.raises(StackError, match=r"name the archive with one of \.tar\.xz"):
        export_log(d, "other", tmp_path / "out.zip")
    (tmp_path / "junk.tar.xz").write_bytes(b"junk")
    with pytest.raises(StackError, match=r"junk\.tar\.xz is not a readable tar archive"), run_log(tmp_path / "junk.tar.xz", "r1"):
        pass


def test_the_archive_holds_the_run_and_what_a_broker_needs_and_reads_back(tmp_path: Path) -> None:
    d = log_dir(tmp_path)
    partition(d, "rs.r1.tasks-0", batch(0, [b"a", b"b"]))
    partition(d, "rs.r1.scored-0", batch(0, [b"s"]))
    partition(d, "rs.r10.tasks-0", batch(0, [b"not mine"]))
    partition(d, "__cluster_metadata-0", batch(0, [b"meta"]))
    (d / "bootstrap.checkpoint").write_bytes(b"cp")
    done = export_log(d, "r1", tmp_path / "out" / "r1.tar.gz")
    assert (done.partitions, done.files) == (2, 5)
    import tarfile

    with tarfile.open(done.path) as tar:
        names = sorted(tar.getnames())
    root = "r1-kafka-log/"
    assert names == sorted(root + n for n in [
        "rs.r1.scored-0/00000000000000000000.log", "rs.r1.tasks-0/00000000000000000000.log",
        "__cluster_metadata-0/00000000000000000000.log", "meta.properties", "bootstrap.checkpoint",
        "rollstream-export.json"])  # no index files, no other run (r10 shares r1's prefix)
    with run_log(done.path, "r1") as unpacked:
        assert [m.value for m in read_partition(unpacked / "rs.r1.tasks-0").messages] == [b"a", b"b"]
        gone = unpacked
    assert not gone.exists()
