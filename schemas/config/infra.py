"""Where a run's infrastructure is: Kafka (:class:`KafkaSettings`), the store of records
(:class:`StoreSettings`), experiment trackers, and where services run under Ray
(:class:`PlacementConfig`)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from schemas.config.base import NonNegativeFloat, PositiveFloat, PositiveInt, Section


class KafkaSettings(Section):
    """How to reach Kafka. Security settings pass straight through to aiokafka."""

    bootstrap: str = ""
    """``host:port[,host:port]``; ``--bootstrap`` / ``$ROLLSTREAM_BOOTSTRAP`` override it; empty = the
    local broker started by ``rollstream stack up`` (docs/architecture.md, "Finding the broker")."""
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """Kafka ``security.protocol``."""
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = "PLAIN"
    """SASL mechanism when the protocol is ``SASL_*`` (``GSSAPI`` and ``OAUTHBEARER`` are not supported:
    no Kerberos service name or token provider is wired)."""
    sasl_username: str = ""
    """SASL user (PLAIN / SCRAM)."""
    sasl_password: str = ""
    """Refused in config files and ``--set`` (it would be copied into ``runs/<id>/config.yaml`` and
    the run's record): give the SASL password as ``$ROLLSTREAM_SASL_PASSWORD`` or in
    ``sasl_password_file``. Only code that builds settings itself may set it; ``***`` (a redacted
    config) counts as unset."""
    sasl_password_file: str = ""
    """File holding the SASL password (PLAIN / SCRAM; its first line); empty =
    ``$ROLLSTREAM_SASL_PASSWORD``. The path is recorded, never the password."""
    ssl_cafile: str = ""
    """CA bundle (PEM) to verify the brokers, for ``SSL`` / ``SASL_SSL``."""
    ssl_certfile: str = ""
    """Client certificate (PEM) for mutual TLS."""
    ssl_keyfile: str = ""
    """Client private key (PEM) for mutual TLS."""
    client_id: str = "rollstream"
    """Prefix of the Kafka client id of every producer/consumer."""
    request_timeout_s: PositiveFloat = 30.0
    """Kafka request timeout, seconds."""
    connect_timeout_s: PositiveFloat = 10.0
    """How long to wait for the first connection before failing with a clear error, seconds."""
    outage_timeout_s: PositiveFloat = 300.0
    """How long a running service keeps retrying while Kafka is unavailable (a broker restart, a
    network outage: sends, transactions, commits and polls that fail with retriable errors)
    before it fails, seconds."""
    samples_per_record: Annotated[int, Meta(ge=1, le=4096)] = 64
    """Most events one Kafka record carries on the hot topics (``tasks``, ``generations``, ``scored``,
    ``metrics``). Outputs that are sent together (one handler batch, one transaction, the handler
    calls that finished in the same engine step) and go to the same partition share a record, up to
    this many and up to the producer's 8 MiB request size; a sample is never held back to fill one.
    Each event stays its own sample (its id, its row, exactly once). 1 = one event per record."""


class StoreSettings(Section):
    """Where the record of runs goes (ClickHouse through clickhouse-connect)."""

    dsn: str = ""
    """``chdb:///path`` (embedded engine, on disk) or ``http(s)://user@host:8123/db`` with the
    password in ``$ROLLSTREAM_STORE_PASSWORD`` (or the file ``$ROLLSTREAM_STORE_PASSWORD_FILE``
    names); a password written in the DSN works too but is shown as ``***`` in
    ``runs/<id>/config.yaml``, the record and every message. Empty = ``chdb:///<runs_dir>/<run_id>/store``."""
    batch_max_records: PositiveInt = 2000
    """Most messages the recorder takes per poll; each poll is written with one insert per table
    (larger = fewer, bigger inserts; smaller = fresher record)."""
    lag_report_every_s: NonNegativeFloat = 10.0
    """How often the recorder logs its consumer lag and writes it to the ``recorder_lag`` table,
    seconds (0 = after every poll)."""
    retry_for_s: NonNegativeFloat = 600.0
    """How long the recorder retries an insert that fails with a connection, timeout or I/O error
    (the store down) before it stops with that error, seconds. Meanwhile training goes on, nothing
    unstored is committed, ``rollstream status`` shows the outage, and the recorder catches up from
    Kafka once the store is back. Other insert errors stop the recorder at once."""
    record_live: bool = True
    """Record the run while it goes: ``rollstream run`` starts the recorder. ``false``: no recorder
    (no chDB needed on the node, its CPU saved); the run's topics are its record until
    ``rollstream record RUN`` builds the store from them, on this machine or another one
    (docs/analytics.md, "The record built later"). Topics keep their events 7 days
    (``retention.ms``): build the record before that. ``summary.json`` then comes from the topics;
    ``tracking`` (fed by the recorder) is refused."""


class TrackingConfig(Section):
    """Optional experiment trackers, fed by the recorder with the record's metric names."""

    tensorboard: bool = False
    """Write TensorBoard event files under ``runs/<id>/tb`` (needs the ``tensorboard`` package:
    ``pip install 'rollstream[trackers]'``; refused before anything starts when it is missing)."""
    wandb: bool = False
    """Log to Weights & Biases in offline mode under ``runs/<id>/wandb`` (needs ``wandb``; refused
    before anything starts when it is missing). Sync later with ``wandb sync``."""
    wandb_project: str = "rollstream"
    """W&B project name."""


class ServicePlacement(Section):
    """What one process of a service reserves on a Ray cluster (``rollstream run --launcher ray``):
    one bundle of the run's placement group per process (each rollout, env or judge worker gets its
    own). Ray's units are scheduling units: they reserve, they do not cap the threads a service uses
    (its ``OMP_NUM_THREADS`` is the one ``rollstream run`` has, else unset, as with the local launcher)."""

    cpus: NonNegativeFloat = 0.25
    """Logical CPUs (fractions allowed). For the trainer: the total of all its ``train.ranks``
    processes, which run on one node (its rank 0 starts the others there)."""
    gpus: NonNegativeFloat = 0.0
    """GPUs (a fraction below 1, or a whole number); the process sees only the ones it got (Ray sets
    its ``CUDA_VISIBLE_DEVICES``), none with 0 (a ``cuda`` device then is refused before the run
    starts; ``auto`` picks the CPU). For the trainer: the total of all its ranks, on one node."""
    resources: dict[str, Annotated[float, Meta(gt=0, description="a finite number > 0")]] = msgspec.field(
        default_factory=dict)
    """Ray custom resources, ``{name: amount}`` (e.g. ``{"node:10.0.0.2": 0.01}`` pins it to that
    node, or a label the cluster's nodes were started with). Not ``CPU`` / ``GPU``: use ``cpus`` /
    ``gpus``."""


class PlacementConfig(Section):
    """Where the services run under ``rollstream run --launcher ray``: each process is a Ray actor in
    one placement group of the run (one bundle per process), reserved before anything starts; a
    request no node can satisfy is refused in one line. The local launcher refuses a non-default
    ``placement`` section (it runs everything on this machine). Replicas are ``rollout.workers``,
    ``env.workers`` and ``judge.workers``; ``train.ranks`` trainer processes share the trainer's one
    bundle."""

    strategy: Literal["pack", "spread", "strict_pack", "strict_spread"] = "pack"
    """How the bundles share nodes (Ray placement group strategies): ``pack`` (as few nodes as
    possible), ``spread`` (as many as possible), ``strict_pack`` (all on one node), ``strict_spread``
    (each on its own node)."""
    ready_timeout_s: PositiveFloat = 120.0
    """How long the run waits for the cluster to reserve its placement group (the resources exist
    but other jobs may hold them), and for each service's actor to start, seconds."""
    recorder: ServicePlacement = msgspec.field(default_factory=ServicePlacement)
    """The recorder."""
    feeder: ServicePlacement = msgspec.field(default_factory=ServicePlacement)
    """The feeder."""
    reward: ServicePlacement = msgspec.field(default_factory=ServicePlacement)
    """The reward router."""
    judge: ServicePlacement = msgspec.field(default_factory=ServicePlacement)
    """Each judge worker (started only when a domain has a judge)."""
    env: ServicePlacement = msgspec.field(default_factory=ServicePlacement)
    """Each environment worker (started only when a domain is multi-turn)."""
    rollout: ServicePlacement = msgspec.field(default_factory=ServicePlacement)
    """Each rollout worker."""
    trainer: ServicePlacement = msgspec.field(default_factory=ServicePlacement)
    """The trainer, all its ``train.ranks`` processes together (one node)."""
