"""Hypothesis strategies of hostile event bytes and hostile (type-valid) events, shared by the
decode and sanity fuzz tests (tests/schemas/test_fuzz.py) and the runtime burst test
(tests/runtime/test_fuzz_runtime.py).

* :func:`hostile_bytes` — what a topic may carry that no producer of ours writes: arbitrary bytes,
  valid encodings of every event with bytes flipped, cut, inserted or duplicated, with a field's
  value swapped for one of another type, wrapped in deep nesting, or with strings that are not
  UTF-8.
* :func:`hostile_generations` and friends — events that decode (every value fits its type) but
  hold impossible values: NaN and ±inf, negative and absurd counts, per-token lists of different
  lengths, token ids outside the int32 range.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
from hypothesis import strategies as st

from schemas import events as ev
from tests.schemas.examples import example_events

FIXTURES = Path(__file__).parent / "fixtures"

_ENC = msgspec.msgpack.Encoder()


def seed_encodings() -> list[bytes]:
    """Valid msgpack of every event type: today's examples and every released fixture."""
    seeds = [_ENC.encode(e) for e in example_events()]
    seeds += [p.read_bytes() for p in sorted(FIXTURES.glob("v*/*.msgpack"))]
    return seeds


SEEDS = seed_encodings()

# --------------------------------------------------------------------------- hostile bytes

_ODD_VALUES = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20), st.binary(max_size=20),
    st.lists(st.integers(-5, 5), max_size=4),
    st.dictionaries(st.text(max_size=5), st.integers(-5, 5), max_size=3),
)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid encoding with 1-4 byte-level mutations."""
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "duplicate", "delete"]))
        i = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del data[i:]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "duplicate":
            j = draw(st.integers(i, min(len(data), i + 16)))
            data[i:i] = data[i:j]
        elif op == "delete" and data:
            del data[i : i + draw(st.integers(1, 8))]
    return bytes(data)


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        out.append((*prefix, k))
        out += _paths(v, (*prefix, k))
    return out


@st.composite
def type_swapped(draw: st.DrawFn) -> bytes:
    """A valid encoding with one field's (or list item's) value replaced by a value of any type."""
    obj = msgspec.msgpack.decode(draw(st.sampled_from(SEEDS[: len(example_events())])))
    path = draw(st.sampled_from(_paths(obj)))
    node = obj
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = draw(_ODD_VALUES)
    return _ENC.encode(obj)


@st.composite
def deeply_nested(draw: st.DrawFn) -> bytes:
    """A valid encoding with one field holding arrays nested thousands deep."""
    obj = msgspec.msgpack.decode(draw(st.sampled_from(SEEDS[: len(example_events())])))
    key = draw(st.sampled_from(sorted(k for k in obj if k != "kind")))
    depth = draw(st.integers(100, 5000))
    inner = _ENC.encode(obj).replace(_ENC.encode(key) + _ENC.encode(obj[key]),
                                     _ENC.encode(key) + b"\x91" * depth + b"\xc0", 1)
    return inner


@st.composite
def not_utf8(draw: st.DrawFn) -> bytes:
    """A valid encoding with the bytes of one string replaced by bytes that are not UTF-8."""
    data = draw(st.sampled_from(SEEDS))
    strings = [i for i in range(len(data) - 2) if 0xA2 <= data[i] <= 0xBF]  # fixstr headers (len >= 2)
    if not strings:
        return data
    i = draw(st.sampled_from(strings))
    return data[: i + 1] + b"\xff" + data[i + 2 :]


def hostile_bytes(*, deep: bool = True) -> st.SearchStrategy[bytes]:
    """Every kind of hostile payload (see the module doc); ``deep=False`` leaves deep nesting out."""
    kinds = [st.binary(max_size=512), mutated(), type_swapped(), not_utf8()]
    return st.one_of(*kinds, *([deeply_nested()] if deep else []))


# --------------------------------------------------------------------------- hostile events

_ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True)
_WIRE_INT = st.one_of(st.integers(-3, 70), st.integers(min_value=-(2**63), max_value=2**63 - 1))
_FLOATS = st.lists(st.one_of(st.floats(-20, 0), _ANY_FLOAT), max_size=6)
_IDS = st.lists(st.one_of(st.integers(0, 50), _WIRE_INT), max_size=6)


@st.composite
def hostile_tasks(draw: st.DrawFn) -> ev.RolloutTask:
    return ev.RolloutTask(
        run_id="fuzz", sample_id=draw(st.sampled_from(["g/0", "", "g/1"])), group_id=draw(st.sampled_from(["g", ""])),
        index=draw(_WIRE_INT), group_size=draw(_WIRE_INT), prompt_id="p", domain=draw(st.sampled_from(["arith", "x"])),
        prompt="1+1=", reference="2", policy_version=draw(_WIRE_INT),
        max_new_tokens=draw(st.one_of(st.none(), _WIRE_INT)),
        env=draw(st.one_of(st.none(), st.builds(ev.EnvSpec, name=st.just("arith"),
                                                 kwargs=st.dictionaries(st.just("x"), _ANY_FLOAT, max_size=1)))),
    )


@st.composite
def hostile_generations(draw: st.DrawFn) -> ev.Generation:
    n = draw(st.integers(0, 4))
    aligned = draw(st.booleans())

    def per_token(strategy: st.SearchStrategy[Any]) -> list[Any]:
        return draw(st.lists(strategy, min_size=n, max_size=n) if aligned else st.lists(strategy, max_size=6))

    return ev.Generation(
        run_id="fuzz", task=draw(hostile_tasks()), prompt_ids=draw(_IDS),
        response_ids=per_token(st.one_of(st.integers(0, 50), _WIRE_INT)),
        response_text="2", logprobs=per_token(st.one_of(st.floats(-20, 0), _ANY_FLOAT)),
        loss_mask=per_token(st.one_of(st.integers(0, 1), _WIRE_INT)),
        finish_reason=draw(st.sampled_from(["stop", "length", "abort", "error"])),
        policy_version=draw(_WIRE_INT), policy_version_end=draw(_WIRE_INT), num_turns=draw(_WIRE_INT),
        queued_s=draw(_ANY_FLOAT), gen_s=draw(_ANY_FLOAT), env_s=draw(_ANY_FLOAT),
    )


@st.composite
def hostile_scored(draw: st.DrawFn) -> ev.ScoredSample:
    return ev.ScoredSample(
        run_id="fuzz", generation=draw(hostile_generations()), reward=draw(st.one_of(st.floats(-1, 1), _ANY_FLOAT)),
        rewards=draw(st.dictionaries(st.sampled_from(["correct", "format"]), _ANY_FLOAT, max_size=2)),
        step_rewards=draw(_FLOATS), reward_s=draw(_ANY_FLOAT), policy_version=draw(_WIRE_INT),
    )
