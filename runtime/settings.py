"""How one service instance runs: :class:`ServiceSettings`, grouped by concern.

* :class:`Subscription` — what the instance reads and in which consumer group;
* :class:`Consume` — how its consumer polls, fetches and stays in the group;
* :class:`Handling` — how its handler calls run, retry, fail and stop;
* :class:`Delivery` — when offsets are committed and how effects stay single (transactions,
  dedupe, derived output ids);
* :class:`Produce` — how its producer batches and compresses.

Bounds are msgspec ``Meta`` constraints on the fields: msgspec checks them when the settings are
decoded or converted, :func:`check_bounds` when they are constructed in code. The rules that tie
fields together are in :meth:`ServiceSettings.__post_init__`, and nowhere else.
"""

from __future__ import annotations

import functools
import operator
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from runtime.clients import Compression
from schemas.config import KafkaSettings
from schemas.services import ALL_RUNS_PATTERN, ServiceSpec
from schemas.topics import TOPICS, topic_name

__all__ = [
    "CommitMode",
    "Consume",
    "Delivery",
    "Handling",
    "Produce",
    "ServiceSettings",
    "Subscription",
    "check_bounds",
    "resolve_topic",
]

CommitMode = Literal["after_effect", "by_service"]

AtLeastOne = Annotated[int, Meta(ge=1)]
NotNegative = Annotated[int, Meta(ge=0)]
Seconds = Annotated[float, Meta(ge=0)]
PositiveSeconds = Annotated[float, Meta(gt=0)]


def resolve_topic(topic: str, run_id: str | None) -> str:
    """A logical name (``scored``) becomes ``rs.<run_id>.scored``; a full name stays."""
    if topic in TOPICS:
        if not run_id:
            raise ValueError(f"logical topic {topic!r} needs a run id")
        return topic_name(run_id, topic)
    return topic


@functools.cache
def _fields(cls: type[msgspec.Struct]) -> tuple[msgspec.inspect.Field, ...]:
    return msgspec.inspect.type_info(cls).fields  # type: ignore[attr-defined,no-any-return]


_BOUNDS = (("ge", operator.lt, ">="), ("gt", operator.le, ">"), ("le", operator.gt, "<="), ("lt", operator.ge, "<"))
"""Each numeric ``Meta`` bound: its name, the test that ``value`` breaks it, and how to say it."""


def _violation(t: msgspec.inspect.Type, value: Any) -> str:
    """What is wrong with ``value`` under the ``Meta`` constraints of ``t`` ("" when nothing)."""
    if isinstance(t, msgspec.inspect.UnionType):
        return next((v for m in t.types if (v := _violation(m, value))), "")
    if isinstance(t, msgspec.inspect.IntType | msgspec.inspect.FloatType) and _number(value):
        for bound, breaks, says in _BOUNDS:
            limit = getattr(t, bound)
            if limit is not None and breaks(value, limit):
                return f"must be {says} {limit}"
    if isinstance(t, msgspec.inspect.StrType) and isinstance(value, str) and len(value) < (t.min_length or 0):
        return "must not be empty" if t.min_length == 1 else f"must have at least {t.min_length} characters"
    return ""


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_bounds(obj: msgspec.Struct) -> None:
    """Raise ``ValueError`` naming the first field of ``obj`` outside its ``Meta`` bounds (msgspec
    checks them only when decoding; this applies them to a Struct constructed in code)."""
    for f in _fields(type(obj)):
        value = getattr(obj, f.name)
        problem = _violation(f.type, value)
        if problem:
            raise ValueError(f"{type(obj).__name__}.{f.name} {problem}, got {value!r}")


