"""Connecting to Kafka: the bootstrap address, the kwargs every aiokafka client gets, a bounded start.

* :func:`resolve_bootstrap` — the address a client connects to: the one it is handed, else
  :func:`runtime.probe.find_bootstrap`'s rule.
* :func:`kafka_kwargs` — connection and security kwargs (SASL, TLS) of producers, consumers, admins;
  :func:`effective_settings` — the config's ``kafka`` section with the ``$ROLLSTREAM_KAFKA_*``
  environment applied; :func:`sasl_password` — where the SASL password comes from.
* :func:`start_bounded` — start a client within ``connect_timeout_s`` or raise :class:`BusError`
  (credentials or a certificate the broker rejects: at once, with one line saying what to check).
* :class:`AsyncClient` — ``async with client:`` for the bus's clients (start, then stop).

Importing this module has no side effects.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Self

import msgspec
from aiokafka.errors import KafkaConnectionError, KafkaError
from aiokafka.helpers import create_ssl_context

from runtime.probe import NO_BROKER, find_bootstrap, probe_async
from runtime.quiet import quiet_aiokafka
from schemas.config import REDACTED, KafkaSettings, redact_url
from schemas.errors import one_line

log = logging.getLogger("rollstream.bus")

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "KAFKA_ENV",
    "SASL_PASSWORD_ENV",
    "TOPIC_MESSAGE_HEADROOM_BYTES",
    "AsyncClient",
    "BusError",
    "effective_settings",
    "kafka_kwargs",
    "new_group_suffix",
    "redacted",
    "resolve_bootstrap",
    "sasl_password",
    "start_bounded",
]

SASL_PASSWORD_ENV = "ROLLSTREAM_SASL_PASSWORD"
"""Environment variable holding the SASL password (PLAIN / SCRAM) when ``kafka.sasl_password_file``
is not set."""

KAFKA_ENV: dict[str, str] = {
    "security_protocol": "ROLLSTREAM_KAFKA_SECURITY_PROTOCOL",
    "sasl_mechanism": "ROLLSTREAM_KAFKA_SASL_MECHANISM",
    "sasl_username": "ROLLSTREAM_KAFKA_SASL_USERNAME",
    "sasl_password_file": "ROLLSTREAM_KAFKA_SASL_PASSWORD_FILE",
    "ssl_cafile": "ROLLSTREAM_KAFKA_SSL_CAFILE",
    "ssl_certfile": "ROLLSTREAM_KAFKA_SSL_CERTFILE",
    "ssl_keyfile": "ROLLSTREAM_KAFKA_SSL_KEYFILE",
}
"""``kafka.<key>`` → the environment variable that overrides it for every client of this process
and of the services it starts (as ``$ROLLSTREAM_BOOTSTRAP`` overrides ``kafka.bootstrap``);
commands without a run config (``topics``, ``stack status``) get their security settings only so."""

DEFAULT_MAX_MESSAGE_BYTES = 8 * 1024 * 1024
"""Largest message a producer may send and a topic accepts (``max.message.bytes``), 8 MiB:
a long generation (tens of thousands of token ids + logprobs) fits with room to spare."""

TOPIC_MESSAGE_HEADROOM_BYTES = 64 * 1024
"""Topics accept a little more than the producer's limit (record batch overhead)."""


class BusError(RuntimeError):
    """A Kafka problem the caller cannot fix by retrying right away, with a one-line message."""


def resolve_bootstrap(settings: KafkaSettings, bootstrap: str | None = None) -> str:
    """The address a client connects to: the one it is handed (the ``bootstrap`` argument, else
    ``settings.bootstrap``; a command hands on what :func:`runtime.probe.find_bootstrap` found),
    else that rule with nothing given (``$ROLLSTREAM_BOOTSTRAP``); :class:`BusError` when none."""
    handed = bootstrap if bootstrap and bootstrap.strip() else settings.bootstrap
    found = find_bootstrap(handed)
    if found is None:
        raise BusError(NO_BROKER)
    return found


def new_group_suffix() -> str:
    """A short random suffix (client ids, transactional ids of one process instance)."""
    return uuid.uuid4().hex[:8]


def effective_settings(settings: KafkaSettings) -> KafkaSettings:
    """``settings`` with every set ``$ROLLSTREAM_KAFKA_*`` variable (:data:`KAFKA_ENV`) applied;
    a bad value is a :class:`BusError` naming the variable."""
    changes = {key: os.environ[var].strip() for key, var in KAFKA_ENV.items() if os.environ.get(var, "").strip()}
    if not changes:
        return settings
    try:
        return msgspec.convert({**msgspec.structs.asdict(settings), **changes}, KafkaSettings)
    except msgspec.ValidationError as e:
        var = next((v for k, v in KAFKA_ENV.items() if f"`$.{k}`" in str(e)), "a $ROLLSTREAM_KAFKA_* variable")
        raise BusError(f"${var}: {str(e).split(' - at ')[0]}") from None


