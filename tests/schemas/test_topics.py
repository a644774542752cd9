from __future__ import annotations

import msgspec
import pytest

from schemas.topics import (
    TOPICS,
    BadRunId,
    check_run_id,
    count_events,
    decode_all,
    pack_values,
    parse_topic,
    spec_for_topic,
    split_value,
    topic_name,
)
from tests.schemas.examples import example_events


def test_registry_matches_design() -> None:
    assert set(TOPICS) == {
        "tasks", "env.requests", "env.responses", "generations", "scored", "judge.requests", "weights", "metrics",
        "control", "dlq",
    }
    assert TOPICS["weights"].cleanup == "compact"
    assert TOPICS["weights"].configs()["cleanup.policy"] == "compact"
    assert all(s.partitions >= 1 for s in TOPICS.values())


def test_topic_names_roundtrip() -> None:
    for name in TOPICS:
        t = topic_name("run-1", name)
        assert t == f"rs.run-1.{name}"
        assert parse_topic(t) == ("run-1", name)
        assert spec_for_topic(t) is TOPICS[name]
    assert parse_topic("other.topic") is None
    assert parse_topic("rs.run.unknown") is None


@pytest.mark.parametrize("bad", ["", "a.b", "has space", "x" * 121, "ü"])
def test_bad_run_ids_are_rejected(bad: str) -> None:
    with pytest.raises(BadRunId, match="run id"):
        check_run_id(bad)


def test_unknown_topic_name() -> None:
    with pytest.raises(KeyError, match="unknown topic"):
        topic_name("r", "nope")


@pytest.mark.parametrize("n", [1, 2, 15, 16, 65535, 65536])
def test_packed_values_split_back_exactly(n: int) -> None:
    # the array header changes size at 16 and 65536 elements; elements keep their own bytes
    values = [msgspec.msgpack.encode({"i": i} if i < 20 else i) for i in range(n)]
    packed = pack_values(values)
    assert split_value(packed) == values
    assert count_events(packed) == n  # from the header alone
    assert msgspec.msgpack.decode(packed) == [msgspec.msgpack.decode(v) for v in values]


def test_a_single_event_is_not_a_batch_and_decodes_as_before() -> None:
    task = next(e for e in example_events() if type(e).__name__ == "RolloutTask")
    data = msgspec.msgpack.encode(task)
    dec = msgspec.msgpack.Decoder(TOPICS["tasks"].event_type)
    assert split_value(data) is None and split_value(b"") is None and split_value(None) is None
    assert decode_all(dec, data) == [task]
    assert decode_all(dec, pack_values([data, data])) == [task, task]
    with pytest.raises(msgspec.DecodeError):
        split_value(pack_values([data, data])[:-3])  # a damaged array


def test_count_events_of_a_single_event_and_a_tombstone() -> None:
    task = next(e for e in example_events() if type(e).__name__ == "RolloutTask")
    assert count_events(msgspec.msgpack.encode(task)) == 1
    assert count_events(b"") == 0 and count_events(None) == 0
