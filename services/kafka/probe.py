"""Finding a Kafka broker and asking whether it is ready.

* :func:`bootstrap_from_env` — the shared rule for the bootstrap address: the first explicit
  value given, else ``$ROLLSTREAM_BOOTSTRAP``. :func:`services.kafka.bus.resolve_bootstrap`
  (config settings) and :func:`services.kafka.broker.resolve_bootstrap` (the local broker as a
  last resort) both build on it.
* :func:`kafka_reachable` — a bounded readiness check from synchronous code: an aiokafka client
  bootstraps (one Metadata round trip) against each address in turn.

aiokafka is imported on the first probe, not with this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time

from services.kafka.quiet import quiet_aiokafka

__all__ = ["BOOTSTRAP_ENV", "bootstrap_from_env", "kafka_reachable", "split_hostport"]

BOOTSTRAP_ENV = "ROLLSTREAM_BOOTSTRAP"
"""Environment variable naming the Kafka bootstrap servers (``host:port[,host:port]``)."""

_JOIN_MARGIN_S = 0.25
"""How long past ``timeout_s`` the caller waits for the probe thread to wind down."""


def bootstrap_from_env(*explicit: str | None) -> str | None:
    """The first of ``explicit`` that is not blank, else ``$ROLLSTREAM_BOOTSTRAP``, stripped;
    ``None`` when none is set."""
    for candidate in (*explicit, os.environ.get(BOOTSTRAP_ENV)):
        if candidate and candidate.strip():
            return candidate.strip()
    return None


def split_hostport(item: str) -> tuple[str, int] | None:
    """``(host, port)`` of one bootstrap entry (``host:port``, ``[v6]:port``, an optional
    ``PROTOCOL://`` prefix); ``None`` when it names no port."""
    s = item.strip()
    if "://" in s:
        s = s.split("://", 1)[1]
    host, sep, port_s = s.rpartition(":")
    if not sep or not port_s.isdigit():
        return None
    host = host.strip("[]") or "localhost"
    return host, int(port_s)


async def _broker_ready(host: str, port: int, timeout_s: float) -> bool:
    """One aiokafka bootstrap (a Metadata request) against ``host:port``; True if the answer lists
    at least one live broker. Bounded by ``timeout_s``; every failure is False."""
    from aiokafka.client import AIOKafkaClient
    from aiokafka.errors import KafkaError

    if timeout_s <= 0:
        return False
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    client = AIOKafkaClient(
        bootstrap_servers=address,
        client_id="rollstream-probe",
        request_timeout_ms=max(1, int(timeout_s * 1000)),
    )
    try:
        await asyncio.wait_for(client.bootstrap(), timeout=timeout_s)
        return bool(client.cluster.brokers())
    except (KafkaError, OSError, TimeoutError):
        return False
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), timeout=1.0)


async def _any_ready(addresses: list[tuple[str, int]], deadline: float) -> bool:
    with quiet_aiokafka():
        for host, port in addresses:
            if await _broker_ready(host, port, deadline - time.monotonic()):
                return True
            if time.monotonic() >= deadline:
                break
    return False


def kafka_reachable(bootstrap: str, timeout_s: float = 5.0) -> bool:
    """True if a Kafka broker at ``bootstrap`` (``host:port[,host:port]``) answers a Metadata
    request listing at least one live broker, i.e. it is ready for clients.

    Each address is tried in turn with an aiokafka client (PLAINTEXT: a TLS/SASL listener reads
    as unreachable); entries without a port are skipped. The probe runs on its own event loop in
    a daemon thread, so it works from synchronous code and from inside a running loop alike, and
    the caller gets an answer within ``timeout_s`` (plus a fraction of a second) in every case,
    a slow DNS lookup included. aiokafka's connection errors are not logged (DEBUG at most).
    """
    addresses = [hp for hp in map(split_hostport, bootstrap.split(",")) if hp is not None]
    if not addresses:
        return False
    deadline = time.monotonic() + max(0.0, timeout_s)
    result: list[bool] = []

    def run() -> None:
        with contextlib.suppress(Exception):
            result.append(asyncio.run(_any_ready(addresses, deadline)))

    worker = threading.Thread(target=run, name="rollstream-kafka-probe", daemon=True)
    worker.start()
    worker.join(max(0.0, deadline - time.monotonic()) + _JOIN_MARGIN_S)
    return bool(result and result[0])
