"""Finding a Kafka broker and asking whether it is ready.

* :func:`find_bootstrap` — the one rule by which every command, service and bench script picks
  its broker (docs/architecture.md, "Finding the broker"): ``--bootstrap``, else
  ``$ROLLSTREAM_BOOTSTRAP``, else ``kafka.bootstrap`` of the config, else the local broker of the
  stack's home. The runtime does not know that home: callers pass the local address
  (:func:`infra.kafka.broker.local_bootstrap`). :data:`NO_BROKER` is the one line when none is found.
* :func:`kafka_reachable` / :func:`probe_kafka` — a bounded readiness check from synchronous code:
  an aiokafka connection (TLS and SASL when the security kwargs ask for them) and one Metadata
  round trip against each address in turn. :func:`probe_async` is the same from a running loop;
  :func:`runtime.connection.start_bounded` uses it to say *why* a client could not start
  (credentials rejected, certificate not trusted, the wrong ``security_protocol``).

aiokafka is imported on the first probe, not with this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runtime.quiet import quiet_aiokafka

__all__ = ["BOOTSTRAP_ENV", "NO_BROKER", "Probe", "find_bootstrap", "kafka_reachable", "probe_async", "probe_kafka",
           "split_hostport"]

BOOTSTRAP_ENV = "ROLLSTREAM_BOOTSTRAP"
"""Environment variable naming the Kafka bootstrap servers (``host:port[,host:port]``): the
environment's spelling of the global ``--bootstrap`` option."""

NO_BROKER = "no Kafka broker: start one with `rollstream stack up`, or pass --bootstrap / set ROLLSTREAM_BOOTSTRAP"
"""The error line of every command that finds no broker by :func:`find_bootstrap`."""

_JOIN_MARGIN_S = 0.25
"""How long past ``timeout_s`` the caller waits for the probe thread to wind down."""


def find_bootstrap(given: str | None = None, configured: str | None = None, local: str | None = None) -> str | None:
    """The Kafka bootstrap address, in this order: ``given`` (``--bootstrap``, or the address a
    caller was handed), else ``$ROLLSTREAM_BOOTSTRAP``, else ``configured`` (``kafka.bootstrap`` of
    the run's config), else ``local`` (the broker ``rollstream stack up`` / ``rollstream run``
    started in the stack's home). Blank values count as unset; the answer is stripped; ``None``
    when there is none (then say :data:`NO_BROKER`)."""
    for candidate in (given, os.environ.get(BOOTSTRAP_ENV), configured, local):
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


@dataclass(frozen=True)
class Probe:
    """The answer of a probe: ``ok``, else what went wrong."""

    ok: bool
    problem: str = ""
    """``""`` when ok; else ``refused`` (nothing listens), ``timeout``, ``auth`` (SASL credentials
    rejected), ``mechanism`` (SASL mechanism not enabled), ``tls`` (handshake or certificate),
    ``protocol`` (the listener speaks another ``security_protocol``), ``empty`` (no live broker
    listed) or ``error``."""
    detail: str = ""
    """One line for the user (for ``auth``, ``mechanism``, ``tls``, ``protocol``: what to check)."""

    @property
    def fatal(self) -> bool:
        """True for problems that waiting does not fix (credentials, certificates, protocol)."""
        return self.problem in ("auth", "mechanism", "tls", "protocol")


