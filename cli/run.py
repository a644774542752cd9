"""``rollstream run`` (a whole run, ``--prepare-only`` or ``--dry-run``), ``rollstream resume RUN``
(the same run again, from where it stopped) and ``rollstream service NAME`` (one
service of a run in this process: the service's handler module, named by the table of services
:data:`schemas.services.SERVICES`, builds its settings and runs it)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import typer

from cli.app import (
    UserError,
    app,
    console,
    find_broker,
    friendly,
    home,
    log_to,
    opt,
    out,
    quiet_transformers,
    setup_logging,
)
from schemas.services import SERVICES


def read_config(path: Path, overrides: list[str]) -> Any:
    """The run config of ``path`` plus ``--set`` overrides; a missing file is a user error."""
    from schemas.config import parse_config

    if not path.exists():
        raise UserError(f"config file not found: {path}")
    if path.is_dir():
        raise UserError(f"config file {path} is a directory, not a YAML file")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"config file {path} cannot be read: {e.strerror if isinstance(e, OSError) else e}") from None
    if not text.strip() or all(not ln.strip() or ln.lstrip().startswith("#") for ln in text.splitlines()):
        raise UserError(f"config file {path} is empty (an empty mapping `{{}}` runs every default)")
    return parse_config(text, overrides, source=str(path))


def check_backends(cfg: Any, devices: bool = True) -> None:
    """Refuse, in one line and before anything starts, what cannot run here: a generation engine
    or training strategy (:func:`rollout.factory.check_engine`, :func:`trainer.factory.check_strategy`),
    a task source, verifier or source argument of ``data.domains`` that does not exist, a
    ``model.path`` that is not a model directory, a judge model that cannot judge
    (:func:`check_judges`), a device this machine lacks (``devices``: a service that uses no
    device skips that check, which imports torch), and an experiment tracker whose package is
    missing (:func:`store.tracking.check_trackers`)."""
    from rollout.factory import check_engine
    from store.tracking import check_trackers
    from trainer.factory import check_strategy

    check_engine(cfg)
    check_strategy(cfg)
    check_trackers(cfg)
    check_domains(cfg)
    check_model_path(cfg)
    if devices:
        check_devices(cfg)
    check_judges(cfg)  # last: it may load a judge's tokenizer (seconds)


def check_servers(cfg: Any) -> None:
    """A server engine's ``rollout.server_urls`` answer (:func:`rollout.factory.check_servers`):
    checked by ``run`` and ``resume`` before anything starts, not by ``service`` (a rollout worker
    retries a server that is down for ``rollout.server_down_s``)."""
    from rollout.factory import check_servers as check

    check(cfg)


def check_devices(cfg: Any) -> None:
    """``rollout.device`` / ``train.device`` exist on this machine (:func:`schemas.devices.placement`);
    so does ``judge.device`` when a domain has a judge."""
    from schemas.devices import placement, resolve_device

    placement(cfg)
    if any(d.judge for d in cfg.data.domains):
        resolve_device(cfg.judge.device, "judge.device")


def check_judges(cfg: Any) -> None:
    """Every judge a domain names can judge: its ``path`` is a model directory of its ``kind``
    (unless ``source`` converts one into it when the run is prepared), its tokenizer suits its
    ``chat_template`` and, for ``score: logprobs``, has one token per score label
    (:func:`launch.prepare.check_judge_model`). One line on refusal."""
    from launch.prepare import check_judge_model, used_judges
    from schemas.config import ConfigError

    for name, m in used_judges(cfg).items():
        try:
            check_judge_model(name, m)
        except ValueError as e:
            raise ConfigError(f"config: {e}") from None


def check_domains(cfg: Any) -> None:
    """Every domain's task source and verifier are registered and the source takes its kwargs."""
    import envs  # noqa: F401  (registers the built-in sources and verifiers)
    from envs.registry import SOURCES, VERIFIERS, is_episodic, load_plugins, make_source
    from schemas.config import ConfigError

    try:
        load_plugins(list(cfg.data.plugins))
    except ImportError as e:
        raise ConfigError(f"config: data.plugins: {e} (a module on sys.path or in the current directory)") from None
    for i, d in enumerate(cfg.data.domains):
        key = f"config: data.domains[{i}]"
        if d.source not in SOURCES:
            raise ConfigError(f"{key}.source={d.source!r} is not a task source; registered: {', '.join(sorted(SOURCES))}")
        if is_episodic(d.source) and (d.verifier or d.verifier_kwargs or d.answer != "raw" or d.format_reward):
            raise ConfigError(f"{key}: source {d.source!r} is a multi-turn environment, scored by its own step rewards; "
                              "remove verifier, verifier_kwargs, answer and format_reward from this domain")
        if is_episodic(d.source) and d.judge:
            raise ConfigError(f"{key}.judge={d.judge!r}: source {d.source!r} is a multi-turn environment, scored "
                              "by its own step rewards; remove judge from this domain")
        if d.verifier and d.verifier not in VERIFIERS:
            raise ConfigError(f"{key}.verifier={d.verifier!r} is not a verifier; registered: {', '.join(sorted(VERIFIERS))}")
        try:
            source = make_source(d.source, **d.kwargs)
        except (TypeError, ValueError, KeyError) as e:
            raise ConfigError(f"{key}.kwargs {d.kwargs} do not suit task source {d.source!r}: {e}") from None
        for line in getattr(source, "notices", ()):  # e.g. a file source's skipped bad rows
            console.print(f"warning: {key.removeprefix('config: ')}: {line}", markup=False)
        try:  # the trainer evaluates on it: a source too small for data.heldout_size fails here, not there
            source.heldout(cfg.data.heldout_size)
        except (ValueError, RuntimeError) as e:
            raise ConfigError(f"{key}: data.heldout_size={cfg.data.heldout_size} held-out prompts cannot be drawn "
                              f"from task source {d.source!r}: {e}") from None
    if cfg.rollout.history_turns is not None and not any(is_episodic(d.source) for d in cfg.data.domains):
        raise ConfigError(f"config: rollout.history_turns={cfg.rollout.history_turns} applies to multi-turn domains "
                          "and data.domains has none; remove it")


