"""The ``rollstream`` command line (typer). It parses, sets up logging and calls library code.

User errors (bad config, unreachable broker, bad DSN, missing files) print one line
``error: ...`` and exit with status 1 — never a traceback. ``--debug`` shows tracebacks.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.console import Console

from schemas.config import ConfigError
from schemas.topics import BadRunId

app = typer.Typer(
    name="rollstream",
    help="Event-sourced streaming RL post-training over Kafka, recorded in ClickHouse.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
stack_app = typer.Typer(help="The local stack: a Kafka broker (KRaft) and the embedded store.", no_args_is_help=True)
topics_app = typer.Typer(help="Inspect a run's Kafka topics.", no_args_is_help=True)
app.add_typer(stack_app, name="stack")
app.add_typer(topics_app, name="topics")

console = Console(stderr=True, highlight=False, soft_wrap=True)
out = Console(highlight=False, soft_wrap=True)
F = TypeVar("F", bound=Callable[..., Any])


class UserError(RuntimeError):
    """A mistake the user can fix; printed as one line."""


def _user_error_types() -> tuple[type[BaseException], ...]:
    from services.store import StoreError

    types: list[type[BaseException]] = [UserError, ConfigError, StoreError, FileNotFoundError, BadRunId]
    try:
        from services.kafka.broker import StackError

        types.append(StackError)
    except ImportError:
        pass
    try:
        from services.kafka.bus import BusError

        types.append(BusError)
    except ImportError:
        pass
    return tuple(types)


def friendly(fn: F) -> F:
    """Turn user errors into one ``error:`` line and exit status 1 (``--debug`` re-raises)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except KeyboardInterrupt:
            console.print("[yellow]interrupted[/yellow]")
            raise typer.Exit(130) from None
        except _user_error_types() as e:
            if _state.get("debug"):
                raise
            msg = str(e) if not isinstance(e, FileNotFoundError) else f"file not found: {e.filename or e}"
            console.print(f"[red]error:[/red] {msg}", soft_wrap=True)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


_state: dict[str, Any] = {}


@app.callback()
def main_options(
    bootstrap: str = typer.Option(
        "", "--bootstrap", envvar="ROLLSTREAM_BOOTSTRAP", help="Kafka bootstrap host:port (default: the local broker)."
    ),
    store: str = typer.Option(
        "", "--store", envvar="ROLLSTREAM_STORE", help="Store DSN: chdb:///path or http(s)://host:8123."
    ),
    home: str = typer.Option(
        "", "--home", envvar="ROLLSTREAM_HOME", help="State directory of the local stack (default ./.rollstream)."
    ),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks and debug logs."),
) -> None:
    """Global options (also from ROLLSTREAM_BOOTSTRAP / ROLLSTREAM_STORE / ROLLSTREAM_HOME)."""
    _state.update(bootstrap=bootstrap or None, store=store or None, home=home or None, debug=debug)
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _home() -> Path:
    from services.kafka.broker import home_dir

    return home_dir(_state.get("home"))


# --------------------------------------------------------------------------- version


