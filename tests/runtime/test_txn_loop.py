"""The exactly-once loop's transaction plan (runtime/txn_loop.py), without a broker: which
finished records the next transaction commits, and the offset and ahead list it commits with."""

from __future__ import annotations

import asyncio

from runtime.bus import TopicPartition
from runtime.offsets import AHEAD_MAX_CHARS, WHOLE, decode_ahead, encode_ahead
from runtime.runner import Context, Delivery, Record, Runner, Service, ServiceSettings, Subscription
from runtime.txn_loop import TxnLoop
from schemas.config import KafkaSettings

TP = TopicPartition("rs.plan.generations", 0)


class Nothing(Service):
    name = "plan"

    async def handle(self, rec: Record, ctx: Context) -> None:  # never called: no broker here
        raise AssertionError("not run")


def finished_loop(finished: list[int], last: int) -> TxnLoop:
    """The loop of a transactional runner that read offsets ``0 .. last`` of ``TP`` and finished ``finished``."""
    kafka = KafkaSettings(bootstrap="127.0.0.1:9")  # never connected: the plan needs no broker
    r = Runner(Nothing(), ServiceSettings(run_id="plan", kafka=kafka,
                                          subscription=Subscription(group_id="g", topics=["generations"]),
                                          delivery=Delivery(transactional=True, commit="after_effect")))
    assert isinstance(r.loop, TxnLoop)  # the settings pick the exactly-once loop
    for o in range(last + 1):
        r.loop.offsets.add(TP, o)
    for o in finished:
        r.loop.offsets.done(TP, o)
        r.loop.done[(TP, o, 0)] = ([], None, None)
    return r.loop


def test_every_finished_record_goes_in_when_the_ahead_list_fits() -> None:
    r = finished_loop([0, 1, 3, 4, 5, 9], last=10)  # 2 is unfinished: 3, 4, 5 and 9 are ahead of it
    keys, offsets, ahead = r._txn_plan(None)
    assert [o for _, o, _ in keys] == [0, 1, 3, 4, 5, 9]
    assert offsets == {TP: (2, "rs-ahead1:1-3,7")}
    assert ahead == {TP: {(3, WHOLE), (4, WHOLE), (5, WHOLE), (9, WHOLE)}}


def test_the_ahead_list_stops_at_the_first_record_that_would_overflow_it() -> None:
    finished = list(range(1, 4000, 2))  # every other record after the unfinished offset 0
    assert len(encode_ahead(0, set(finished))) > AHEAD_MAX_CHARS
    keys, offsets, ahead = finished_loop(finished, last=4000)._txn_plan(None)
    taken = [o for _, o, _ in keys]
    pos, metadata = offsets[TP]
    assert pos == 0 and len(metadata) <= AHEAD_MAX_CHARS
    assert taken == finished[: len(taken)] and 0 < len(taken) < len(finished)  # a prefix, the rest wait
    assert decode_ahead(pos, metadata) == {(o, WHOLE) for o in taken} == ahead[TP]
    assert len(encode_ahead(0, {*taken, finished[len(taken)]})) > AHEAD_MAX_CHARS  # the next one did not fit


def test_events_of_a_batched_record_go_in_one_by_one() -> None:
    # record 0 (one event) done; record 1 carries 4 events, 0 and 2 done; record 2 (3 events) all done
    r = finished_loop([0], last=0)
    for off, n, done in ((1, 4, (0, 2)), (2, 3, (0, 1, 2))):
        for _ in range(n):
            r.offsets.add(TP, off, n)
        r.sizes[(TP, off)] = n
        for i in done:
            r.offsets.done(TP, off, i)
            r.done[(TP, off, i)] = ([], None, None)
    keys, offsets, ahead = r._txn_plan(None)
    assert [(o, i) for _, o, i in keys] == [(0, 0), (1, 0), (1, 2), (2, 0), (2, 1), (2, 2)]
    assert offsets == {TP: (1, "rs-ahead1:0.0,0.2,1")}  # events 0 and 2 of record 1, all of record 2
    assert ahead == {TP: {(1, 0), (1, 2), (2, WHOLE)}}


async def test_a_revoke_waits_for_the_transaction_in_flight_and_never_overlaps_it() -> None:
    r = finished_loop([0, 1], last=3)
    active, most, committed = 0, 0, []

    async def transaction(outputs: list, offsets: dict) -> None:  # the producer: one transaction at a time
        nonlocal active, most
        active += 1
        most = max(most, active)
        await asyncio.sleep(0.05)
        committed.append(dict(offsets))
        active -= 1

    r.io.transaction = transaction  # type: ignore[method-assign]
    periodic = asyncio.ensure_future(r._commit_txn_ready())
    await asyncio.sleep(0.01)  # the periodic transaction is in flight
    r.offsets.done(TP, 2)
    r.done[(TP, 2, 0)] = ([], None, None)  # finished meanwhile: the revoke commits it
    await asyncio.gather(periodic, r.on_revoked({TP}))
    assert most == 1  # before the lock: IN_TRANSACTION -> IN_TRANSACTION on the same producer
    assert [c[TP][0] for c in committed] == [2, 3]  # each event once, in order
    assert not r.done