def model_dir_of(cfg: Any, run_dir: Path) -> Path:
    """The model directory of a run (see :func:`launch.prepare.model_dir_of`)."""
    from launch.prepare import model_dir_of as of

    return of(cfg, run_dir)


def check_model_path(cfg: Any) -> None:
    """``model.path``, when given, is a Hugging Face model directory (holds config.json)."""
    from schemas.config import ConfigError

    if not cfg.model.path:
        return
    path = Path(cfg.model.path)
    if cfg.model.source and not (path / "config.json").is_file():
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise ConfigError(f"config: model.path={str(path)!r} exists but holds no model, so model.source="
                              f"{cfg.model.source!r} cannot be converted into it; remove it or pick another path")
        return  # converted from model.source when the run is prepared
    if not path.exists():
        raise ConfigError(f"config: model.path={str(path)!r} does not exist (leave it empty to create a tiny model)")
    if not path.is_dir():
        raise ConfigError(f"config: model.path={str(path)!r} is a file, not a Hugging Face model directory")
    if not (path / "config.json").is_file():
        raise ConfigError(f"config: model.path={str(path)!r} is not a Hugging Face model directory (no config.json)")
    if cfg.model.chat_template is True:
        from rollout.model_init import load_tokenizer, use_chat_template

        try:
            use_chat_template(load_tokenizer(path), True)
        except ValueError as e:
            raise ConfigError(f"config: {e}") from None


def with_store(cfg: Any) -> Any:
    """``cfg`` with ``store.dsn`` set from ``--store`` / ``$ROLLSTREAM_STORE`` (checked) when given."""
    dsn = opt("store")
    if not dsn:
        return cfg
    import msgspec

    import store as st

    st.check_dsn(dsn)
    return msgspec.structs.replace(cfg, store=msgspec.structs.replace(cfg.store, dsn=dsn))


