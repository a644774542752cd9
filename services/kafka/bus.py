"""The bus: thin, typed wrappers around aiokafka for rollstream's per-run topics.

* :func:`kafka_kwargs` — the connection/security kwargs every aiokafka client gets.
* :class:`Producer` — idempotent (``acks=all``), compressed, msgpack-encoding producer, with an
  optional transactional mode for consume-transform-produce.
* :class:`Consumer` — manual-commit, ``read_committed`` consumer that decodes every message
  with its topic's msgspec decoder and hands out :class:`Record` s (a record that does not
  decode carries ``error`` instead of ``event``; it is never dropped here).
* :class:`TopicAdmin` — creates, describes, lists and deletes the topics of a run following
  :data:`schemas.topics.TOPICS`.
* :class:`Deduper` — a bounded LRU (optionally TTL) set of ids seen.

Every client start is bounded by ``KafkaSettings.connect_timeout_s``; an unreachable broker
raises :class:`BusError` with one line naming the address, never hangs.

Importing this module has no side effects.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaConnectionError, KafkaError
from aiokafka.helpers import create_ssl_context
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.structs import RecordMetadata, TopicPartition

from schemas.config import KafkaSettings
from schemas.events import Event
from schemas.topics import TOPICS, TopicSpec, check_run_id, parse_topic, spec_for_topic

log = logging.getLogger("rollstream.bus")

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "BusError",
    "Consumer",
    "Deduper",
    "Producer",
    "Record",
    "RecordMetadata",
    "TopicAdmin",
    "TopicInfo",
    "TopicPartition",
    "encode_key",
    "kafka_kwargs",
    "key_for",
    "new_group_suffix",
    "next_offsets",
    "one_line",
    "resolve_bootstrap",
]

DEFAULT_MAX_MESSAGE_BYTES = 8 * 1024 * 1024
"""Largest message a producer may send and a topic accepts (``max.message.bytes``), 8 MiB:
a long generation (tens of thousands of token ids + logprobs) fits with room to spare."""

_TOPIC_MESSAGE_HEADROOM_BYTES = 64 * 1024
"""Topics accept a little more than the producer's limit (record batch overhead)."""

Compression = Literal["lz4", "zstd", "gzip", "snappy", "none"]
KeyLike = str | bytes | None
RevokeHook = Callable[[set[TopicPartition]], Awaitable[None] | None]


class BusError(RuntimeError):
    """A Kafka problem the caller cannot fix by retrying right away, with a one-line message."""


# --------------------------------------------------------------------------- connection


def resolve_bootstrap(settings: KafkaSettings, bootstrap: str | None = None) -> str:
    """The bootstrap address to use: ``bootstrap`` argument, else ``settings.bootstrap``,
    else ``$ROLLSTREAM_BOOTSTRAP``; raises :class:`BusError` when none is set."""
    for candidate in (bootstrap, settings.bootstrap, os.environ.get("ROLLSTREAM_BOOTSTRAP")):
        if candidate and candidate.strip():
            return candidate.strip()
    raise BusError(
        "no Kafka bootstrap address: set kafka.bootstrap in the config or $ROLLSTREAM_BOOTSTRAP "
        "(or start a local broker with `rollstream stack up`)"
    )


def _ssl_context(settings: KafkaSettings) -> ssl.SSLContext | None:
    if settings.security_protocol not in ("SSL", "SASL_SSL"):
        return None
    try:
        return create_ssl_context(
            cafile=settings.ssl_cafile or None,
            certfile=settings.ssl_certfile or None,
            keyfile=settings.ssl_keyfile or None,
        )
    except (OSError, ssl.SSLError) as e:
        raise BusError(
            f"cannot build the TLS context (kafka.ssl_cafile={settings.ssl_cafile!r}, "
            f"ssl_certfile={settings.ssl_certfile!r}, ssl_keyfile={settings.ssl_keyfile!r}): {e}"
        ) from None


