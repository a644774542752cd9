"""The service runtime: consume → decode → handle → produce → commit, for every rollstream service.

A concrete service is a small class::

    class Scorer(Service):
        name = "reward-router"

        async def handle(self, rec: Record, ctx: Context) -> None:
            gen: Generation = rec.event
            ctx.emit("scored", ScoredSample(run_id=gen.run_id, generation=gen, reward=score(gen)))

    settings = ServiceSettings(run_id=run, subscription=Subscription(group_id="rr", topics=["generations"]))
    counters = await run_service(Scorer(), settings)

* :class:`Service` — ``handle(rec, ctx)``, one call per record; :class:`BatchService` —
  ``handle_batch(records, ctx)``, one call per poll. Hooks: ``on_start``, ``on_tick``,
  ``on_assigned``, ``on_stop``; they get the :class:`Runner` (``send``, ``commit``, ``fail``,
  ``stop``, ``consumer``, ``producer``, ``counters``, ``settings``, ``last_polled``...).
* :func:`run_service` builds a :class:`Runner`: its Kafka I/O (:class:`runtime.kafka_io.KafkaIO`)
  and the loop the service kind and settings pick — :class:`runtime.loops.RecordLoop`,
  :class:`runtime.loops.BatchLoop` or :class:`runtime.txn_loop.TxnLoop` — and drives it from the
  first poll to the graceful stop.

What the loops guarantee (commit after effect, exactly once, dead letters, graceful stop, outage
ride-through, rebalance safety): docs/architecture.md, "The service runtime".
"""

from __future__ import annotations

import abc
import asyncio
import logging
import signal
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Literal

from aiokafka.errors import KafkaError

from runtime import gc_tuning
from runtime.bus import BusError, Consumer, KeyLike, Producer, Record, RecordMetadata, TopicPartition
from runtime.handling import Control, Loop
from runtime.kafka_io import KafkaIO
from runtime.loops import BatchLoop, RecordLoop
from runtime.outage import Outage, is_outage
from runtime.service import (
    BatchContext,
    Context,
    Counters,
    Output,
    derive_event_id,
    make_output,
    resolve_topic,
)
from runtime.settings import Consume, Delivery, Handling, Produce, ServiceSettings, Subscription
from runtime.txn_loop import TxnLoop
from schemas.config import KafkaSettings
from schemas.errors import one_line
from schemas.events import Event
from schemas.services import Loop as LoopKind

log = logging.getLogger("rollstream.runtime")

__all__ = [
    "BatchContext",
    "BatchService",
    "Consume",
    "Context",
    "Counters",
    "Delivery",
    "FunctionService",
    "Handling",
    "Output",
    "Produce",
    "Runner",
    "Service",
    "ServiceSettings",
    "Subscription",
    "derive_event_id",
    "loop_kind",
    "publish",
    "resolve_topic",
    "run_service",
]

# --------------------------------------------------------------------------- services


class Service(abc.ABC):
    """Base of a rollstream service: set ``name``, implement :meth:`handle` (one record at a
    time; see :class:`BatchService` for one call per poll). Every hook is optional."""

    name: str = "service"

    @abc.abstractmethod
    async def handle(self, rec: Record, ctx: Context) -> None:
        """Handle one decoded record; emit outputs with ``ctx.emit``. Raising dead-letters it."""

    async def on_start(self, runner: Runner) -> None:
        """After the Kafka clients are up, before the first poll (a source such as the feeder
        may start its own work here and publish with ``runner.send``)."""
        return None

    async def on_tick(self, runner: Runner) -> None:
        """After every poll (``runner.last_polled`` records, maybe 0): periodic work. Raising
        stops the service with that error."""
        return None

    async def on_assigned(self, runner: Runner, tps: set[TopicPartition]) -> None:
        """Partitions were assigned to this instance (with a group): seek them with
        ``runner.consumer.seek`` to resume at the service's own positions."""
        return None

    async def on_stop(self, runner: Runner) -> None:
        """After in-flight work finished, before the clients close."""
        return None


class BatchService(Service):
    """A service whose handler takes every decoded record of a poll at once."""

    @abc.abstractmethod
    async def handle_batch(self, records: list[Record], ctx: BatchContext) -> None:
        """Handle the decoded, not yet seen records of one poll (in offset order per partition;
        called for every poll that returned records, so possibly with none left: ``ctx.polled``
        has them all, ``ctx.dead_letters`` the ones the runtime dead-lettered). ``ctx.emit``
        queues outputs, ``ctx.reject(rec, error)`` dead-letters one record, ``await ctx.flush()``
        sends what is queued now. Raising stops the service."""

    async def handle(self, rec: Record, ctx: Context) -> None:
        raise TypeError(f"{self.name} is a batch service: the runtime calls handle_batch")


