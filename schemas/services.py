"""The service table: one :class:`ServiceSpec` per service of a run, beside the topic table.

Every fact about a service that more than one place needs is written here once: its name
(``rollstream service NAME``), its consumer group (:meth:`ServiceSpec.group_id`, the only place
``rs-<service>-<run_id>`` is built), the topics it consumes, observes and produces, the runtime
loop it runs, its device and placement keys, how many processes a run starts and when, whether it
runs until told to stop or finishes by itself, and the module of its handler. The CLI, the
supervisor, the Ray launcher, ``rollstream status``, the thread budget, healing and the config's
placement rule read it. docs/architecture.md, "Services", shows it (:func:`markdown_table`; a test
keeps the two equal) and says how to add a service. No I/O; imports only ``schemas``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from schemas.topics import ALL_RUNS_PATTERN, TOPICS

__all__ = [
    "ALL_RUNS_PATTERN",
    "SERVICES",
    "Lifecycle",
    "Loop",
    "Needed",
    "ServiceSpec",
    "in_start_order",
    "markdown_table",
    "stop_waves",
    "value_at",
]

Loop = Literal["record", "batch", "transactional"]
"""The runtime loop (:mod:`runtime.runner`): ``RecordLoop``, ``BatchLoop`` or ``TxnLoop``."""
Lifecycle = Literal["until_stopped", "finishes"]
"""``until_stopped``: runs until SIGTERM (the supervisor sends it once the run finished);
``finishes``: exits 0 by itself once the run finished (``RunFinished``)."""
Needed = Literal["always", "multi_turn", "judged", "record_live"]
"""When ``rollstream run`` starts the service: always, only when a domain is multi-turn, only when
a domain has a judge, only when the run is recorded live (``store.record_live``)."""


@dataclass(frozen=True)
class ServiceSpec:
    """One service of a run."""

    name: str
    """``rollstream service NAME``; also the service's name in the runtime (derived event ids), its
    log label (``rollout0``, ``rollout1``... with several processes) and its ``placement`` key."""
    handler: str
    """Dotted module of its handler: ``settings_from(start)`` builds its settings from a
    :class:`services.ServiceStart`, ``run(settings, stop)`` runs it."""
    start_order: int
    """Where it starts among the run's services (the supervisor and ``status`` list them so)."""
    consumes: tuple[str, ...]
    """Logical topics it consumes: their records reach its handler, and the ones it cannot decode or
    handle are dead-lettered."""
    produces: tuple[str, ...]
    """Logical topics it writes (besides the dead letters the runtime writes to ``dlq``)."""
    observes: tuple[str, ...] = ()
    """Topics it reads only to follow what others do: another group owns their records and
    dead-letters the bad ones (``Subscription.observed_topics``)."""
    grouped: bool = True
    """Whether it consumes in its consumer group (:meth:`group_id`). Without one it reads its topics
    from the beginning on every start and commits nothing."""
    loops: tuple[Loop, ...] = ("record",)
    """The runtime loop it runs by default, then any its settings may switch to."""
    lifecycle: Lifecycle = "until_stopped"
    """Whether it runs until told to stop or finishes by itself."""
    stop_order: int = 0
    """``until_stopped`` services are SIGTERMed at the end of the run in increasing order: one that
    others may still wait on (env and judge workers) after them."""
    device_key: str = ""
    """The config key of the device its model runs on (empty: it runs no model)."""
    replicas_key: str = ""
    """The config key of its number of processes (empty: one)."""
    needed: Needed = "always"
    """When ``rollstream run`` starts it."""
    lag_topics: tuple[str, ...] = ()
    """The topics whose lag tells how far behind its group is; empty = every topic it consumes."""
    lag_label: str = ""
    """How a stall line names its group's lag (empty: not named)."""
    all_runs: bool = False
    """One instance may serve every run (empty run id: a pattern subscription, group ``…-all``)."""

    def __post_init__(self) -> None:
        if self.grouped and not self.lag_topics:
            object.__setattr__(self, "lag_topics", self.consumes)

    def group_id(self, run_id: str) -> str:
        """Its consumer group in run ``run_id``: ``rs-<name>-<run_id>`` (``rs-<name>-all`` for an
        instance of every run)."""
        return f"rs-{self.name}-{run_id or 'all'}"

    def transactional_id(self, run_id: str, label: str = "") -> str:
        """A stable Kafka transactional id of one of its processes: its group id, then ``-<label>``
        when several processes each need their own (judge workers)."""
        return self.group_id(run_id) + (f"-{label}" if label else "")

    @property
    def subscribed(self) -> tuple[str, ...]:
        """Every topic its consumer subscribes to: the consumed ones, then the observed ones."""
        return self.consumes + self.observes

    @property
    def placement_key(self) -> str:
        """Its section of ``placement`` (``rollstream run --launcher ray``)."""
        return f"placement.{self.name}"

    @property
    def runs_model(self) -> bool:
        """Whether its processes run a model (they get torch threads: ``run.torch_threads``)."""
        return bool(self.device_key)

    def device(self, cfg: Any) -> str:
        """Its device as ``cfg`` (a ``RunConfig``) sets it ('' when it runs no model)."""
        return str(value_at(cfg, self.device_key)) if self.device_key else ""

    def replicas(self, cfg: Any) -> int:
        """Its number of processes under ``cfg`` (a ``RunConfig``) when it is started at all."""
        return int(value_at(cfg, self.replicas_key)) if self.replicas_key else 1


