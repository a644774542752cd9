"""The bus's Kafka clients: an idempotent producer and a decoding, manual-commit consumer.

* :class:`Producer` — idempotent (``acks=all``), compressed, msgpack-encoding producer, with an
  optional transactional mode for consume-transform-produce.
* :class:`Consumer` — manual-commit, ``read_committed`` consumer that decodes every message
  with its topic's msgspec decoder and hands out :class:`~runtime.records.Record` s (a
  record that does not decode carries ``error`` instead of ``event``; it is never dropped here).

Both share one lifecycle (:class:`_Client`): :meth:`~_Client.start` is bounded by
``KafkaSettings.connect_timeout_s`` (an unreachable broker is a :class:`BusError` naming the
address), :meth:`~_Client.stop` by the request timeout; a stopped client cannot be restarted.

Importing this module has no side effects.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, ClassVar, Generic, Literal, Self, TypeVar

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.structs import RecordMetadata, TopicPartition

from runtime.connection import (
    DEFAULT_MAX_MESSAGE_BYTES,
    TOPIC_MESSAGE_HEADROOM_BYTES,
    AsyncClient,
    BusError,
    kafka_kwargs,
    redacted,
    resolve_bootstrap,
    start_bounded,
)
from runtime.records import KeyLike, KeyPartitioner, Record, encode_key, key_for
from schemas.config import KafkaSettings
from schemas.errors import one_line
from schemas.events import Event
from schemas.topics import spec_for_topic, split_value

log = logging.getLogger("rollstream.bus")

__all__ = ["Compression", "Consumer", "Producer", "RevokeHook", "records_of"]

Compression = Literal["lz4", "zstd", "gzip", "snappy", "none"]
"""Producer compression codecs (``none`` = uncompressed)."""
RevokeHook = Callable[[set[TopicPartition]], Awaitable[None] | None]
"""A consumer's ``on_revoked`` / ``on_assigned`` hook, sync or async."""

RawT = TypeVar("RawT", AIOKafkaProducer, AIOKafkaConsumer)


class _Client(AsyncClient, Generic[RawT]):
    """What :class:`Producer` and :class:`Consumer` share: the address, the aiokafka kwargs, and
    a bounded start and stop of the underlying aiokafka client (created by :meth:`_make_raw`)."""

    what: ClassVar[str] = "client"
    """``producer`` / ``consumer``: how messages name this client."""

    def __init__(self, settings: KafkaSettings, bootstrap: str | None, client_suffix: str) -> None:
        self.settings = settings
        self.bootstrap = resolve_bootstrap(settings, bootstrap)
        self._kwargs = kafka_kwargs(settings, self.bootstrap, client_suffix=client_suffix)
        self._raw: RawT | None = None
        self._started = False
        self._stopped = False

    @property
    def config(self) -> dict[str, Any]:
        """The exact kwargs given to the aiokafka client (SASL password redacted)."""
        return redacted(self._kwargs)

    @property
    def raw(self) -> RawT:
        """The underlying aiokafka client (created on :meth:`start`)."""
        if self._raw is None:
            raise BusError(f"{self.what} not started: call `await {self.what}.start()` first")
        return self._raw

    @property
    def started(self) -> bool:
        return self._started and not self._stopped

    @abc.abstractmethod
    def _make_raw(self) -> RawT:
        """The aiokafka client to start."""

    def _after_start(self, raw: RawT) -> None:
        """Called once the client is connected (the consumer subscribes here)."""

    async def start(self) -> Self:
        """Connect (bounded by ``connect_timeout_s``; :class:`BusError` if unreachable).
        Idempotent; a stopped client cannot be restarted."""
        if self._started:
            if self._stopped:
                raise BusError(f"{self.what} was stopped; create a new one")
            return self
        raw = self._raw = self._make_raw()
        await start_bounded(self.what, raw.start, raw.stop, self.bootstrap, self.settings.connect_timeout_s, self._kwargs)
        self._after_start(raw)
        self._started = True
        return self

    async def stop(self) -> None:
        """Close (a producer flushes what is queued first). Idempotent; bounded by the request
        timeout (plus 5 s), after which the connections are dropped."""
        if self._stopped or self._raw is None:
            self._stopped = True
            return
        self._stopped = True
        limit = self.settings.request_timeout_s + 5
        try:
            await asyncio.wait_for(self._raw.stop(), timeout=limit)
        except TimeoutError:
            log.error("%s did not close within %.0f s; dropping connections", self.what, limit)


