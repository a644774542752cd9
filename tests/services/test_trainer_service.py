"""Group assembly and the staleness filter of the trainer service (pure functions)."""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from schemas import events as ev
from services.trainer_service import assemble, ready_groups


def scored(group: str, index: int, version: int, size: int = 4, reward: float = 1.0) -> ev.ScoredSample:
    task = ev.RolloutTask(run_id="r", sample_id=f"{group}/{index}", group_id=group, index=index, group_size=size,
                          prompt_id="p", domain="arith", prompt="1+1=", reference="2")
    gen = ev.Generation(run_id="r", task=task, prompt_ids=[1], response_ids=[2], response_text="2", logprobs=[-0.1],
                        loss_mask=[1], finish_reason="stop", policy_version=version, policy_version_end=version)
    return ev.ScoredSample(run_id="r", generation=gen, reward=reward, policy_version=version)


def test_only_complete_groups_in_arrival_order() -> None:
    groups: OrderedDict[str, list[ev.ScoredSample]] = OrderedDict()
    groups["a"] = [scored("a", i, 0) for i in range(3)]  # incomplete (3 of 4)
    groups["b"] = [scored("b", i, 0) for i in range(4)]
    assert ready_groups(groups, batch_size=8) is None  # only 4 complete samples
    groups["c"] = [scored("c", i, 0) for i in range(4)]
    assert ready_groups(groups, batch_size=8) == ["b", "c"]
    groups["a"].append(scored("a", 3, 0))
    assert ready_groups(groups, batch_size=8) == ["a", "b"]
    assert ready_groups(groups, batch_size=4) == ["a"]


def test_staleness_filter_drops_and_records_reasons() -> None:
    fresh = [scored("f", i, 5) for i in range(4)]
    mixed = [scored("m", 0, 3), scored("m", 1, 4), scored("m", 2, 5), scored("m", 3, 5)]
    lone = [scored("l", 0, 1), scored("l", 1, 1), scored("l", 2, 1), scored("l", 3, 5)]
    batch, rejected = assemble([fresh, mixed, lone], version=5, max_staleness=1)
    assert [s.generation.task.sample_id for s in batch] == ["f/0", "f/1", "f/2", "f/3", "m/1", "m/2", "m/3"]
    by_id = {s.generation.task.sample_id: (status, reason) for s, status, reason in rejected}
    assert by_id["m/0"] == ("dropped_stale", "stale: gap 2 > 1")
    assert by_id["l/0"][0] == "dropped_stale"
    assert by_id["l/3"] == ("filtered", "group too small after the staleness filter")
    # every sample is either in the batch or rejected, exactly once
    assert len(batch) + len(rejected) == 12


def test_on_policy_batch_keeps_everything() -> None:
    groups = [[scored("g", i, 7) for i in range(4)]]
    batch, rejected = assemble(groups, version=7, max_staleness=0)
    assert len(batch) == 4 and rejected == []


def test_checkpoint_restores_model_buffer_and_positions(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch

    from rollout.model_init import init_tiny_model
    from schemas.config import TinyModelSpec, parse_config
    from services.kafka.bus import TopicPartition
    from services.trainer_service import Trainer, TrainerSettings

    model = init_tiny_model(tmp_path / "m", TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2,
                                                         intermediate_size=64, max_position_embeddings=32))
    cfg = parse_config("rollout: {group_size: 4}\ntrain: {batch_size: 4}\ndata: {heldout_size: 2}")
    settings = TrainerSettings(run_id="r", config=cfg, model_dir=str(model), run_dir=str(tmp_path / "run"))
    a = Trainer(settings)
    a.add(scored("g", 0, 0))
    a.decided.add("old/0")
    a.positions[TopicPartition("rs.r.scored", 2)] = 17
    a.version = 3
    with torch.no_grad():
        next(a.strategy.model.parameters()).add_(1.0)
    a.save_checkpoint()

    b = Trainer(settings)
    assert b.load_checkpoint()
    assert b.version == 3 and b.decided == {"old/0"}
    assert [s.generation.task.sample_id for s in b.groups["g"]] == ["g/0"]
    assert b.positions == {TopicPartition("rs.r.scored", 2): 17}
    for pa, pb in zip(a.strategy.model.parameters(), b.strategy.model.parameters(), strict=True):
        assert torch.equal(pa, pb)
    # a redelivered sample of a decided or buffered id is ignored
    b.add(scored("g", 0, 0))
    b.add(scored("old", 0, 0))
    assert len(b.groups["g"]) == 1 and "old" not in b.groups


def test_dynamic_filter_drops_groups_without_signal() -> None:
    from schemas.config import AlgorithmConfig

    def grp(gid: str, rewards: list[float]) -> list[ev.ScoredSample]:
        return [msgspec.structs.replace(scored(gid, i, 0), reward=r) for i, r in enumerate(rewards)]

    algo = AlgorithmConfig(dynamic_filter="all_equal")
    batch, rejected = assemble([grp("a", [1, 1, 1, 1]), grp("b", [1, 0, 0, 1])], version=0, max_staleness=0,
                               algo=algo)
    assert [s.generation.task.group_id for s in batch] == ["b"] * 4
    assert {(s.generation.task.group_id, st) for s, st, _ in rejected} == {("a", "filtered")}
    assert all("all 4 rewards equal" in why for _, _, why in rejected)


def test_reference_model_loaded_only_when_a_kl_term_is_on(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from rollout.model_init import init_tiny_model
    from schemas.config import TinyModelSpec, parse_config
    from services.trainer_service import Trainer, TrainerSettings

    model = init_tiny_model(tmp_path / "m", TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2,
                                                         intermediate_size=64, max_position_embeddings=32))
    for text, wants_ref in [("", False), ("algorithm: {use_kl_loss: true}", True),
                            ("algorithm: {add_token_level_kl: true}", True)]:
        cfg = parse_config("rollout: {group_size: 4}\ntrain: {batch_size: 4}\ndata: {heldout_size: 2}\n" + text)
        run_dir = tmp_path / f"run{int(wants_ref)}{len(text)}"
        t = Trainer(TrainerSettings(run_id="r", config=cfg, model_dir=str(model), run_dir=str(run_dir)))
        t.setup_algorithm_models(fresh=True)
        assert (t.strategy.ref_model is not None) == wants_ref, text
        assert (run_dir / "reference").exists() == wants_ref
        t.save_checkpoint()
        again = Trainer(TrainerSettings(run_id="r", config=cfg, model_dir=str(model), run_dir=str(run_dir)))
        assert again.load_checkpoint()
        assert (again.strategy.ref_model is not None) == wants_ref
