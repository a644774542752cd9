"""The table of services holds together: names, topics, orders, groups, config keys."""

from __future__ import annotations

import msgspec
import pytest

from schemas.config import PlacementConfig, RunConfig, ServicePlacement, parse_config
from schemas.services import SERVICES, ServiceSpec, in_start_order, stop_waves, value_at
from schemas.topics import TOPICS, check_run_id


def test_names_are_unique_and_the_keys() -> None:
    names = [s.name for s in SERVICES.values()]
    assert len(set(names)) == len(names) == len(SERVICES)
    assert all(key == spec.name for key, spec in SERVICES.items())
    assert set(SERVICES) == {"feeder", "rollout", "env", "reward", "judge", "trainer", "recorder"}


@pytest.mark.parametrize("spec", SERVICES.values(), ids=list(SERVICES))
def test_every_topic_of_a_service_is_a_topic_of_the_run(spec: ServiceSpec) -> None:
    for field in ("consumes", "produces", "observes", "lag_topics"):
        unknown = set(getattr(spec, field)) - set(TOPICS)
        assert not unknown, f"{spec.name}.{field} names topics that do not exist: {sorted(unknown)}"
        assert len(set(getattr(spec, field))) == len(getattr(spec, field)), f"{spec.name}.{field} repeats a topic"
    assert not set(spec.observes) & set(spec.consumes), "a topic is either consumed or observed"
    assert spec.consumes, "a service consumes something"
    assert set(spec.lag_topics) <= set(spec.consumes)
    assert bool(spec.lag_topics) == spec.grouped  # a group has a lag, no group none


def test_every_topic_is_produced_and_read_by_some_service() -> None:
    """Except ``dlq``, which the runtime writes for every consumer, every topic has a service that
    writes it, and every topic has a service that reads it."""
    produced = {t for s in SERVICES.values() for t in s.produces}
    read = {t for s in SERVICES.values() for t in s.subscribed}
    assert set(TOPICS) - produced == {"dlq"}
    assert read == set(TOPICS)


def test_start_and_stop_orders() -> None:
    assert sorted(s.start_order for s in SERVICES.values()) == list(range(len(SERVICES)))
    assert [s.name for s in in_start_order()] == ["recorder", "feeder", "reward", "judge", "env", "rollout", "trainer"]
    # the env and judge workers serve rollout and reward: they are stopped after them
    assert stop_waves() == [("rollout", "reward"), ("env", "judge")]
    assert {s.name for s in SERVICES.values() if s.lifecycle == "finishes"} == {"feeder", "trainer", "recorder"}
    # a service that finishes by itself is never SIGTERMed in a wave
    assert not {n for wave in stop_waves() for n in wave} & {"feeder", "trainer", "recorder"}


def test_group_and_transactional_ids_are_built_here() -> None:
    run = check_run_id("r-1")
    ids = {spec.group_id(run) for spec in SERVICES.values()}
    assert len(ids) == len(SERVICES)
    assert SERVICES["rollout"].group_id(run) == "rs-rollout-r-1"
    assert SERVICES["recorder"].group_id("") == "rs-recorder-all"
    assert SERVICES["reward"].transactional_id(run) == "rs-reward-r-1"
    assert SERVICES["judge"].transactional_id(run, "judge1") == "rs-judge-r-1-judge1"


def test_every_service_has_a_placement_section_and_nothing_else_does() -> None:
    placed = {f.name for f in msgspec.structs.fields(PlacementConfig) if f.type is ServicePlacement}
    assert placed == set(SERVICES)
    cfg = RunConfig()
    for spec in SERVICES.values():
        assert isinstance(value_at(cfg, spec.placement_key), ServicePlacement)


def test_device_and_replica_keys_are_config_keys() -> None:
    cfg = parse_config("{rollout: {workers: 3, device: cpu}, env: {workers: 2}, judge: {workers: 4}}")
    assert {s.name: s.replicas(cfg) for s in SERVICES.values()} == {
        "feeder": 1, "rollout": 3, "env": 2, "reward": 1, "judge": 4, "trainer": 1, "recorder": 1}
    assert {s.name: s.device(cfg) for s in SERVICES.values() if s.runs_model} == {
        "rollout": "cpu", "judge": cfg.judge.device, "trainer": cfg.train.device}
    assert all(s.device(cfg) == "" for s in SERVICES.values() if not s.runs_model)


def test_the_loops_a_table_row_may_name() -> None:
    for spec in SERVICES.values():
        assert spec.loops and len(set(spec.loops)) == len(spec.loops)
        assert set(spec.loops) <= {"record", "batch", "transactional"}
        assert "batch" not in spec.loops or spec.loops == ("batch",), "a batch handler runs only on the batch loop"
    # transactions need a consumer group to commit offsets in
    assert all(s.grouped for s in SERVICES.values() if "transactional" in s.loops)