def bootstrap_for_run(cfg: Any) -> str:
    """The broker by :func:`runtime.probe.find_bootstrap` (--bootstrap / $ROLLSTREAM_BOOTSTRAP /
    kafka.bootstrap / the local broker of --home); the local one is started when it is not running."""
    from infra.kafka import broker as stack
    from runtime.probe import find_bootstrap

    explicit = find_bootstrap(opt("bootstrap"), cfg.kafka.bootstrap)  # every step of the rule but the last
    if explicit:
        if cfg.kafka.security_protocol == "PLAINTEXT" and not stack.kafka_reachable(explicit, timeout_s=10):
            raise UserError(f"no Kafka broker answers at {explicit}")
        return str(explicit)
    local = stack.local_bootstrap(home())  # the local broker, or the nodes of `stack up --brokers N`
    if local is not None and stack.kafka_reachable(local, timeout_s=5):
        return local
    with console.status("starting the local Kafka broker...") as status:
        stack.ensure_kafka_jars(progress=lambda m: status.update(m))
        proc, _ = stack.start_local_kafka(home(), progress=lambda m: status.update(m))
    console.print(f"kafka: started at {proc.bootstrap} (stop it with `rollstream stack down`)")
    return proc.bootstrap


@app.command("run")
@friendly
def run_cmd(
    config: Path = typer.Argument(..., help="Run config (YAML)."),
    set_: list[str] = typer.Option([], "--set", help="Override a config key: section.key=value (repeatable)."),
    run_id: str = typer.Option("", "--run-id", help="Run id (default: <run.name>-<timestamp>-<pid>)."),
    prepare_only: bool = typer.Option(
        False, "--prepare-only",
        help="Only prepare the run: create its topics, runs/<id>/config.yaml and the model (when "
             "model.path is empty), print the run id on stdout and exit; start no service. Then start "
             "each service with `rollstream service NAME --run ID` (e.g. one container each). Preparing "
             "the same run again with the same config changes nothing.",
    ),
    launcher: str = typer.Option(
        "local", "--launcher",
        help="How the services run: local (OS processes on this machine) or ray (Ray actors on a Ray cluster, "
             "placed by the config's placement section; needs pip install 'rollstream\\[ray]').",
    ),
    address: str = typer.Option(
        "", "--address",
        help="--launcher ray: the Ray cluster to join (e.g. head-node:6379, or ray://head-node:10001); default: "
             "$RAY_ADDRESS, else a local Ray instance started with this machine's CPUs and GPUs and stopped at the end.",
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run",
        help="Print the resolved config (the file plus --set) as YAML and run every check that comes before "
             "anything starts; create nothing (no run folder, topics or model) and start nothing.",
    ),
) -> None:
    """Run a whole training run: broker, topics, model, every service; live progress; summary.json; the trained model in runs/<id>/final.

    The config is checked first (keys, values, and that the generation engine and training strategy it names can run here): a bad one stops the command before anything starts. With --launcher ray, every service process is a Ray actor in one placement group of the run (bundles from the placement section), reserved before anything starts: a request the cluster's nodes cannot hold is refused in one line. The run directory must then be on storage every node sees at the same path. An interrupted run goes on with `rollstream resume RUN`.
    """
    from launch import supervisor
    from schemas.topics import check_run_id

    if dry_run and prepare_only:
        raise UserError("--dry-run creates nothing and --prepare-only prepares the run: give one of them")
    cfg = read_config(config, set_)
    check_launcher(cfg, launcher, address, prepare_only)
    check_backends(cfg)
    if not prepare_only:  # a prepared run's servers may come later, with its services
        check_servers(cfg)
    cfg = with_store(cfg)
    rid = check_run_id(run_id) if run_id else supervisor.new_run_id(cfg)
    if dry_run:
        dry_run_report(cfg, rid, given_id=bool(run_id))
        return
    launch_run(cfg, rid, launcher=launcher, address=address, prepare_only=prepare_only)