def sasl_password(settings: KafkaSettings) -> str:
    """The SASL password: ``settings.sasl_password`` (code only; ``***`` counts as unset), else the
    first line of ``settings.sasl_password_file``, else ``$ROLLSTREAM_SASL_PASSWORD``; a
    :class:`BusError` when none is given or the file cannot be read."""
    if settings.sasl_password and settings.sasl_password != REDACTED:
        return settings.sasl_password
    if settings.sasl_password_file:
        path = Path(settings.sasl_password_file).expanduser()
        try:
            lines = path.read_text().splitlines()
        except OSError as e:
            raise BusError(f"cannot read kafka.sasl_password_file {str(path)!r}: {e.strerror or e}") from None
        if not lines or not lines[0]:
            raise BusError(f"kafka.sasl_password_file {str(path)!r} is empty (the password is its first line)")
        return lines[0]
    env = os.environ.get(SASL_PASSWORD_ENV, "")
    if not env:
        raise BusError(
            f"no SASL password for user {settings.sasl_username!r} ({settings.sasl_mechanism}): set "
            f"${SASL_PASSWORD_ENV} or kafka.sasl_password_file"
        )
    return env


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


def kafka_kwargs(
    settings: KafkaSettings, bootstrap: str, *, client_suffix: str = "", from_env: bool = True
) -> dict[str, Any]:
    """The kwargs every aiokafka client (producer, consumer, admin) gets from ``settings``.

    ``bootstrap`` is the address to use (see :func:`resolve_bootstrap`). Security settings pass
    through, after the ``$ROLLSTREAM_KAFKA_*`` environment (:func:`effective_settings`; not with
    ``from_env=False``): ``security_protocol``, the SASL mechanism and PLAIN/SCRAM credentials
    (the password from :func:`sasl_password`: a missing one is a :class:`BusError`), and an
    ``ssl_context`` built from the CA / client certificate / key files for ``SSL`` and
    ``SASL_SSL``. The client id is ``<settings.client_id>-<client_suffix>`` when a suffix is given.
    """
    if from_env:
        settings = effective_settings(settings)
    kw: dict[str, Any] = {
        "bootstrap_servers": bootstrap,
        "client_id": f"{settings.client_id}-{client_suffix}" if client_suffix else settings.client_id,
        "request_timeout_ms": int(settings.request_timeout_s * 1000),
        "security_protocol": settings.security_protocol,
    }
    if settings.security_protocol.startswith("SASL_"):
        kw["sasl_mechanism"] = settings.sasl_mechanism
        if settings.sasl_mechanism in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
            if not settings.sasl_username:
                raise BusError(f"kafka.security_protocol={settings.security_protocol} with {settings.sasl_mechanism} "
                               "needs a user: set kafka.sasl_username")
            kw["sasl_plain_username"] = settings.sasl_username
            kw["sasl_plain_password"] = sasl_password(settings)
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
    kwargs: Mapping[str, Any] | None = None,
) -> None:
    """Run ``start()`` until it succeeds, retrying refused connections, for at most ``timeout_s``.

    On failure ``close()`` is called (errors while closing are logged) and :class:`BusError`
    is raised with one line naming the address and the last reason. aiokafka's own log records
    of the attempts are DEBUG records (:func:`runtime.quiet.quiet_aiokafka`): the error
    says what went wrong once. With the client's ``kwargs`` (:func:`kafka_kwargs`), a failed
    attempt is followed by a probe as that client (:func:`runtime.probe.probe_async`):
    SASL credentials or a certificate the broker rejects, or a listener that speaks another
    ``security_protocol``, end the wait at once with the probe's one line (what to check).
    """
    deadline = time.monotonic() + timeout_s
    reason = "timed out"
    fatal = ""
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
                if kwargs is not None:
                    found = await probe_async(bootstrap, max(1.0, min(5.0, deadline - time.monotonic())), kwargs)
                    if found.fatal:
                        fatal = found.detail
                        break
                await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
            except (KafkaError, OSError) as e:
                reason = one_line(e)
                break
        try:
            await close()
        except Exception as e:  # closing a half-started client is best effort
            log.debug("closing %s after failed start: %s", what, one_line(e))
    if fatal:
        raise BusError(fatal)
    raise BusError(
        f"cannot reach Kafka at {redact_url(bootstrap)} within {timeout_s:g} s ({what}: {reason}); is the broker "
        "running? (`rollstream stack up`, or set kafka.bootstrap / $ROLLSTREAM_BOOTSTRAP)"
    )


class AsyncClient(abc.ABC):
    """A client that ``async with`` starts on entry and stops on exit (subclasses define both)."""

    @abc.abstractmethod
    async def start(self) -> Self:
        """Connect; return the client."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Close (idempotently)."""

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
