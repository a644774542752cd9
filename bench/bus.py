"""Bus throughput and codec speed, measured side by side in one run.

    .venv/bin/python bench/bus.py [--bootstrap HOST:PORT] [--n N] [--seconds S]

1. Kafka end to end, per event size: a consumer group (``read_committed``, manual commit after
   every batch, the same :class:`services.kafka.bus.Consumer` the services use) runs while a
   :class:`services.kafka.bus.Producer` (idempotent, acks=all, zstd unless ``--compression``) sends
   ``N`` events; the clock runs from the first send to the commit of the last event. Small = a
   ``RolloutTask``; large = a ``Generation`` with 4096 response tokens and 4096 logprobs (the
   large run sends ``N / 10``).
2. Codecs, per event size: msgspec msgpack (typed encode + typed, validated decode into the
   Struct) against stdlib ``json`` (``json.dumps`` of a ready-made dict + ``json.loads`` into a
   dict). The json side is given the dict for free and builds no typed object, so its numbers
   are flattering: the ratio is a lower bound of msgpack's advantage.
3. Batch compression with the exact functions aiokafka calls (lz4 = its level 9, LZ4-HC; zstd =
   level 3): MB/s and compressed size over a batch of each event size. Why zstd is the default.

Needs a reachable broker (``--bootstrap``, else ``$ROLLSTREAM_BOOTSTRAP``, else
127.0.0.1:9092); creates the topics of a throwaway run and deletes them at the end.
Default runtime is well under a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from uuid import uuid4

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiokafka.codec import lz4_encode, zstd_encode

from schemas.config import KafkaSettings
from schemas.events import Event, Generation, RolloutTask
from schemas.topics import topic_name
from services.kafka.bus import BusError, Compression, Consumer, Producer, TopicAdmin, next_offsets


def small_event(run_id: str, i: int) -> RolloutTask:
    return RolloutTask(
        run_id=run_id,
        sample_id=f"grp{i // 8:06d}/{i % 8}",
        group_id=f"grp{i // 8:06d}",
        index=i % 8,
        group_size=8,
        prompt_id=f"arith-{i // 8}",
        domain="arith",
        prompt=f"Compute {i % 997} + {i % 991}. Put the answer after 'Answer:'.",
        reference=str(i % 997 + i % 991),
        policy_version=3,
        max_new_tokens=64,
    )


def large_event(run_id: str, i: int, tokens: int = 4096) -> Generation:
    rng = random.Random(i)
    return Generation(
        run_id=run_id,
        task=small_event(run_id, i),
        prompt_ids=[rng.randrange(32_000) for _ in range(256)],
        response_ids=[rng.randrange(32_000) for _ in range(tokens)],
        response_text="".join(rng.choice("abcdefghij klmnop") for _ in range(tokens * 3)),
        logprobs=[-rng.expovariate(2.0) for _ in range(tokens)],
        loss_mask=[1] * tokens,
        finish_reason="length",
        policy_version=3,
        policy_version_end=3,
        worker_id="w0",
        gen_s=1.5,
    )


# --------------------------------------------------------------------------- codecs


def _rate(fn: Callable[[], Any], seconds: float) -> float:
    """Calls per second of ``fn`` over at least ``seconds`` (after a short warm-up)."""
    for _ in range(3):
        fn()
    n, batch = 0, 1
    t0 = time.perf_counter()
    while True:
        for _ in range(batch):
            fn()
        n += batch
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return n / dt
        batch = min(batch * 2, 4096)


def codec_rates(event: Event, seconds: float) -> dict[str, float]:
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(type(event))
    packed = enc.encode(event)
    as_dict = msgspec.to_builtins(event)
    as_json = json.dumps(as_dict).encode()
    assert dec.decode(packed) == event
    assert json.loads(as_json) == as_dict
    return {
        "msgpack_rate": _rate(lambda: dec.decode(enc.encode(event)), seconds),
        "json_rate": _rate(lambda: json.loads(json.dumps(as_dict).encode()), seconds),
        "msgpack_bytes": float(len(packed)),
        "json_bytes": float(len(as_json)),
    }


def compression_rates(events: list[Event], seconds: float) -> dict[str, tuple[float, float]]:
    """codec -> (MB/s compressing one batch of ``events``, compressed/raw size)."""
    enc = msgspec.msgpack.Encoder()
    blob = b"".join(enc.encode(e) for e in events)
    out = {}
    for name, fn in (("lz4", lz4_encode), ("zstd", zstd_encode)):
        ratio = len(fn(blob)) / len(blob)
        out[name] = (_rate(lambda fn=fn: fn(blob), seconds) * len(blob) / 1e6, ratio)
    return out


# --------------------------------------------------------------------------- kafka


async def kafka_rate(
    kafka: KafkaSettings, run_id: str, topic: str, events: list[Event], compression: Compression
) -> dict[str, float]:
    """Produce ``events`` while a group consumes and commits them; events/s and MB/s."""
    n = len(events)
    consumer = Consumer(kafka, group_id=f"bench-{run_id}-{topic.rsplit('.', 1)[-1]}", topics=[topic])
    await consumer.start()
    try:
        # join the group before the clock starts (a rebalance is not what we measure)
        deadline = time.monotonic() + 30
        while not consumer.assignment():
            if time.monotonic() > deadline:
                raise BusError("bench consumer got no partitions within 30 s")
            await consumer.getmany(timeout_ms=100)
        async with Producer(kafka, compression=compression, client_suffix="bench") as producer:
            payload = [producer.encode(e) for e in events]
            keys = [str(i).encode() for i in range(n)]
            nbytes = sum(map(len, payload))
            got = 0

            async def consume() -> None:
                nonlocal got
                stop_at = time.monotonic() + 120
                while got < n:
                    if time.monotonic() > stop_at:
                        raise BusError(f"only {got} of {n} events came back within 120 s")
                    recs = await consumer.getmany(timeout_ms=200, max_records=2000)
                    if recs:
                        bad = [r.error for r in recs if r.error]
                        if bad:
                            raise BusError(f"bench read undecodable records: {bad[0]}")
                        await consumer.commit(next_offsets(recs))
                        got += len(recs)

            t0 = time.perf_counter()
            reader = asyncio.create_task(consume())
            futs = [await producer.send_raw(topic, v, k) for v, k in zip(payload, keys, strict=True)]
            await asyncio.gather(*futs)
            t_acked = time.perf_counter() - t0
            await reader
            dt = time.perf_counter() - t0
    finally:
        await consumer.stop()
    return {"events_s": n / dt, "mb_s": nbytes / dt / 1e6, "acked_s": n / t_acked, "n": n, "seconds": dt}


# --------------------------------------------------------------------------- main


def _fmt(x: float) -> str:
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:.2f}"


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bootstrap", default=os.environ.get("ROLLSTREAM_BOOTSTRAP", "127.0.0.1:9092"))
    ap.add_argument("--n", type=int, default=20_000, help="small events through Kafka (large: N/10)")
    ap.add_argument("--seconds", type=float, default=1.0, help="time per codec measurement")
    ap.add_argument(
        "--compression",
        default="zstd",
        choices=["zstd", "lz4", "gzip", "snappy", "none"],
        help="producer codec",
    )
    args = ap.parse_args()
    kafka = KafkaSettings(bootstrap=args.bootstrap, connect_timeout_s=10.0)
    run_id = f"bench{uuid4().hex[:8]}"
    t_start = time.perf_counter()

    smalls: list[Event] = [small_event(run_id, i) for i in range(args.n)]
    n_large = max(1, args.n // 10)
    larges: list[Event] = [large_event(run_id, i) for i in range(n_large)]

    try:
        async with TopicAdmin(kafka) as admin:
            await admin.ensure_run_topics(run_id)
            try:
                k_small = await kafka_rate(
                    kafka, run_id, topic_name(run_id, "tasks"), smalls, args.compression
                )
                k_large = await kafka_rate(
                    kafka, run_id, topic_name(run_id, "generations"), larges, args.compression
                )
            finally:
                await admin.delete_run_topics(run_id)
    except BusError as e:
        print(f"bench/bus.py: {e}", file=sys.stderr)
        return 1
    c_small = codec_rates(smalls[0], args.seconds)
    c_large = codec_rates(larges[0], args.seconds)
    z_small = compression_rates(smalls[:2000], args.seconds / 2)
    z_large = compression_rates(larges[:16], args.seconds / 2)

    print(
        f"rollstream bus bench — broker {args.bootstrap}, python {platform.python_version()}, "
        f"{os.cpu_count()} cores, msgspec {msgspec.__version__}"
    )
    print()
    print(
        f"Kafka end to end (produce idempotent acks=all {args.compression}, "
        "consume read_committed, commit per batch)"
    )
    rows = [
        ("event", "n", "bytes/event", "events/s", "MB/s", "acked events/s"),
        (
            "small RolloutTask",
            str(args.n),
            str(int(c_small["msgpack_bytes"])),
            _fmt(k_small["events_s"]),
            _fmt(k_small["mb_s"]),
            _fmt(k_small["acked_s"]),
        ),
        (
            "large Generation 4096 tok",
            str(n_large),
            str(int(c_large["msgpack_bytes"])),
            _fmt(k_large["events_s"]),
            _fmt(k_large["mb_s"]),
            _fmt(k_large["acked_s"]),
        ),
    ]
    _table(rows)
    print()
    print("Codec: encode + decode round trips per second (json given a ready dict, decodes to a dict)")
    rows = [
        ("event", "msgpack/s", "json/s", "msgpack ÷ json", "msgpack bytes", "json bytes"),
        *[
            (
                name,
                _fmt(c["msgpack_rate"]),
                _fmt(c["json_rate"]),
                f"{c['msgpack_rate'] / c['json_rate']:.1f}x",
                str(int(c["msgpack_bytes"])),
                str(int(c["json_bytes"])),
            )
            for name, c in (("small RolloutTask", c_small), ("large Generation 4096 tok", c_large))
        ],
    ]
    _table(rows)
    print()
    print("Batch compression as aiokafka does it (lz4 = level 9 LZ4-HC, zstd = level 3)")
    rows = [("event batch", "lz4 MB/s", "zstd MB/s", "zstd ÷ lz4 speed", "lz4 size", "zstd size")]
    for name, z in (("2000 small", z_small), ("16 large", z_large)):
        rows.append(
            (
                name,
                _fmt(z["lz4"][0]),
                _fmt(z["zstd"][0]),
                f"{z['zstd'][0] / z['lz4'][0]:.1f}x",
                f"{z['lz4'][1]:.0%}",
                f"{z['zstd'][1]:.0%}",
            )
        )
    _table(rows)
    print()
    print(f"total {time.perf_counter() - t_start:.1f} s")
    return 0


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for j, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
        print("  ".join(cells))
        if j == 0:
            print("  ".join("-" * w for w in widths))


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    sys.exit(asyncio.run(main()))
