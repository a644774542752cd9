"""runtime.offsets: the finished-prefix tracker and the ahead list committed with an offset
(pure unit tests; the runtime tests use both against the real broker)."""

from __future__ import annotations

import random

import pytest

from runtime.bus import TopicPartition
from runtime.offsets import AHEAD_TAG, OffsetTracker, decode_ahead, encode_ahead

TP = TopicPartition("rs.t.generations", 0)


def test_ahead_list_examples() -> None:
    assert encode_ahead(100, []) == ""
    assert encode_ahead(100, [102, 103, 104, 107]) == f"{AHEAD_TAG}2-4,7"
    assert encode_ahead(100, [100]) == f"{AHEAD_TAG}0"
    assert encode_ahead(0, [5, 3, 4, 4]) == f"{AHEAD_TAG}3-5"  # unordered, repeated
    assert decode_ahead(100, f"{AHEAD_TAG}2-4,7") == {102, 103, 104, 107}
    assert decode_ahead(7, "") == set()


def test_ahead_list_round_trips() -> None:
    rng = random.Random(0)
    for _ in range(500):
        base = rng.randrange(0, 10**9)
        offsets = {base + rng.randrange(0, 300) for _ in range(rng.randrange(0, 60))}
        meta = encode_ahead(base, offsets)
        assert decode_ahead(base, meta) == offsets
        assert len(meta) <= len(AHEAD_TAG) + 5 * len(offsets)  # deltas < 300: short


def test_ahead_list_refuses_an_offset_before_the_committed_one() -> None:
    with pytest.raises(ValueError, match="before the committed offset"):
        encode_ahead(10, [9, 11])


def test_foreign_and_damaged_metadata() -> None:
    assert decode_ahead(5, "written by some tool") == set()  # not ours: nothing to skip
    for bad in ("x", "3-1", "-2", "1,,2", "1-a"):
        with pytest.raises(ValueError, match="damaged ahead list"):
            decode_ahead(5, AHEAD_TAG + bad)


def test_tracker_prefix_and_position() -> None:
    t = OffsetTracker()
    assert t.position(TP) is None and t.committed(TP) == -1
    for o in (10, 11, 13, 14):  # 12: not a record (a transaction marker)
        t.add(TP, o)
    assert t.position(TP) == 10  # nothing finished yet: the first admitted offset
    t.done(TP, 13)
    assert t.position(TP) == 10 and t.ready() == {}  # 13 finished out of order
    t.done(TP, 10)
    assert t.position(TP) == 11 and t.ready() == {TP: 11}
    t.done(TP, 11)
    assert t.position(TP) == 14  # past 13, which finished before
    t.mark_committed({TP: 14})
    assert t.committed(TP) == 14 and t.ready() == {}
    t.done(TP, 14)
    assert t.ready() == {TP: 15}
    t.drop([TP])
    assert t.position(TP) is None and t.committed(TP) == -1