class FunctionService(Service):
    """A service from a plain ``async def handle(rec, ctx)`` function."""

    def __init__(self, name: str, fn: Callable[[Record, Context], Awaitable[None]]) -> None:
        self.name = name
        self._fn = fn

    async def handle(self, rec: Record, ctx: Context) -> None:
        await self._fn(rec, ctx)


# --------------------------------------------------------------------------- the runner


def loop_kind(service: type[Service], settings: ServiceSettings) -> LoopKind:
    """Which loop :func:`pick_loop` runs a ``service`` of this class on under ``settings`` (the names
    the table of services uses: :data:`schemas.services.Loop`)."""
    if settings.delivery.transactional:
        return "transactional"
    return "batch" if issubclass(service, BatchService) else "record"


def pick_loop(io: KafkaIO, service: Service, control: Control, tick: Callable[[], Awaitable[None]]) -> Loop:
    """The loop for ``service`` under ``io.settings``: transactional, batch or per record."""
    kind = loop_kind(type(service), io.settings)
    if kind == "transactional":
        if isinstance(service, BatchService):
            raise ValueError(f"{service.name}: transactional mode takes a record handler, not handle_batch")
        return TxnLoop(io, service, control, tick)
    if isinstance(service, BatchService):  # kind == "batch"
        return BatchLoop(io, service, control, tick)
    return RecordLoop(io, service, control, tick)