@app.command()
def version() -> None:
    """Print the versions of rollstream and the pieces it runs on."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as pkg_version

    def v(name: str) -> str:
        try:
            return pkg_version(name)
        except PackageNotFoundError:
            return "not installed"

    from services.kafka.broker import KAFKA_VERSION

    out.print(f"rollstream {v('rollstream')}")
    out.print(f"kafka (local broker) {KAFKA_VERSION}")
    for name in ("aiokafka", "msgspec", "clickhouse-connect", "chdb", "torch", "transformers"):
        out.print(f"{name} {v(name)}")


# --------------------------------------------------------------------------- stack


def _store_check(dsn: str | None) -> tuple[bool, str]:
    """Open the store (or an embedded probe store), apply DDL, ping. Returns (ok, description)."""
    from services import store as st

    if dsn:
        client = st.connect(dsn)
        st.apply_ddl(client)
        return st.ping(client), dsn
    probe = _home() / "store-probe"
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

    explicit = _state.get("bootstrap")
    if explicit:
        if not stack.kafka_reachable(explicit, timeout_s=10):
            raise UserError(f"no Kafka broker answers at {explicit} (from --bootstrap / ROLLSTREAM_BOOTSTRAP)")
        out.print(f"kafka: using {explicit}")
    else:
        with console.status("resolving Kafka jars from Maven Central...") as status:
            stack.ensure_kafka_jars(progress=lambda m: status.update(m))
            status.update("starting the local Kafka broker...")
            proc, started = stack.start_local_kafka(_home(), port=port or None, progress=lambda m: status.update(m))
        word = "started" if started else "already running"
        out.print(f"kafka: {word} at {proc.bootstrap} (pid {proc.pid}, log {proc.log_path})")
    ok, desc = _store_check(_state.get("store"))
    out.print(f"store: {desc}")
    if not ok:
        raise UserError("the store does not answer SELECT 1")


@stack_app.command("down")
@friendly
def stack_down() -> None:
    """Stop the local Kafka broker started by `stack up` (data and logs are kept)."""
    from services.kafka import broker as stack

    stopped = stack.stop_local_kafka(_home())
    out.print("kafka: stopped" if stopped else "kafka: no local broker was running")


@stack_app.command("status")
@friendly
def stack_status() -> None:
    """Print the bootstrap address and store DSN; exit 0 only when both answer."""
    from services.kafka import broker as stack

    bootstrap = stack.resolve_bootstrap(_state.get("bootstrap"), _home())
    kafka_ok = bool(bootstrap) and stack.kafka_reachable(bootstrap or "", timeout_s=5)
    out.print(f"kafka: {bootstrap or 'none (run `rollstream stack up`)'} — {'up' if kafka_ok else 'DOWN'}")
    try:
        store_ok, desc = _store_check(_state.get("store"))
    except Exception as e:
        store_ok, desc = False, str(e)
    out.print(f"store: {desc} — {'up' if store_ok else 'DOWN'}")
    if not (kafka_ok and store_ok):
        raise typer.Exit(1)


# --------------------------------------------------------------------------- topics


def _kafka_settings() -> Any:
    from schemas.config import KafkaSettings

    return KafkaSettings()


def _bootstrap_or_fail() -> str:
    from services.kafka import broker as stack

    bootstrap = stack.resolve_bootstrap(_state.get("bootstrap"), _home())
    if not bootstrap:
        raise UserError("no Kafka broker: run `rollstream stack up` or pass --bootstrap HOST:PORT")
    return bootstrap


async def _topics_list(bootstrap: str, run: str | None) -> list[tuple[str, list[str]]]:
    from services.kafka.bus import TopicAdmin

    async with TopicAdmin(_kafka_settings(), bootstrap) as admin:
        runs = [run] if run else await admin.list_runs()
        return [(r, await admin.run_topics(r)) for r in runs]


async def _topics_describe(bootstrap: str, run: str) -> list[tuple[str, str, int, str, int]]:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from services.kafka.bus import TopicAdmin, kafka_kwargs

    settings = _kafka_settings()
    async with TopicAdmin(settings, bootstrap) as admin:
        infos = await admin.describe(run)
    if not infos:
        raise UserError(f"run {run!r} has no topics on {bootstrap} (see `rollstream topics list`)")
    consumer = AIOKafkaConsumer(**kafka_kwargs(settings, bootstrap, client_suffix="cli"))
    await consumer.start()
    try:
        tps = [TopicPartition(i.topic, p) for i in infos.values() for p in range(i.partitions)]
        begin = await consumer.beginning_offsets(tps)
        end = await consumer.end_offsets(tps)
    finally:
        await consumer.stop()
    rows = []
    for name, info in infos.items():
        n = sum(end[tp] - begin[tp] for tp in tps if tp.topic == info.topic)
        rows.append((name, info.topic, info.partitions, info.configs.get("cleanup.policy", "delete"), n))
    return rows


@topics_app.command("list")
@friendly
def topics_list(run: str = typer.Argument(None, help="Only this run.")) -> None:
    """List runs that have topics on the broker, with their topics."""
    import asyncio

    from schemas.topics import check_run_id

    if run:
        check_run_id(run)
    found = asyncio.run(_topics_list(_bootstrap_or_fail(), run))
    if not found:
        out.print("no runs on this broker")
    for r, topics in found:
        out.print(f"{r}: {len(topics)} topics")
        for t in topics:
            out.print(f"  {t}")


@topics_app.command("describe")
@friendly
def topics_describe(run: str = typer.Argument(..., help="Run id.")) -> None:
    """Partitions, cleanup policy and message counts of a run's topics."""
    import asyncio

    from rich.table import Table

    from schemas.topics import check_run_id

    check_run_id(run)
    rows = asyncio.run(_topics_describe(_bootstrap_or_fail(), run))
    table = Table(title=f"topics of run {run}")
    for col in ("name", "topic", "partitions", "cleanup", "messages"):
        table.add_column(col)
    for row in rows:
        table.add_row(*(str(c) for c in row))
    out.print(table)