@app.command("resume")
@friendly
def resume_cmd(
    run: str = typer.Argument(..., help="Run id (`rollstream runs list` lists them)."),
    runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Directory of run folders."),
    launcher: str = typer.Option("local", "--launcher", help="local or ray, as for `rollstream run`."),
    address: str = typer.Option("", "--address", help="--launcher ray: the Ray cluster to join, as for `rollstream run`."),
) -> None:
    """Resume a run that ended before it finished (Ctrl-C, a failed service, a killed supervisor or machine).

    It runs again with its own config (runs/RUN/config.yaml): every service starts again and goes on from what is durable (the trainer from its latest checkpoint, re-running the recorded steps after it; docs/reliability.md), then the run finishes as `rollstream run` does. A finished run is left alone (one line says so); a running one is refused. `rollstream status RUN` exits 3 for a run this resumes.
    """
    import msgspec

    from launch import runs as rn
    from launch.prepare import RunError, load_run_config
    from launch.state import read_state
    from schemas.topics import check_run_id

    check_run_id(run)
    run_dir = runs_dir.resolve() / run
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"run {run} not found: no {runs_dir / run / 'config.yaml'} (`rollstream runs list` lists runs)")
    state = read_state(run_dir)
    now = rn.state_of(run_dir, state)
    if now in ("finished", "stopped"):
        out.print(f"run {run} already finished ({now}; {run_dir / 'summary.json'}): nothing to resume")
        return
    if now == "running":
        raise UserError(f"run {run} is running (supervisor pid {state and state.get('supervisor_pid')}); "
                        f"`rollstream status {run}` follows it")
    alive = rn.live_services(state)
    if alive:
        pids = ", ".join(f"{label} (pid {pid})" for label, pid in alive.items())
        raise UserError(f"run {run} still has service processes of its last start: {pids}; end them "
                        f"(kill PID) and resume again")
    try:
        cfg = load_run_config(str(runs_dir), run, [])
    except RunError as e:
        raise UserError(str(e)) from None
    if Path(cfg.run.runs_dir).resolve() != runs_dir.resolve():  # the folder moved: where it is now
        cfg = msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, runs_dir=str(runs_dir)))
    check_launcher(cfg, launcher, address, False)
    check_backends(cfg)
    check_servers(cfg)
    cfg = with_store(cfg)
    progress = (state or {}).get("progress") or {}
    console.print(f"resuming run {run} ({now} at step {progress.get('step', 0)}/{cfg.train.steps})")
    launch_run(cfg, run, launcher=launcher, address=address)


def dry_run_report(cfg: Any, rid: str, *, given_id: bool) -> None:
    """``run --dry-run``: the resolved config on stdout, what the run would use on stderr; refuses
    (one line) a run id that already finished and an explicit broker that does not answer."""
    from infra.kafka import broker as stack
    from launch.prepare import config_text
    from launch.runs import resume_command
    from runtime.probe import find_bootstrap
    from store.runs import run_dir_of, store_dsn_of

    run_dir = run_dir_of(cfg, rid)
    if (run_dir / "summary.json").exists():
        raise UserError(f"run {rid} already finished ({run_dir / 'summary.json'}); pick another --run-id")
    explicit = find_bootstrap(opt("bootstrap"), cfg.kafka.bootstrap)
    if explicit and cfg.kafka.security_protocol == "PLAINTEXT" and not stack.kafka_reachable(explicit, timeout_s=10):
        raise UserError(f"no Kafka broker answers at {explicit}")
    out.print(config_text(cfg), end="", markup=False, highlight=False)
    kafka = explicit or f"the local broker of {home()} (started by `rollstream run` when it is not running)"
    again = f"; it exists: this id resumes it ({resume_command(rid, cfg.run.runs_dir)})" if run_dir.exists() else ""
    console.print(f"dry run: the config passed every check; run id {rid}" + ("" if given_id else " (a new one each time)")
                  + f", run folder {run_dir}{again}; kafka {kafka}; store {store_dsn_of(cfg, rid)}; nothing was created")