class Runner:
    """One running service instance (what :func:`run_service` drives): its Kafka I/O, its loop,
    its counters and stop. Hooks get it to reach ``producer``, ``consumer``, ``settings``,
    ``counters``, the ``stop`` event, :meth:`send`, :meth:`commit` and :meth:`fail`."""

    def __init__(self, service: Service, settings: ServiceSettings, stop: asyncio.Event | None = None) -> None:
        self.service = service
        self.settings = settings
        self.counters = Counters()
        self.revocations = 0
        """How many times the group took partitions away from this instance (rebalances)."""
        self.control = Control(stop if stop is not None else asyncio.Event())
        self.io = KafkaIO(service.name, settings, self.counters, on_revoked=self._on_revoked,
                          on_assigned=self._on_assigned)
        self.loop = pick_loop(self.io, service, self.control, self._tick)
        self._tick_retry = self.io.outage.retry("on_tick")
        self._closed = False

    # -- what hooks read

    @property
    def stop(self) -> asyncio.Event:
        """Set it to stop the service gracefully."""
        return self.control.stop

    @property
    def producer(self) -> Producer:
        """The producer now (a new one after a renewal)."""
        return self.io.producer

    @property
    def consumer(self) -> Consumer:
        return self.io.consumer

    @property
    def outage(self) -> Outage:
        """Retries through a Kafka outage (:mod:`runtime.outage`)."""
        return self.io.outage

    @property
    def polls(self) -> int:
        """Polls so far."""
        return self.io.polls

    @property
    def last_polled(self) -> int:
        """Records the latest poll returned (``on_tick`` reads it: 0 = the topics were quiet)."""
        return self.io.last_polled

    @property
    def service_name(self) -> str:
        return self.service.name

    # -- lifecycle

    async def run(self, install_signal_handlers: bool = True) -> Counters:
        """Run until ``stop`` (see :func:`run_service`); return the counters."""
        loop = asyncio.get_running_loop()
        installed: dict[signal.Signals, Any] = {}
        if install_signal_handlers and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                try:
                    previous = signal.getsignal(sig)
                    loop.add_signal_handler(sig, self._on_signal, sig)
                    installed[sig] = previous
                except (NotImplementedError, RuntimeError, ValueError):
                    pass
        error: BaseException | None = None
        try:
            await self.io.start()
            await self.service.on_start(self)
            gc_tuning.settle()  # a service process keeps what its start-up made (runtime.gc_tuning)
            await self.loop.run()
        except BusError as e:
            error = e
        except KafkaError as e:
            error = BusError(f"service {self.service.name}: Kafka failed: {one_line(e)}")
        except BaseException as e:
            error = e
        finally:
            try:
                await self._shutdown()
            finally:
                for sig, previous in installed.items():
                    loop.remove_signal_handler(sig)
                    if previous is not None:
                        signal.signal(sig, previous)  # give back whatever was there before
        if error is None:
            error = self.control.fatal
        if error is not None:
            raise error
        return self.counters

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.stop.is_set():
            log.warning("%s: second %s, cutting the shutdown grace short", self.service.name, sig.name)
            self.control.force.set()
        else:
            log.info("%s: %s received, stopping", self.service.name, sig.name)
            self.stop.set()

    def fail(self, err: BaseException) -> None:
        """Stop the service with ``err`` (raised by :meth:`run` after the graceful stop): for a
        service's own background work that cannot go on."""
        self.control.fail(err)

    async def _shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stop.set()
        try:
            await self.loop.finish()
            try:
                await self.service.on_stop(self)
            except Exception as e:
                log.error("%s: on_stop failed: %s", self.service.name, one_line(e))
        finally:
            await self.io.close()

    # -- what services call

    async def send(self, topic: str, *events: Event, key: KeyLike = None) -> list[RecordMetadata]:
        """Send ``events`` to ``topic`` (logical names are of ``settings.run_id``) now and wait
        for Kafka's acknowledgements (counted in ``emitted``). ``key=None``: registry key."""
        full = resolve_topic(topic, self.settings.run_id)
        return await self.io.send_outputs([make_output(self, full, e, key) for e in events], f"send to {full}")

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> dict[TopicPartition, int]:
        """Commit ``offsets`` (next offset to read per partition) now; what was committed. For
        ``commit="by_service"``; without a group nothing is committed. A commit refused because
        the group rebalanced is logged and returns ``{}`` (the positions the service keeps are
        what it resumes from)."""
        return await self.io.commit(offsets)

    def dead_letter(self, rec: Record, stage: Literal["decode", "handle"], error: str) -> list[Output]:
        """The dead letter of ``rec`` as an output to send (empty when it cannot be routed, logged)."""
        return self.io.dead_letter(rec, stage, error)

    async def send_outputs(self, outs: list[Output], what: str, count: bool = True) -> list[RecordMetadata]:
        """Send outputs made by a context of this runner (:meth:`KafkaIO.send_outputs`)."""
        return await self.io.send_outputs(outs, what, count)

    # -- rebalance and ticks

    async def _on_revoked(self, tps: set[TopicPartition]) -> None:
        if tps:
            self.revocations += 1
        await self.loop.on_revoked(tps)

    async def _on_assigned(self, tps: set[TopicPartition]) -> None:
        await self.service.on_assigned(self, tps)

    async def _tick(self) -> None:
        """``on_tick``; one that fails with an outage error is retried on the next tick (after a
        pause), for at most ``kafka.outage_timeout_s`` of consecutive failures."""
        try:
            await self.service.on_tick(self)
        except (KafkaError, BusError) as e:
            if not is_outage(e):
                raise
            await self._tick_retry.failed(e)
            return
        self._tick_retry.done()


async def run_service(
    service: Service,
    settings: ServiceSettings,
    *,
    stop: asyncio.Event | None = None,
    install_signal_handlers: bool = True,
) -> Counters:
    """Run ``service`` until ``stop`` is set (or SIGTERM/SIGINT); return its :class:`Counters`.

    Signal handlers are installed only when running in the main thread (and unless
    ``install_signal_handlers=False``); they set ``stop``. Raises :class:`BusError` when Kafka
    cannot be reached (within ``kafka.connect_timeout_s``) or an output is not acknowledged;
    the clients are closed and finished work committed first.
    """
    return await Runner(service, settings, stop).run(install_signal_handlers)


async def publish(
    settings: KafkaSettings,
    bootstrap: str | None,
    topic: str,
    events: Iterable[Event],
    *,
    key: KeyLike = None,
) -> list[RecordMetadata]:
    """Publish ``events`` to ``topic`` with a short-lived producer; return their metadata.

    ``topic`` is a full Kafka name or a logical name (then each event's ``run_id`` picks the
    run). ``key=None`` uses the registry key of each event. Waits for every acknowledgement.
    """
    async with Producer(settings, bootstrap, client_suffix="publish") as producer:
        futs = [await producer.send(resolve_topic(topic, ev.run_id), ev, key) for ev in events]
        return list(await asyncio.gather(*futs))
