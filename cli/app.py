"""The typer app, its global options, logging, and the one-line error convention.

* **Errors.** A user error (bad config, unreachable broker, bad DSN, missing file, a backend that
  is not available) prints one line ``error: ...`` on stderr and exits 1; a command-line usage
  error prints one line and exits 2; an unexpected exception prints one line naming the log file
  that holds its traceback and exits 1. ``--debug`` (or ``$ROLLSTREAM_DEBUG``) shows tracebacks.
* **Logging.** Library loggers (aiokafka, clickhouse_connect, urllib3, transformers) and Python
  warnings never reach the terminal unless ``--debug``: everything logged in the CLI process
  goes to a log file, ``<home>/logs/cli.log`` (home: ``--home`` / ``$ROLLSTREAM_HOME`` /
  ``./.rollstream``), and for ``rollstream run`` to ``runs/<run_id>/logs/cli.log`` once the run
  directory exists. With ``--debug`` it also goes to stderr. ``rollstream service`` is the
  exception: a service's log is its stderr (the supervisor writes it to
  ``runs/<run_id>/logs/<service>.log``; a container runtime keeps it).
* **Global options** (``--bootstrap``, ``--store``, ``--home``, ``--debug``: the parameters of
  :func:`main_options`) go before or after the command: :class:`Commands`, the app's group class,
  gives every command and command group below it a copy of each (in its help's "Global options"
  panel) whose callback sets the same value. A command added anywhere (``@app.command``, a
  sub-app's command) gets them with no code of its own.
* **Help** shows no type for a flag (typer 0.29 prints ``<bool>`` after every flag:
  :func:`_flags_take_no_metavar`).
* **A closed stdout** (``rollstream sql ... | head``) ends the command quietly: exit status 1 and
  nothing on stderr, as rich's consoles do (:func:`main`).
"""

from __future__ import annotations

import functools
import logging
import logging.handlers
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup, TyperOption

from schemas.config import ConfigError, redact_text
from schemas.errors import one_line
from schemas.topics import BadRunId

GLOBAL_PANEL = "Global options (before or after the command)"