def _unverified_tls() -> ssl.SSLContext:
    """A TLS context that trusts any certificate: only to ask whether a listener speaks TLS at all."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _classify(e: BaseException, address: str, sec: Mapping[str, Any]) -> Probe:
    """A connection failure as a :class:`Probe` whose detail says what to check."""
    from aiokafka.errors import (
        IllegalSaslStateError,
        KafkaConnectionError,
        SaslAuthenticationFailed,
        UnsupportedSaslMechanismError,
    )

    mechanism = sec.get("sasl_mechanism") or "PLAIN"
    if isinstance(e, SaslAuthenticationFailed | IllegalSaslStateError):
        who = f"user {sec.get('sasl_plain_username')!r}" if sec.get("sasl_plain_username") is not None else "the client"
        return Probe(False, "auth", f"Kafka at {address} rejected the SASL credentials of {who} ({mechanism}): "
                                    "check kafka.sasl_username / ROLLSTREAM_SASL_PASSWORD (or kafka.sasl_password_file)")
    if isinstance(e, UnsupportedSaslMechanismError):
        return Probe(False, "mechanism", f"Kafka at {address} does not accept SASL mechanism {mechanism}: "
                                         "check kafka.sasl_mechanism")
    if isinstance(e, ssl.SSLCertVerificationError):
        why = getattr(e, "verify_message", "") or _short(e)
        return Probe(False, "tls", f"Kafka at {address} presented a certificate this client does not trust "
                                   f"({why}): check kafka.ssl_cafile (the CA that signed the broker's certificate)")
    if isinstance(e, ssl.SSLError):
        return Probe(False, "tls", f"TLS handshake with Kafka at {address} failed ({_short(e)}): check "
                                   "kafka.security_protocol and kafka.ssl_cafile / ssl_certfile / ssl_keyfile")
    if isinstance(e, ConnectionRefusedError):
        return Probe(False, "refused", f"nothing listens on {address}")
    if isinstance(e, TimeoutError | asyncio.TimeoutError):
        return Probe(False, "timeout", f"no answer from {address} in time")
    if isinstance(e, KafkaConnectionError | OSError):
        return Probe(False, "error", f"{address}: {_short(e)}")
    return Probe(False, "error", f"{address}: {type(e).__name__}: {_short(e)}")


async def _connect(host: str, port: int, sec: Mapping[str, Any], timeout_s: float) -> Any:
    """An aiokafka connection (ApiVersions done, TLS and SASL as ``sec`` asks), within ``timeout_s``."""
    from aiokafka.conn import create_conn

    if timeout_s <= 0:
        raise TimeoutError
    kw = {k: v for k, v in sec.items() if k in _CONN_KEYS}
    return await asyncio.wait_for(
        create_conn(host, port, client_id="rollstream-probe", request_timeout_ms=max(1, int(timeout_s * 1000)), **kw),
        timeout=timeout_s,
    )


_CONN_KEYS = frozenset({
    "security_protocol", "ssl_context", "sasl_mechanism", "sasl_plain_username", "sasl_plain_password",
    "sasl_kerberos_service_name", "sasl_kerberos_domain_name", "sasl_oauth_token_provider",
})
"""The aiokafka client kwargs that shape a connection (the rest are ignored here)."""


async def _answers(host: str, port: int, sec: Mapping[str, Any], deadline: float) -> bool:
    """True if a connection as ``sec`` asks gets an ApiVersions answer (no authentication needed)."""
    with contextlib.suppress(Exception):
        conn = await _connect(host, port, sec, deadline - time.monotonic())
        conn.close()
        return True
    return False


async def _probe_one(host: str, port: int, sec: Mapping[str, Any], deadline: float, lenient: bool) -> Probe:
    """Connect as ``sec`` asks and send one Metadata request. When that fails, ask whether the
    listener speaks another protocol: ``lenient`` (no security given) counts a TLS or SASL listener
    that answers ApiVersions as ready; otherwise that is a ``protocol`` problem."""
    from aiokafka.protocol.metadata import MetadataRequest

    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    protocol = str(sec.get("security_protocol") or "PLAINTEXT")
    try:
        conn = await _connect(host, port, sec, deadline - time.monotonic())
        try:
            metadata = await asyncio.wait_for(conn.send(MetadataRequest([])), max(0.01, deadline - time.monotonic()))
        finally:
            conn.close()
        if metadata.brokers:
            return Probe(True)
        return Probe(False, "empty", f"Kafka at {address} lists no live broker yet")
    except Exception as e:  # every failure is an answer
        found = _classify(e, address, sec)
        untrusted = isinstance(e, ssl.SSLCertVerificationError)
    if untrusted or found.problem in ("refused", "timeout", "auth", "mechanism"):
        return found
    if protocol in ("PLAINTEXT", "SASL_PLAINTEXT") and await _answers(
            host, port, {"security_protocol": "SSL", "ssl_context": _unverified_tls()}, deadline):
        return Probe(True) if lenient else Probe(
            False, "protocol", f"Kafka at {address} speaks TLS (an SSL or SASL_SSL listener), not {protocol}: "
                               "set kafka.security_protocol (and kafka.ssl_cafile)")
    if protocol in ("SSL", "SASL_SSL") and await _answers(host, port, {"security_protocol": "PLAINTEXT"}, deadline):
        return Probe(False, "protocol", f"Kafka at {address} does not speak TLS (a PLAINTEXT or SASL_PLAINTEXT "
                                        f"listener), not {protocol}: check kafka.security_protocol")
    if protocol == "SSL" and await _answers(host, port, sec, deadline):
        return Probe(False, "protocol", f"Kafka at {address} asks for SASL authentication after the TLS handshake "
                                        "(a SASL_SSL listener): set kafka.security_protocol and kafka.sasl_*")
    if protocol == "PLAINTEXT" and await _answers(host, port, {"security_protocol": "PLAINTEXT"}, deadline):
        return Probe(True) if lenient else Probe(
            False, "protocol", f"Kafka at {address} asks for SASL authentication (a SASL_PLAINTEXT listener): "
                               "set kafka.security_protocol and kafka.sasl_*")
    return found


async def probe_async(bootstrap: str, timeout_s: float = 5.0, security: Mapping[str, Any] | None = None) -> Probe:
    """:func:`probe_kafka` from a running event loop (aiokafka's own log records are DEBUG here)."""
    addresses = [hp for hp in map(split_hostport, bootstrap.split(",")) if hp is not None]
    if not addresses:
        return Probe(False, "error", f"no host:port in {bootstrap!r}")
    deadline = time.monotonic() + max(0.0, timeout_s)
    found = Probe(False, "timeout", f"no answer from {bootstrap} within {timeout_s:g} s")
    with quiet_aiokafka():
        for host, port in addresses:
            if time.monotonic() >= deadline:
                break
            found = await _probe_one(host, port, security or {}, deadline, lenient=security is None)
            if found.ok or found.fatal:
                return found
    return found


def probe_kafka(bootstrap: str, timeout_s: float = 5.0, security: Mapping[str, Any] | None = None) -> Probe:
    """Whether a Kafka broker at ``bootstrap`` (``host:port[,host:port]``) is ready for clients,
    and if not, why (:class:`Probe`).

    ``security``: the aiokafka kwargs of a client (:func:`runtime.connection.kafka_kwargs`;
    ``security_protocol``, ``ssl_context``, ``sasl_*``). With it the probe connects as that client
    does (TLS handshake, SASL authentication) and sends one Metadata request that must list a live
    broker; credentials or a certificate the broker rejects are a ``fatal`` answer. Without it the
    probe speaks PLAINTEXT, and a listener that turns out to be TLS or SASL (it answers
    ApiVersions, which needs no credentials) counts as ready too: a broker is there, and whoever
    connects needs the right settings.

    Each address is tried in turn; entries without a port are skipped. The probe runs on its own
    event loop in a daemon thread, so it works from synchronous code and from inside a running
    loop alike, and the caller gets an answer within ``timeout_s`` (plus a fraction of a second)
    in every case, a slow DNS lookup included. aiokafka's connection errors are not logged (DEBUG
    at most).
    """
    deadline = time.monotonic() + max(0.0, timeout_s)
    result: list[Probe] = []

    def run() -> None:
        with contextlib.suppress(Exception):
            result.append(asyncio.run(probe_async(bootstrap, timeout_s, security)))

    worker = threading.Thread(target=run, name="rollstream-kafka-probe", daemon=True)
    worker.start()
    worker.join(max(0.0, deadline - time.monotonic()) + _JOIN_MARGIN_S)
    return result[0] if result else Probe(False, "timeout", f"no answer from {bootstrap} within {timeout_s:g} s")


def kafka_reachable(bootstrap: str, timeout_s: float = 5.0, security: Mapping[str, Any] | None = None) -> bool:
    """True if :func:`probe_kafka` finds a broker at ``bootstrap`` ready (see there)."""
    return probe_kafka(bootstrap, timeout_s, security).ok