def launch_run(cfg: Any, rid: str, *, launcher: str, address: str, prepare_only: bool = False) -> None:
    """Start (or resume) run ``rid`` of ``cfg`` with the launcher (the config is checked)."""
    from launch import supervisor

    cluster = None
    if launcher == "ray":  # placed and reserved before anything of the run starts
        from launch import ray_launcher

        try:
            cluster = ray_launcher.connect(cfg, address, console=console)
        except supervisor.RunError as e:
            raise UserError(str(e)) from None
    try:
        _run(cfg, rid, prepare_only, cluster)
    finally:
        if cluster is not None:
            cluster.close()


def check_launcher(cfg: Any, launcher: str, address: str, prepare_only: bool) -> None:
    """``--launcher`` is local or ray; ``--address`` and a non-default ``placement`` section go with
    ``--launcher ray`` only (the local launcher would not honour them); ``--prepare-only`` starts no
    service, so it takes no launcher; Ray is installed when asked for. One line on refusal."""
    from schemas.config import PlacementConfig

    if launcher not in ("local", "ray"):
        raise UserError(f"--launcher {launcher!r}: one of local, ray")
    if prepare_only and launcher != "local":
        raise UserError("--prepare-only starts no service, so it takes no --launcher; leave --launcher out")
    if launcher == "local":
        if address:
            raise UserError(f"--address {address!r} is for --launcher ray only; add --launcher ray or leave it out")
        if cfg.placement != PlacementConfig():
            raise UserError("the config's placement.* keys are used by --launcher ray only (the local launcher runs "
                            "every service on this machine); add --launcher ray or remove the placement section")
        return
    from launch.ray_launcher import require_ray
    from launch.supervisor import RunError

    try:
        require_ray()
    except RunError as e:
        raise UserError(str(e)) from None


def _run(cfg: Any, rid: str, prepare_only: bool, cluster: Any) -> None:
    import asyncio
    import json

    from launch import supervisor

    bootstrap = bootstrap_for_run(cfg)
    quiet_transformers()  # the model is created in this process

    def on_run_dir(run_dir: Path) -> None:
        log_to(run_dir / "logs" / "cli.log")

    try:
        if prepare_only:
            asyncio.run(supervisor.prepare_run(cfg, rid, bootstrap, console, on_run_dir=on_run_dir,
                                               allow_prepared=True))
            out.print(rid)
            return
        summary = asyncio.run(supervisor.run_supervised(
            cfg, rid, bootstrap, console, on_run_dir=on_run_dir,
            make_supervisor=cluster.supervisor if cluster is not None else None))
    except supervisor.RunError as e:
        raise UserError(str(e)) from None
    ev_ = summary["eval"]
    out.print(json.dumps({k: summary[k] for k in ("run_id", "steps", "wall_s", "samples", "throughput")}))
    out.print(f"held-out accuracy: init {ev_['init']['accuracy']}, start {ev_['start']['accuracy']}, "
              f"final {ev_['final']['accuracy']}")
    if "accuracy_sampled" in ev_["final"]:
        out.print(f"held-out sampled accuracy (train.eval_samples={cfg.train.eval_samples}): "
                  f"init {ev_['init'].get('accuracy_sampled')}, start {ev_['start'].get('accuracy_sampled')}, "
                  f"final {ev_['final']['accuracy_sampled']}")
    out.print(f"summary: {supervisor.run_dir_of(cfg, rid) / 'summary.json'}")
    if not cfg.store.record_live:
        out.print(f"record: none yet (store.record_live=false); `rollstream record {rid}` builds it from the "
                  "run's topics, here or on another machine that reaches the broker")
    if summary.get("final_model"):
        out.print(f"final model: {summary['final_model']}")


