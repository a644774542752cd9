"""runtime.loops, unit: a batch that runs longer than ``max_poll_interval_s`` keeps the instance in
its group (a poll with every partition paused each half interval), and a stop ends the wait."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from runtime.handling import Control
from runtime.loops import BatchLoop
from runtime.settings import Consume, Handling, ServiceSettings, Subscription


class _IO:
    """What the batch loop's wait uses of a KafkaIO: its settings and ``keepalive`` (timed)."""

    def __init__(self, max_poll_interval_s: float, shutdown_grace_s: float = 10.0) -> None:
        self.settings = ServiceSettings(run_id="r", subscription=Subscription(group_id="g", topics=["tasks"]),
                                        consume=Consume(max_poll_interval_s=max_poll_interval_s),
                                        handling=Handling(shutdown_grace_s=shutdown_grace_s))
        self.service_name = "test"
        self.polls: list[float] = []

    async def keepalive(self) -> None:
        self.polls.append(time.monotonic())


def _loop(io: _IO) -> tuple[BatchLoop, Control]:
    control = Control(stop=asyncio.Event())

    async def tick() -> None:
        return None

    return BatchLoop(io, SimpleNamespace(), control, tick), control  # type: ignore[arg-type]


async def test_a_long_batch_polls_paused_at_least_every_half_poll_interval() -> None:
    io = _IO(max_poll_interval_s=0.1)
    loop, control = _loop(io)
    stop_wait = asyncio.ensure_future(control.stop.wait())
    t0 = time.monotonic()
    await loop._run_polled(asyncio.create_task(asyncio.sleep(0.4)), stop_wait)
    gaps = [b - a for a, b in zip([t0, *io.polls], io.polls, strict=False)]
    assert len(io.polls) >= 5, io.polls  # 0.4 s batch, a poll each 0.05 s
    assert max(gaps) < 0.1, gaps  # never near the interval that evicts the instance
    stop_wait.cancel()


async def test_a_stop_during_a_long_batch_ends_the_wait_and_cancels_it_after_the_grace() -> None:
    io = _IO(max_poll_interval_s=0.1, shutdown_grace_s=0.05)
    loop, control = _loop(io)
    stop_wait = asyncio.ensure_future(control.stop.wait())
    work: asyncio.Task[Any] = asyncio.create_task(asyncio.sleep(60))
    asyncio.get_running_loop().call_later(0.12, control.stop.set)
    t0 = time.monotonic()
    await loop._run_polled(work, stop_wait)
    assert work.cancelled() and time.monotonic() - t0 < 1.0
