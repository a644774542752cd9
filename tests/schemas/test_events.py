from __future__ import annotations

import os
import random
from pathlib import Path

import msgspec
import pytest

from schemas import events as ev
from schemas.topics import BATCHED_TOPICS, TOPICS, decode_all, split_value
from tests.schemas.examples import example_events

FIXTURES = Path(__file__).parent / "fixtures"


def topic_of(event: ev.Event) -> str:
    for name, spec in TOPICS.items():
        members = getattr(spec.event_type, "__args__", (spec.event_type,))
        if type(event) in members:
            return name
    raise AssertionError(f"{type(event).__name__} is on no topic")


def test_every_event_type_has_an_example_and_a_topic() -> None:
    examples = example_events()
    assert {type(e) for e in examples} == set(ev.ALL_EVENT_TYPES)
    for e in examples:
        topic_of(e)


@pytest.mark.parametrize("event", example_events(), ids=lambda e: type(e).__name__)
def test_roundtrip_through_its_topic_decoder(event: ev.Event) -> None:
    spec = TOPICS[topic_of(event)]
    dec = msgspec.msgpack.Decoder(spec.event_type)
    assert dec.decode(msgspec.msgpack.encode(event)) == event


def test_tags_are_unique_and_events_are_frozen() -> None:
    tags = [t.__struct_config__.tag for t in ev.ALL_EVENT_TYPES]
    assert len(tags) == len(set(tags))
    task = example_events()[0]
    with pytest.raises(AttributeError):
        task.prompt = "changed"  # type: ignore[misc]


def test_defaults_give_unique_ids_and_timestamps() -> None:
    a = ev.Resume(run_id="r")
    b = ev.Resume(run_id="r")
    assert a.event_id != b.event_id and len(a.event_id) == 32
    assert a.ts > 1.6e9


@pytest.mark.parametrize("version_dir", sorted(p for p in FIXTURES.iterdir() if p.is_dir()), ids=lambda p: p.name)
def test_old_fixtures_still_decode(version_dir: Path) -> None:
    """Evolution rule: payloads of every released version decode with today's Structs."""
    files = sorted(version_dir.glob("*.msgpack"))
    assert files, f"no fixtures in {version_dir}"
    decoders = {name: msgspec.msgpack.Decoder(spec.event_type) for name, spec in TOPICS.items()}
    by_tag = {t.__struct_config__.tag: t for t in ev.ALL_EVENT_TYPES}
    for f in files:
        data = f.read_bytes()
        kind = msgspec.msgpack.decode(data)["kind"]
        assert kind == f.stem
        cls = by_tag[kind]
        decoded = [d.decode(data) for d in decoders.values() if _accepts(d, data)]
        assert len(decoded) == 1, f"{f.name} must decode on exactly one topic"
        assert isinstance(decoded[0], cls)
        assert decoded[0].run_id


BATCHED_FIXTURES = Path(__file__).parent / "fixtures_batched"


@pytest.mark.parametrize("version_dir", sorted(p for p in BATCHED_FIXTURES.iterdir() if p.is_dir()), ids=lambda p: p.name)
def test_old_batched_fixtures_still_decode(version_dir: Path) -> None:
    """Batched records of every released version split into events that decode on their topic,
    each one's bytes exactly its single-event encoding (what the recorder stores per row)."""
    files = {f.stem: f.read_bytes() for f in version_dir.glob("*.msgpack")}
    assert set(files) == set(BATCHED_TOPICS)
    for name, data in files.items():
        dec = msgspec.msgpack.Decoder(TOPICS[name].event_type)
        parts = split_value(data)
        assert parts is not None and len(parts) >= 2 and len(parts) % 2 == 0  # examples written twice over
        events = decode_all(dec, data)
        assert [dec.decode(p) for p in parts] == events
        assert events[: len(events) // 2] == events[len(events) // 2:] and all(e.run_id for e in events)


def _accepts(dec: msgspec.msgpack.Decoder, data: bytes) -> bool:
    try:
        dec.decode(data)
        return True
    except msgspec.ValidationError:
        return False


def test_newer_payload_with_unknown_field_decodes() -> None:
    """Forward compatibility: a field added by a later version is ignored by this one."""
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(example_events()[0]))
    raw["a_future_field"] = [1, 2, 3]
    out = msgspec.msgpack.Decoder(TOPICS["tasks"].event_type).decode(msgspec.msgpack.encode(raw))
    assert out == example_events()[0]


def test_malformed_payload_is_a_validation_error() -> None:
    dec = msgspec.msgpack.Decoder(TOPICS["generations"].event_type)
    with pytest.raises(msgspec.DecodeError):
        dec.decode(b"\xff\x00garbage")
    with pytest.raises(msgspec.ValidationError):
        dec.decode(msgspec.msgpack.encode({"kind": "Generation", "run_id": "r"}))


