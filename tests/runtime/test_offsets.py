"""runtime.offsets: the finished-prefix tracker and the ahead list committed with an offset
(pure unit tests; the runtime tests use both against the real broker)."""

from __future__ import annotations

import random

import pytest

from runtime.bus import TopicPartition
from runtime.offsets import AHEAD_TAG, WHOLE, OffsetTracker, decode_ahead, encode_ahead, holds, whole_records

TP = TopicPartition("rs.t.generations", 0)


def test_ahead_list_examples() -> None:
    assert encode_ahead(100, []) == ""
    assert encode_ahead(100, [102, 103, 104, 107]) == f"{AHEAD_TAG}2-4,7"
    assert encode_ahead(100, [100]) == f"{AHEAD_TAG}0"
    assert encode_ahead(0, [5, 3, 4, 4]) == f"{AHEAD_TAG}3-5"  # unordered, repeated
    assert decode_ahead(100, f"{AHEAD_TAG}2-4,7") == {(o, WHOLE) for o in (102, 103, 104, 107)}
    assert decode_ahead(7, "") == set()


def test_ahead_list_round_trips() -> None:
    rng = random.Random(0)
    for _ in range(500):
        base = rng.randrange(0, 10**9)
        offsets = {base + rng.randrange(0, 300) for _ in range(rng.randrange(0, 60))}
        meta = encode_ahead(base, offsets)
        assert decode_ahead(base, meta) == {(o, WHOLE) for o in offsets}
        assert len(meta) <= len(AHEAD_TAG) + 5 * len(offsets)  # deltas < 300: short


def test_ahead_list_refuses_an_offset_before_the_committed_one() -> None:
    with pytest.raises(ValueError, match="before the committed offset"):
        encode_ahead(10, [9, 11])


def test_foreign_and_damaged_metadata() -> None:
    assert decode_ahead(5, "written by some tool") == set()  # not ours: nothing to skip
    for bad in ("x", "3-1", "-2", "1,,2", "1-a", "1.", "1.3-2", "a.1", "-1.2"):
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


def test_ahead_list_of_batched_records() -> None:
    # records 102-104 done whole, events 0-2 and 5 of record 109 done (the rest of it is not)
    entries = {(102, WHOLE), (103, WHOLE), (104, WHOLE), (109, 0), (109, 1), (109, 2), (109, 5)}
    meta = encode_ahead(100, entries)
    assert meta == f"{AHEAD_TAG}2-4,9.0-2,9.5"
    assert decode_ahead(100, meta) == entries
    assert encode_ahead(100, [(105, 3), 105]) == f"{AHEAD_TAG}5"  # the whole record covers its events
    assert holds(entries, 103, 7) and holds(entries, 109, 5) and not holds(entries, 109, 3)
    # a record whose every event is listed is written as the whole record
    assert whole_records({(7, 0), (7, 1), (8, 0)}, {7: 2, 8: 3}) == {(7, WHOLE), (8, 0)}


def test_ahead_list_of_batched_records_round_trips() -> None:
    rng = random.Random(1)
    for _ in range(300):
        base = rng.randrange(0, 10**9)
        entries = {(base + rng.randrange(0, 50), rng.choice([WHOLE, *range(64)])) for _ in range(rng.randrange(0, 80))}
        whole = {o for o, i in entries if i == WHOLE}
        expected = {(o, i) for o, i in entries if i == WHOLE or o not in whole}
        assert decode_ahead(base, encode_ahead(base, entries)) == expected


def test_tracker_commits_a_batched_record_once_every_event_is_done() -> None:
    t = OffsetTracker()
    for _ in range(3):  # the record at 10 carries 3 events, 11 carries one
        t.add(TP, 10, 3)
    t.add(TP, 11)
    t.done(TP, 11)
    t.done(TP, 10, 2)
    t.done(TP, 10, 0)
    assert t.position(TP) == 10 and t.ready() == {}  # event 1 of record 10 is not done
    t.done(TP, 10, 0)  # a repeat changes nothing
    assert t.ready() == {}
    t.done(TP, 10, 1)
    assert t.position(TP) == 12 and t.ready() == {TP: 12}


def test_tracker_never_passes_a_record_admitted_in_part() -> None:
    t = OffsetTracker()
    t.add(TP, 20, 4)  # only events 0 and 1 of 4 were admitted (a stop came before the rest)
    t.done(TP, 20, 0)
    t.done(TP, 20, 1)
    assert t.position(TP) == 20 and t.ready() == {}
