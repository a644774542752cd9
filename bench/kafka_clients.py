"""Client CPU of two Python Kafka clients side by side: aiokafka (the bus's, pure Python over asyncio)
and confluent-kafka (librdkafka, C threads), on the same broker, topic settings and records.

    .venv/bin/python bench/kafka_clients.py [--bootstrap HOST:PORT] [--n 50000] [--rounds 2000] [--batch 4]

Needs ``confluent-kafka`` (``.venv/bin/pip install -e '.[bench]'``; without it the script says so in
one line). Two measurements per client, each as the process's CPU (user + system, every thread:
librdkafka's work happens on its own threads) divided by what was moved:

1. **bulk**: ``--n`` records of 300 bytes produced (idempotent, ``acks=all``, zstd, 5 ms linger,
   keyed over 4 partitions), then consumed by a fresh group (``read_committed``, a commit per
   batch): CPU per record, and records per second.
2. **round trips**: ``--rounds`` times, ``--batch`` records produced and awaited, then read back by
   a consumer already in its group (a fetch answered as soon as a byte is ready): CPU per round
   trip. A service's traffic at the main example's rate is this kind: small sends awaited one
   after the other, and fetches that come back with a few records each.

The asyncio side of confluent-kafka is its ``confluent_kafka.aio`` wrappers (calls on a thread
pool). bench/README.md ("kafka_clients.py") keeps the measured runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for path in (REPO, HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

PARTITIONS = 4
RECORD = os.urandom(150) + b"x" * 150
"""A 300-byte value, half of it incompressible (about a ``RolloutTask``)."""


def cpu_s() -> float:
    """This process's CPU seconds so far, every thread, user and system."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def new_topic(bootstrap: str) -> str:
    from confluent_kafka.admin import AdminClient, NewTopic

    name = f"bench-clients-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 4})  # held: the futures fail once it is collected
    admin.create_topics([NewTopic(name, PARTITIONS, 1)])[name].result(30)
    return name


def drop_topics(bootstrap: str, names: list[str]) -> None:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 4})
    for f in admin.delete_topics(names).values():
        f.result(30)


async def measured(work: Callable[[], Awaitable[int]]) -> tuple[float, float, int]:
    """(CPU seconds, wall seconds, units) of one awaited piece of work."""
    c0, t0 = cpu_s(), time.perf_counter()
    units = await work()
    return cpu_s() - c0, time.perf_counter() - t0, units


class Aiokafka:
    name = "aiokafka"

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap

    def producer(self):  # type: ignore[no-untyped-def]
        from aiokafka import AIOKafkaProducer

        return AIOKafkaProducer(bootstrap_servers=self.bootstrap, enable_idempotence=True, acks="all",
                                compression_type="zstd", linger_ms=5)

    def consumer(self, topic: str):  # type: ignore[no-untyped-def]
        from aiokafka import AIOKafkaConsumer

        return AIOKafkaConsumer(topic, bootstrap_servers=self.bootstrap, group_id=f"g{uuid.uuid4().hex}",
                                auto_offset_reset="earliest", isolation_level="read_committed",
                                enable_auto_commit=False, fetch_max_wait_ms=100)

    async def bulk(self, topic: str, n: int) -> tuple[float, float, float, float]:
        p = self.producer()
        await p.start()

        async def produce() -> int:
            pending = []
            for i in range(n):
                pending.append(await p.send(topic, RECORD, key=str(i % 64).encode()))
                if len(pending) >= 5000:
                    await asyncio.gather(*pending)
                    pending = []
            await asyncio.gather(*pending)
            return n

        pc, pw, _ = await measured(produce)
        await p.stop()
        c = self.consumer(topic)
        await c.start()

        async def consume() -> int:
            got = 0
            while got < n:
                batch = await c.getmany(timeout_ms=1000, max_records=1000)
                got += sum(len(recs) for recs in batch.values())
                if batch:
                    await c.commit()
            return got

        cc, cw, _ = await measured(consume)
        await c.stop()
        return pc, pw, cc, cw

    async def round_trips(self, topic: str, rounds: int, batch: int) -> tuple[float, float]:
        p, c = self.producer(), self.consumer(topic)
        await p.start()
        await c.start()
        await p.send_and_wait(topic, RECORD, key=b"warm")  # the group joins and reads from here
        while not sum(len(r) for r in (await c.getmany(timeout_ms=1000)).values()):
            pass

        async def work() -> int:
            for _ in range(rounds):
                futs = [await p.send(topic, RECORD, key=str(k).encode()) for k in range(batch)]
                await asyncio.gather(*futs)
                got = 0
                while got < batch:
                    got += sum(len(r) for r in (await c.getmany(timeout_ms=1000)).values())
            return rounds

        cpu, wall, _ = await measured(work)
        await c.stop()
        await p.stop()
        return cpu, wall


