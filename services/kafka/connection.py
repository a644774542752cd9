"""Connecting to Kafka: the bootstrap address, the kwargs every aiokafka client gets, a bounded start.

* :func:`resolve_bootstrap` — the address from an argument, the config or ``$ROLLSTREAM_BOOTSTRAP``.
* :func:`kafka_kwargs` — connection and security kwargs (SASL, TLS) of producers, consumers, admins.
* :func:`start_bounded` — start a client within ``connect_timeout_s`` or raise :class:`BusError`.
* :class:`AsyncClient` — ``async with client:`` for the bus's clients (start, then stop).

Importing this module has no side effects.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Self

from aiokafka.errors import KafkaConnectionError, KafkaError
from aiokafka.helpers import create_ssl_context

from schemas.config import KafkaSettings
from services.errors import one_line
from services.kafka.probe import bootstrap_from_env
from services.kafka.quiet import quiet_aiokafka

log = logging.getLogger("rollstream.bus")

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "TOPIC_MESSAGE_HEADROOM_BYTES",
    "AsyncClient",
    "BusError",
    "kafka_kwargs",
    "new_group_suffix",
    "redacted",
    "resolve_bootstrap",
    "start_bounded",
]

DEFAULT_MAX_MESSAGE_BYTES = 8 * 1024 * 1024
"""Largest message a producer may send and a topic accepts (``max.message.bytes``), 8 MiB:
a long generation (tens of thousands of token ids + logprobs) fits with room to spare."""

TOPIC_MESSAGE_HEADROOM_BYTES = 64 * 1024
"""Topics accept a little more than the producer's limit (record batch overhead)."""


class BusError(RuntimeError):
    """A Kafka problem the caller cannot fix by retrying right away, with a one-line message."""


def resolve_bootstrap(settings: KafkaSettings, bootstrap: str | None = None) -> str:
    """The bootstrap address to use: ``bootstrap`` argument, else ``settings.bootstrap``,
    else ``$ROLLSTREAM_BOOTSTRAP``; raises :class:`BusError` when none is set."""
    found = bootstrap_from_env(bootstrap, settings.bootstrap)
    if found is None:
        raise BusError(
            "no Kafka bootstrap address: set kafka.bootstrap in the config or $ROLLSTREAM_BOOTSTRAP "
            "(or start a local broker with `rollstream stack up`)"
        )
    return found


def new_group_suffix() -> str:
    """A short random suffix (client ids, transactional ids of one process instance)."""
    return uuid.uuid4().hex[:8]


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


def redacted(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the SASL password shown as ``***`` (what a client reports as its config)."""
    return {k: ("***" if k == "sasl_plain_password" and v else v) for k, v in kwargs.items()}


async def start_bounded(
    what: str,
    start: Callable[[], Awaitable[Any]],
    close: Callable[[], Awaitable[Any]],
    bootstrap: str,
    timeout_s: float,
) -> None:
    """Run ``start()`` until it succeeds, retrying refused connections, for at most ``timeout_s``.

    On failure ``close()`` is called (errors while closing are logged) and :class:`BusError`
    is raised with one line naming the address and the last reason. aiokafka's own log records
    of the attempts are DEBUG records (:func:`services.kafka.quiet.quiet_aiokafka`): the error
    says what went wrong once.
    """
    deadline = time.monotonic() + timeout_s
    reason = "timed out"
    with quiet_aiokafka():
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


class AsyncClient:
    """A client that ``async with`` starts on entry and stops on exit (subclasses define both)."""

    async def start(self) -> Self:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