class Commands(TyperGroup):
    """The app's command group: every command (and group) below it also takes the global options
    (the group's own parameters) after its name, as copies that set the same values."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        copies = [_after_command(p) for p in self.params if isinstance(p, TyperOption)]
        todo = list(self.commands.values())
        while todo:
            cmd = todo.pop()
            taken = {o for p in cmd.params for o in p.opts}
            cmd.params.extend(c for c in copies if not set(c.opts) & taken)
            todo += list(getattr(cmd, "commands", {}).values())


def _after_command(param: TyperOption) -> TyperOption:
    """A copy of a global option for the commands: no default, no environment variable (those
    are the group's), and a callback that sets the value when the option is given."""
    import copy

    key = param.name or ""
    late = copy.copy(param)
    late.name = f"global_{key}"
    late.default, late.envvar, late.show_envvar, late.expose_value = None, None, False, False
    late.rich_help_panel = GLOBAL_PANEL
    late.help = (param.help or "").split(". ")[0].rstrip(".") + " (global option)."

    def given(_ctx: Any, _param: Any, value: Any) -> None:
        if value:  # None when not given; a flag is only ever turned on
            _set_globals(**{key.rstrip("_"): value})

    late.callback = given
    return late


def _flags_take_no_metavar() -> None:
    """typer's rich help shows an option's type after it, a flag's too (``--debug <bool>``,
    ``--help <bool>``); a flag takes no value: show nothing."""
    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "_no_flag_types", False):
        return

    def display_type_rich(self: TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag or self.count else shown(self, ctx)

    display_type_rich._no_flag_types = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_flags_take_no_metavar()

app = typer.Typer(
    name="rollstream",
    help="Event-sourced streaming RL post-training over Kafka, recorded in ClickHouse.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    cls=Commands,
)

console = Console(stderr=True, highlight=False, soft_wrap=True)
"""Progress, warnings and errors (stderr)."""
out = Console(highlight=False, soft_wrap=True)
"""Results (stdout)."""

F = TypeVar("F", bound=Callable[..., Any])
LOG_FORMAT = "%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"
log = logging.getLogger("rollstream.cli")

_state: dict[str, Any] = {}


class UserError(RuntimeError):
    """A mistake the user can fix; printed as one line."""


def opt(name: str) -> Any:
    """A global option's value: ``bootstrap``, ``store``, ``home`` (None when not given) or ``debug``."""
    return _state.get(name)


def home() -> Path:
    """The local stack's state directory (``--home`` / ``$ROLLSTREAM_HOME`` / ``./.rollstream``)."""
    from infra.kafka.broker import home_dir

    return home_dir(opt("home"))


def find_broker(configured: str | None = None) -> str | None:
    """This command's Kafka address by :func:`runtime.probe.find_bootstrap`: ``--bootstrap`` /
    ``$ROLLSTREAM_BOOTSTRAP``, else ``configured`` (``kafka.bootstrap`` of the run's config), else
    the local broker of ``--home``; None when there is none (say :data:`runtime.probe.NO_BROKER`)."""
    from infra.kafka.broker import local_bootstrap
    from runtime.probe import find_bootstrap

    return find_bootstrap(opt("bootstrap"), configured, local_bootstrap(home()))


# --------------------------------------------------------------------------- logging


class _LazyFileHandler(logging.handlers.RotatingFileHandler):
    """A rotating log file (5 × 10 MB) created, with its directory, at its first record."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, maxBytes=10 << 20, backupCount=5, encoding="utf-8", delay=True)

    def _open(self) -> Any:
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()

    def handleError(self, record: logging.LogRecord) -> None:
        """A log file that cannot be written (read-only home) is reported once, then left alone."""
        if not getattr(self, "_reported", False):
            self._reported = True
            err = sys.exc_info()[1]
            sys.stderr.write(f"warning: cannot write the log file {self.baseFilename}: {err}\n")


def setup_logging(*, debug: bool, log_file: Path | None, stderr_level: int | None = None) -> None:
    """Route every log record of this process: to ``log_file`` (when given), and to stderr at
    ``stderr_level`` (with ``debug``: everything). Replaces earlier handlers; Python warnings are
    logged too (``py.warnings``)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    fmt = logging.Formatter(LOG_FORMAT)
    levels = [logging.DEBUG if debug else logging.INFO]
    if log_file is not None:
        fh = _LazyFileHandler(log_file)
        fh.setFormatter(fmt)
        root.addHandler(fh)
    if debug or stderr_level is not None:
        sh = logging.StreamHandler(sys.stderr)
        sh.setFormatter(fmt)
        sh.setLevel(logging.DEBUG if debug else stderr_level or logging.INFO)
        root.addHandler(sh)
        levels.append(sh.level)
    root.setLevel(min(levels))
    logging.captureWarnings(True)
    _state["log_file"] = log_file


def log_to(path: Path) -> None:
    """Move this process's log file to ``path`` (``run``: the run's ``logs/cli.log``)."""
    setup_logging(debug=bool(opt("debug")), log_file=path)
    log.info("rollstream %s", redact_text(" ".join(sys.argv[1:])))


def log_file() -> Path | None:
    """Where this process logs (None: stderr only)."""
    path = _state.get("log_file")
    return path if isinstance(path, Path) else None


def quiet_transformers() -> None:
    """Send transformers' logs through :mod:`logging` (to the log file) instead of its own stderr
    handler. Call it where the CLI process itself loads a model."""
    from transformers.utils import logging as tlog

    tlog.disable_default_handler()
    tlog.enable_propagation()


# --------------------------------------------------------------------------- errors


def _user_error_types() -> tuple[type[BaseException], ...]:
    from infra.kafka.broker import StackError
    from runtime.bus import BusError
    from store import StoreError

    return (UserError, ConfigError, StoreError, BadRunId, StackError, BusError, *_PATH_ERRORS)


_PATH_ERRORS = (FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError, FileExistsError)
"""OS errors about a path the user named (a file, a directory, a chdb store): user errors."""


def _user_message(e: BaseException) -> str:
    if isinstance(e, _PATH_ERRORS):
        if isinstance(e, FileNotFoundError):
            return f"file not found: {e.filename or e}"
        return f"{e.strerror or type(e).__name__}: {e.filename}" if e.filename else str(e)
    return str(e)


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print ``error: message`` (one line) and return the :class:`typer.Exit` to raise."""
    line = " ".join(message.split())
    console.print(f"[red]error:[/red] {escape(line)}", soft_wrap=True)
    return typer.Exit(code)


def stdout_closed() -> bool:
    """True when nobody reads stdout any more (the reader of its pipe exited: ``| head``)."""
    import select

    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def friendly(fn: F) -> F:
    """Turn errors into one ``error:`` line and exit status 1 (``--debug`` re-raises); a closed
    stdout goes on to :func:`main`, which ends quietly."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _state.get("cli_log") and not _state.get("argv_logged"):  # every option is parsed by now
            _state["argv_logged"] = True
            log.info("rollstream %s", redact_text(" ".join(sys.argv[1:])))
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except BrokenPipeError:
            if stdout_closed():
                raise
            if opt("debug"):
                raise
            log.exception("unexpected error")
            raise fail(f"unexpected BrokenPipeError (traceback in {log_file() or 'the log above'})") from None
        except KeyboardInterrupt:
            console.print("[yellow]interrupted[/yellow]")
            raise typer.Exit(130) from None
        except _user_error_types() as e:
            if opt("debug"):
                raise
            if log_file() is not None:  # a service logs to its stderr, where the error line says it once
                log.info("user error: %s", one_line(e))
            raise fail(_user_message(e)) from None
        except Exception as e:
            if opt("debug"):
                raise
            log.exception("unexpected error")
            where = log_file()
            hint = f" (traceback in {where}; --debug shows it)" if where else " (traceback in the log above)"
            raise fail(f"unexpected {one_line(e)}{hint}") from None

    return wrapper  # type: ignore[return-value]


# --------------------------------------------------------------------------- global options


@app.callback()
def main_options(
    ctx: typer.Context,
    bootstrap: str = typer.Option(
        "", "--bootstrap", envvar="ROLLSTREAM_BOOTSTRAP",
        help="Kafka bootstrap host:port. Every command finds Kafka in one order: --bootstrap (or ROLLSTREAM_BOOTSTRAP), "
             "else kafka.bootstrap of the run's config, else the local broker that `rollstream stack up` or "
             "`rollstream run` started in --home.",
    ),
    store: str = typer.Option(
        "", "--store", envvar="ROLLSTREAM_STORE",
        help="Store DSN, chdb:///path or http(s)://host:8123: where run, service, sql, report and replay "
             "find the record (default: store.dsn of the run's config, else runs/<run>/store).",
    ),
    home_: str = typer.Option(
        "", "--home", envvar="ROLLSTREAM_HOME",
        help="State directory of the local stack and of the CLI's log (default ./.rollstream).",
    ),
    debug: bool = typer.Option(
        False, "--debug", envvar="ROLLSTREAM_DEBUG",
        help="Show tracebacks, and debug logs on stderr (they always go to <home>/logs/cli.log).",
    ),
) -> None:
    """Global options (also from ROLLSTREAM_BOOTSTRAP / ROLLSTREAM_STORE / ROLLSTREAM_HOME / ROLLSTREAM_DEBUG;
    after the command too)."""
    _state["cli_log"] = ctx.invoked_subcommand != "service"  # a service logs to its stderr (see the module doc)
    _set_globals(bootstrap=bootstrap or None, store=store or None, home=home_ or None, debug=debug)


def _set_globals(**values: Any) -> None:
    """Set global options (before the command: all four; after it: those given) and log where
    ``--home`` and ``--debug`` now say (the log file is created at its first record, so a
    ``--home`` after the command leaves no log in the default home)."""
    _state.update(values)
    if _state.get("cli_log") and ({"home", "debug"} & set(values)):
        setup_logging(debug=bool(opt("debug")), log_file=home() / "logs" / "cli.log")


def version() -> None:
    """Print the versions of rollstream and the pieces it runs on."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as pkg_version

    def v(name: str) -> str:
        try:
            return pkg_version(name)
        except PackageNotFoundError:
            return "not installed"

    from infra.kafka.broker import KAFKA_VERSION

    out.print(f"rollstream {v('rollstream')}")
    out.print(f"kafka (local broker) {KAFKA_VERSION}")
    for name in ("aiokafka", "msgspec", "clickhouse-connect", "chdb", "torch", "transformers"):
        out.print(f"{name} {v(name)}")


# --------------------------------------------------------------------------- entry point


def main() -> None:
    """Console-script entry point (also ``python -m cli``, how ``rollstream run`` starts
    its services). A command-line usage error is one ``error:`` line and exit status 2."""
    # quiet third-party progress bars and info chatter
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        code = app(prog_name="rollstream", standalone_mode=False)
        sys.stdout.flush()  # here, not at exit, where a closed pipe is an "Exception ignored" message
    except BrokenPipeError:
        _end_quietly()
    except typer.TyperException as e:  # typer's (click's) parsing errors
        if type(e).__name__ == "NoArgsIsHelpError":  # the help is already printed
            sys.exit(e.exit_code)
        ctx = getattr(e, "ctx", None)
        hint = f" (see `{ctx.command_path} --help`)" if ctx is not None and e.exit_code == 2 else ""
        raise SystemExit(fail(f"{e.format_message()}{hint}", e.exit_code).exit_code) from None
    except typer.Abort:
        console.print("[yellow]interrupted[/yellow]")
        code = 130
    sys.exit(code if isinstance(code, int) else 0)


def _end_quietly() -> None:
    """stdout's reader went away (``| head``): exit 1 with nothing on stderr, as rich's consoles do
    (stdout is pointed at /dev/null so that the interpreter's last flush is quiet)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    sys.exit(1)
