"""Fuzzing event decoding and the sanity checks (hypothesis; strategies in tests/schemas/fuzzing.py).

* ``Consumer.decode(topic, bytes)``, the decode every consumer runs on what it polls, returns an
  event of the topic's union or a one-line reason for any bytes on any topic — it never raises.
* A decoded (type-valid) event with impossible values goes through the checks the services run
  (``schemas.sanity``) and comes out sound or rejected with one line — they never raise, and what
  they pass holds what the trainer relies on.
"""

from __future__ import annotations

import math
import typing

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.clients import Consumer
from schemas import events as ev
from schemas import sanity
from schemas.config import KafkaSettings
from schemas.topics import TOPICS, topic_name
from tests.schemas.examples import example_events
from tests.schemas.fuzzing import SEEDS, hostile_bytes, hostile_generations, hostile_scored, hostile_tasks

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOPIC_NAMES = sorted(TOPICS)
CONSUMER = Consumer(KafkaSettings(), "127.0.0.1:1", group_id=None, topics=["unused"])  # decode only: never started
ENC = msgspec.msgpack.Encoder()


def union_types(name: str) -> tuple[type, ...]:
    tp = TOPICS[name].event_type
    return typing.get_args(tp) or (tp,)


def assert_decoded_or_one_line(name: str, value: bytes) -> None:
    event, error = CONSUMER.decode(topic_name("fuzz", name), value)
    if error is None:
        assert isinstance(event, union_types(name)), (name, event)
    else:
        assert event is None
        assert error.strip() and "\n" not in error and len(error) <= 500, error


@FUZZ
@given(name=st.sampled_from(TOPIC_NAMES), value=hostile_bytes())
def test_decode_never_raises(name: str, value: bytes) -> None:
    assert_decoded_or_one_line(name, value)


def test_every_seed_decodes_on_its_topic_and_is_refused_elsewhere() -> None:
    """The seeds the fuzzers mutate are real: each decodes on some topic; on a topic whose union
    lacks its type it is a one-line reason."""
    for value in SEEDS:
        decoded = [n for n in TOPIC_NAMES if CONSUMER.decode(topic_name("fuzz", n), value)[1] is None]
        assert decoded, value[:60]
        for n in TOPIC_NAMES:
            assert_decoded_or_one_line(n, value)


def test_known_hostile_payloads() -> None:
    """Payloads hypothesis found raising (before the fix, msgspec's UnicodeDecodeError escaped
    ``decode`` and took the consumer down) and other edge cases, kept as regressions."""
    gen = ENC.encode(ev.RolloutTask(run_id="r", sample_id="s", group_id="g", index=0, group_size=1, prompt_id="p",
                                   domain="d", prompt="x"))
    cases = [
        gen.replace(b"\xa1s", b"\xa1\xff"),  # a string that is not UTF-8
        b"\x91" * 100_000 + b"\xc0",  # nested 100k deep
        b"", b"\xc1", b"\xdd\xff\xff\xff\xff",  # empty, never-used byte, an array claiming 4G items
        gen[:-1], gen + b"\x00",  # cut, trailing byte
    ]
    for value in cases:
        for n in TOPIC_NAMES:
            assert_decoded_or_one_line(n, value)
    assert CONSUMER.decode(topic_name("fuzz", "tasks"), None) == (None, "message has no value (tombstone)")


# --------------------------------------------------------------------------- sanity checks


def wire(event: ev.Event) -> typing.Any:
    """``event`` as a consumer sees it: encoded and decoded (only values the wire carries)."""
    return msgspec.msgpack.decode(ENC.encode(event), type=type(event))


def assert_verdict(why: str | None) -> None:
    assert why is None or (isinstance(why, str) and why.strip() and "\n" not in why), why


@FUZZ
@given(task=hostile_tasks())
def test_check_task_rejects_cleanly(task: ev.RolloutTask) -> None:
    task = wire(task)
    why = sanity.check_task(task, domains={"arith"})
    assert_verdict(why)
    if why is None:
        assert task.sample_id and task.group_id
        assert 0 <= task.index < task.group_size <= sanity.MAX_GROUP_SIZE
        assert task.max_new_tokens is None or 1 <= task.max_new_tokens <= sanity.MAX_TOKENS
        assert task.policy_version >= 0
        assert all(len(h) == 64 and set(h) <= set("0123456789abcdef") for h in task.image_hashes)