def test_env_fields_added_after_v3_default_in_old_payloads() -> None:
    """EnvStep.history/env/seed and EnvObservation.env_s/failed: v3 payloads decode with the
    defaults, v4 payloads carry them."""
    dec = msgspec.msgpack.Decoder(TOPICS["env.requests"].event_type)
    old = dec.decode((FIXTURES / "v3" / "EnvStep.msgpack").read_bytes())
    assert isinstance(old, ev.EnvStep) and (old.history, old.env, old.seed) == ([], None, 0)
    new = dec.decode((FIXTURES / "v4" / "EnvStep.msgpack").read_bytes())
    assert isinstance(new, ev.EnvStep) and new.history == ["2*3"] and new.env is not None and new.seed == 7
    obs = msgspec.msgpack.Decoder(TOPICS["env.responses"].event_type)
    old_obs = obs.decode((FIXTURES / "v3" / "EnvObservation.msgpack").read_bytes())
    assert (old_obs.env_s, old_obs.failed) == (0.0, False)
    assert obs.decode((FIXTURES / "v4" / "EnvObservation.msgpack").read_bytes()).env_s == 0.25


def test_generation_episode_fields_added_after_v4_default_in_old_payloads() -> None:
    """Generation.episode_id/step_rewards/turn_versions/state_hashes/env_finish/env_error/success:
    v4 payloads decode with the defaults (a single-turn generation), v5 payloads carry them."""
    dec = msgspec.msgpack.Decoder(TOPICS["generations"].event_type)
    old = dec.decode((FIXTURES / "v4" / "Generation.msgpack").read_bytes())
    assert (old.episode_id, old.step_rewards, old.turn_versions, old.state_hashes) == ("", [], [], [])
    assert (old.env_finish, old.env_error, old.success) == ("", "", False)
    new = dec.decode((FIXTURES / "v5" / "Generation.msgpack").read_bytes())
    assert new.step_rewards == [0.0, 1.0] and new.turn_versions == [3, 4] and new.state_hashes == ["aa11", "bb22"]
    assert (new.episode_id, new.env_finish, new.success) == ("g1/0@0a1b2c3d", "terminated", True)
    assert old.task.redundancy == 0 and new.task.redundancy == 1  # RolloutTask.redundancy, added after v4


def test_judge_fields_added_after_v5_default_in_old_payloads() -> None:
    """ScoredSample.judge/judge_s/judge_error: v5 payloads decode with the defaults (no judge), v6
    payloads carry them; JudgeRequest exists from v6 on (topic judge.requests)."""
    dec = msgspec.msgpack.Decoder(TOPICS["scored"].event_type)
    old = dec.decode((FIXTURES / "v5" / "ScoredSample.msgpack").read_bytes())
    assert (old.judge, old.judge_s, old.judge_error) == ("", 0.0, "")
    new = dec.decode((FIXTURES / "v6" / "ScoredSample.msgpack").read_bytes())
    assert (new.judge, new.judge_s, new.rewards["judge"]) == ("quality", 0.125, 0.75)
    req = msgspec.msgpack.Decoder(TOPICS["judge.requests"].event_type).decode(
        (FIXTURES / "v6" / "JudgeRequest.msgpack").read_bytes())
    assert isinstance(req, ev.JudgeRequest) and req.judge == "quality" and req.scored.generation.response_text == "19"


def test_segment_starts_added_after_v6_default_in_old_payloads() -> None:
    """Generation.segment_starts (history windows): v6 payloads decode as one sequence, v7 payloads
    carry where each later turn's own prompt starts."""
    dec = msgspec.msgpack.Decoder(TOPICS["generations"].event_type)
    old = dec.decode((FIXTURES / "v6" / "Generation.msgpack").read_bytes())
    assert isinstance(old, ev.Generation) and old.segment_starts == []
    new = dec.decode((FIXTURES / "v7" / "Generation.msgpack").read_bytes())
    assert isinstance(new, ev.Generation) and new.segment_starts == [1] and new.loss_mask == [1, 0, 1]


def test_drain_origin_added_after_v7_defaults_to_the_trainer_in_old_payloads() -> None:
    """Drain.origin: a v7 Drain (before the field) reads as the trainer's (see the field's doc for
    why), a v8 one carries who published it."""
    dec = msgspec.msgpack.Decoder(TOPICS["control"].event_type)
    old = dec.decode((FIXTURES / "v7" / "Drain.msgpack").read_bytes())
    assert isinstance(old, ev.Drain) and old.origin == "trainer" and old.reason == "end"
    new = dec.decode((FIXTURES / "v8" / "Drain.msgpack").read_bytes())
    assert isinstance(new, ev.Drain) and new.origin == "user" and new.reason == "end"
    with pytest.raises(msgspec.ValidationError, match="origin"):
        dec.decode(msgspec.msgpack.encode({"kind": "Drain", "run_id": "r", "origin": "someone"}))