def kafka_kwargs(settings: KafkaSettings, bootstrap: str, *, client_suffix: str = "") -> dict[str, Any]:
    """The kwargs every aiokafka client (producer, consumer, admin) gets from ``settings``.

    ``bootstrap`` is the address to use (see :func:`resolve_bootstrap`). Security settings pass
    through: ``security_protocol``, the SASL mechanism and PLAIN/SCRAM credentials (the password
    falls back to ``$ROLLSTREAM_SASL_PASSWORD``), and an ``ssl_context`` built from the CA /
    client certificate / key files for ``SSL`` and ``SASL_SSL``. The client id is
    ``<settings.client_id>-<client_suffix>`` when a suffix is given.
    """
    kw: dict[str, Any] = {
        "bootstrap_servers": bootstrap,
        "client_id": f"{settings.client_id}-{client_suffix}" if client_suffix else settings.client_id,
        "request_timeout_ms": int(settings.request_timeout_s * 1000),
        "security_protocol": settings.security_protocol,
    }
    if settings.security_protocol.startswith("SASL_"):
        kw["sasl_mechanism"] = settings.sasl_mechanism
        if settings.sasl_mechanism in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
            kw["sasl_plain_username"] = settings.sasl_username or None
            kw["sasl_plain_password"] = (
                settings.sasl_password or os.environ.get("ROLLSTREAM_SASL_PASSWORD") or None
            )
    ctx = _ssl_context(settings)
    if ctx is not None:
        kw["ssl_context"] = ctx
    return kw


async def _start_bounded(
    what: str,
    start: Callable[[], Awaitable[Any]],
    close: Callable[[], Awaitable[Any]],
    bootstrap: str,
    timeout_s: float,
) -> None:
    """Run ``start()`` until it succeeds, retrying refused connections, for at most ``timeout_s``.

    On failure ``close()`` is called (errors while closing are logged) and :class:`BusError`
    is raised with one line naming the address and the last reason.
    """
    deadline = time.monotonic() + timeout_s
    reason = "timed out"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            await asyncio.wait_for(start(), timeout=left)
            return
        except TimeoutError:
            reason = "timed out"
            break
        except KafkaConnectionError as e:  # refused / reset: the broker may still be starting
            reason = one_line(e)
            await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        except (KafkaError, OSError) as e:
            reason = one_line(e)
            break
    try:
        await close()
    except Exception as e:  # closing a half-started client is best effort
        log.debug("closing %s after failed start: %s", what, one_line(e))
    raise BusError(
        f"cannot reach Kafka at {bootstrap} within {timeout_s:g} s ({what}: {reason}); is the broker "
        "running? (`rollstream stack up`, or set kafka.bootstrap / $ROLLSTREAM_BOOTSTRAP)"
    )


def one_line(exc: BaseException) -> str:
    """``ExcType: message`` on one line (message truncated to 500 characters)."""
    name = type(exc).__name__
    msg = " ".join(str(exc).split())
    if msg.startswith(name + ":"):  # aiokafka errors already start with their class name
        msg = msg[len(name) + 1 :].strip()
    if len(msg) > 500:
        msg = msg[:497] + "..."
    return f"{name}: {msg}" if msg else name


# --------------------------------------------------------------------------- keys and records


def encode_key(key: KeyLike) -> bytes | None:
    """Message key bytes: ``str`` as UTF-8, ``bytes`` as is, ``None`` stays ``None``."""
    if key is None or isinstance(key, bytes):
        return key
    return key.encode()


def key_for(spec: TopicSpec, event: Event) -> bytes | None:
    """The registry's key for ``event`` on ``spec``'s topic, or ``None`` if it has none.

    The registry names a field (``sample_id``, ``group_id``, ``episode_id``, ``step``,
    ``run_id``); it is looked up on the event, then on its ``generation``/``task`` (a
    ``Generation`` keys by ``task.sample_id``, a ``ScoredSample`` by
    ``generation.task.group_id``). ``weights`` uses the literal ``latest`` (compaction keeps
    the newest); ``dlq`` uses the dead letter's original key. ``None`` means Kafka picks a
    partition.
    """
    if spec.name == "weights":
        return b"latest"
    if spec.name == "dlq":
        return getattr(event, "key", None)
    for holder in (event, getattr(event, "generation", None), getattr(event, "task", None)):
        if holder is None:
            continue
        value = getattr(holder, spec.key, None)
        if value is None:
            task = getattr(holder, "task", None)
            value = getattr(task, spec.key, None) if task is not None else None
        if value is not None:
            return str(value).encode()
    return None


