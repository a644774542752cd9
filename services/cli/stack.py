"""``rollstream stack up|down|status``: the local Kafka broker and the store."""

from __future__ import annotations

import typer

from services.cli.app import UserError, app, console, friendly, home, opt, out

stack_app = typer.Typer(help="The local stack: a Kafka broker (KRaft) and the embedded store.", no_args_is_help=True)
app.add_typer(stack_app, name="stack")


def _store_check(dsn: str | None) -> tuple[bool, str]:
    """Open the store (or an embedded probe store), apply DDL, ping. Returns (ok, description)."""
    from services import store as st

    if dsn:
        client = st.connect(dsn)
        st.apply_ddl(client)
        return st.ping(client), dsn
    probe = home() / "store-probe"
    client = st.connect(f"chdb://{probe}")
    st.apply_ddl(client)
    ver = client.query("SELECT version()").result_rows[0][0]
    return st.ping(client), f"embedded chDB (ClickHouse {ver}); each run records to runs/<run_id>/store"


@stack_app.command("up")
@friendly
def stack_up(
    port: int = typer.Option(0, "--port", help="Broker port for a local Kafka (0 = a free port)."),
) -> None:
    """Start the local Kafka broker (unless --bootstrap points at a reachable one) and prepare the store."""
    from services.kafka import broker as stack

    explicit = opt("bootstrap")
    if explicit:
        if not stack.kafka_reachable(explicit, timeout_s=10):
            raise UserError(f"no Kafka broker answers at {explicit} (from --bootstrap / ROLLSTREAM_BOOTSTRAP)")
        out.print(f"kafka: using {explicit}")
    else:
        with console.status("resolving Kafka jars from Maven Central...") as status:
            stack.ensure_kafka_jars(progress=lambda m: status.update(m))
            status.update("starting the local Kafka broker...")
            proc, started = stack.start_local_kafka(home(), port=port or None, progress=lambda m: status.update(m))
        word = "started" if started else "already running"
        out.print(f"kafka: {word} at {proc.bootstrap} (pid {proc.pid}, log {proc.log_path})")
    ok, desc = _store_check(opt("store"))
    out.print(f"store: {desc}")
    if not ok:
        raise UserError("the store does not answer SELECT 1")


@stack_app.command("down")
@friendly
def stack_down() -> None:
    """Stop the local Kafka broker started by `stack up` (data and logs are kept)."""
    from services.kafka import broker as stack

    stopped = stack.stop_local_kafka(home())
    out.print("kafka: stopped" if stopped else "kafka: no local broker was running")


@stack_app.command("status")
@friendly
def stack_status() -> None:
    """Print the bootstrap address and store DSN; exit 0 only when both answer."""
    from services.kafka import broker as stack

    bootstrap = stack.resolve_bootstrap(opt("bootstrap"), home())
    kafka_ok = bool(bootstrap) and stack.kafka_reachable(bootstrap or "", timeout_s=5)
    out.print(f"kafka: {bootstrap or 'none (run `rollstream stack up`)'} — {'up' if kafka_ok else 'DOWN'}")
    try:
        store_ok, desc = _store_check(opt("store"))
    except Exception as e:
        store_ok, desc = False, str(e)
    out.print(f"store: {desc} — {'up' if store_ok else 'DOWN'}")
    if not (kafka_ok and store_ok):
        raise typer.Exit(1)