def test_task_system_prompt_added_after_v8_defaults_to_the_domains_in_old_payloads() -> None:
    """RolloutTask.system_prompt (a file row's own system turn): a v8 task has none (the domain's
    applies), a v9 one carries it."""
    dec = msgspec.msgpack.Decoder(TOPICS["tasks"].event_type)
    old = dec.decode((FIXTURES / "v8" / "RolloutTask.msgpack").read_bytes())
    assert isinstance(old, ev.RolloutTask) and old.system_prompt == "" and old.prompt == "12+7="
    new = dec.decode((FIXTURES / "v9" / "RolloutTask.msgpack").read_bytes())
    assert isinstance(new, ev.RolloutTask) and new.system_prompt == "Answer with a number."


def test_weights_memory_copy_added_after_v9_defaults_to_none_in_old_payloads() -> None:
    """WeightsPublished.memory / memory_host / memory_checksum (the same-node shared-memory copy):
    a v9 event has none (engines read the directory), a v10 one says where the segment is."""
    dec = msgspec.msgpack.Decoder(TOPICS["weights"].event_type)
    old = dec.decode((FIXTURES / "v9" / "WeightsPublished.msgpack").read_bytes())
    assert isinstance(old, ev.WeightsPublished) and old.uri == "/tmp/w/v4" and old.checksum == "ab" * 32
    assert (old.memory, old.memory_host, old.memory_checksum) == ("", "", "")
    new = dec.decode((FIXTURES / "v10" / "WeightsPublished.msgpack").read_bytes())
    assert isinstance(new, ev.WeightsPublished) and new.uri == "/tmp/w/v4" and new.memory_host == "node-a"
    assert new.memory.endswith("-v00004-e5f6a7b8") and new.memory_checksum == "cd" * 32


def test_weights_broadcast_added_after_v15_defaults_to_none_in_old_payloads() -> None:
    """WeightsPublished.broadcast (the trainer's sender for other nodes): a v15 event has none
    (other nodes read the directory), a v16 one names it."""
    dec = msgspec.msgpack.Decoder(TOPICS["weights"].event_type)
    old = dec.decode((FIXTURES / "v15" / "WeightsPublished.msgpack").read_bytes())
    assert isinstance(old, ev.WeightsPublished) and old.broadcast == "" and old.memory_host == "node-a"
    new = dec.decode((FIXTURES / "v16" / "WeightsPublished.msgpack").read_bytes())
    assert isinstance(new, ev.WeightsPublished) and new.broadcast == "gloo://10.0.0.7:29517"


@pytest.mark.parametrize("k", [0, 7, 999_999, 1_234_567])
def test_group_ids_carry_their_number(k: int) -> None:
    assert ev.group_number(ev.group_id_of(k)) == k
    assert ev.group_id_of(k) == f"g{k:06d}"


@pytest.mark.parametrize("other", ["", "g", "gx1", "h000001", "g-1", "job/3", "g①"])
def test_other_group_ids_have_no_number(other: str) -> None:
    assert ev.group_number(other) is None


def test_task_baseline_index_added_after_v10_defaults_to_none_in_old_payloads() -> None:
    """RolloutTask.baseline_index (ReMax's greedy baseline task): a v10 task's group has none, a v11
    one names it (one past the group's samples); only the task with that index is the baseline."""
    dec = msgspec.msgpack.Decoder(TOPICS["tasks"].event_type)
    old = dec.decode((FIXTURES / "v10" / "RolloutTask.msgpack").read_bytes())
    assert isinstance(old, ev.RolloutTask) and old.baseline_index == -1 and not old.is_baseline
    new = dec.decode((FIXTURES / "v11" / "RolloutTask.msgpack").read_bytes())
    assert isinstance(new, ev.RolloutTask) and new.baseline_index == 5 and not new.is_baseline
    assert msgspec.structs.replace(new, index=5).is_baseline


def test_task_image_hashes_added_after_v11_default_to_none_in_old_payloads() -> None:
    """RolloutTask.image_hashes (a visual task's images in the blob store): a v11 task is a text task,
    a v12 one names its image's digest; both decode, and a Generation carries its task's hashes."""
    dec = msgspec.msgpack.Decoder(TOPICS["tasks"].event_type)
    old = dec.decode((FIXTURES / "v11" / "RolloutTask.msgpack").read_bytes())
    assert isinstance(old, ev.RolloutTask) and old.image_hashes == []
    new = dec.decode((FIXTURES / "v12" / "RolloutTask.msgpack").read_bytes())
    assert isinstance(new, ev.RolloutTask) and new.image_hashes == ["ab" * 32]
    gen = msgspec.msgpack.decode((FIXTURES / "v12" / "Generation.msgpack").read_bytes(), type=ev.Generation)
    assert gen.task.image_hashes == ["ab" * 32]


