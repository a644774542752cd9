"""SASL_SSL for the local broker (``rollstream stack up --sasl-ssl``): a self-signed CA and a broker
certificate, SCRAM users created when the storage is formatted, and the listener settings.

Such a broker has one listener for clients, ``SASL_SSL://127.0.0.1:<port>`` (TLS with the generated
certificate, SCRAM authentication). It is also the inter-broker listener: the broker authenticates
as its own SCRAM user. Only the KRaft controller listener stays PLAINTEXT, on loopback.

Files in ``<home>/kafka/`` (the secret ones readable by their owner only)::

    tls/ca.pem             the CA certificate clients trust (kafka.ssl_cafile)
    tls/ca.key             the CA's private key (openssl; keytool keeps it in tls/ca.p12)
    tls/broker.pem         the broker's private key and certificate chain (a PEM keystore), or
    tls/broker.p12         a PKCS12 keystore (keytool) with its password in tls/keystore.password
    sasl.password          the client user's password, when none was given (generated)
    broker.password        the broker's own SCRAM password (generated)
    scram.json             the SCRAM users the storage was formatted with (names and mechanism, no secret)

Certificates are made with ``openssl`` when it is on PATH, else with the JDK's ``keytool``. SCRAM
credentials reach the format step salted (``saltedpassword=...``): no password is ever on a
command line. The users exist from the first start on: a home formatted without them (a
PLAINTEXT stack) cannot become a SASL_SSL stack, and a user's password is the one of that start.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from infra.kafka.home import HOST, StackError, kafka_dir
from runtime.connection import SASL_PASSWORD_ENV
from schemas.config import KafkaSettings

__all__ = [
    "DEFAULT_MECHANISM",
    "DEFAULT_USER",
    "LocalSasl",
    "SaslSslOptions",
    "broker_settings",
    "ca_path",
    "client_env",
    "ensure_tls",
    "prepare_sasl_ssl",
    "read_scram",
    "sasl_ssl_properties",
    "scram_credential",
]

DEFAULT_USER = "rollstream"
"""The SCRAM user clients log in as, unless ``--sasl-user`` names another."""
DEFAULT_MECHANISM = "SCRAM-SHA-512"
BROKER_USER = "rollstream-broker"
"""The broker's own SCRAM user (inter-broker connections, the readiness probe)."""
SCRAM_ITERATIONS = 8192
_TOOL_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class SaslSslOptions:
    """What ``stack up --sasl-ssl`` asks for."""

    user: str = DEFAULT_USER
    mechanism: str = DEFAULT_MECHANISM
    password_file: str = ""
    """The client user's password: this file's first line; empty = ``$ROLLSTREAM_SASL_PASSWORD``,
    else a generated password in ``<home>/kafka/sasl.password``. Read only when the storage is
    first formatted (the user is created then)."""


@dataclass(frozen=True)
class LocalSasl:
    """A home's SASL_SSL setup, ready for server.properties and the readiness probe."""

    user: str
    mechanism: str
    password_source: str
    """Where the client user's password came from: ``$ROLLSTREAM_SASL_PASSWORD`` or a file path."""
    ca_file: Path
    keystore: Path
    keystore_type: str
    broker_password: str = field(repr=False)
    keystore_password: str = field(default="", repr=False)


# --------------------------------------------------------------------------- files


def tls_dir(home: Path) -> Path:
    return kafka_dir(home) / "tls"


def ca_path(home: Path) -> Path:
    """``<home>/kafka/tls/ca.pem``: the CA certificate clients of a SASL_SSL local broker trust."""
    return tls_dir(home) / "ca.pem"