# --------------------------------------------------------------------------- producer


class Producer(_Client[AIOKafkaProducer]):
    """An idempotent, msgpack-encoding Kafka producer.

    ``enable_idempotence=True`` (hence ``acks=all``) always; ``compression`` zstd by default
    (aiokafka 0.14 compresses lz4 at level 9, i.e. LZ4-HC: ``bench/bus.py`` measures it slower
    than zstd level 3 with a worse ratio, so zstd is the default and lz4 stays selectable);
    ``linger_ms`` / ``max_batch_bytes`` batch small events; ``max_request_bytes`` (8 MiB)
    admits long generations (topics created by :class:`TopicAdmin` accept that size).
    One ``msgspec.msgpack.Encoder`` is reused for every event.

    With ``transactional_id`` it is a transactional producer: sends are only allowed inside
    :meth:`transaction` and :meth:`send_offsets_to_transaction` commits consumed offsets in the
    same transaction (consume-transform-produce).

    ``config`` is the exact kwargs given to ``AIOKafkaProducer`` (password redacted).
    """

    what = "producer"

    def __init__(
        self,
        settings: KafkaSettings,
        bootstrap: str | None = None,
        *,
        compression: Compression = "zstd",
        linger_ms: int = 5,
        max_batch_bytes: int = 1024 * 1024,
        max_request_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        transactional_id: str | None = None,
        transaction_timeout_s: float = 60.0,
        client_suffix: str = "producer",
    ) -> None:
        super().__init__(settings, bootstrap, client_suffix)
        self.transactional_id = transactional_id
        self._kwargs.update(
            enable_idempotence=True,
            acks="all",
            compression_type=None if compression == "none" else compression,
            linger_ms=linger_ms,
            max_batch_size=max_batch_bytes,
            max_request_size=max_request_bytes,
        )
        if transactional_id is not None:
            self._kwargs["transactional_id"] = transactional_id
            self._kwargs["transaction_timeout_ms"] = int(transaction_timeout_s * 1000)
        self.max_request_bytes = max_request_bytes
        self._encoder = msgspec.msgpack.Encoder()

    def _make_raw(self) -> AIOKafkaProducer:
        # Kafka's default partitioning, as aiokafka's DefaultPartitioner, with a faster murmur2
        return AIOKafkaProducer(**self._kwargs, partitioner=KeyPartitioner())

    # -- encoding

    def encode(self, event: Event) -> bytes:
        """msgpack bytes of ``event`` (tagged, so the topic's union decodes it)."""
        return self._encoder.encode(event)

    def check_size(self, key: bytes | None, value: bytes | None) -> None:
        """Raise ``ValueError`` if a message with this key/value exceeds ``max_request_bytes``."""
        size = DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, [])
        if size > self.max_request_bytes:
            raise ValueError(
                f"message of {size} bytes exceeds the producer limit of {self.max_request_bytes} bytes"
            )

    # -- sending

    async def send(self, topic: str, event: Event, key: KeyLike = None) -> asyncio.Future[RecordMetadata]:
        """Queue ``event`` for ``topic``; returns a future resolving to its ``RecordMetadata``
        once the broker acknowledged it (``acks=all``). ``key=None`` uses the registry key
        (:func:`key_for`) for rollstream topics."""
        kbytes = encode_key(key)
        if kbytes is None:
            spec = spec_for_topic(topic)
            if spec is not None:
                kbytes = key_for(spec, event)
        return await self.send_raw(topic, self.encode(event), kbytes)

    async def send_raw(
        self, topic: str, value: bytes | None, key: KeyLike = None, *, partition: int | None = None
    ) -> asyncio.Future[RecordMetadata]:
        """Queue already-encoded bytes (replay, dead letters, tests of undecodable input).
        ``partition=None`` lets the key pick the partition (Kafka's default partitioner)."""
        fut: asyncio.Future[RecordMetadata] = await self.raw.send(
            topic, value=value, key=encode_key(key), partition=partition)
        return fut

    async def send_and_wait(self, topic: str, event: Event, key: KeyLike = None) -> RecordMetadata:
        """Send and wait for the broker's acknowledgement."""
        return await (await self.send(topic, event, key))

    async def flush(self) -> None:
        """Wait until everything queued so far is acknowledged (or failed)."""
        await self.raw.flush()

    # -- transactions

    def transaction(self) -> Any:
        """``async with producer.transaction():`` begin; commit on success, abort on error."""
        if self.transactional_id is None:
            raise BusError("transaction() needs a producer created with transactional_id")
        return self.raw.transaction()

    async def send_offsets_to_transaction(
        self, offsets: Mapping[TopicPartition, int | tuple[int, str]], group_id: str
    ) -> None:
        """Commit ``offsets`` (next offset per partition, or ``(offset, metadata)``: Kafka keeps the
        metadata string with the offset) of ``group_id`` in the open transaction.

        The transaction's messages are flushed (acknowledged) first. Brokers since Kafka 3.6
        verify with the transaction coordinator that a partition is in the transaction before
        appending (KIP-890), and they queue one verification per transactional id: a second one
        (the offset commit's, on ``__consumer_offsets``) replaces one still pending (a produce
        request's) and the replaced request fails with ``NETWORK_EXCEPTION``, which a produce
        request below version 12 (aiokafka's) receives as ``NOT_ENOUGH_REPLICAS`` and retries
        after a backoff. Sequencing the two avoids that retry; the commit waits for the messages
        anyway.
        """
        await self.raw.flush()
        await self.raw.send_offsets_to_transaction(dict(offsets), group_id)


