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
    from_dir: str = typer.Option(
        "", "--from",
        help="A bundle written by `rollstream stack bundle DIR`: unpack its Java runtime and Kafka jars into the "
             "cache ($ROLLSTREAM_CACHE) first, so that nothing is downloaded (an offline node).",
    ),
    brokers: int = typer.Option(
        1, "--brokers",
        help="Brokers of the local Kafka: 1, or a local KRaft cluster of N broker+controller JVMs on this machine "
             "(their quorum: the N controllers; 512 MiB of heap each, more with many partitions). With 3 or more, a run's topics get "
             "3 replicas and min.insync.replicas 2. PLAINTEXT, free ports chosen at the first start and kept.",
    ),
) -> None:
    """Start the local Kafka broker, or a local cluster (--brokers N), unless --bootstrap points at a reachable one; prepare the store."""
    from infra.kafka import broker as stack
    from runtime.probe import find_bootstrap

    explicit = find_bootstrap(opt("bootstrap"))  # the rule's steps before the local broker (no config here)
    if from_dir:
        from pathlib import Path

        from infra.kafka.bundle import install_bundle

        if explicit:
            raise UserError("--from unpacks a bundle for a local broker; leave out --bootstrap / ROLLSTREAM_BOOTSTRAP")
        with console.status("unpacking the bundle...") as status:
            manifest = install_bundle(Path(from_dir), progress=lambda m: status.update(m))
        out.print(f"bundle: {from_dir} unpacked (Java {manifest.get('java_version')}, {manifest.get('jars')} jars)")
    if brokers != 1 and (sasl_ssl or port):
        raise UserError(f"--brokers {brokers} starts a PLAINTEXT cluster on ports of its own; leave out "
                        f"{'--sasl-ssl' if sasl_ssl else '--port'}")
    if explicit:
        if sasl_ssl or brokers != 1:
            raise UserError(f"{'--sasl-ssl' if sasl_ssl else '--brokers'} starts a local broker; leave out "
                            "--bootstrap / ROLLSTREAM_BOOTSTRAP")
            raise UserError("--sasl-ssl starts a local broker; leave out --bootstrap / ROLLSTREAM_BOOTSTRAP")
        found = _probe(explicit, 10)
        if not found.ok:
            raise UserError(found.detail if found.fatal else
                            f"no Kafka broker answers at {explicit} (from --bootstrap / ROLLSTREAM_BOOTSTRAP)")
        out.print(f"kafka: using {explicit}")
    elif brokers != 1:
        from infra.kafka import cluster as kc

        with console.status(f"starting a local Kafka cluster of {brokers} brokers...") as status:
            cl, launched = kc.start_cluster(home(), brokers, progress=lambda m: status.update(m))
        word = f"started (brokers {', '.join(map(str, launched))})" if launched else "already running"
        out.print(f"kafka: a cluster of {brokers} brokers {word} at {cl.bootstrap}")
        for line in kc.describe(cl):
            out.print(f"  {line}", markup=False, highlight=False)
    else:
        from infra.kafka.local_security import SaslSslOptions

        options = SaslSslOptions(sasl_user, sasl_mechanism, sasl_password_file) if sasl_ssl else None
        with console.status("resolving the Kafka jars...") as status:
            stack.ensure_kafka_jars(progress=lambda m: status.update(m))
            status.update("starting the local Kafka broker...")
            proc, started = stack.start_local_kafka(home(), port=port or None, progress=lambda m: status.update(m),
                                                    sasl_ssl=options)
        word = "started" if started else "already running"
        out.print(f"kafka: {word} at {proc.bootstrap} (pid {proc.pid}, log {proc.log_path})")
        partitions = stack.partitions_in(proc.data_dir)
        if started and stack.heap_mb(partitions) > stack.HEAP_MB:
            out.print(f"kafka: {partitions} partitions to load, heap up to {stack.heap_mb(partitions)} MB (every earlier "
                      "run's topics stay until `rollstream runs rm RUN`)")
        if proc.security_protocol == "SASL_SSL":
            _print_sasl(proc)
    ok, desc = _store_check(opt("store"))
    out.print(f"store: {desc}")
    if not ok:
        raise UserError("the store does not answer SELECT 1")


@stack_app.command("down")
@friendly
def stack_down() -> None:
    """Stop the local Kafka broker, or every broker of the local cluster, started by `stack up` (data and logs are kept)."""
    from infra.kafka import broker as stack
    from infra.kafka.cluster import stop_cluster

    stopped = stack.stop_local_kafka(home())
    nodes = stop_cluster(home())
    if nodes:
        out.print(f"kafka: stopped brokers {', '.join(map(str, nodes))} of the local cluster")
    elif stopped:
        out.print("kafka: stopped")
    else:
        out.print("kafka: no local broker was running")


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
    from infra.kafka.cluster import local_cluster

    cluster = local_cluster(home())
    if cluster is not None and local is None:  # each broker of the local cluster
        for node in cluster.nodes:
            up = node.process is not None and _probe(node.bootstrap, 3).ok
            out.print(f"  broker {node.node_id}: {node.bootstrap} "
                      + (f"pid {node.process.pid} — {'up' if up else 'DOWN'}" if node.process else "— stopped"))
    try:
        store_ok, desc = _store_check(opt("store"))
    except Exception as e:
        from schemas.config import redact_text

        store_ok, desc = False, redact_text(str(e))
    out.print(f"store: {desc} — {'up' if store_ok else 'DOWN'}")
    if not (kafka_ok and store_ok):
        raise typer.Exit(1)


@stack_app.command("bundle")
@friendly
def stack_bundle(
    out_dir: str = typer.Argument(..., help="A new (or empty) directory to write the bundle into."),
    jdk: str = typer.Option("", "--jdk", help="The JDK home to jlink the runtime from (default: the Java that runs "
                                              "the broker here)."),
    wheels: bool = typer.Option(True, "--wheels/--no-wheels",
                                help="Also download the wheels a plain PyTorch image lacks (from PyPI)."),
) -> None:
    """Write what an offline Linux x86-64 node needs for `stack up --from DIR`: a jlink'd Java runtime, the
    broker's jars trimmed, our wheels (infra/kafka/README.md, "A stack that travels")."""
    from pathlib import Path

    from infra.kafka.bundle import write_bundle

    with console.status("writing the bundle...") as status:
        manifest = write_bundle(Path(out_dir), progress=lambda m: status.update(m), jdk=Path(jdk) if jdk else None,
                                wheels=wheels)
    files = manifest["files"]
    assert isinstance(files, dict)
    for name, size in files.items():
        out.print(f"  {size / 2**20:7.2f} MiB  {name}", markup=False, highlight=False)
    total = manifest["total_bytes"]
    assert isinstance(total, int)
    out.print(f"bundle: {out_dir}, {total / 2**20:.1f} MiB (Java {manifest['java_version']} by {manifest['runtime']}, "
              f"{manifest['jars']} jars); on the node: pip install --no-deps {out_dir}/wheels/*.whl, then "
              f"rollstream stack up --from {out_dir}")