class _Group(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A group of settings whose ``Meta`` bounds hold when constructed in code too."""

    def __post_init__(self) -> None:
        check_bounds(self)


class Subscription(_Group):
    """What the instance reads, and as whom."""

    group_id: Annotated[str, Meta(min_length=1)] | None
    """Kafka consumer group; instances with the same group share the partitions. ``None``: no
    group — the instance reads every partition from ``auto_offset_reset`` on each start and
    commits nothing (the feeder rebuilds its state from the run's topics this way)."""
    topics: list[str] = msgspec.field(default_factory=list)
    """Topics to consume: logical names (``generations``, resolved with ``run_id``) or full
    Kafka names. Exactly one of ``topics`` / ``topic_pattern`` is set."""
    topic_pattern: str = ""
    """Regex of topics to consume (e.g. ``^rs\\..*`` for the recorder)."""
    observed_topics: list[str] = msgspec.field(default_factory=list)
    """Topics (logical or full names) this service reads only to follow what others do, while
    another consumer group owns their records (the feeder reads back ``tasks``, which the
    rollout group consumes): a record of these that fails to decode is left to its owner, who
    dead-letters it, and is counted in ``ignored`` here (logged at WARNING), so one bad record
    makes one dead letter."""
    auto_offset_reset: Literal["earliest", "latest"] = "earliest"
    """Where a group without committed offsets (or an instance without a group) starts."""
    ensure_topics: bool = True
    """On start, create the run's topics if missing (``TopicAdmin.ensure_run_topics``; needs
    ``run_id``), so a consumer never subscribes to (and a broker never auto-creates) a topic
    with the wrong partitions or configs."""

    @classmethod
    def of(cls, spec: ServiceSpec, run_id: str, **more: Any) -> Subscription:
        """What the service table says ``spec`` reads in run ``run_id``: its group (none for a
        service without one), the Kafka names of its consumed then observed topics, the observed
        ones marked; an instance of every run (empty ``run_id``, :attr:`ServiceSpec.all_runs`)
        subscribes by pattern. ``more``: the other fields."""
        group = spec.group_id(run_id) if spec.grouped else None
        if not run_id and spec.all_runs:
            return cls(group_id=group, topic_pattern=ALL_RUNS_PATTERN, **more)
        return cls(group_id=group, topics=[topic_name(run_id, t) for t in spec.subscribed],
                   observed_topics=[topic_name(run_id, t) for t in spec.observes], **more)


class Consume(_Group):
    """How the consumer polls and fetches, and stays in its group."""

    batch_max_records: AtLeastOne = 100
    """Most records taken per poll (per call of a batch handler)."""
    poll_timeout_s: Seconds = 0.5
    """Longest wait for new records per poll, seconds (also bounds how late a stop is noticed
    and how often ``on_tick`` runs when the topics are quiet)."""
    fetch_min_bytes: AtLeastOne = 1
    """The broker answers a fetch once this many bytes are ready (or ``fetch_max_wait_ms`` passed):
    1 = at once. Larger: fewer, fuller fetches for a service that need not see each record at
    once (the recorder)."""
    fetch_max_wait_ms: NotNegative = 100
    """Longest the broker holds a fetch waiting for ``fetch_min_bytes``, milliseconds. It also
    bounds how late a record can reach a busy consumer: aiokafka fetches nothing for a partition
    whose fetched records the service has not taken yet, and after 0.1 s sends one fetch for the
    other partitions; the broker holds that fetch up to this long when they are quiet, and the
    drained partition is fetched only after it returns. Kafka's own default, 500 ms, made the
    trainer wait up to half a second per step for samples that were already committed."""
    session_timeout_s: PositiveSeconds = 10.0
    """Group session timeout: a silent instance is evicted after this long, seconds."""
    max_poll_interval_s: PositiveSeconds = 300.0
    """An instance that does not poll for this long leaves the group (one handler call must
    finish within it), seconds."""


class Handling(_Group):
    """How handler calls run, retry, fail and stop."""

    max_concurrency: AtLeastOne = 1
    """Record handler calls in flight at once. 1 = strictly in order per instance. With more,
    outputs of different records may interleave, but offsets are still committed only up to the
    first unfinished record of each partition."""
    handler_retries: NotNegative = 0
    """Extra attempts of a record handler that raised before the record is dead-lettered."""
    retry_backoff_s: Seconds = 0.2
    """Pause between handler attempts, seconds."""
    shutdown_grace_s: Seconds = 10.0
    """On stop or partition revocation, how long in-flight handler calls may still run, seconds."""
    dlq: bool = True
    """Send records that fail to decode or handle to the run's ``dlq`` topic as ``DeadLetter``.
    False: log them at ERROR and count them in ``failed`` only."""
    handle_undecodable: bool = False
    """Give records that fail to decode to the handler (``rec.event is None``, ``rec.error`` says
    why) instead of dead-lettering them: for a service whose job is the bytes (the recorder)."""


class Delivery(_Group):
    """When consumed offsets are committed, and what keeps each effect single."""

    commit: CommitMode = "after_effect"
    """``after_effect``: the runtime commits a record's offset once its outputs (or its dead
    letter) are acknowledged. ``by_service``: the runtime never commits; the service commits
    the positions its own durable state covers with ``runner.commit`` (the trainer commits the
    positions saved in each checkpoint). Ignored without a ``group_id``."""
    transactional: bool = False
    """Commit outputs and consumed offsets together in Kafka transactions (exactly once): every
    ``txn_interval_s``, the outputs of every finished record, each partition's offset up to its
    first unfinished record, and the records finished after that in the offset's metadata (its
    next reader skips them). Record handlers only, with a ``group_id`` and
    ``commit="after_effect"``."""
    transactional_id: str = ""
    """Transactional id of this instance (stable across restarts to fence zombies); empty =
    ``<group_id>.<random>``."""
    transaction_timeout_s: PositiveSeconds = 60.0
    """Transaction timeout: the broker aborts a transaction left open this long (an instance killed
    mid-transaction with a per-start ``transactional_id`` holds back ``read_committed`` readers of
    its partitions until then), seconds."""
    txn_interval_s: Seconds = 0.1
    """Transactional services: how often finished work is committed (one transaction holding the
    outputs of every record finished since the last one, and the offsets), seconds. When no
    handler runs and no record came for ``QUIET_COMMIT_S`` (0.01 s), finished records commit
    sooner, at most every ``txn_interval_s / 4`` (:mod:`runtime.txn_loop`)."""
    dedupe: bool = True
    """Skip a record whose ``event_id`` this process already handled (counted in ``duplicates``).
    False: every record reaches the handler (the recorder stores every message, duplicates too)."""
    dedupe_capacity: AtLeastOne = 100_000
    """How many handled ``event_id`` s the in-process dedupe set remembers (LRU)."""
    deterministic_output_ids: bool = True
    """Give each emitted event an ``event_id`` derived from (input event_id, service name,
    output index), so a re-handled input produces the same ids (downstream dedupe). Batch
    handlers get this for outputs emitted with a ``parent`` record."""


class Produce(_Group):
    """How the producer batches and compresses."""

    compression: Compression = "zstd"
    """Producer compression codec (zstd: faster than aiokafka's LZ4-HC, see bench/bus.py)."""
    linger_ms: NotNegative = 5
    """Producer batching delay, milliseconds: how long a send waits for more records to share its
    request. In ``bench/pipeline_ceiling.py`` 1-2 ms sent more samples/s than 5 ms but trained
    about as many: two to three times as many samples were dropped as stale, generated for
    nothing. 0 (a request per send) cost more CPU in every client and the broker. A transactional
    producer (``delivery.transactional``) ignores it and sends at once: a transaction's outputs are
    all sent at its commit, where a linger only delays the commit."""


class ServiceSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How one service instance consumes, handles, commits and produces."""

    subscription: Subscription
    """What it reads, and in which consumer group."""
    run_id: str = ""
    """The run whose topics are meant by logical names (``topics``, ``ctx.emit("scored")``).
    Empty for cross-run services (pattern subscription): then the record's own run is used."""
    kafka: KafkaSettings = msgspec.field(default_factory=KafkaSettings)
    """How to reach Kafka (bootstrap, security, timeouts)."""
    consume: Consume = msgspec.field(default_factory=Consume)
    """How the consumer polls and fetches."""
    handling: Handling = msgspec.field(default_factory=Handling)
    """How handler calls run."""
    delivery: Delivery = msgspec.field(default_factory=Delivery)
    """When offsets commit, and what keeps effects single."""
    produce: Produce = msgspec.field(default_factory=Produce)
    """How outputs are produced."""

    def __post_init__(self) -> None:
        """The rules that tie fields of different groups together (the bounds are the groups')."""
        sub, d = self.subscription, self.delivery
        if bool(sub.topics) == bool(sub.topic_pattern):
            raise ValueError("ServiceSettings: set exactly one of subscription.topics / subscription.topic_pattern")
        if any(t in TOPICS for t in [*sub.topics, *sub.observed_topics]) and not self.run_id:
            raise ValueError("ServiceSettings: logical topic names need run_id")
        if d.transactional and (sub.group_id is None or d.commit != "after_effect"):
            raise ValueError("ServiceSettings: delivery.transactional needs a subscription.group_id and "
                             "delivery.commit='after_effect'")

    @property
    def runtime_commits(self) -> bool:
        """Whether the runtime itself commits offsets (a group and ``commit="after_effect"``)."""
        return self.subscription.group_id is not None and self.delivery.commit == "after_effect"

    def observed(self, topic: str) -> bool:
        """Whether ``topic`` (a full Kafka name) is one of ``subscription.observed_topics``."""
        return any(resolve_topic(t, self.run_id) == topic for t in self.subscription.observed_topics)
