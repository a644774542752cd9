"""One service instance's Kafka I/O, shared by whichever loop runs it: :class:`KafkaIO`.

It holds the instance's producer and consumer and does every Kafka call a loop makes, each
through a Kafka outage (:mod:`runtime.outage`):

* :meth:`KafkaIO.poll` / :meth:`KafkaIO.keepalive` — records, or a poll that keeps a busy
  instance in its group;
* :meth:`KafkaIO.send_outputs` — outputs sent and acknowledged, again through a new producer
  when the broker no longer accepts the old one (:meth:`KafkaIO.renew_producer`); a failed one
  already on its topic (its acknowledgement lost) is not sent again (:meth:`KafkaIO._landed`);
* :meth:`KafkaIO.send_together` — the outputs of handler calls that finish at the same moment,
  sent as one :meth:`KafkaIO.send_outputs`;
* :meth:`KafkaIO.commit` — consumed offsets (a commit refused by a rebalance is logged);
* :meth:`KafkaIO.transaction` — outputs and offsets in one Kafka transaction, done again by a
  new producer of the same transactional id after a failure;
* :meth:`KafkaIO.dead_letter` — the ``DeadLetter`` of a record, routed to its run's ``dlq``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from typing import Any, Literal

from aiokafka.errors import CommitFailedError, KafkaConnectionError, KafkaError, ProducerFenced

from runtime.bus import (
    BusError,
    Consumer,
    Producer,
    Record,
    RecordMetadata,
    RevokeHook,
    TopicAdmin,
    TopicPartition,
    new_group_suffix,
)
from runtime.deadletter import dead_letter_for
from runtime.outage import Outage, Retry, is_outage, needs_new_producer, producer_dead
from runtime.reading import ReadTimeout, read_to_end
from runtime.records import KeyPartitioner
from runtime.service import Counters, Output, derive_event_id
from runtime.settings import ServiceSettings, resolve_topic
from schemas.errors import one_line
from schemas.topics import BATCHED_TOPICS, pack_values, parse_topic, topic_name

log = logging.getLogger("rollstream.runtime")

__all__ = ["LANDED_MARGIN_MS", "KafkaIO"]

LANDED_MARGIN_MS = 1000
"""How far before a send's first attempt :meth:`KafkaIO._landed` looks for its records, ms (the
records' create time is the producer's clock at ``send``, never earlier than that attempt)."""


class KafkaIO:
    """The producer, consumer and outage state of one service instance (see the module doc).
    ``on_revoked`` / ``on_assigned`` are the consumer's rebalance hooks (a group only)."""

    def __init__(self, service_name: str, settings: ServiceSettings, counters: Counters, *,
                 on_revoked: RevokeHook | None = None, on_assigned: RevokeHook | None = None) -> None:
        self.service_name = service_name
        self.settings = settings
        self.counters = counters
        """Counts what was sent (``emitted``, ``dead_lettered``)."""
        self.outage = Outage(service_name, settings.kafka.outage_timeout_s)
        """Retries through a Kafka outage (:mod:`runtime.outage`)."""
        self.polls = 0
        """Polls so far."""
        self.last_polled = 0
        """Records the latest poll returned (0 = the topics were quiet)."""
        s, sub, con = settings, settings.subscription, settings.consume
        d = s.delivery
        self.transactional_id = (d.transactional_id or f"{sub.group_id}.{new_group_suffix()}") if d.transactional else None
        self._poll_retry = self.outage.retry("poll")
        self._renew_lock = asyncio.Lock()
        self._closing: set[asyncio.Task[Any]] = set()
        self._partitions: dict[str, list[int]] = {}
        self._partitioner = KeyPartitioner()
        self._together: tuple[list[Output], list[str], asyncio.Future[None]] | None = None
        self.producer = self._new_producer()
        grace_ms = int(s.handling.shutdown_grace_s * 1000)
        grouped = sub.group_id is not None
        self.consumer = Consumer(
            s.kafka,
            group_id=sub.group_id,
            topics=[resolve_topic(t, s.run_id) for t in sub.topics],
            pattern=sub.topic_pattern or None,
            auto_offset_reset=sub.auto_offset_reset,
            isolation_level="read_committed",
            on_revoked=on_revoked if grouped else None,
            on_assigned=on_assigned if grouped else None,
            session_timeout_ms=int(con.session_timeout_s * 1000),
            # the revoke hook may take the grace period: give the rebalance room for it
            rebalance_timeout_ms=max(int(con.session_timeout_s * 1000), grace_ms + 10_000),
            max_poll_interval_ms=int(con.max_poll_interval_s * 1000),
            fetch_min_bytes=con.fetch_min_bytes,
            fetch_max_wait_ms=con.fetch_max_wait_ms,
            client_suffix=f"{service_name}-consumer",
        )

    # -- lifecycle

    async def start(self) -> None:
        """Create the run's topics (``subscription.ensure_topics``), start producer and consumer."""
        s = self.settings
        if s.subscription.ensure_topics and s.run_id:
            async with TopicAdmin(s.kafka) as admin:
                await admin.ensure_run_topics(s.run_id)
        await self.producer.start()
        await self.consumer.start()

    async def close(self) -> None:
        """Stop producer and consumer (and producers being replaced, for up to 5 s)."""
        await self.producer.stop()
        await self.consumer.stop()
        if self._closing:
            await asyncio.wait(set(self._closing), timeout=5.0)

    def _close_later(self, task: asyncio.Task[Any]) -> None:
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    # -- consuming

    async def poll(self, max_records: int | None = None, timeout_s: float | None = None) -> list[Record]:
        """One poll (at most ``max_records``, default ``consume.batch_max_records``; waiting at most
        ``timeout_s``, default ``consume.poll_timeout_s``, rounded up to whole milliseconds). A
        poll that fails with an outage error returns nothing after a pause (retried by the next
        call, for at most ``kafka.outage_timeout_s`` of consecutive failures)."""
        con = self.settings.consume
        try:
            wait_s = con.poll_timeout_s if timeout_s is None else timeout_s
            recs = await self.consumer.getmany(timeout_ms=math.ceil(wait_s * 1000),
                                               max_records=max_records or con.batch_max_records)
        except KafkaError as e:
            await self._poll_retry.failed(e)
            recs = []
        else:
            self._poll_retry.done()
        self.polls += 1
        self.last_polled = len(recs)
        return recs

    async def keepalive(self) -> None:
        """Count as a poll without taking records (every slot busy: stay in the group)."""
        await self.consumer.keepalive()

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> dict[TopicPartition, int]:
        """Commit ``offsets`` (next offset to read per partition) now; what was committed. Without
        a group nothing is committed. A commit refused because the group rebalanced is logged and
        returns ``{}``, as does one that failed otherwise (logged; the next commit covers it)."""
        if self.settings.subscription.group_id is None or not offsets:
            return {}
        try:
            return await self.consumer.commit(offsets)
        except CommitFailedError as e:
            log.warning("%s: commit failed, the group rebalanced (records will be redelivered): %s",
                        self.service_name, one_line(e))
        except KafkaError as e:
            log.log(logging.DEBUG if self.outage.active else logging.WARNING,
                    "%s: commit failed, will retry: %s", self.service_name, one_line(e))
        return {}

    # -- producing

    def _new_producer(self) -> Producer:
        """The service's producer. A transactional one sends with no linger: a transaction's outputs
        are all sent at its commit, so a linger would only hold the commit (its produce request left
        ``produce.linger_ms`` after the transaction began, and the rest of the commit waited for it)."""
        s = self.settings
        linger_ms = 0 if self.transactional_id else s.produce.linger_ms
        return Producer(s.kafka, compression=s.produce.compression, linger_ms=linger_ms,
                        transactional_id=self.transactional_id,
                        transaction_timeout_s=s.delivery.transaction_timeout_s,
                        client_suffix=f"{self.service_name}-producer")

    async def renew_producer(self, failed: Producer, retry: Retry) -> None:
        """Replace ``failed`` by a new producer unless another caller did already."""
        async with self._renew_lock:
            if self.producer is failed:
                log.warning("%s: replacing the Kafka producer (it can no longer deliver)", self.service_name)
                await self._renew(retry)

    async def _renew(self, retry: Retry) -> None:
        """Replace the producer by a new one (same transactional id: it fences the old one and
        aborts its open transaction), retrying its start through an outage (``retry``). The old
        one is closed in the background (it may wait for an unreachable broker)."""
        self._close_later(asyncio.create_task(self.producer.stop()))
        while True:
            fresh = self._new_producer()
            try:
                await fresh.start()
            except BusError as e:
                await retry.failed(e)
                continue
            self.producer = fresh
            return

    async def _partitions_of(self, topic: str) -> list[int] | None:
        """The partitions of ``topic`` (cached; ``None`` when the producer cannot tell now)."""
        parts = self._partitions.get(topic)
        if parts is None:
            try:
                found = await self.producer.raw.partitions_for(topic)
            except KafkaError:
                return None
            if not found:
                return None
            parts = self._partitions[topic] = sorted(found)
        return parts

    async def pack(self, outs: list[Output]) -> tuple[list[Output], list[list[int]]]:
        """``outs`` as the Kafka records to send, and the indices of ``outs`` each one carries.

        Events of a hot topic (:data:`schemas.topics.BATCHED_TOPICS`) that go to the same partition
        (the one their own key maps to, as Kafka's default partitioner maps it) share a record,
        in their order, up to ``kafka.samples_per_record`` events and the producer's request size;
        the record is keyed by its first event. Everything else is sent as it is."""
        per_record = self.settings.kafka.samples_per_record
        if per_record <= 1 or len(outs) < 2:
            return outs, [[i] for i in range(len(outs))]
        groups: dict[tuple[str, int | None], list[int]] = {}
        alone: list[int] = []
        known: dict[str, list[int] | None] = {}  # a topic's partitions, None: sent alone
        for i, o in enumerate(outs):
            if o.dead_letter:
                alone.append(i)
                continue
            if o.topic in known:
                parts = known[o.topic]
            else:
                parsed = parse_topic(o.topic)
                batched = parsed is not None and parsed[1] in BATCHED_TOPICS
                parts = known[o.topic] = await self._partitions_of(o.topic) if batched else None
            if parts is None:
                alone.append(i)
                continue
            part = None if o.key is None else self._partitioner(o.key, parts, parts)
            groups.setdefault((o.topic, part), []).append(i)
        limit = self.producer.max_request_bytes - 64 * 1024  # room for the batch's own overhead
        records: list[Output] = [outs[i] for i in alone]
        covers: list[list[int]] = [[i] for i in alone]
        for members in groups.values():
            chunk: list[int] = []
            size = 0
            for i in [*members, -1]:
                n = len(outs[i].value) + len(outs[i].key or b"") if i >= 0 else 0
                if chunk and (i < 0 or len(chunk) >= per_record or size + n > limit):
                    first = outs[chunk[0]]
                    value = first.value if len(chunk) == 1 else pack_values([outs[j].value for j in chunk])
                    records.append(Output(first.topic, first.key, value, first.event))
                    covers.append(chunk)
                    chunk, size = [], 0
                if i >= 0:
                    chunk.append(i)
                    size += n
        return records, covers

    async def send_together(self, outs: list[Output], what: str) -> None:
        """Send ``outs`` with the outputs of every other call made before the event loop next turns
        (handler calls that finished at the same moment: one engine step's completions), as one
        :meth:`send_outputs` (not counted: the caller counts); returns once they are acknowledged.
        Nothing waits for more outputs: the send starts as soon as the calls already due have run."""
        if self.settings.kafka.samples_per_record <= 1:
            await self.send_outputs(outs, what, count=False)
            return
        if self._together is None:
            self._together = ([], [], asyncio.get_running_loop().create_future())
            asyncio.get_running_loop().call_soon(self._send_gathered)
        gathered, whats, fut = self._together
        gathered += outs
        whats.append(what)
        await asyncio.shield(fut)

    def _send_gathered(self) -> None:
        assert self._together is not None
        gathered, whats, fut = self._together
        self._together = None
        what = whats[0] if len(whats) == 1 else f"outputs of {len(whats)} records"

        async def send() -> None:
            try:
                await self.send_outputs(gathered, what, count=False)
            except asyncio.CancelledError:
                fut.cancel()
                raise
            except Exception as e:
                fut.set_exception(e)
            else:
                fut.set_result(None)

        task = asyncio.ensure_future(send())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even with no waiter left

    async def send_outputs(self, outs: list[Output], what: str, count: bool = True) -> list[RecordMetadata]:
        """Send ``outs``, wait for every acknowledgement, count them (``emitted`` / ``dead_lettered``;
        ``count=False``: the caller counts).

        A Kafka outage does not fail the call: the idempotent producer retries a batch by itself
        while the broker is away (waited for, not sent again: that could duplicate it); outputs
        that failed are sent again (0.5 s doubling to 5 s apart); a producer whose state the broker
        no longer accepts after a restart (out-of-order sequence, unknown producer id) is replaced
        and what it had not delivered goes through the new one. A failed output may be on its topic
        all the same (written, its acknowledgement lost): it is looked for there first and not sent
        again when found (:meth:`_landed`). Raises :class:`BusError` with one
        line when that has gone on for ``kafka.outage_timeout_s``, or at once when Kafka refuses
        the outputs for another reason."""
        if not outs:
            return []
        originals = outs
        outs, covers = await self.pack(outs)
        mds: list[RecordMetadata | None] = [None] * len(outs)
        todo = list(range(len(outs)))
        retry = self.outage.retry(f"{what} not acknowledged")
        since_ms = int(time.time() * 1000) - LANDED_MARGIN_MS  # no record of this call is older
        unsure: set[int] = set()  # handed to a producer and failed: may be on the topic all the same
        while todo:
            producer = self.producer
            queued: list[tuple[int, asyncio.Future[RecordMetadata]]] = []
            error: BaseException | None = None
            try:
                for i in todo:
                    o = outs[i]
                    queued.append((i, await producer.send_raw(o.topic, o.value, o.key)))
            except KafkaError as e:
                error = e
            await self._acknowledged({f for _, f in queued}, producer, retry, what)
            failed = todo[len(queued):]
            renew = error is not None and needs_new_producer(error)
            for i, fut in queued:
                resolved = fut.done() and not fut.cancelled()
                exc = fut.exception() if resolved else None
                if resolved and exc is None:
                    mds[i] = fut.result()
                    continue
                if exc is not None and not isinstance(exc, KafkaError):
                    raise exc
                failed.append(i)
                # unresolved: its producer stopped delivering (or was replaced meanwhile)
                renew = renew or exc is None or needs_new_producer(exc)
                error = error or exc or KafkaConnectionError("the producer stopped delivering")
            unsure.update(i for i, _ in queued if i in failed)
            if not failed:
                break
            assert error is not None
            await retry.failed(error, transient=True if renew else None)  # waits, or raises BusError
            if renew:
                await self.renew_producer(producer, retry)
            todo = sorted(failed)
            if unsure.intersection(todo):  # sending those again blindly would duplicate the written ones
                try:
                    landed = await self._landed([outs[i] for i in todo if i in unsure], since_ms)
                except (KafkaError, BusError, ReadTimeout, TimeoutError) as e:
                    await retry.failed(e, transient=True)
                    continue  # checked again before they are sent
                todo = [i for i in todo if not (i in unsure and (outs[i].topic, outs[i].key, outs[i].value) in landed)]
        retry.done()
        if count:
            for o in originals:
                if o.dead_letter:
                    self.counters.dead_lettered += 1
                else:
                    self.counters.emitted += 1
        per_output: list[RecordMetadata | None] = [None] * len(originals)
        for md, carried in zip(mds, covers, strict=True):
            for i in carried:
                per_output[i] = md
        return [md for md in per_output if md is not None]

    async def _landed(self, outs: list[Output], since_ms: int) -> set[tuple[str, bytes | None, bytes]]:
        """``(topic, key, value)`` of the records of ``outs``' topics written since ``since_ms``
        (epoch ms, the records' create time) that equal one of ``outs``: records a producer sent
        whose acknowledgement was lost (a broker killed after writing it, a batch aiokafka expired
        while no leader was known) are on the topic although their send failed. Reads those topics'
        partitions from ``since_ms`` to their current end, uncommitted records included."""
        wanted = {(o.topic, o.key, o.value) for o in outs}
        found: set[tuple[str, bytes | None, bytes]] = set()
        topics = sorted({o.topic for o in outs})
        async with Consumer(self.settings.kafka, group_id=None, topics=topics, isolation_level="read_uncommitted",
                            client_suffix=f"{self.service_name}-landed") as consumer:
            raw = consumer.raw
            raw.unsubscribe()  # read_to_end assigns the partitions itself
            tps: list[TopicPartition] = []
            for t in topics:
                parts = await self._partitions_of(t)
                if parts is None:
                    raise KafkaConnectionError(f"the partitions of {t} are not known now")
                tps += [TopicPartition(t, p) for p in parts]
            at = await asyncio.wait_for(raw.offsets_for_times({tp: since_ms for tp in tps}),
                                        self.settings.kafka.request_timeout_s)
            start = {tp: ts.offset for tp, ts in at.items() if ts is not None}  # None: nothing since

            def take(tp: TopicPartition, record: Any) -> None:
                if (tp.topic, record.key, record.value) in wanted:
                    found.add((tp.topic, record.key, record.value))

            await read_to_end(raw, take, start=start, timeout_s=self.settings.kafka.request_timeout_s,
                              poll_ms=200, what=f"what {self.service_name} sent to {', '.join(topics)}")
        if found:
            log.warning("%s: %d record(s) whose send failed were written all the same; not sent again",
                        self.service_name, len(found))
        return found

    async def _acknowledged(self, pending: set[asyncio.Future[RecordMetadata]], producer: Producer, retry: Retry,
                            what: str) -> None:
        """Wait for ``pending`` until all resolved, or ``producer`` stopped delivering (or was
        replaced); :class:`BusError` after ``kafka.outage_timeout_s``."""
        deadline = time.monotonic() + self.outage.limit_s
        while pending:
            _, pending = await asyncio.wait(pending, timeout=1.0)
            if pending and (self.producer is not producer or producer_dead(producer)):
                return  # what it had not delivered goes through a new producer
            if pending and time.monotonic() > deadline:
                retry.done()
                raise BusError(f"{self.service_name}: {what} not acknowledged within kafka.outage_timeout_s="
                               f"{self.outage.limit_s:g} s (Kafka unavailable?)")

    async def transaction(self, outputs: list[Output], offsets: Mapping[TopicPartition, int | tuple[int, str]]) -> None:
        """Send ``outputs`` and commit ``offsets`` (with their metadata) in one transaction. A
        transaction that fails (a broker outage, a coordinator moving) is aborted and done again
        with a new producer of the same transactional id, which fences the old one, until it
        commits or it has failed for ``kafka.outage_timeout_s``; then :class:`BusError` (the
        records are reprocessed after a restart). A fenced producer (another instance took over)
        fails at once."""
        retry = self.outage.retry(f"transaction of {len(outputs)} output(s)")
        outputs, _ = await self.pack(outputs)
        # one attempt waits at most this long (an abort waits for the coordinator otherwise)
        attempt_s = self.settings.kafka.request_timeout_s + 10
        group = str(self.settings.subscription.group_id)

        async def attempt() -> None:
            futs: list[asyncio.Future[RecordMetadata]] = []
            async with self.producer.transaction():
                for o in outputs:
                    futs.append(await self.producer.send_raw(o.topic, o.value, o.key))
                await self.producer.send_offsets_to_transaction(offsets, group)
            await asyncio.gather(*futs)

        while True:
            try:
                task = asyncio.ensure_future(attempt())
                await asyncio.wait({task}, timeout=attempt_s)
                if not task.done():  # its abort would wait for the coordinator: leave it to the old producer
                    task.cancel()
                    self._close_later(task)
                    raise TimeoutError(f"no answer within {attempt_s:g} s")
                task.result()
            except (KafkaError, BusError, TimeoutError) as e:
                if isinstance(e, ProducerFenced) or (isinstance(e, BusError) and not is_outage(e)):
                    raise BusError(f"{self.service_name}: transaction failed and was aborted (its records "
                                   f"will be reprocessed after a restart): {one_line(e)}") from None
                # any other error of a transaction is treated as transient: a new producer (same
                # transactional id) fences this one and aborts what is left of its transaction
                await retry.failed(e, transient=True)
                await self._renew(retry)
                continue
            retry.done()
            return

    # -- dead letters

    def dead_letter(self, rec: Record, stage: Literal["decode", "handle"], error: str) -> list[Output]:
        """The dead letter of ``rec`` as an output to send (empty when it cannot be routed, logged)."""
        s = self.settings
        if not s.handling.dlq:
            return []
        parsed = parse_topic(rec.topic)
        if parsed is not None and parsed[1] == "dlq":
            log.error("%s: not dead-lettering a record of the dlq topic %s (would loop)", self.service_name, rec.topic)
            return []
        run_id = s.run_id or (parsed[0] if parsed else "")
        if not run_id:
            log.error("%s: no run to dead-letter %s[%d]@%d into", self.service_name, rec.topic, rec.partition,
                      rec.offset)
            return []
        dl = dead_letter_for(
            rec,
            run_id=run_id,
            event_id=derive_event_id(f"{rec.topic}/{rec.partition}/{rec.offset}"
                                     + (f".{rec.index}" if rec.in_record > 1 else ""), self.service_name, 0),
            service=s.subscription.group_id or self.service_name,
            stage=stage,
            error=error,
        )
        return [Output(topic_name(run_id, "dlq"), rec.key, self.producer.encode(dl), dl, dead_letter=True)]
