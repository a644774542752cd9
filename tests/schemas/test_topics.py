from __future__ import annotations

import pytest

from schemas.topics import TOPICS, BadRunId, check_run_id, parse_topic, spec_for_topic, topic_name


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