def value_at(cfg: Any, key: str) -> Any:
    """The value of a dotted config key (``rollout.workers``) in ``cfg``."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


SERVICES: dict[str, ServiceSpec] = {
    spec.name: spec
    for spec in (
        ServiceSpec("feeder", "services.feeder", 1, grouped=False, loops=("batch",), lifecycle="finishes",
                    consumes=("metrics", "dlq", "weights", "control"), observes=("tasks",),
                    produces=("tasks", "metrics", "control")),
        ServiceSpec("rollout", "services.rollout_worker", 5, consumes=("tasks",),
                    produces=("generations", "env.requests"), device_key="rollout.device",
                    replicas_key="rollout.workers", lag_label="rollout lag"),
        ServiceSpec("env", "services.env_worker", 4, consumes=("env.requests",), produces=("env.responses",),
                    stop_order=1, replicas_key="env.workers", needed="multi_turn", lag_label="env lag"),
        ServiceSpec("reward", "services.reward_router", 2, consumes=("generations",),
                    produces=("scored", "judge.requests"), loops=("transactional", "record"), lag_label="reward lag"),
        ServiceSpec("judge", "services.judge_worker", 3, consumes=("judge.requests",), produces=("scored",),
                    loops=("transactional",), stop_order=1, device_key="judge.device", replicas_key="judge.workers",
                    needed="judged", lag_label="judge lag"),
        ServiceSpec("trainer", "services.trainer", 6, consumes=("scored", "dlq"), observes=("control",),
                    produces=("metrics", "weights", "control"), loops=("batch",), lifecycle="finishes",
                    device_key="train.device", lag_topics=("scored",), lag_label="scored lag"),
        ServiceSpec("recorder", "services.recorder", 0, consumes=tuple(TOPICS), produces=(), loops=("batch",),
                    lifecycle="finishes", all_runs=True, needed="record_live"),
    )
}
"""Every service of a run, in the order a sample flows through them (then the recorder)."""


def in_start_order() -> list[ServiceSpec]:
    """The services in the order the supervisor starts them: the recorder first (it records from the
    start), the feeder, then each consumer before the services that send to it, the trainer last."""
    return sorted(SERVICES.values(), key=lambda s: s.start_order)


def stop_waves() -> list[tuple[str, ...]]:
    """The ``until_stopped`` services in the waves the supervisor SIGTERMs them at the end of a run."""
    orders = sorted({s.stop_order for s in SERVICES.values() if s.lifecycle == "until_stopped"})
    return [tuple(s.name for s in SERVICES.values() if s.lifecycle == "until_stopped" and s.stop_order == o)
            for o in orders]


_NEEDED = {"multi_turn": "multi-turn domains only", "judged": "judged domains only",
           "record_live": "with `store.record_live` only"}
_LOOPS = {"record": "per record", "batch": "batch", "transactional": "transactional"}


def _names(topics: tuple[str, ...]) -> str:
    return "every topic" if topics and set(topics) == set(TOPICS) else ", ".join(f"`{t}`" for t in topics) or "—"


def _row(s: ServiceSpec) -> tuple[str, ...]:
    group = f"`{s.group_id('<run>')}`" if s.grouped else "none"
    if s.all_runs:
        group += f" (`{s.group_id('')}`: every run)"
    count = f"`{s.replicas_key}`" if s.replicas_key else "1"
    if s.needed != "always":
        count += f", {_NEEDED[s.needed]}"
    lifecycle = "finishes" if s.lifecycle == "finishes" else "until stopped" + (
        f", stop wave {s.stop_order + 1}" if s.stop_order else "")
    return (f"`{s.name}`", str(s.start_order + 1), f"`{s.handler}`", group, _names(s.consumes), _names(s.observes),
            _names(s.produces), " or ".join(_LOOPS[x] for x in s.loops), f"`{s.device_key}`" if s.device_key else "—",
            count, lifecycle)


def markdown_table() -> str:
    """The table of docs/architecture.md, "Services": one row per service, in :data:`SERVICES` order."""
    head = ("service", "starts", "handler", "consumer group", "consumes", "observes", "produces", "loop", "device",
            "processes", "lifecycle")
    rows = [head, ("---",) * len(head), *(_row(s) for s in SERVICES.values())]
    return "".join("| " + " | ".join(r) + " |\n" for r in rows)