def _write_secret(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, readable and writable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _first_line(path: Path, what: str) -> str:
    try:
        lines = path.expanduser().read_text().splitlines()
    except OSError as e:
        raise StackError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if not lines or not lines[0]:
        raise StackError(f"{what} {path} is empty (the password is its first line)")
    return lines[0]


def _generated_secret(path: Path) -> str:
    """The secret in ``path``, created (random, 0600) when the file does not exist."""
    if not path.is_file():
        _write_secret(path, secrets.token_urlsafe(24) + "\n")
    return _first_line(path, "password file")


def _client_password(home: Path, opts: SaslSslOptions) -> tuple[str, str]:
    """(password, where it came from) of the client user: the file asked for, else
    ``$ROLLSTREAM_SASL_PASSWORD``, else ``<home>/kafka/sasl.password`` (generated)."""
    if opts.password_file:
        path = Path(opts.password_file).expanduser().absolute()
        return _first_line(path, "--sasl-password-file"), str(path)
    env = os.environ.get(SASL_PASSWORD_ENV, "")
    if env:
        return env, f"${SASL_PASSWORD_ENV}"
    path = kafka_dir(home) / "sasl.password"
    return _generated_secret(path), str(path)


def read_scram(home: Path) -> dict[str, str] | None:
    """The SCRAM users the storage of ``home`` was formatted with (``scram.json``), or None."""
    try:
        data = json.loads((kafka_dir(home) / "scram.json").read_text())
    except (OSError, ValueError):
        return None
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else None


# --------------------------------------------------------------------------- certificates


def _run_tool(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
    try:
        res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=_TOOL_TIMEOUT_S,
                             stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise StackError(f"making the local broker's TLS certificate failed ({Path(cmd[0]).name}: {e})") from None
    if res.returncode != 0:
        last = next((ln for ln in reversed((res.stderr + res.stdout).splitlines()) if ln.strip()), "")
        raise StackError(f"making the local broker's TLS certificate failed ({Path(cmd[0]).name} "
                         f"{cmd[1]}: {last.strip()[:300]}); files in {cwd}")


_SAN = "IP:127.0.0.1,DNS:localhost"


def _openssl_certs(openssl: str, d: Path) -> None:
    """CA (self-signed) and a broker certificate for 127.0.0.1 / localhost signed by it; the broker's
    PKCS#8 key and chain in ``broker.pem`` (Kafka's PEM keystore)."""
    days = "3650"
    _run_tool([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
               "-days", days, "-subj", "/CN=rollstream local CA", "-addext", "basicConstraints=critical,CA:true",
               "-addext", "keyUsage=critical,keyCertSign,cRLSign"], d)
    _run_tool([openssl, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "broker.key", "-out", "broker.csr",
               "-subj", "/CN=localhost"], d)
    (d / "broker.ext").write_text(
        f"subjectAltName={_SAN}\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\nbasicConstraints=CA:false\nsubjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid\n")
    _run_tool([openssl, "x509", "-req", "-in", "broker.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
               "-set_serial", f"0x{secrets.token_hex(8)}", "-out", "broker.crt", "-days", days,
               "-extfile", "broker.ext"], d)
    _write_secret(d / "broker.pem", "".join((d / n).read_text() for n in ("broker.key", "broker.crt", "ca.pem")))
    for name in ("broker.key", "broker.csr", "broker.ext", "broker.crt"):
        (d / name).unlink(missing_ok=True)
    os.chmod(d / "ca.key", 0o600)


def _keytool_certs(keytool: str, d: Path, password: str) -> None:
    """The same with the JDK's keytool: ``broker.p12`` (PKCS12) and ``ca.pem``."""
    env = dict(os.environ, RS_KEYSTORE_PASSWORD=password)
    pw = "-storepass:env"
    var = "RS_KEYSTORE_PASSWORD"
    common = ["-keyalg", "RSA", "-keysize", "2048", "-validity", "3650", "-storetype", "PKCS12"]
    _run_tool([keytool, "-genkeypair", "-alias", "ca", "-dname", "CN=rollstream local CA", "-ext", "bc:c=ca:true",
               "-ext", "ku:c=keyCertSign,cRLSign", "-keystore", "ca.p12", pw, var, *common], d, env)
    _run_tool([keytool, "-exportcert", "-rfc", "-alias", "ca", "-keystore", "ca.p12", pw, var, "-file", "ca.pem"],
              d, env)
    _run_tool([keytool, "-genkeypair", "-alias", "broker", "-dname", "CN=localhost", "-ext", f"SAN={_SAN.lower()}",
               "-keystore", "broker.p12", pw, var, *common], d, env)
    _run_tool([keytool, "-certreq", "-alias", "broker", "-keystore", "broker.p12", pw, var, "-file", "broker.csr"],
              d, env)
    _run_tool([keytool, "-gencert", "-alias", "ca", "-keystore", "ca.p12", pw, var, "-infile", "broker.csr",
               "-outfile", "broker.crt", "-rfc", "-validity", "3650", "-ext", f"SAN={_SAN.lower()}",
               "-ext", "ku:c=digitalSignature,keyEncipherment", "-ext", "eku=serverAuth"], d, env)
    (d / "chain.pem").write_text((d / "broker.crt").read_text() + (d / "ca.pem").read_text())
    _run_tool([keytool, "-importcert", "-noprompt", "-trustcacerts", "-alias", "broker", "-keystore", "broker.p12",
               pw, var, "-file", "chain.pem"], d, env)
    for name in ("broker.csr", "broker.crt", "chain.pem"):
        (d / name).unlink(missing_ok=True)
    for name in ("ca.p12", "broker.p12"):
        os.chmod(d / name, 0o600)


def ensure_tls(home: Path, java: str, tool: str | None = None) -> tuple[Path, str, str]:
    """(keystore, keystore type, keystore password) of the broker; made on the first call (with
    ``tool`` = ``openssl`` or ``keytool`` when given, else openssl if on PATH, else keytool)."""
    d = tls_dir(home)
    if (d / "broker.pem").is_file() and ca_path(home).is_file():
        return d / "broker.pem", "PEM", ""
    if (d / "broker.p12").is_file() and ca_path(home).is_file() and (d / "keystore.password").is_file():
        return d / "broker.p12", "PKCS12", _first_line(d / "keystore.password", "keystore password file")
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    os.chmod(d, 0o700)
    openssl = shutil.which("openssl") if tool in (None, "openssl") else None
    if openssl:
        _openssl_certs(openssl, d)
        return d / "broker.pem", "PEM", ""
    keytool = str(Path(java).parent / "keytool")
    if not Path(keytool).is_file():
        keytool = shutil.which("keytool") or ""
    if not keytool:
        raise StackError("neither openssl nor keytool found (needed for the SASL_SSL broker's certificate); "
                         "install openssl or a full JDK 17")
    password = _generated_secret(d / "keystore.password")
    _keytool_certs(keytool, d, password)
    return d / "broker.p12", "PKCS12", password


# --------------------------------------------------------------------------- SCRAM


def scram_credential(mechanism: str, user: str, password: str, *, salt: bytes | None = None,
                     iterations: int = SCRAM_ITERATIONS) -> str:
    """The ``--add-scram`` argument of ``kafka-storage format`` for one user, salted (RFC 5802:
    ``SaltedPassword = PBKDF2-HMAC(password, salt, iterations)``), so the password itself is not
    on the command line."""
    digest = {"SCRAM-SHA-256": "sha256", "SCRAM-SHA-512": "sha512"}[mechanism]
    salt = salt if salt is not None else os.urandom(16)
    salted = hashlib.pbkdf2_hmac(digest, password.encode("utf-8"), salt, iterations)
    b64 = base64.b64encode
    return (f'{mechanism}=[name={user},iterations={iterations},salt="{b64(salt).decode()}",'
            f'saltedpassword="{b64(salted).decode()}"]')


def prepare_sasl_ssl(home: Path, java: str, opts: SaslSslOptions, formatted: bool,
                     tool: str | None = None) -> tuple[LocalSasl, list[str]]:
    """The home's SASL_SSL setup (certificates made on the first call) and the ``--add-scram``
    arguments of the format step ([] when the storage is ``formatted`` already: its users exist;
    the ones recorded must then match ``opts``)."""
    if opts.mechanism not in ("SCRAM-SHA-256", "SCRAM-SHA-512"):
        raise StackError(f"--sasl-mechanism {opts.mechanism}: the local broker supports SCRAM-SHA-256 and SCRAM-SHA-512")
    if not opts.user or any(c in opts.user for c in ",=[]\" "):
        raise StackError(f"--sasl-user {opts.user!r}: use letters, digits, '-', '_' or '.'")
    recorded = read_scram(home)
    broker_password = _generated_secret(kafka_dir(home) / "broker.password")
    scram_args: list[str] = []
    if formatted:
        if recorded is None:
            raise StackError(
                f"the Kafka storage of {home} was formatted without SASL users (a PLAINTEXT stack); start the "
                f"SASL_SSL stack in another home (--home) or remove {kafka_dir(home) / 'data'} (its topics are lost)")
        if (recorded.get("user"), recorded.get("mechanism")) != (opts.user, opts.mechanism):
            raise StackError(
                f"the Kafka storage of {home} was formatted with SASL user {recorded.get('user')!r} "
                f"({recorded.get('mechanism')}); ask for that (--sasl-user / --sasl-mechanism) or use another --home")
        source = recorded.get("password_source", "")
    else:
        password, source = _client_password(home, opts)
        scram_args = ["--add-scram", scram_credential(opts.mechanism, opts.user, password),
                      "--add-scram", scram_credential(opts.mechanism, BROKER_USER, broker_password)]
    keystore, kind, ks_password = ensure_tls(home, java, tool)
    sasl = LocalSasl(user=opts.user, mechanism=opts.mechanism, password_source=source, ca_file=ca_path(home),
                     keystore=keystore, keystore_type=kind, broker_password=broker_password,
                     keystore_password=ks_password)
    return sasl, scram_args


def record_scram(home: Path, sasl: LocalSasl) -> None:
    """Note in ``scram.json`` which users the storage was just formatted with (no secret)."""
    data = {"user": sasl.user, "mechanism": sasl.mechanism, "broker_user": BROKER_USER,
            "password_source": sasl.password_source}
    _write_secret(kafka_dir(home) / "scram.json", json.dumps(data, indent=2) + "\n")


# --------------------------------------------------------------------------- broker and clients


def sasl_ssl_properties(sasl: LocalSasl, port: int, controller_port: int) -> dict[str, str]:
    """server.properties entries (over :func:`infra.kafka.home.server_properties`) of a broker
    whose client and inter-broker listener is SASL_SSL on ``port``."""
    mech = sasl.mechanism
    props = {
        "listeners": f"SASL_SSL://{HOST}:{port},CONTROLLER://{HOST}:{controller_port}",
        "advertised.listeners": f"SASL_SSL://{HOST}:{port}",
        "listener.security.protocol.map": "SASL_SSL:SASL_SSL,CONTROLLER:PLAINTEXT",
        "inter.broker.listener.name": "SASL_SSL",
        "sasl.enabled.mechanisms": mech,
        "sasl.mechanism.inter.broker.protocol": mech,
        f"listener.name.sasl_ssl.{mech.lower()}.sasl.jaas.config": (
            "org.apache.kafka.common.security.scram.ScramLoginModule required "
            f'username="{BROKER_USER}" password="{sasl.broker_password}";'),
        "ssl.keystore.type": sasl.keystore_type,
        "ssl.keystore.location": str(sasl.keystore),
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(sasl.ca_file),
        "ssl.client.auth": "none",
        "ssl.endpoint.identification.algorithm": "https",
    }
    if sasl.keystore_password:
        props["ssl.keystore.password"] = sasl.keystore_password
        props["ssl.key.password"] = sasl.keystore_password
    return props


def broker_settings(sasl: LocalSasl, bootstrap: str) -> KafkaSettings:
    """Client settings that log in as the broker's own user (the readiness probe: it does not
    need the client user's password)."""
    return KafkaSettings(bootstrap=bootstrap, security_protocol="SASL_SSL", sasl_mechanism=sasl.mechanism,  # type: ignore[arg-type]
                         sasl_username=BROKER_USER, sasl_password=sasl.broker_password, ssl_cafile=str(sasl.ca_file))


def client_env(bootstrap: str, user: str, mechanism: str, ca_file: str, password_source: str) -> dict[str, str]:
    """The environment a client of the local SASL_SSL broker needs (the password's variable is
    named, its value never written): what ``stack up`` prints and writes to ``client.env``."""
    env = {
        "ROLLSTREAM_BOOTSTRAP": bootstrap,
        "ROLLSTREAM_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "ROLLSTREAM_KAFKA_SASL_MECHANISM": mechanism,
        "ROLLSTREAM_KAFKA_SASL_USERNAME": user,
        "ROLLSTREAM_KAFKA_SSL_CAFILE": ca_file,
    }
    if password_source and not password_source.startswith("$"):
        env["ROLLSTREAM_KAFKA_SASL_PASSWORD_FILE"] = password_source
    return env