# --------------------------------------------------------------------------- consumer


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, owner: Consumer) -> None:
        self._owner = owner

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._owner._call_hook(self._owner.on_revoked, set(revoked), "on_revoked")

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self._owner._call_hook(self._owner.on_assigned, set(assigned), "on_assigned")


class Consumer(_Client[AIOKafkaConsumer]):
    """A manual-commit, ``read_committed`` consumer of rollstream topics that decodes.

    * ``enable_auto_commit=False``: nothing is committed unless :meth:`commit` (or a
      transaction's ``send_offsets_to_transaction``) says so.
    * ``isolation_level="read_committed"``: aborted transactional output is never seen.
    * Subscribes to ``topics`` or to a regex ``pattern`` (e.g. ``^rs\\..*``) after connecting,
      so :meth:`start` is bounded by ``connect_timeout_s``; the group join happens on the first
      :meth:`getmany`.
    * One ``msgspec.msgpack.Decoder`` per logical topic (type from the registry).
    * ``on_revoked`` / ``on_assigned`` hooks (sync or async) run inside the rebalance: a hook on
      revoke is where the owner finishes and commits the work of those partitions (Kafka waits
      for it up to ``rebalance_timeout_ms``).
    * ``fetch_min_bytes`` / ``fetch_max_wait_ms``: the broker holds a fetch until that many bytes
      are ready or that long has passed. The default (1 byte) answers as soon as anything arrives:
      for readers that wait on each record. A reader that only follows a busy topic (the recorder,
      the rollout's cancellation watcher) asks for more and waits longer, and so sends far fewer
      fetch requests (each costs the reader CPU and a round trip).
    """

    what = "consumer"

    def __init__(
        self,
        settings: KafkaSettings,
        bootstrap: str | None = None,
        *,
        group_id: str | None,
        topics: Iterable[str] = (),
        pattern: str | None = None,
        auto_offset_reset: Literal["earliest", "latest"] = "earliest",
        isolation_level: Literal["read_committed", "read_uncommitted"] = "read_committed",
        on_revoked: RevokeHook | None = None,
        on_assigned: RevokeHook | None = None,
        session_timeout_ms: int = 10_000,
        heartbeat_interval_ms: int | None = None,
        rebalance_timeout_ms: int | None = None,
        max_poll_interval_ms: int = 300_000,
        metadata_max_age_ms: int | None = None,
        max_partition_fetch_bytes: int = DEFAULT_MAX_MESSAGE_BYTES + TOPIC_MESSAGE_HEADROOM_BYTES,
        fetch_min_bytes: int = 1,
        fetch_max_wait_ms: int = 500,
        client_suffix: str = "consumer",
    ) -> None:
        self.topics = sorted(set(topics))
        self.pattern = pattern
        if bool(self.topics) == bool(pattern):
            raise ValueError("Consumer needs either topics or a pattern (exactly one of them)")
        super().__init__(settings, bootstrap, client_suffix)
        self.group_id = group_id
        self.on_revoked = on_revoked
        self.on_assigned = on_assigned
        self._kwargs.update(
            group_id=group_id,
            enable_auto_commit=False,
            auto_offset_reset=auto_offset_reset,
            isolation_level=isolation_level,
            session_timeout_ms=session_timeout_ms,
            # a rebalance is noticed on the next heartbeat: a third of the session timeout
            heartbeat_interval_ms=heartbeat_interval_ms or max(100, session_timeout_ms // 3),
            rebalance_timeout_ms=rebalance_timeout_ms,
            max_poll_interval_ms=max_poll_interval_ms,
            max_partition_fetch_bytes=max_partition_fetch_bytes,
            fetch_max_bytes=max(52_428_800, max_partition_fetch_bytes),
            fetch_min_bytes=fetch_min_bytes,
            fetch_max_wait_ms=fetch_max_wait_ms,
        )
        if metadata_max_age_ms is None:
            # a pattern subscription discovers new topics (new runs) on metadata refresh; otherwise
            # 30 s: aiokafka retries an offset reset against a partition's old leader (a broker
            # frozen, then back) until the next refresh, and only then learns the new leader
            metadata_max_age_ms = 5_000 if pattern else 30_000
        self._kwargs["metadata_max_age_ms"] = metadata_max_age_ms
        self._decoders: dict[str, msgspec.msgpack.Decoder[Any]] = {}

    def _make_raw(self) -> AIOKafkaConsumer:
        return AIOKafkaConsumer(**self._kwargs)

    def _after_start(self, raw: AIOKafkaConsumer) -> None:
        listener = _Listener(self) if self.group_id is not None else None
        if self.pattern:
            raw.subscribe(pattern=self.pattern, listener=listener)
        else:
            raw.subscribe(topics=self.topics, listener=listener)

    async def _call_hook(self, hook: RevokeHook | None, tps: set[TopicPartition], name: str) -> None:
        if hook is None:
            return
        try:
            res = hook(tps)
            if res is not None:
                await res
        except Exception as e:
            # aiokafka would only log it too; say which hook and go on with the rebalance
            log.error("consumer group %s: %s hook failed: %s", self.group_id, name, one_line(e))

    # -- decoding

    def decoder_for(self, topic: str) -> msgspec.msgpack.Decoder[Any] | None:
        """The cached decoder of ``topic``'s logical name, ``None`` for a foreign topic."""
        spec = spec_for_topic(topic)
        if spec is None:
            return None
        dec = self._decoders.get(spec.name)
        if dec is None:
            dec = self._decoders[spec.name] = msgspec.msgpack.Decoder(spec.event_type)
        return dec

    def decode(self, topic: str, value: bytes | None) -> tuple[Any, str | None]:
        """``(event, None)`` or ``(None, reason)`` for ``value`` read from ``topic``; never raises.

        Besides ``DecodeError`` / ``ValidationError``, msgspec raises ``UnicodeDecodeError`` for a
        string that is not UTF-8 and ``RecursionError`` for deeply nested containers: bytes from
        the wire are untrusted, so any failure is a reason, not an exception."""
        return self._decode_with(self.decoder_for(topic), topic, value)

    @staticmethod
    def _decode_with(dec: msgspec.msgpack.Decoder[Any] | None, topic: str, value: bytes | None) -> tuple[Any, str | None]:
        """:meth:`decode` with ``topic``'s decoder looked up already (once per partition of a poll)."""
        if dec is None:
            return None, f"topic {topic!r} is not a rollstream topic (rs.<run_id>.<name>)"
        if value is None:
            return None, "message has no value (tombstone)"
        try:
            return dec.decode(value), None
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return None, one_line(e)
        except Exception as e:
            return None, f"DecodeError: {one_line(e)}"

    # -- consuming

    async def getmany(self, timeout_ms: int = 1000, max_records: int | None = None) -> list[Record]:
        """The records of up to ``max_records`` Kafka messages (waiting at most ``timeout_ms`` if none
        are buffered), each partition's in offset order; a batched message comes back as one record
        per event (:func:`schemas.topics.split_value`), in its order, keyed by the event's registry
        key (:func:`runtime.records.key_for`). Undecodable ones come back with ``error`` set."""
        batches = await self.raw.getmany(timeout_ms=timeout_ms, max_records=max_records)
        out: list[Record] = []
        for tp, msgs in batches.items():
            out += records_of(tp.topic, tp.partition, msgs, self.decoder_for(tp.topic))
        return out

    async def keepalive(self) -> None:
        """Count as a poll without taking any record (every partition paused for the call).

        A caller whose workers are all busy calls this so the group does not evict it for
        exceeding ``max_poll_interval_ms``; records prefetched meanwhile are fetched again later.
        """
        tps = self.raw.assignment()
        self.raw.pause(*tps)
        try:
            await self.raw.getmany(timeout_ms=0)
        finally:
            self.raw.resume(*[tp for tp in tps if tp in self.raw.assignment()])

    def assignment(self) -> set[TopicPartition]:
        return set(self.raw.assignment())

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> dict[TopicPartition, int]:
        """Commit the next offset to read per partition (``last handled + 1``).

        Partitions no longer assigned are left out (logged): their new owner decides. Returns
        what was committed. aiokafka's ``CommitFailedError`` (the group rebalanced meanwhile)
        propagates.
        """
        if not offsets:
            return {}
        assigned = self.assignment()
        keep = {tp: off for tp, off in offsets.items() if tp in assigned}
        if len(keep) != len(offsets):
            log.warning(
                "group %s: not committing offsets of partitions no longer assigned: %s",
                self.group_id,
                sorted(f"{tp.topic}[{tp.partition}]" for tp in offsets if tp not in assigned),
            )
        if keep:
            await self.raw.commit(keep)
        return keep

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.raw.seek(tp, offset)

    async def committed(self, tp: TopicPartition) -> int | None:
        """The group's committed offset of ``tp`` (``None`` if none)."""
        res: int | None = await self.raw.committed(tp)
        return res

    async def committed_with_metadata(self, tps: set[TopicPartition]) -> dict[TopicPartition, tuple[int, str]]:
        """The group's committed offset and its metadata string per partition of ``tps`` (partitions
        without a committed offset are left out). aiokafka's public ``committed`` drops the
        metadata, so this asks its group coordinator, which retries retriable errors."""
        if not tps:
            return {}
        if self.group_id is None:
            raise BusError("committed_with_metadata needs a consumer group")
        found = await self.raw._coordinator.fetch_committed_offsets(sorted(tps))
        return {tp: (om.offset, om.metadata or "") for tp, om in found.items() if om.offset >= 0}


def records_of(topic: str, partition: int, msgs: Iterable[Any], dec: msgspec.msgpack.Decoder[Any] | None) -> list[Record]:
    """The :class:`Record` s of Kafka messages of one partition (each with ``offset``, ``key``,
    ``value``, ``timestamp`` in ms, as aiokafka's), decoded with ``dec`` (the topic's decoder): a
    batched message comes back as one record per event (:func:`schemas.topics.split_value`), in its
    order, keyed by the event's registry key (:func:`runtime.records.key_for`); undecodable ones come
    back with ``error`` set. What :meth:`Consumer.getmany` hands out, and the records a run's log
    directory is read into (:mod:`infra.kafka.logdir`)."""
    spec = spec_for_topic(topic)
    decode = Consumer._decode_with
    out: list[Record] = []
    for m in msgs:
        ts = m.timestamp / 1000.0
        try:
            parts = split_value(m.value)
        except Exception as e:  # a damaged array: the whole record is one undecodable record
            out.append(Record(topic, partition, m.offset, m.key, m.value, None,
                              f"damaged batched record: {one_line(e)}", ts))
            continue
        if parts is None:
            event, error = decode(dec, topic, m.value)
            out.append(Record(topic, partition, m.offset, m.key, m.value, event, error, ts))
            continue
        if not parts:
            out.append(Record(topic, partition, m.offset, m.key, m.value, None,
                              "batched record with no events", ts))
            continue
        n = len(parts)
        for i, part in enumerate(parts):
            event, error = decode(dec, topic, part)
            # the record is keyed by its first event: each event gets its own registry key back
            key = key_for(spec, event) if event is not None and spec is not None else None
            out.append(Record(topic, partition, m.offset, key or m.key, part, event, error, ts, i, n))
    return out
