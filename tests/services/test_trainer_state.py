"""The trainer's state: one Struct a checkpoint writes and reads whole, and the checkpoints of
earlier versions (``StreamState``, a flat ``buffer``) still load."""

from __future__ import annotations

from pathlib import Path

import msgspec

from schemas import events as ev
from services.trainer.checkpoint import read_state
from services.trainer.state import TrainerState

FIXTURES = Path(__file__).parent / "fixtures"


def scored(group: str, index: int) -> ev.ScoredSample:
    task = ev.RolloutTask(run_id="r", sample_id=f"{group}/{index}", group_id=group, index=index, group_size=4,
                          prompt_id="p", domain="arith", prompt="1+1=", reference="2")
    gen = ev.Generation(run_id="r", task=task, prompt_ids=[1], response_ids=[2], response_text="2", logprobs=[-0.1],
                        loss_mask=[1], finish_reason="stop", policy_version=0, policy_version_end=0)
    return ev.ScoredSample(run_id="r", generation=gen, reward=1.0, policy_version=0)


def test_the_state_round_trips_whole() -> None:
    state = TrainerState(step=4, version=5, positions={"rs.r.scored:0": 9}, decided={"z/0", "a/1"},
                         dead={"a": {"a/1"}}, groups={"b": [scored("b", 0)], "a": [scored("a", 0), scored("a", 2)]},
                         pool={"c/1": scored("c", 1)})
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(state), type=TrainerState)
    assert again == state and list(again.groups) == ["b", "a"]  # groups keep their arrival order
    assert "buffer" not in msgspec.msgpack.decode(msgspec.msgpack.encode(state))  # the old field is never written
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(TrainerState()), type=TrainerState) == TrainerState()


def test_a_checkpoint_state_written_before_this_struct_loads(tmp_path: Path) -> None:
    """``stream_state.msgpack`` as the trainer wrote it at af813ad (``StreamState``: step, version,
    positions, a flat buffer with the re-run pool at its end, sorted decided ids, dead members)."""
    (tmp_path / "stream_state.msgpack").write_bytes((FIXTURES / "trainer_stream_state_af813ad.msgpack").read_bytes())
    state = read_state(tmp_path)
    assert (state.step, state.version) == (3, 3)
    assert state.positions == {"rs.r.scored:0": 41, "rs.r.scored:1": 17, "rs.r.dlq:0": 2}
    assert {g: [s.generation.task.sample_id for s in m] for g, m in state.groups.items()} == {
        "g000007": ["g000007/0", "g000007/2"], "g000005": ["g000005/1", "g000005/3"], "g000004": ["g000004/0"]}
    assert list(state.groups) == ["g000007", "g000005", "g000004"] and state.buffer == [] and state.pool == {}
    assert state.groups["g000007"][1].generation.policy_version == 3 and state.groups["g000005"][0].reward == 0.0
    assert state.decided == {"g000001/0", "g000001/1", "g000001/2", "g000001/3", "g000002/0", "g000002/1", "g000007/1"}
    assert state.dead == {"g000007": {"g000007/1"}, "g000002": {"g000002/1"}}


def test_a_checkpoint_state_from_before_dead_members_loads() -> None:
    """The oldest checkpoints have no ``dead`` (and the fields of that time only)."""
    old = {"step": 1, "version": 1, "positions": {"rs.r.scored:0": 4}, "buffer": [msgspec.to_builtins(scored("a", 0))],
           "decided": ["b/0"]}
    state = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=TrainerState)
    assert state.dead == {} and state.decided == {"b/0"} and list(state.groups) == ["a"]