@dataclass(frozen=True, slots=True)
class Record:
    """One consumed Kafka message, decoded.

    Exactly one of ``event`` / ``error`` is set: ``error`` is a one-line reason when the bytes
    did not decode (or the topic is not a rollstream topic); the raw ``value_bytes`` are kept
    either way (for dead letters and the recorder).
    """

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value_bytes: bytes | None
    event: Any
    """The decoded event (a member of the topic's union), ``None`` when ``error`` is set."""
    error: str | None
    ts: float
    """Kafka record timestamp, unix seconds."""

    @property
    def tp(self) -> TopicPartition:
        return TopicPartition(self.topic, self.partition)

    @property
    def run_id(self) -> str | None:
        """The run of the topic (``rs.<run_id>.<name>``), ``None`` for a foreign topic."""
        parsed = parse_topic(self.topic)
        return parsed[0] if parsed else None

    @property
    def event_id(self) -> str | None:
        return getattr(self.event, "event_id", None) if self.event is not None else None


def next_offsets(records: Iterable[Record]) -> dict[TopicPartition, int]:
    """Per partition, the offset to commit after ``records`` (highest offset + 1)."""
    out: dict[TopicPartition, int] = {}
    for r in records:
        tp = r.tp
        if r.offset + 1 > out.get(tp, -1):
            out[tp] = r.offset + 1
    return out


# --------------------------------------------------------------------------- dedupe


class Deduper:
    """A bounded set of ids seen (LRU eviction past ``capacity``; optional TTL in seconds).

    It remembers ids, not effects: the caller adds an id when it starts (or finishes)
    handling a message and :meth:`discard` s it if that handling was abandoned, so a later
    redelivery is handled again.
    """

    def __init__(self, capacity: int = 100_000, ttl_s: float | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"Deduper capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._seen: OrderedDict[str, float] = OrderedDict()
        self.evicted = 0
        """Ids dropped because the set was full (a duplicate older than that is not caught)."""

    def __len__(self) -> int:
        return len(self._seen)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        t = self._seen.get(key)
        if t is None:
            return False
        if self.ttl_s is not None and time.monotonic() - t > self.ttl_s:
            del self._seen[key]
            return False
        return True

    def add(self, key: str) -> None:
        self._seen[key] = time.monotonic()
        self._seen.move_to_end(key)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
            self.evicted += 1

    def check_and_add(self, key: str) -> bool:
        """``True`` if ``key`` was already seen (a duplicate); otherwise remember it, ``False``."""
        if key in self:
            self._seen.move_to_end(key)
            return True
        self.add(key)
        return False

    def discard(self, key: str) -> None:
        self._seen.pop(key, None)

    def clear(self) -> None:
        self._seen.clear()


# --------------------------------------------------------------------------- producer


class Producer:
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
        self.settings = settings
        self.bootstrap = resolve_bootstrap(settings, bootstrap)
        self.transactional_id = transactional_id
        kw = kafka_kwargs(settings, self.bootstrap, client_suffix=client_suffix)
        kw.update(
            enable_idempotence=True,
            acks="all",
            compression_type=None if compression == "none" else compression,
            linger_ms=linger_ms,
            max_batch_size=max_batch_bytes,
            max_request_size=max_request_bytes,
        )
        if transactional_id is not None:
            kw["transactional_id"] = transactional_id
            kw["transaction_timeout_ms"] = int(transaction_timeout_s * 1000)
        self._kwargs = kw
        self.config: dict[str, Any] = {
            k: ("***" if k == "sasl_plain_password" and v else v) for k, v in kw.items()
        }
        self.max_request_bytes = max_request_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._raw: AIOKafkaProducer | None = None
        self._started = False
        self._stopped = False

    @property
    def raw(self) -> AIOKafkaProducer:
        """The underlying ``AIOKafkaProducer`` (created on :meth:`start`)."""
        if self._raw is None:
            raise BusError("producer not started: call `await producer.start()` first")
        return self._raw

    @property
    def started(self) -> bool:
        return self._started and not self._stopped

    async def start(self) -> Producer:
        """Connect (bounded by ``connect_timeout_s``; :class:`BusError` if unreachable).
        Idempotent; a stopped producer cannot be restarted."""
        if self._started:
            if self._stopped:
                raise BusError("producer was stopped; create a new one")
            return self
        self._raw = AIOKafkaProducer(**self._kwargs)
        await _start_bounded(
            "producer", self._raw.start, self._raw.stop, self.bootstrap, self.settings.connect_timeout_s
        )
        self._started = True
        return self

    async def stop(self) -> None:
        """Flush what is queued and close. Idempotent; bounded by the request timeout."""
        if self._stopped or self._raw is None:
            self._stopped = True
            return
        self._stopped = True
        try:
            await asyncio.wait_for(self._raw.stop(), timeout=self.settings.request_timeout_s + 5)
        except TimeoutError:
            log.error(
                "producer did not close within %.0f s; dropping connections",
                self.settings.request_timeout_s + 5,
            )

    async def __aenter__(self) -> Producer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

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

    async def send_offsets_to_transaction(self, offsets: Mapping[TopicPartition, int], group_id: str) -> None:
        """Commit ``offsets`` (next offset per partition) of ``group_id`` in the open transaction."""
        await self.raw.send_offsets_to_transaction(dict(offsets), group_id)


# --------------------------------------------------------------------------- consumer


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, owner: Consumer) -> None:
        self._owner = owner

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._owner._call_hook(self._owner.on_revoked, set(revoked), "on_revoked")

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self._owner._call_hook(self._owner.on_assigned, set(assigned), "on_assigned")