@app.command("service")
@friendly
def service_cmd(
    name: str = typer.Argument(..., help="One of: " + ", ".join(SERVICES) + " (env: an environment worker "
                               "for multi-turn domains; it idles in a single-turn run. judge: a judge worker "
                               "for domains with a judge (data.domains[].judge); it idles in a run without "
                               "one)."),
    run: str = typer.Option(..., "--run", help="Run id (its config is read from <runs-dir>/<run>/config.yaml)."),
    runs_dir: str = typer.Option("runs", "--runs-dir", help="Directory of run folders."),
    set_: list[str] = typer.Option([], "--set", help="Override a config key: section.key=value (repeatable)."),
    log_level: str = typer.Option("INFO", "--log-level", help="Logging level of the service's log (its stderr): "
                                  "DEBUG, INFO, WARNING or ERROR."),
) -> None:
    """Start one service of a run in this process (`rollstream run` starts them all, env only when a domain is multi-turn, judge only when a domain has a judge; `rollstream run --prepare-only` prepares a run for services started one by one).

    The service logs to stderr. A judge worker takes its label (part of its Kafka transactional id: give each of several judge workers its own) from ROLLSTREAM_SERVICE_LABEL, default judge. It records to / reads the store of --store / ROLLSTREAM_STORE when given (as `rollstream run` does), else store.dsn of the run's config, else <runs-dir>/<run>/store.
    """
    import os

    import msgspec

    from launch import supervisor
    from runtime import event_loop
    from runtime.probe import BOOTSTRAP_ENV, NO_BROKER
    from schemas.topics import check_run_id

    if name not in SERVICES:
        raise UserError(f"unknown service {name!r}; one of: {', '.join(SERVICES)}")
    check_run_id(run)
    level = logging.getLevelName(log_level.upper())
    if not isinstance(level, int):
        raise UserError(f"--log-level {log_level!r}: one of DEBUG, INFO, WARNING, ERROR")
    try:
        cfg = supervisor.load_run_config(runs_dir, run, set_)
    except supervisor.RunError as e:
        raise UserError(str(e)) from None
    # a service that runs no model uses no device: checking one would import torch
    # (about 1.7 s of CPU per process, at every start and restart)
    check_backends(cfg, devices=SERVICES[name].runs_model)
    cfg = with_store(cfg)
    # The broker by the one rule (the supervisor hands its own in $ROLLSTREAM_BOOTSTRAP), handed on to
    # this process's clients the same way; a configured address the rule overrode is replaced (the
    # config the service records is then the one it used), an empty one stays empty.
    bootstrap = find_broker(cfg.kafka.bootstrap)
    if bootstrap is None:
        raise UserError(NO_BROKER)
    os.environ[BOOTSTRAP_ENV] = bootstrap
    if cfg.kafka.bootstrap:
        cfg = msgspec.structs.replace(cfg, kafka=msgspec.structs.replace(cfg.kafka, bootstrap=bootstrap))
    # the run's folder is where its config was found (the default store lives there too)
    cfg = msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, runs_dir=runs_dir))
    setup_logging(debug=bool(opt("debug")), log_file=None, stderr_level=level)
    if not opt("debug"):
        logging.getLogger("aiokafka").setLevel(max(logging.WARNING, level))
    run_dir = Path(runs_dir).resolve() / run
    model_dir = str(model_dir_of(cfg, run_dir))
    event_loop.run(_run_service(name, cfg, run, run_dir, model_dir))  # uvloop's loop (runtime.event_loop)


async def _run_service(name: str, cfg: Any, run: str, run_dir: Path, model_dir: str) -> None:
    """Run service ``name`` of run ``run`` here until it finishes or SIGTERM/SIGINT: its handler
    module (:attr:`~schemas.services.ServiceSpec.handler`) builds its settings from a
    :class:`services.ServiceStart` (``settings_from``) and runs them (``run``)."""
    import asyncio
    import importlib
    import os
    import signal

    from launch.supervisor import LABEL_ENV
    from runtime.gc_tuning import tune_process
    from services import ServiceStart

    handler = importlib.import_module(SERVICES[name].handler)
    tune_process()  # this process runs one service: a collector for a stream of short-lived events
    start = ServiceStart(config=cfg, run_id=run, run_dir=run_dir, model_dir=model_dir,
                         label=os.environ.get(LABEL_ENV, "").strip())
    settings = handler.settings_from(start)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await handler.run(settings, stop)