class Confluent:
    name = "confluent-kafka"

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap

    def producer(self):  # type: ignore[no-untyped-def]
        from confluent_kafka.aio import AIOProducer

        return AIOProducer({"bootstrap.servers": self.bootstrap, "enable.idempotence": True, "acks": "all",
                            "compression.type": "zstd", "linger.ms": 5, "log_level": 4})

    def consumer(self, topic: str):  # type: ignore[no-untyped-def]
        from confluent_kafka.aio import AIOConsumer

        return AIOConsumer({"bootstrap.servers": self.bootstrap, "group.id": f"g{uuid.uuid4().hex}",
                            "auto.offset.reset": "earliest", "isolation.level": "read_committed",
                            "enable.auto.commit": False, "fetch.wait.max.ms": 100, "log_level": 4})

    async def bulk(self, topic: str, n: int) -> tuple[float, float, float, float]:
        p = self.producer()

        async def produce() -> int:
            pending = []
            for i in range(n):
                pending.append(await p.produce(topic, RECORD, key=str(i % 64).encode()))
                if len(pending) >= 5000:
                    await p.flush()
                    await asyncio.gather(*pending)
                    pending = []
            await p.flush()
            await asyncio.gather(*pending)
            return n

        pc, pw, _ = await measured(produce)
        await p.close()
        c = self.consumer(topic)
        await c.subscribe([topic])

        async def consume() -> int:
            got = 0
            while got < n:
                msgs = await c.consume(1000, 1.0)
                got += sum(1 for m in msgs if m.error() is None)
                if msgs:
                    await c.commit(asynchronous=True)
            return got

        cc, cw, _ = await measured(consume)
        await c.close()
        return pc, pw, cc, cw

    async def round_trips(self, topic: str, rounds: int, batch: int) -> tuple[float, float]:
        p, c = self.producer(), self.consumer(topic)
        await c.subscribe([topic])
        warm = await p.produce(topic, RECORD, key=b"warm")
        await p.flush()
        await warm
        while not [m for m in await c.consume(100, 1.0) if m.error() is None]:
            pass

        async def work() -> int:
            for _ in range(rounds):
                futs = [await p.produce(topic, RECORD, key=str(k).encode()) for k in range(batch)]
                await p.flush()
                await asyncio.gather(*futs)
                got = 0
                while got < batch:  # consume() waits until it has this many or the timeout passed
                    got += sum(1 for m in await c.consume(batch - got, 1.0) if m.error() is None)
            return rounds

        cpu, wall, _ = await measured(work)
        await c.close()
        await p.close()
        return cpu, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bootstrap", default="", help="broker (default: $ROLLSTREAM_BOOTSTRAP, else the local broker)")
    ap.add_argument("--n", type=int, default=50_000, help="records of the bulk measurement")
    ap.add_argument("--rounds", type=int, default=2_000, help="round trips of the second measurement")
    ap.add_argument("--batch", type=int, default=4, help="records per round trip")
    args = ap.parse_args()
    try:
        import confluent_kafka  # noqa: F401
    except ImportError:
        sys.exit("kafka_clients.py: needs confluent-kafka: .venv/bin/pip install -e '.[bench]'")
    from common import find_broker, machine

    from runtime.probe import NO_BROKER

    bootstrap = find_broker(args.bootstrap)
    if bootstrap is None:
        sys.exit(f"kafka_clients.py: {NO_BROKER}")
    rows, topics = [], []
    try:
        for client in (Aiokafka(bootstrap), Confluent(bootstrap)):
            topics += [new_topic(bootstrap), new_topic(bootstrap)]
            print(f"{client.name}: {args.n} records, then {args.rounds} round trips ...", flush=True)
            pc, pw, cc, cw = asyncio.run(client.bulk(topics[-2], args.n))
            rc, rw = asyncio.run(client.round_trips(topics[-1], args.rounds, args.batch))
            rows.append((client.name, pc / args.n * 1e6, args.n / pw, cc / args.n * 1e6, args.n / cw,
                         rc / args.rounds * 1e3, rw / args.rounds * 1e3))
    finally:
        if topics:
            drop_topics(bootstrap, topics)
    print(f"\nKafka client CPU (process CPU, all threads), {args.n} bulk records of {len(RECORD)} B; "
          f"{args.rounds} round trips of {args.batch} records; broker {bootstrap}")
    print(f"machine: {machine()}")
    print(f"{'client':16s} {'produce µs/rec':>14s} {'rec/s':>8s} {'consume µs/rec':>14s} {'rec/s':>8s} "
          f"{'round trip CPU ms':>17s} {'wall ms':>8s}")
    for name, p_us, p_rate, c_us, c_rate, r_ms, r_wall in rows:
        print(f"{name:16s} {p_us:14.1f} {p_rate:8,.0f} {c_us:14.1f} {c_rate:8,.0f} {r_ms:17.3f} {r_wall:8.2f}")
    a, b = rows
    print(f"aiokafka / confluent-kafka CPU: produce {a[1] / b[1]:.1f}x, consume {a[3] / b[3]:.1f}x, "
          f"round trip {a[5] / b[5]:.1f}x")


if __name__ == "__main__":
    main()