class Consumer:
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
    """

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
        max_partition_fetch_bytes: int = DEFAULT_MAX_MESSAGE_BYTES + _TOPIC_MESSAGE_HEADROOM_BYTES,
        client_suffix: str = "consumer",
    ) -> None:
        self.topics = sorted(set(topics))
        self.pattern = pattern
        if bool(self.topics) == bool(pattern):
            raise ValueError("Consumer needs either topics or a pattern (exactly one of them)")
        self.settings = settings
        self.bootstrap = resolve_bootstrap(settings, bootstrap)
        self.group_id = group_id
        self.on_revoked = on_revoked
        self.on_assigned = on_assigned
        kw = kafka_kwargs(settings, self.bootstrap, client_suffix=client_suffix)
        kw.update(
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
        )
        if metadata_max_age_ms is None:
            # a pattern subscription discovers new topics (new runs) on metadata refresh
            metadata_max_age_ms = 5_000 if pattern else 300_000
        kw["metadata_max_age_ms"] = metadata_max_age_ms
        self._kwargs = kw
        self.config: dict[str, Any] = {
            k: ("***" if k == "sasl_plain_password" and v else v) for k, v in kw.items()
        }
        self._decoders: dict[str, msgspec.msgpack.Decoder[Any]] = {}
        self._raw: AIOKafkaConsumer | None = None
        self._started = False
        self._stopped = False

    @property
    def raw(self) -> AIOKafkaConsumer:
        if self._raw is None:
            raise BusError("consumer not started: call `await consumer.start()` first")
        return self._raw

    @property
    def started(self) -> bool:
        return self._started and not self._stopped

    async def start(self) -> Consumer:
        """Connect (bounded by ``connect_timeout_s``) and subscribe. Idempotent."""
        if self._started:
            if self._stopped:
                raise BusError("consumer was stopped; create a new one")
            return self
        self._raw = AIOKafkaConsumer(**self._kwargs)
        await _start_bounded(
            "consumer", self._raw.start, self._raw.stop, self.bootstrap, self.settings.connect_timeout_s
        )
        listener = _Listener(self) if self.group_id is not None else None
        if self.pattern:
            self._raw.subscribe(pattern=self.pattern, listener=listener)
        else:
            self._raw.subscribe(topics=self.topics, listener=listener)
        self._started = True
        return self

    async def stop(self) -> None:
        """Leave the group and close, committing nothing. Idempotent; bounded."""
        if self._stopped or self._raw is None:
            self._stopped = True
            return
        self._stopped = True
        try:
            await asyncio.wait_for(self._raw.stop(), timeout=self.settings.request_timeout_s + 5)
        except TimeoutError:
            log.error("consumer did not close within %.0f s", self.settings.request_timeout_s + 5)

    async def __aenter__(self) -> Consumer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

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
        """``(event, None)`` or ``(None, reason)`` for ``value`` read from ``topic``."""
        dec = self.decoder_for(topic)
        if dec is None:
            return None, f"topic {topic!r} is not a rollstream topic (rs.<run_id>.<name>)"
        if value is None:
            return None, "message has no value (tombstone)"
        try:
            return dec.decode(value), None
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return None, one_line(e)

    # -- consuming

    async def getmany(self, timeout_ms: int = 1000, max_records: int | None = None) -> list[Record]:
        """Up to ``max_records`` records (waiting at most ``timeout_ms`` if none are buffered),
        each partition's in offset order. Undecodable ones come back with ``error`` set."""
        batches = await self.raw.getmany(timeout_ms=timeout_ms, max_records=max_records)
        out: list[Record] = []
        for tp, msgs in batches.items():
            for m in msgs:
                event, error = self.decode(tp.topic, m.value)
                out.append(
                    Record(
                        topic=tp.topic,
                        partition=tp.partition,
                        offset=m.offset,
                        key=m.key,
                        value_bytes=m.value,
                        event=event,
                        error=error,
                        ts=m.timestamp / 1000.0,
                    )
                )
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


