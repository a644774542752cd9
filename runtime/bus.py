"""The bus: thin, typed wrappers around aiokafka for rollstream's per-run topics.

This module gathers the bus's public names in one place; the code lives in:

* :mod:`runtime.connection` — :func:`resolve_bootstrap`, :func:`kafka_kwargs` (the
  connection/security kwargs every aiokafka client gets), the bounded client start and
  :class:`BusError`: an unreachable broker raises it with one line naming the address, never hangs;
* :mod:`runtime.records` — message keys (:func:`key_for`), :class:`Record`,
  :func:`next_offsets` and :class:`Deduper` (a bounded LRU, optionally TTL, set of ids seen);
* :mod:`runtime.clients` — :class:`Producer` (idempotent, compressed, msgpack-encoding,
  optionally transactional) and :class:`Consumer` (manual-commit, ``read_committed``, decoding);
* :mod:`runtime.admin` — :class:`TopicAdmin` (the topics of a run, following
  :data:`schemas.topics.TOPICS`), :func:`message_count` and :func:`message_counts`.

Importing this module has no side effects.
"""

from __future__ import annotations

from aiokafka.structs import RecordMetadata, TopicPartition

from runtime.admin import TopicAdmin, TopicInfo, message_count, message_counts
from runtime.clients import Compression, Consumer, Producer, RevokeHook
from runtime.connection import (
    DEFAULT_MAX_MESSAGE_BYTES,
    BusError,
    kafka_kwargs,
    new_group_suffix,
    resolve_bootstrap,
)
from runtime.records import Deduper, KeyLike, Record, encode_key, key_for, next_offsets
from schemas.errors import one_line

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "BusError",
    "Compression",
    "Consumer",
    "Deduper",
    "KeyLike",
    "Producer",
    "Record",
    "RecordMetadata",
    "RevokeHook",
    "TopicAdmin",
    "TopicInfo",
    "TopicPartition",
    "encode_key",
    "kafka_kwargs",
    "key_for",
    "message_count",
    "message_counts",
    "new_group_suffix",
    "next_offsets",
    "one_line",
    "resolve_bootstrap",
]
