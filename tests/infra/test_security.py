"""Security: a SASL_SSL local broker (SCRAM over TLS, generated CA) and a run over it, one clear line
for wrong credentials or a wrong CA, and secrets (SASL password, store DSN password) kept out of
logs, ``runs/<id>/`` and the record.

The broker is real (``rollstream stack up --sasl-ssl`` in a temporary home, stopped at the end);
every CLI call is a subprocess, as a user runs it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from infra.kafka import broker as stack
from infra.kafka import local_security as ls
from runtime.connection import BusError, effective_settings, kafka_kwargs
from schemas.config import (
    REDACTED,
    KafkaSettings,
    parse_config,
    redact_text,
    redact_url,
    redacted_dict,
    to_dict,
)
from store.client import StoreError, check_dsn, connect, store_password

MARKER = f"rsMarker{uuid.uuid4().hex[:10]}"
"""The SASL password of the test broker's user: it must appear nowhere it is not given."""
STORE_MARKER = f"rsStore{uuid.uuid4().hex[:10]}"

SHORT = [
    "train.steps=2", "train.warmup_sft_steps=20", "train.eval_every=2", "train.checkpoint_every=2",
    "data.heldout_size=16", "rollout.group_size=4", "train.batch_size=16", "train.micro_batch_size=16",
]


# --------------------------------------------------------------------------- unit: redaction and sources


def test_redacted_dict_hides_the_sasl_password_and_dsn_passwords() -> None:
    cfg = parse_config(f"store: {{dsn: 'http://rs:{STORE_MARKER}@db.example:8123/rec'}}")
    cfg = msgspec.structs.replace(cfg, kafka=KafkaSettings(sasl_password=MARKER, sasl_username="u"))
    for out in (redacted_dict(cfg), to_dict(cfg)):  # to_dict redacts by default
        text = json.dumps(out)
        assert MARKER not in text and STORE_MARKER not in text
        assert out["kafka"]["sasl_password"] == REDACTED
        assert out["store"]["dsn"] == "http://rs:***@db.example:8123/rec"
        assert out["kafka"]["sasl_username"] == "u"
    assert to_dict(cfg, reveal_secrets=True)["kafka"]["sasl_password"] == MARKER
    # a redacted config parses again (*** = given elsewhere)
    again = parse_config(json.dumps(redacted_dict(cfg)))
    assert again.kafka.sasl_password == REDACTED and again.store.dsn.endswith("***@db.example:8123/rec")


def test_redact_text_and_urls() -> None:
    line = (f"run cfg.yaml --store http://u:{STORE_MARKER}@h:8123 --set kafka.sasl_password={MARKER} "
            f"--set x=https://a:p@ss{MARKER}@h2/db")
    red = redact_text(line)
    assert MARKER not in red and STORE_MARKER not in red
    assert "http://u:***@h:8123" in red and "https://a:***@h2/db" in red
    assert redact_url("chdb:///tmp/x http://h:8123 http://u@h") == "chdb:///tmp/x http://h:8123 http://u@h"


def test_a_password_in_the_config_is_refused() -> None:
    from schemas.config import ConfigError

    with pytest.raises(ConfigError, match=r"kafka\.sasl_password: .*ROLLSTREAM_SASL_PASSWORD or kafka\.sasl_password_file"):
        parse_config(f"kafka: {{sasl_password: {MARKER}}}")
    with pytest.raises(ConfigError) as err:
        parse_config("", [f"kafka.sasl_password={MARKER}"])
    assert MARKER not in str(err.value)
    with pytest.raises(ConfigError) as err:  # a value echoed in an error is redacted
        parse_config(f"store: {{dsn: ['http://u:{STORE_MARKER}@h']}}")
    assert STORE_MARKER not in str(err.value)