# --------------------------------------------------------------------------- runs


def _read_config(path: Path, overrides: list[str]) -> Any:
    from schemas.config import parse_config

    if not path.exists():
        raise UserError(f"config file not found: {path}")
    return parse_config(path.read_text(), overrides, source=str(path))


def _bootstrap_for_run(cfg: Any) -> str:
    """--bootstrap / kafka.bootstrap / $ROLLSTREAM_BOOTSTRAP / the local broker (started if missing)."""
    from services.kafka import broker as stack

    explicit = _state.get("bootstrap") or cfg.kafka.bootstrap
    if explicit:
        if cfg.kafka.security_protocol == "PLAINTEXT" and not stack.kafka_reachable(explicit, timeout_s=10):
            raise UserError(f"no Kafka broker answers at {explicit}")
        return str(explicit)
    local = stack.local_kafka(_home())
    if local is not None and stack.kafka_reachable(local.bootstrap, timeout_s=5):
        return local.bootstrap
    with console.status("starting the local Kafka broker...") as status:
        stack.ensure_kafka_jars(progress=lambda m: status.update(m))
        proc, _ = stack.start_local_kafka(_home(), progress=lambda m: status.update(m))
    console.print(f"kafka: started at {proc.bootstrap} (stop it with `rollstream stack down`)")
    return proc.bootstrap


@app.command("run")
@friendly
def run_cmd(
    config: Path = typer.Argument(..., help="Run config (YAML)."),
    set_: list[str] = typer.Option([], "--set", help="Override a config key: section.key=value (repeatable)."),
    run_id: str = typer.Option("", "--run-id", help="Run id (default: <run.name>-<timestamp>)."),
) -> None:
    """Run a whole training run: broker, topics, model, every service; live progress; summary.json."""
    import asyncio
    import json

    from schemas.topics import check_run_id
    from services.launch import supervisor

    cfg = _read_config(config, set_)
    rid = check_run_id(run_id) if run_id else supervisor.new_run_id(cfg)
    if _state.get("store"):
        import msgspec

        cfg = msgspec.structs.replace(cfg, store=msgspec.structs.replace(cfg.store, dsn=_state["store"]))
    bootstrap = _bootstrap_for_run(cfg)
    try:
        summary = asyncio.run(supervisor.run_supervised(cfg, rid, bootstrap, console))
    except supervisor.RunError as e:
        raise UserError(str(e)) from None
    ev_ = summary["eval"]
    out.print(json.dumps({k: summary[k] for k in ("run_id", "steps", "wall_s", "samples", "throughput")}))
    out.print(f"held-out accuracy: init {ev_['init']['accuracy']}, start {ev_['start']['accuracy']}, "
              f"final {ev_['final']['accuracy']}")
    out.print(f"summary: {supervisor.run_dir_of(cfg, rid) / 'summary.json'}")


SERVICES = ("feeder", "rollout", "reward", "trainer", "recorder")


@app.command("service")
@friendly
def service_cmd(
    name: str = typer.Argument(..., help="One of: " + ", ".join(SERVICES)),
    run: str = typer.Option(..., "--run", help="Run id (its config is read from <runs-dir>/<run>/config.yaml)."),
    runs_dir: str = typer.Option("runs", "--runs-dir", help="Directory of run folders."),
    set_: list[str] = typer.Option([], "--set", help="Override a config key: section.key=value (repeatable)."),
    log_level: str = typer.Option("INFO", "--log-level", help="Python logging level."),
) -> None:
    """Start one service of a run in this process (`rollstream run` starts them all)."""
    import asyncio

    from schemas.topics import check_run_id
    from services.launch import supervisor

    if name not in SERVICES:
        raise UserError(f"unknown service {name!r}; one of: {', '.join(SERVICES)}")
    check_run_id(run)
    logging.getLogger().setLevel(log_level.upper())
    logging.getLogger("rollstream").setLevel(log_level.upper())
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        cfg = supervisor.load_run_config(runs_dir, run, set_)
    except supervisor.RunError as e:
        raise UserError(str(e)) from None
    run_dir = Path(runs_dir).resolve() / run
    model_dir = str(Path(cfg.model.path) if cfg.model.path else run_dir / "model")
    asyncio.run(_run_service(name, cfg, run, run_dir, model_dir))