@FUZZ
@given(gen=hostile_generations())
def test_check_generation_rejects_cleanly(gen: ev.Generation) -> None:
    gen = wire(gen)
    why = sanity.check_generation(gen)
    assert_verdict(why)
    if why is None:  # what the trainer indexes and sums over
        assert len(gen.response_ids) == len(gen.logprobs) == len(gen.loss_mask)
        assert gen.prompt_ids and all(0 <= t <= sanity.MAX_TOKEN_ID for t in gen.prompt_ids + gen.response_ids)
        assert all(math.isfinite(x) and x <= 1e-3 for x in gen.logprobs)
        assert set(gen.loss_mask) <= {0, 1}
        assert 0 <= gen.policy_version <= gen.policy_version_end and gen.num_turns >= 1
        assert sanity.check_task(gen.task) is None


@FUZZ
@given(scored=hostile_scored())
def test_check_scored_rejects_cleanly(scored: ev.ScoredSample) -> None:
    scored = wire(scored)
    why = sanity.check_scored(scored)
    assert_verdict(why)
    if why is None:
        assert all(math.isfinite(x) for x in (scored.reward, scored.reward_s, *scored.rewards.values(),
                                              *scored.step_rewards))
        assert sanity.check_generation(scored.generation) is None


def test_the_examples_are_sound() -> None:
    """The checks pass real events (no false rejections of what the services produce)."""
    checked = 0
    for e in example_events():
        if isinstance(e, ev.RolloutTask):
            assert sanity.check_task(e, domains={"arith"}) is None
        elif isinstance(e, ev.Generation):
            assert sanity.check_generation(e) is None
        elif isinstance(e, ev.ScoredSample):
            assert sanity.check_scored(e) is None
        else:
            continue
        checked += 1
    assert checked == 3


def test_segment_images_must_match_the_segments_and_the_images() -> None:
    """A windowed episode's per-segment images: one list per segment, together its ``image_hashes``."""
    import msgspec

    gen = next(e for e in example_events() if isinstance(e, ev.Generation))
    assert gen.segment_starts == [1] and sanity.check_generation(gen) is None
    three = msgspec.structs.replace(gen, segment_image_hashes=[["ef" * 32], [], []])
    assert "segment_image_hashes has 3 segments, segment_starts gives 2" in str(sanity.check_generation(three))
    other = msgspec.structs.replace(gen, segment_image_hashes=[["ef" * 32], ["ef" * 32]])
    assert "not the concatenation of segment_image_hashes" in str(sanity.check_generation(other))


def test_the_per_token_checks_hold_at_their_bounds() -> None:
    (gen,) = [e for e in example_events() if type(e) is ev.Generation]
    rep = msgspec.structs.replace
    n = len(gen.response_ids)

    def why(**fields: typing.Any) -> str | None:
        return sanity.check_generation(rep(gen, **fields))

    top = sanity.MAX_TOKEN_ID
    assert why(prompt_ids=[0, top], response_ids=[0] * n) is None  # the bounds themselves pass
    assert why(response_ids=[], logprobs=[], loss_mask=[], segment_starts=[], segment_image_hashes=[]) is None
    assert "token ids outside" in str(why(prompt_ids=[-1]))
    assert "token ids outside" in str(why(response_ids=[top + 1] * n))
    assert why(logprobs=[1e-3] * n) is None  # float error up to the slack
    assert "above 0" in str(why(logprobs=[0.0] * (n - 1) + [0.01]))
    assert "non-finite values (nan)" in str(why(logprobs=[float("nan")] * n))
    assert "non-finite values (-inf)" in str(why(logprobs=[0.0] * (n - 1) + [-math.inf]))
    assert "other than 0 and 1" in str(why(loss_mask=[1] * (n - 1) + [2]))
