"""``rollstream stack up|down|status``: the local Kafka broker and the store."""

from __future__ import annotations

from typing import Any

import typer

from cli.app import UserError, app, console, find_broker, friendly, home, opt, out

stack_app = typer.Typer(help="The local stack: a Kafka broker (KRaft) and the embedded store.", no_args_is_help=True)
app.add_typer(stack_app, name="stack")


def _store_check(dsn: str | None) -> tuple[bool, str]:
    """Open the store (or an embedded probe store), apply DDL, ping. Returns (ok, description);
    a DSN's password is shown as ``***``."""
    import store as st
    from schemas.config import redact_url

    if dsn:
        client = st.connect(dsn)
        st.apply_ddl(client)
        return st.ping(client), redact_url(dsn)
    probe = home() / "store-probe"
    client = st.connect(f"chdb://{probe}")
    st.apply_ddl(client)
    ver = client.query("SELECT version()").result_rows[0][0]
    return st.ping(client), f"embedded chDB (ClickHouse {ver}); each run records to runs/<run_id>/store"


def _probe(bootstrap: str, timeout_s: float) -> Any:
    """Probe ``bootstrap`` as this process's clients would connect: with the ``$ROLLSTREAM_KAFKA_*``
    security settings when they ask for more than PLAINTEXT (credentials checked), else
    leniently (a TLS or SASL listener counts as up)."""
    from runtime.connection import effective_settings, kafka_kwargs
    from runtime.probe import probe_kafka
    from schemas.config import KafkaSettings

    settings = effective_settings(KafkaSettings())
    security = kafka_kwargs(settings, bootstrap) if settings.security_protocol != "PLAINTEXT" else None
    return probe_kafka(bootstrap, timeout_s, security)


def _print_sasl(proc: Any) -> None:
    """How clients reach a SASL_SSL local broker: config keys, the password's source, client.env."""
    import shlex

    from infra.kafka.home import kafka_dir, write_atomic
    from infra.kafka.local_security import client_env

    env = client_env(proc.bootstrap, proc.sasl_username, proc.sasl_mechanism, proc.ssl_cafile, proc.password_source)
    env_path = kafka_dir(home()) / "client.env"
    write_atomic(env_path, "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()))
    from_file = bool(proc.password_source) and not proc.password_source.startswith("$")
    keys = {"bootstrap": proc.bootstrap, "security_protocol": "SASL_SSL", "sasl_mechanism": proc.sasl_mechanism,
            "sasl_username": proc.sasl_username, "ssl_cafile": proc.ssl_cafile}
    if from_file:
        keys["sasl_password_file"] = proc.password_source
    out.print(f"kafka: SASL_SSL, {proc.sasl_mechanism} user {proc.sasl_username!r}; CA certificate {proc.ssl_cafile}")
    if from_file:
        out.print(f"  password: in {proc.password_source} (kafka.sasl_password_file)")
    else:
        out.print("  password: $ROLLSTREAM_SASL_PASSWORD, the one given at this home's first SASL_SSL start")
    out.print("  run config: " + " ".join(f"--set kafka.{k}={shlex.quote(v)}" for k, v in keys.items()))
    out.print(f"  every command (topics, sql, run): source {env_path}"
              + ("" if from_file else "; export ROLLSTREAM_SASL_PASSWORD too"))


@stack_app.command("up")
@friendly
def stack_up(
    port: int = typer.Option(0, "--port", help="Broker port for a local Kafka (0 = a free port)."),
    sasl_ssl: bool = typer.Option(
        False, "--sasl-ssl",
        help="Give the local broker a SASL_SSL listener (SCRAM over TLS, with a CA and certificate made in "
             "<home>/kafka/tls) instead of PLAINTEXT; the SCRAM user is created at the home's first start.",
    ),
    sasl_user: str = typer.Option("rollstream", "--sasl-user", help="--sasl-ssl: the SCRAM user clients log in as."),
    sasl_mechanism: str = typer.Option("SCRAM-SHA-512", "--sasl-mechanism",
                                       help="--sasl-ssl: SCRAM-SHA-512 or SCRAM-SHA-256."),
    sasl_password_file: str = typer.Option(
        "", "--sasl-password-file",
        help="--sasl-ssl: file whose first line is the user's password (default: $ROLLSTREAM_SASL_PASSWORD, "
             "else a generated one in <home>/kafka/sasl.password). Read at the home's first start only.",
    ),
) -> None:
    """Start the local Kafka broker (unless --bootstrap points at a reachable one) and prepare the store."""
    from infra.kafka import broker as stack
    from runtime.probe import find_bootstrap

    explicit = find_bootstrap(opt("bootstrap"))  # the rule's steps before the local broker (no config here)
    if explicit:
        if sasl_ssl:
            raise UserError("--sasl-ssl starts a local broker; leave out --bootstrap / ROLLSTREAM_BOOTSTRAP")
        found = _probe(explicit, 10)
        if not found.ok:
            raise UserError(found.detail if found.fatal else
                            f"no Kafka broker answers at {explicit} (from --bootstrap / ROLLSTREAM_BOOTSTRAP)")
        out.print(f"kafka: using {explicit}")
    else:
        from infra.kafka.local_security import SaslSslOptions

        options = SaslSslOptions(sasl_user, sasl_mechanism, sasl_password_file) if sasl_ssl else None
        with console.status("resolving Kafka jars from Maven Central...") as status:
            stack.ensure_kafka_jars(progress=lambda m: status.update(m))
            status.update("starting the local Kafka broker...")
            proc, started = stack.start_local_kafka(home(), port=port or None, progress=lambda m: status.update(m),
                                                    sasl_ssl=options)
        word = "started" if started else "already running"
        out.print(f"kafka: {word} at {proc.bootstrap} (pid {proc.pid}, log {proc.log_path})")
        if proc.security_protocol == "SASL_SSL":
            _print_sasl(proc)
    ok, desc = _store_check(opt("store"))
    out.print(f"store: {desc}")
    if not ok:
        raise UserError("the store does not answer SELECT 1")


@stack_app.command("down")
@friendly
def stack_down() -> None:
    """Stop the local Kafka broker started by `stack up` (data and logs are kept)."""
    from infra.kafka import broker as stack

    stopped = stack.stop_local_kafka(home())
    out.print("kafka: stopped" if stopped else "kafka: no local broker was running")


@stack_app.command("status")
@friendly
def stack_status() -> None:
    """Print the bootstrap address and store DSN; exit 0 only when both answer."""
    from infra.kafka import broker as stack

    bootstrap = find_broker()
    found = _probe(bootstrap, 5) if bootstrap else None
    kafka_ok = bool(found and found.ok)
    state = "up" if kafka_ok else f"DOWN ({found.detail})" if found is not None and found.fatal else "DOWN"
    local = stack.local_kafka(home())
    kind = f" ({local.security_protocol})" if local is not None and local.bootstrap == bootstrap else ""
    out.print(f"kafka: {bootstrap or 'none (run `rollstream stack up`)'}{kind} — {state}")
    try:
        store_ok, desc = _store_check(opt("store"))
    except Exception as e:
        from schemas.config import redact_text

        store_ok, desc = False, redact_text(str(e))
    out.print(f"store: {desc} — {'up' if store_ok else 'DOWN'}")
    if not (kafka_ok and store_ok):
        raise typer.Exit(1)