async def _run_service(name: str, cfg: Any, run: str, run_dir: Path, model_dir: str) -> None:
    import asyncio
    import signal

    from services.launch import supervisor

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if name == "feeder":
        from services import feeder

        n = await feeder.run(feeder.FeederSettings(run_id=run, config=cfg), stop)
        logging.getLogger("rollstream").info("feeder: issued %d tasks", n)
    elif name == "rollout":
        from services import rollout_worker

        await rollout_worker.run(rollout_worker.RolloutSettings(run_id=run, config=cfg, model_dir=model_dir), stop)
    elif name == "reward":
        from services import reward_router as reward

        await reward.run(reward.RewardSettings(run_id=run, config=cfg), stop)
    elif name == "trainer":
        from services import trainer_service

        await trainer_service.run(trainer_service.TrainerSettings(
            run_id=run, config=cfg, model_dir=model_dir, run_dir=str(run_dir)), stop)
    elif name == "recorder":
        from services import recorder

        await recorder.run(recorder.RecorderSettings(
            run_id=run, dsn=supervisor.store_dsn_of(cfg, run), kafka=cfg.kafka, stop_when_finished=True,
            batch_max_records=cfg.store.batch_max_records, lag_report_every_s=cfg.store.lag_report_every_s), stop)


@app.command("init-model")
@friendly
def init_model(
    out_dir: Path = typer.Argument(..., help="Directory to create (Hugging Face format)."),
    set_: list[str] = typer.Option([], "--set", help="Model shape: hidden_size=, num_layers=, ... (repeatable)."),
    seed: int = typer.Option(0, "--seed", help="Initialisation seed."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing model directory."),
) -> None:
    """Create a tiny causal LM (Llama architecture, own tokenizer, safetensors). Nothing is downloaded."""
    from schemas.config import TinyModelSpec, parse_raw

    if (out_dir / "config.json").exists() and not force:
        raise UserError(f"{out_dir} already holds a model (use --force to overwrite)")
    spec = parse_raw({}, set_, root=TinyModelSpec)
    from rollout.model_init import count_parameters, init_tiny_model, load_model

    path = init_tiny_model(out_dir, spec, seed=seed)
    n = count_parameters(load_model(path))
    out.print(f"created {path} ({n / 1e6:.2f}M parameters)")


def _latest_run(runs_dir: Path) -> str:
    runs = sorted((p for p in runs_dir.glob("*/config.yaml")), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise UserError(f"no runs in {runs_dir}")
    return runs[-1].parent.name


@app.command("sql")
@friendly
def sql_cmd(
    query: str = typer.Argument(..., help="SQL (ClickHouse dialect), or - to read it from stdin; {name:Type} "
                                "placeholders take --param. A query starting with a -- comment goes after --."),
    run: str = typer.Option("", "--run", help="Run whose embedded store to query (default: the latest run)."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Directory of run folders."),
    fmt: str = typer.Option("table", "--format", help="table, csv or json."),
    param: list[str] = typer.Option([], "--param", help="Query parameter name=value (repeatable)."),
    write: bool = typer.Option(False, "--write", help="Allow statements that change data."),
) -> None:
    """Query the record of a run (tables: events, samples, episodes, train_steps, evals, weights, dlq, ...;
    docs/analytics.md). Works during a run too: the run's recorder answers read-only queries."""
    import contextlib
    import csv
    import json

    from rich.table import Table

    from services import store as st
    from services.store.server import check_read_only

    if fmt not in ("table", "csv", "json"):
        raise UserError(f"--format {fmt!r}: one of table, csv, json")
    if query == "-":
        query = sys.stdin.read()
        if not query.strip():
            raise UserError("no query on stdin")
    why = None if write else check_read_only(query)
    if why is not None:
        raise UserError(f"{why} without --write")
    params = {}
    for p in param:
        k, sep, v = p.partition("=")
        if not sep:
            raise UserError(f"--param {p!r}: expected name=value")
        params[k] = v
    dsn = _state.get("store")
    if not dsn:
        rid = run or _latest_run(runs_dir)
        dsn = st.default_dsn(runs_dir, rid)
        if not Path(st.chdb_path(dsn)).exists():
            raise UserError(f"run {rid} has no store at {st.chdb_path(dsn)}")
    # reads go through the running recorder when it holds the store; writes need the store itself
    client = st.connect(dsn) if write else st.connect_reader(dsn)
    served = getattr(client, "served", False)
    settings = {} if write or served else {"readonly": 2}
    if not write:
        query = query.rstrip().rstrip(";")  # the client appends SETTINGS/FORMAT clauses
    waiting = console.status("running the query...") if console.is_terminal else contextlib.nullcontext()
    try:
        with waiting:
            result = client.query(query, parameters=params or None, settings=settings)
    except Exception as e:
        text = str(e).strip()
        raise UserError(f"query failed: {text.splitlines()[0][:400] if text else type(e).__name__}") from None
    cols, rows = list(result.column_names), result.result_rows
    if fmt == "json":
        out.print(json.dumps([dict(zip(cols, r, strict=True)) for r in rows], default=str))
    elif fmt == "csv":
        w = csv.writer(sys.stdout)
        w.writerow(cols)
        w.writerows(rows)
    else:
        table = Table()
        for c in cols:
            table.add_column(c)
        for r in rows:
            table.add_row(*(str(v) for v in r))
        out.print(table)


@app.command("report")
@friendly
def report(
    run: str = typer.Argument(..., help="Run id."),
    run2: str = typer.Argument(None, help="A second run to overlay on the first."),
    out_dir: Path = typer.Option(None, "--out", help="Output directory (default runs/<run>/report/)."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Directory of run folders."),
) -> None:
    """Plots and a self-contained index.html from a run's record (two runs: overlaid curves)."""
    from services import report as rp

    run_ids = [run] + ([run2] if run2 else [])
    if run2 and run2 == run:
        raise UserError("give two different runs to compare")
    dest = out_dir or rp.default_out_dir(run_ids, runs_dir)
    try:
        with console.status(f"reading the record of {', '.join(run_ids)}...") as status:
            runs = rp.load_runs(run_ids, runs_dir, _state.get("store"), progress=status.update)
            index = rp.write_report(runs, dest, progress=lambda m: status.update(m))
    except rp.ReportError as e:
        raise UserError(str(e)) from None
    for r in runs:
        out.print(f"{r['run_id']}: {len(r['train_steps'])} train steps, {len(r['evals'])} evals, "
                  f"{sum(r['status'].values())} samples")
    out.print(f"report: {index}")


@app.command("replay")
@friendly
def replay_cmd(
    run: str = typer.Argument(..., help="The recorded run."),
    into: str = typer.Option("", "--into", help="Re-publish the record into this new run's topics."),
    rescore: bool = typer.Option(False, "--rescore", help="Re-run the verifiers with the changed config; "
                                 "report how rewards and advantages would change."),
    train_step: int | None = typer.Option(None, "--train-step", help="Recompute training step N from the record "
                                          "and the checkpoint it started from; print loss and gradient norm "
                                          "beside the recorded ones."),
    from_step: int | None = typer.Option(None, "--from-step", help="First training step of the slice."),
    to_step: int | None = typer.Option(None, "--to-step", help="Last training step of the slice (inclusive)."),
    topics: str = typer.Option("", "--topics", help="--into: comma-separated topics (default: all), "
                               "e.g. generations or tasks,generations."),
    set_: list[str] = typer.Option([], "--set", help="Override the run's recorded config: section.key=value "
                                   "(repeatable)."),
    fmt: str = typer.Option("table", "--format", help="table or json."),
    examples: int = typer.Option(5, "--examples", help="--rescore: changed samples to show."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Directory of run folders."),
) -> None:
    """Replay a run's record: re-publish a slice into a new run (--into), re-score it (--rescore), or
    recompute one training step (--train-step N)."""
    import asyncio
    import json

    from services import replay as rp

    modes = [m for m, on in (("--into", bool(into)), ("--rescore", rescore), ("--train-step", train_step is not None))
             if on]
    if len(modes) != 1:
        raise UserError("give one of --into NEW_RUN (re-publish), --rescore (re-score) or --train-step N "
                        f"(recompute a step){'; got ' + ' and '.join(modes) if modes else ''}")
    if fmt not in ("table", "json"):
        raise UserError(f"--format {fmt!r}: one of table, json")
    if rescore and topics:
        raise UserError("--topics applies to --into only (--rescore reads the scored samples)")
    if examples < 0:
        raise UserError(f"--examples {examples}: must be >= 0")
    if train_step is not None:
        _replay_train_step(run, train_step, runs_dir, fmt, set_, topics, from_step, to_step)
        return
    if not _state.get("debug"):
        logging.getLogger("aiokafka").setLevel(logging.ERROR)  # metadata retries right after topic creation
    settings = rp.ReplaySettings(
        run_id=run, runs_dir=str(runs_dir), store=_state.get("store") or "", from_step=from_step,
        to_step=to_step, overrides=list(set_), into=into, topics=rp.parse_topics(topics),
        bootstrap=_state.get("bootstrap") or "",
    )
    try:
        rp.check_settings(settings)
        with console.status(f"reading the record of {run}...") as status:
            if rescore:
                report = rp.rescore(settings, progress=status.update, examples=examples)
            else:
                summary = asyncio.run(rp.replay_into(settings, progress=status.update))
    except rp.ReplayError as e:
        raise UserError(str(e)) from None
    if rescore:
        if fmt == "json":
            out.print(json.dumps(report), soft_wrap=True)
        else:
            for line in rp.rescore_lines(report):
                out.print(line, markup=False)
        return
    if summary.config_note:
        console.print(f"[yellow]warning:[/yellow] {summary.config_note}")
    if fmt == "json":
        out.print(json.dumps(summary.to_dict()), soft_wrap=True)
    else:
        out.print(rp.into_table(summary))
        out.print(f"config: {summary.config_path}")


def _replay_train_step(run: str, step: int, runs_dir: Path, fmt: str, set_: list[str], topics: str,
                       from_step: int | None, to_step: int | None) -> None:
    import json

    from rich.table import Table

    from services.launch.supervisor import load_run_config
    from services.replay import step as rs

    if set_ or topics or from_step is not None or to_step is not None:
        raise UserError("--train-step recomputes the step exactly as recorded: it takes no --set, --topics, "
                        "--from-step or --to-step")
    if not (runs_dir / run / "config.yaml").exists():
        raise UserError(f"run {run} not found: no {runs_dir / run / 'config.yaml'}")
    cfg = load_run_config(str(runs_dir), run, [])
    try:
        with console.status(f"replaying step {step} of {run}...") as status:
            res = rs.replay_train_step(cfg, run, step, dsn=_state.get("store") or "", progress=status.update)
    except rs.ReplayError as e:
        raise UserError(str(e)) from None
    if fmt == "json":
        out.print(json.dumps({"run_id": run, "step": res.step, "from_checkpoint": res.from_checkpoint,
                              "max_abs_diff": res.max_abs_diff,
                              "metrics": [{"metric": k, "recorded": a, "replayed": b, "abs_diff": d}
                                          for k, a, b, d in res.rows]}), soft_wrap=True)
        return
    table = Table(title=f"{run}: step {res.step} recomputed from the checkpoint of step {res.from_checkpoint}")
    for col in ("metric", "recorded", "replayed", "|difference|"):
        table.add_column(col, justify="left" if col == "metric" else "right")

    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.9g}"

    for key, a, b, d in res.rows:
        table.add_row(key, num(a), num(b), "-" if d is None else f"{d:.2e}")
    out.print(table)
    out.print(f"max |difference| {res.max_abs_diff:.2e} over {sum(d is not None for *_, d in res.rows)} metrics")


def main() -> None:
    """Console-script entry point."""
    # quiet third-party progress bars and info chatter (services log to files)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if os.environ.get("ROLLSTREAM_DEBUG"):
        _state["debug"] = True
    app(prog_name="rollstream")
    sys.exit(0)


if __name__ == "__main__":  # `python -m services.cli` (how `rollstream run` starts services)
    main()