def test_eval_answers_added_after_v12_default_to_none_in_old_payloads() -> None:
    """EvalResult.answers (the greedy answers to a few held-out problems): a v12 evaluation has none,
    a v13 one carries an answer naming its image's digest."""
    dec = msgspec.msgpack.Decoder(TOPICS["metrics"].event_type)
    old = dec.decode((FIXTURES / "v12" / "EvalResult.msgpack").read_bytes())
    assert isinstance(old, ev.EvalResult) and old.answers == [] and old.metrics == {"eval/accuracy": 0.5}
    new = dec.decode((FIXTURES / "v13" / "EvalResult.msgpack").read_bytes())
    assert isinstance(new, ev.EvalResult) and [(a.reference, a.correct, a.image_hashes) for a in new.answers] == \
        [("red", True, ["cd" * 32])]


def test_generation_peak_memory_added_after_v11_defaults_to_unreported_in_old_payloads() -> None:
    """Generation.peak_memory_gib (the rollout worker's peak memory): a v11 generation has none (0),
    a new one carries it through its topic."""
    dec = msgspec.msgpack.Decoder(TOPICS["generations"].event_type)
    old = dec.decode((FIXTURES / "v11" / "Generation.msgpack").read_bytes())
    assert isinstance(old, ev.Generation) and old.peak_memory_gib == 0.0 and old.response_ids
    new = dec.decode(msgspec.msgpack.encode(msgspec.structs.replace(old, peak_memory_gib=3.25)))
    assert isinstance(new, ev.Generation) and new.peak_memory_gib == 3.25


def test_observation_images_added_after_v13_default_to_none_in_old_payloads() -> None:
    """EnvObservation.image_hashes and Generation.image_hashes (a visual environment's images): a v13
    observation and generation show none, v14 ones name the image's digest."""
    obs = msgspec.msgpack.Decoder(TOPICS["env.responses"].event_type)
    gens = msgspec.msgpack.Decoder(TOPICS["generations"].event_type)
    for version, want in (("v13", []), ("v14", ["ef" * 32])):
        o = obs.decode((FIXTURES / version / "EnvObservation.msgpack").read_bytes())
        g = gens.decode((FIXTURES / version / "Generation.msgpack").read_bytes())
        assert isinstance(o, ev.EnvObservation) and o.image_hashes == want and o.observation == "7"
        assert isinstance(g, ev.Generation) and g.image_hashes == want and g.task.image_hashes == ["ab" * 32]


def test_segment_images_added_after_v14_default_to_none_in_old_payloads() -> None:
    """Generation.segment_image_hashes (a windowed visual episode's images per segment): a v14
    generation has none, a v15 one names each segment's (the first shows the image, the second none),
    and the field round-trips through its topic."""
    dec = msgspec.msgpack.Decoder(TOPICS["generations"].event_type)
    old = dec.decode((FIXTURES / "v14" / "Generation.msgpack").read_bytes())
    assert isinstance(old, ev.Generation) and old.segment_image_hashes == [] and old.image_hashes == ["ef" * 32]
    new = dec.decode((FIXTURES / "v15" / "Generation.msgpack").read_bytes())
    assert isinstance(new, ev.Generation) and new.segment_image_hashes == [["ef" * 32], []]
    again = dec.decode(msgspec.msgpack.encode(msgspec.structs.replace(new, segment_image_hashes=[["ab" * 32], ["cd" * 32]])))
    assert isinstance(again, ev.Generation) and again.segment_image_hashes == [["ab" * 32], ["cd" * 32]]


def test_event_ids_are_random_128_bit_hex_whatever_the_run_seeds() -> None:
    random.seed(0)  # a run seeds the global generator: event ids must not follow it
    first = [ev.new_event_id() for _ in range(1000)]
    random.seed(0)
    again = [ev.new_event_id() for _ in range(1000)]
    assert len(set(first + again)) == 2000
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in first)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX")
def test_a_forked_child_draws_other_event_ids_than_its_parent() -> None:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        os.write(w, "".join(ev.new_event_id() for _ in range(8)).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    child = os.read(r, 1024).decode()
    os.close(r)
    parent = "".join(ev.new_event_id() for _ in range(8))
    assert len(child) == len(parent) == 256 and child != parent