def test_sasl_password_comes_from_the_file_or_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("ROLLSTREAM_SASL_PASSWORD", *(v for v in os.environ if v.startswith("ROLLSTREAM_KAFKA_"))):
        monkeypatch.delenv(var, raising=False)
    sasl = KafkaSettings(security_protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-512", sasl_username="u")
    with pytest.raises(BusError, match=r"no SASL password for user 'u'.*ROLLSTREAM_SASL_PASSWORD or kafka.sasl_password_file"):
        kafka_kwargs(sasl, "h:1")
    monkeypatch.setenv("ROLLSTREAM_SASL_PASSWORD", "from-env")
    assert kafka_kwargs(sasl, "h:1")["sasl_plain_password"] == "from-env"
    (tmp_path / "pw").write_text("from-file\n")
    with_file = msgspec.structs.replace(sasl, sasl_password_file=str(tmp_path / "pw"))
    assert kafka_kwargs(with_file, "h:1")["sasl_plain_password"] == "from-file"
    missing = msgspec.structs.replace(sasl, sasl_password_file=str(tmp_path / "nope"))
    with pytest.raises(BusError, match=r"cannot read kafka\.sasl_password_file"):
        kafka_kwargs(missing, "h:1")
    with pytest.raises(BusError, match="needs a user"):
        kafka_kwargs(KafkaSettings(security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN"), "h:1")
    # the environment overrides the config's security keys (for commands without a config)
    monkeypatch.setenv("ROLLSTREAM_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    monkeypatch.setenv("ROLLSTREAM_KAFKA_SASL_USERNAME", "envuser")
    eff = effective_settings(KafkaSettings())
    assert (eff.security_protocol, eff.sasl_username) == ("SASL_PLAINTEXT", "envuser")
    monkeypatch.setenv("ROLLSTREAM_KAFKA_SECURITY_PROTOCOL", "TLS")
    with pytest.raises(BusError, match=r"\$ROLLSTREAM_KAFKA_SECURITY_PROTOCOL"):
        effective_settings(KafkaSettings())


def test_store_dsn_passwords_never_reach_messages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLSTREAM_STORE_PASSWORD", raising=False)
    monkeypatch.delenv("ROLLSTREAM_STORE_PASSWORD_FILE", raising=False)
    with pytest.raises(StoreError) as err:
        connect(f"http://user:{STORE_MARKER}@127.0.0.1:1/db", connect_timeout_s=1)
    assert STORE_MARKER not in str(err.value) and "http://user:***@127.0.0.1:1/db" in str(err.value)
    with pytest.raises(StoreError) as err:
        check_dsn(f"ftp://user:{STORE_MARKER}@h")
    assert STORE_MARKER not in str(err.value)
    # a redacted DSN (copied from a run's config) needs the password from the environment or a file
    with pytest.raises(StoreError, match=r"redacted.*ROLLSTREAM_STORE_PASSWORD"):
        store_password("http://user:***@h:8123")
    assert store_password(f"http://user:{STORE_MARKER}@h:8123") is None  # the DSN's own is used
    assert store_password("http://user@h:8123") is None
    (tmp_path / "pw").write_text(f"{STORE_MARKER}\n")
    monkeypatch.setenv("ROLLSTREAM_STORE_PASSWORD_FILE", str(tmp_path / "pw"))
    assert store_password("http://user:***@h:8123") == STORE_MARKER
    monkeypatch.setenv("ROLLSTREAM_STORE_PASSWORD", "env-first")
    assert store_password("http://user@h:8123") == "env-first"
    with pytest.raises(StoreError) as err:  # nor does the password from the environment
        connect("http://user@127.0.0.1:1/db", connect_timeout_s=1)
    assert "env-first" not in str(err.value)


def test_scram_credential_is_salted() -> None:
    salt = b"0123456789abcdef"
    arg = ls.scram_credential("SCRAM-SHA-512", "alice", MARKER, salt=salt, iterations=4096)
    assert MARKER not in arg
    m = re.fullmatch(r'SCRAM-SHA-512=\[name=alice,iterations=4096,salt="([^"]+)",saltedpassword="([^"]+)"\]', arg)
    assert m is not None
    import base64

    assert base64.b64decode(m.group(1)) == salt
    assert base64.b64decode(m.group(2)) == hashlib.pbkdf2_hmac("sha512", MARKER.encode(), salt, 4096)


# --------------------------------------------------------------------------- the SASL_SSL broker


@dataclass(frozen=True)
class SaslBroker:
    home: Path
    bootstrap: str
    ca: Path
    up_stdout: str
    env: dict[str, str]
    """Environment of a client: no broker variables, the user's password."""


def rollstream(*args: str, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("ROLLSTREAM_KAFKA_", "ROLLSTREAM_SASL", "ROLLSTREAM_STORE", "ROLLSTREAM_BOOTSTRAP"))}


@pytest.fixture(scope="module")
def sasl_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SaslBroker]:
    stack.ensure_kafka_jars()
    home = tmp_path_factory.mktemp("sasl-home")
    env = dict(_clean_env(), ROLLSTREAM_SASL_PASSWORD=MARKER)
    try:
        res = rollstream("--home", str(home), "stack", "up", "--sasl-ssl", env=env, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        proc = stack.local_kafka(home)
        assert proc is not None and proc.security_protocol == "SASL_SSL"
        yield SaslBroker(home, proc.bootstrap, Path(proc.ssl_cafile), res.stdout, env)
    finally:
        stack.stop_local_kafka(home)


def _run_args(b: SaslBroker, *extra: str, ca: Path | None = None, user: str = "rollstream") -> list[str]:
    keys = [f"kafka.bootstrap={b.bootstrap}", "kafka.security_protocol=SASL_SSL",
            "kafka.sasl_mechanism=SCRAM-SHA-512", f"kafka.sasl_username={user}", f"kafka.ssl_cafile={ca or b.ca}"]
    return [a for kv in (*keys, *extra) for a in ("--set", kv)]


def test_stack_up_sasl_ssl_prints_how_to_connect(sasl_broker: SaslBroker) -> None:
    b = sasl_broker
    text = b.up_stdout
    assert f"kafka: started at {b.bootstrap}" in text
    assert "SASL_SSL, SCRAM-SHA-512 user 'rollstream'" in text and str(b.ca) in text
    for key in ("kafka.security_protocol=SASL_SSL", "kafka.sasl_mechanism=SCRAM-SHA-512",
                "kafka.sasl_username=rollstream", f"kafka.ssl_cafile={b.ca}", "ROLLSTREAM_SASL_PASSWORD"):
        assert key in text, key
    assert MARKER not in text
    # the password never lands in the home: server.properties, state, logs, client.env
    for path in b.home.rglob("*"):
        if path.is_file() and "data" not in path.relative_to(b.home).parts:
            assert MARKER.encode() not in path.read_bytes(), path
    props = (b.home / "kafka" / "server.properties")
    assert props.stat().st_mode & 0o077 == 0  # it holds the broker's own SCRAM password
    # the CA verifies the broker (hostname 127.0.0.1 included) and the user logs in
    env = dict(b.env, **{k: v for line in (b.home / "kafka" / "client.env").read_text().splitlines()
                         for k, v in [line.removeprefix("export ").split("=", 1)]})
    res = rollstream("--home", str(b.home), "topics", "list", env=env, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    res = rollstream("--home", str(b.home), "stack", "status", env=env, timeout=60)
    assert res.returncode == 0 and "(SASL_SSL) — up" in res.stdout, res.stdout + res.stderr


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CA of another (never started) SASL_SSL home: it did not sign the test broker's certificate."""
    other = tmp_path_factory.mktemp("other-home")
    ls.ensure_tls(other, shutil.which("java") or "java")
    return ls.ca_path(other)


@pytest.mark.parametrize(("command", "fault"), [("run", "password"), ("run", "ca"), ("topics", "user"),
                                                ("topics", "ca")])
def test_wrong_credentials_or_ca_is_one_line_within_15_s(
        sasl_broker: SaslBroker, other_ca: Path, tmp_path: Path, repo_root: Path, command: str, fault: str) -> None:
    b = sasl_broker
    env = dict(b.env, ROLLSTREAM_SASL_PASSWORD="wrong-" + MARKER[::-1] if fault == "password" else MARKER)
    ca = other_ca if fault == "ca" else b.ca
    user = "mallory" if fault == "user" else "rollstream"
    if command == "run":
        args = ["run", str(repo_root / "examples" / "main.yaml"), *_run_args(b, f"run.runs_dir={tmp_path}", ca=ca,
                                                                              user=user)]
    else:
        env.update(ROLLSTREAM_BOOTSTRAP=b.bootstrap, ROLLSTREAM_KAFKA_SECURITY_PROTOCOL="SASL_SSL",
                   ROLLSTREAM_KAFKA_SASL_MECHANISM="SCRAM-SHA-512", ROLLSTREAM_KAFKA_SASL_USERNAME=user,
                   ROLLSTREAM_KAFKA_SSL_CAFILE=str(ca))
        args = ["topics", "list"]
    t0 = time.monotonic()
    res = rollstream("--home", str(b.home), *args, env=env, timeout=60)
    took = time.monotonic() - t0
    err = res.stderr.strip()
    assert res.returncode == 1, res.stdout + res.stderr
    assert took < 15, f"{took:.1f} s"
    assert "\n" not in err and err.startswith("error: ") and "Traceback" not in err, err
    if fault == "ca":
        assert f"Kafka at {b.bootstrap} presented a certificate this client does not trust" in err, err
        assert "check kafka.ssl_cafile" in err
    else:
        assert (f"Kafka at {b.bootstrap} rejected the SASL credentials of user '{user}' (SCRAM-SHA-512): "
                "check kafka.sasl_username / ROLLSTREAM_SASL_PASSWORD") in err, err
    assert MARKER not in res.stdout + res.stderr and MARKER[::-1] not in res.stdout + res.stderr


def _files_holding(root: Path, secret: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def test_prepared_run_keeps_the_store_password_out_of_its_files(sasl_broker: SaslBroker, tmp_path: Path,
                                                               repo_root: Path) -> None:
    """A store DSN with a password (from the config or --set) is written and logged as ``***``;
    reading the run's record later needs the password from the environment again."""
    b = sasl_broker
    runs = tmp_path / "runs"
    run_id = f"sec-prep-{uuid.uuid4().hex[:6]}"
    dsn = f"http://rs:{STORE_MARKER}@127.0.0.1:1/rec"
    res = rollstream("--home", str(b.home), "run", str(repo_root / "examples" / "main.yaml"), "--prepare-only",
                     "--run-id", run_id, *_run_args(b, f"run.runs_dir={runs}", f"store.dsn={dsn}",
                                                    "model.init.hidden_size=32", "model.init.num_layers=1"),
                     env=b.env, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    run_dir = runs / run_id
    assert "dsn: http://rs:***@127.0.0.1:1/rec" in (run_dir / "config.yaml").read_text()
    assert _files_holding(run_dir, STORE_MARKER) == [] and _files_holding(b.home / "logs", STORE_MARKER) == []
    assert STORE_MARKER not in res.stdout + res.stderr
    res = rollstream("sql", "SELECT 1", "--run", run_id, "--runs-dir", str(runs), env=b.env, timeout=60)
    assert res.returncode == 1 and "redacted" in res.stderr and "ROLLSTREAM_STORE_PASSWORD" in res.stderr, res.stderr
    res = rollstream("sql", "SELECT 1", "--run", run_id, "--runs-dir", str(runs), timeout=60,
                     env=dict(b.env, ROLLSTREAM_STORE_PASSWORD=STORE_MARKER))
    assert res.returncode == 1 and "cannot reach ClickHouse at http://rs:***@127.0.0.1:1/rec" in res.stderr, res.stderr
    assert STORE_MARKER not in res.stdout + res.stderr


@pytest.mark.slow
def test_run_over_sasl_ssl_completes_and_records_no_secret(sasl_broker: SaslBroker, tmp_path: Path,
                                                          repo_root: Path) -> None:
    b = sasl_broker
    runs = tmp_path / "runs"
    run_id = f"sec-run-{uuid.uuid4().hex[:6]}"
    env = dict(b.env, ROLLSTREAM_STORE_PASSWORD=STORE_MARKER)  # unused by the embedded store: must not leak
    res = rollstream("--home", str(b.home), "run", str(repo_root / "examples" / "main.yaml"), "--run-id", run_id,
                     *_run_args(b, *SHORT, f"run.runs_dir={runs}"), env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    run_dir = runs / run_id
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2
    s = summary["samples"]
    assert s["issued"] > 0 and s["trained"] > 0 and s["unaccounted"] == 0
    assert s["issued"] == s["trained"] + s["dropped_stale"] + s["filtered"] + s["dead_letter"]
    assert summary["config"]["kafka"]["security_protocol"] == "SASL_SSL"

    # no secret in the run's files (logs, config.yaml, summary.json, ...), the CLI's output or the home's logs
    for secret in (MARKER, STORE_MARKER):
        assert _files_holding(run_dir, secret) == []
        assert _files_holding(b.home / "logs", secret) == []
        assert secret not in res.stdout + res.stderr
    # nor in the record: every event's payload, RunStarted's config included
    q = (f"SELECT countIf(payload LIKE '%{MARKER}%') + countIf(payload LIKE '%{STORE_MARKER}%') AS leaks, "
         "countIf(kind = 'RunStarted') AS started FROM events")
    res = rollstream("sql", q, "--run", run_id, "--runs-dir", str(runs), "--format", "json", env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == [{"leaks": 0, "started": 1}]
