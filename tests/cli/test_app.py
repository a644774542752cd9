"""The app's conventions for every command: global options before or after the command, no type
shown after a flag in any help, and a closed stdout ends a command quietly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import typer
from typer.testing import CliRunner

from cli import app


def command_paths() -> list[list[str]]:
    """Every command and command group of the app, as the words that name it."""
    root = typer.main.get_command(app)
    paths, todo = [], [([], root)]
    while todo:
        words, cmd = todo.pop()
        paths.append(words)
        todo += [([*words, name], sub) for name, sub in getattr(cmd, "commands", {}).items()]
    return sorted(paths)


def test_no_help_shows_a_type_after_a_flag(tmp_path: Path) -> None:
    """Walks every command's --help (in this process: typer's rich help as a terminal shows it)."""
    runner = CliRunner()
    paths = command_paths()
    assert ["sql"] in paths and ["stack", "up"] in paths and len(paths) > 15
    for words in paths:
        res = runner.invoke(app, [*words, "--help"], env={"ROLLSTREAM_HOME": str(tmp_path), "COLUMNS": "160"})
        assert res.exit_code == 0, (words, res.output)
        assert "<bool>" not in res.output, words
        assert "--help" in res.output and ("--debug" in res.output), words  # the global options are listed
        if words:
            assert "Global options (before or after the command)" in res.output, words


def test_every_command_takes_the_global_options_after_its_name() -> None:
    root = typer.main.get_command(app)
    globals_ = {o for p in root.params for o in p.opts} - {"--help"}
    assert globals_ == {"--bootstrap", "--store", "--home", "--debug"}
    for words in command_paths()[1:]:
        cmd = root
        for w in words:
            cmd = cmd.commands[w]  # type: ignore[attr-defined]
        assert globals_ <= {o for p in cmd.params for o in p.opts}, words


def test_global_options_after_the_command_work(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    res = subprocess.run([sys.executable, "-m", "cli", "sql", "SELECT 1", "--store", "bogus://x", "--home",
                          str(tmp_path / "home"), "--debug"], capture_output=True, text=True, env=env, timeout=60,
                         cwd=tmp_path)
    assert res.returncode == 1 and "StoreError: bad store DSN 'bogus://x'" in res.stderr  # --debug: the traceback
    assert "sql SELECT 1 --store bogus://x" in (tmp_path / "home" / "logs" / "cli.log").read_text()  # --home
    assert not (tmp_path / ".rollstream").exists()  # nothing in the default home


def test_a_closed_stdout_ends_quietly(tmp_path: Path) -> None:
    """As ``rollstream sql ... --format csv | head`` once head has exited: nothing on stderr."""
    argv = ["sql", "SELECT number FROM numbers(200000)", "--format", "csv", "--store", f"chdb://{tmp_path}/s", "--write"]
    env = dict(os.environ, ROLLSTREAM_HOME=str(tmp_path / "home"))
    proc = subprocess.Popen([sys.executable, "-m", "cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # nobody reads: the first write fails with EPIPE
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1 and err == "", err