# --------------------------------------------------------------------------- admin


@dataclass(frozen=True)
class TopicInfo:
    """What the broker says about one topic of a run."""

    name: str
    """Logical name (``tasks``...)."""
    topic: str
    """Kafka topic name."""
    partitions: int
    configs: dict[str, str] = field(default_factory=dict)
    """Topic-level configs that differ from the broker default (plus ``cleanup.policy``)."""


class TopicAdmin:
    """Creates and inspects the per-run topics of :data:`schemas.topics.TOPICS`.

    ``replication_factor=None`` uses ``min(3, number of brokers)``. Topics get the registry's
    partitions and cleanup policy, and ``max.message.bytes`` large enough for
    :data:`DEFAULT_MAX_MESSAGE_BYTES` messages.
    """

    def __init__(
        self,
        settings: KafkaSettings,
        bootstrap: str | None = None,
        *,
        replication_factor: int | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.settings = settings
        self.bootstrap = resolve_bootstrap(settings, bootstrap)
        self.replication_factor = replication_factor
        self.max_message_bytes = max_message_bytes
        self._kwargs = kafka_kwargs(settings, self.bootstrap, client_suffix="admin")
        self._raw: AIOKafkaAdminClient | None = None
        self._stopped = False

    @property
    def raw(self) -> AIOKafkaAdminClient:
        if self._raw is None:
            raise BusError("admin not started: call `await admin.start()` first")
        return self._raw

    async def start(self) -> TopicAdmin:
        """Connect (bounded by ``connect_timeout_s``). Idempotent."""
        if self._raw is not None:
            return self
        raw = AIOKafkaAdminClient(**self._kwargs)
        await _start_bounded("admin", raw.start, raw.close, self.bootstrap, self.settings.connect_timeout_s)
        self._raw = raw
        return self

    async def stop(self) -> None:
        if self._raw is not None and not self._stopped:
            self._stopped = True
            await self._raw.close()

    async def __aenter__(self) -> TopicAdmin:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def topic_configs(self, spec: TopicSpec) -> dict[str, str]:
        """Configs a run topic is created with: the registry's plus ``max.message.bytes``."""
        cfg = dict(spec.configs())
        cfg["max.message.bytes"] = str(self.max_message_bytes + _TOPIC_MESSAGE_HEADROOM_BYTES)
        return cfg

    async def _timeout(self, coro: Awaitable[Any], what: str) -> Any:
        t = self.settings.request_timeout_s + 5
        try:
            return await asyncio.wait_for(coro, timeout=t)
        except TimeoutError:
            raise BusError(f"Kafka at {self.bootstrap} did not answer {what} within {t:g} s") from None

    async def ensure_run_topics(self, run_id: str) -> list[str]:
        """Create every topic of the run (existing ones are fine); wait until all have leaders.

        Returns the Kafka topic names in registry order. An existing topic is left as is (its
        partition count is not changed; :meth:`describe` shows it).
        """
        check_run_id(run_id)
        rf = self.replication_factor
        if rf is None:
            cluster = await self._timeout(self.raw.describe_cluster(), "describe_cluster")
            rf = max(1, min(3, len(cluster.get("brokers") or [1])))
        new = [
            NewTopic(spec.topic(run_id), spec.partitions, rf, topic_configs=self.topic_configs(spec))
            for spec in TOPICS.values()
        ]
        resp = await self._timeout(self.raw.create_topics(new), "create_topics")
        problems = []
        for t in resp.to_object()["topic_errors"]:
            code = t["error_code"]
            if code not in (0, 36):  # 36 = TOPIC_ALREADY_EXISTS
                problems.append(f"{t['topic']}: error {code} {t.get('error_message') or ''}".strip())
        if problems:
            raise BusError(f"creating topics of run {run_id} failed: " + "; ".join(problems))
        names = [n.name for n in new]
        await self._wait_leaders(names)
        return names

    async def _wait_leaders(self, names: list[str]) -> None:
        deadline = time.monotonic() + self.settings.request_timeout_s
        while True:
            topics = await self._timeout(self.raw.describe_topics(names), "describe_topics")
            missing = [
                t["topic"]
                for t in topics
                if t["error_code"] != 0
                or not t["partitions"]
                or any(p["leader"] < 0 for p in t["partitions"])
            ]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise BusError(
                    f"topics have no leader after {self.settings.request_timeout_s:g} s: {missing}"
                )
            await asyncio.sleep(0.1)

    async def run_topics(self, run_id: str) -> list[str]:
        """Kafka topics of ``run_id`` that exist now."""
        check_run_id(run_id)
        existing = set(await self._timeout(self.raw.list_topics(), "list_topics"))
        return [spec.topic(run_id) for spec in TOPICS.values() if spec.topic(run_id) in existing]

    async def describe(self, run_id: str) -> dict[str, TopicInfo]:
        """Logical name -> :class:`TopicInfo` for the run's existing topics."""
        names = await self.run_topics(run_id)
        if not names:
            return {}
        meta = await self._timeout(self.raw.describe_topics(names), "describe_topics")
        parts = {t["topic"]: len(t["partitions"]) for t in meta if t["error_code"] == 0}
        resources = [ConfigResource(ConfigResourceType.TOPIC, n) for n in names]
        responses = await self._timeout(self.raw.describe_configs(resources), "describe_configs")
        configs: dict[str, dict[str, str]] = {}
        for resp in responses:
            for res in resp.to_object()["resources"]:
                entries = {}
                for e in res["config_entries"]:
                    # config_source 1 = topic config; keep cleanup.policy always
                    if e.get("config_source") == 1 or e["config_names"] == "cleanup.policy":
                        entries[e["config_names"]] = e["config_value"]
                configs[res["resource_name"]] = entries
        out: dict[str, TopicInfo] = {}
        for n in names:
            parsed = parse_topic(n)
            assert parsed is not None
            out[parsed[1]] = TopicInfo(parsed[1], n, parts.get(n, 0), configs.get(n, {}))
        return out

    async def topic_config(self, topic: str) -> dict[str, str]:
        """Every config of one topic as the broker reports it (defaults included)."""
        responses = await self._timeout(
            self.raw.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)]), "describe_configs"
        )
        out: dict[str, str] = {}
        for resp in responses:
            for res in resp.to_object()["resources"]:
                if res["error_code"]:
                    raise BusError(
                        f"describe_configs {topic}: error {res['error_code']} {res['error_message']}"
                    )
                for e in res["config_entries"]:
                    out[e["config_names"]] = e["config_value"]
        return out

    async def list_runs(self) -> list[str]:
        """Run ids that have at least one topic, sorted."""
        topics = await self._timeout(self.raw.list_topics(), "list_topics")
        return sorted({p[0] for p in map(parse_topic, topics) if p is not None})

    async def delete_run_topics(self, run_id: str) -> list[str]:
        """Delete the run's existing topics and wait until the broker no longer lists them;
        returns the names deleted."""
        names = await self.run_topics(run_id)
        if not names:
            return []
        resp = await self._timeout(self.raw.delete_topics(names), "delete_topics")
        problems = [
            f"{t['topic']}: error {t['error_code']}"
            for t in resp.to_object()["topic_error_codes"]
            if t["error_code"] not in (0, 3)  # 3 = UNKNOWN_TOPIC_OR_PARTITION (already gone)
        ]
        if problems:
            raise BusError(f"deleting topics of run {run_id} failed: " + "; ".join(problems))
        # deletion is asynchronous on the broker: wait until metadata no longer lists them
        deadline = time.monotonic() + self.settings.request_timeout_s
        while await self.run_topics(run_id):
            if time.monotonic() > deadline:
                raise BusError(
                    f"topics of run {run_id} still listed {self.settings.request_timeout_s:g} s after deletion"
                )
            await asyncio.sleep(0.1)
        return names


def new_group_suffix() -> str:
    """A short random suffix (client ids, transactional ids of one process instance)."""
    return uuid.uuid4().hex[:8]


async def message_count(kafka: KafkaSettings, bootstrap: str, partitions: dict[str, int]) -> int:
    """Messages currently held by the topics of ``partitions`` (Kafka topic -> partition count)."""
    tps = [TopicPartition(t, p) for t, n in partitions.items() for p in range(n)]
    if not tps:
        return 0
    consumer = AIOKafkaConsumer(**kafka_kwargs(kafka, bootstrap, client_suffix="count"))
    await consumer.start()
    try:
        begin = await consumer.beginning_offsets(tps)
        end = await consumer.end_offsets(tps)
    finally:
        await consumer.stop()
    return int(sum(end[tp] - begin[tp] for tp in tps))
