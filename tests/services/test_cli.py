"""One subprocess smoke test per CLI command, as a user runs them; user errors are one line."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest


def cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True,
                          env=env or dict(os.environ), cwd=cwd, timeout=timeout)


def one_error_line(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode != 0
    assert "Traceback" not in res.stderr + res.stdout
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error:")
    return lines[0]


def test_version() -> None:
    res = cli("version")
    assert res.returncode == 0
    assert "rollstream" in res.stdout and "kafka (local broker) 4." in res.stdout


def test_help_lists_every_command() -> None:
    res = cli("--help")
    assert res.returncode == 0
    for cmd in ("run", "service", "stack", "topics", "sql", "report", "replay", "init-model", "version"):
        assert cmd in res.stdout


def test_stack_status_and_unreachable_broker_is_fast(tmp_path: Path, bootstrap: str) -> None:
    env = dict(os.environ, ROLLSTREAM_HOME=str(tmp_path / "home"))
    ok = cli("--bootstrap", bootstrap, "stack", "status", env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert bootstrap in ok.stdout and "up" in ok.stdout
    t0 = time.monotonic()
    bad = cli("--bootstrap", "127.0.0.1:1", "stack", "status", env=env)
    assert bad.returncode == 1
    assert "DOWN" in bad.stdout
    up = cli("--bootstrap", "127.0.0.1:1", "stack", "up", env=env)
    assert "no Kafka broker answers at 127.0.0.1:1" in one_error_line(up)
    assert time.monotonic() - t0 < 30  # two commands, each well under 15 s


def test_topics_list_and_describe(bootstrap: str, run_id: str) -> None:
    import asyncio

    from schemas.config import KafkaSettings
    from services.kafka.bus import TopicAdmin

    async def create() -> None:
        async with TopicAdmin(KafkaSettings(), bootstrap) as admin:
            await admin.ensure_run_topics(run_id)

    asyncio.run(create())
    listed = cli("--bootstrap", bootstrap, "topics", "list", run_id)
    assert listed.returncode == 0 and f"rs.{run_id}.weights" in listed.stdout
    described = cli("--bootstrap", bootstrap, "topics", "describe", run_id)
    assert described.returncode == 0, described.stderr
    assert "compact" in described.stdout and "tasks" in described.stdout
    missing = cli("--bootstrap", bootstrap, "topics", "describe", "no-such-run")
    assert "has no topics" in one_error_line(missing)
    bad = cli("--bootstrap", bootstrap, "topics", "describe", "bad id!")
    assert "run id" in one_error_line(bad)


def test_run_with_bad_config_is_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("train: {lr: fast}\n")
    assert "train.lr" in one_error_line(cli("run", str(cfg)))
    assert "not found" in one_error_line(cli("run", str(tmp_path / "nope.yaml")))
    good = tmp_path / "good.yaml"
    good.write_text("train: {lr: 0.1}\n")
    assert "unknown key 'train.nope'" in one_error_line(cli("run", str(good), "--set", "train.nope=1"))


def test_service_errors_are_one_line(tmp_path: Path) -> None:
    assert "unknown service" in one_error_line(cli("service", "nope", "--run", "r1"))
    assert "has no config" in one_error_line(cli("service", "feeder", "--run", "r1", "--runs-dir", str(tmp_path)))


def test_init_model_creates_a_loadable_model(tmp_path: Path) -> None:
    out = tmp_path / "m"
    res = cli("init-model", str(out), "--set", "hidden_size=64", "--set", "num_layers=2")
    assert res.returncode == 0, res.stderr
    assert (out / "config.json").exists() and list(out.glob("*.safetensors"))
    assert "M parameters" in res.stdout
    again = cli("init-model", str(out))
    assert "already holds a model" in one_error_line(again)
    bad = cli("init-model", str(tmp_path / "x"), "--set", "hidden_size=big")
    assert "hidden_size" in one_error_line(bad)


def test_sql_errors_are_one_line(tmp_path: Path) -> None:
    assert "no runs" in one_error_line(cli("sql", "SELECT 1", "--runs-dir", str(tmp_path)))
    (tmp_path / "r1").mkdir()
    (tmp_path / "r1" / "config.yaml").write_text("{}")
    assert "only read-only" in one_error_line(cli("sql", "DROP TABLE events", "--runs-dir", str(tmp_path)))
    assert "has no store" in one_error_line(cli("sql", "SELECT 1", "--runs-dir", str(tmp_path)))


def test_replay_errors_are_one_line(tmp_path: Path) -> None:
    # replay of a recorded run is tested in test_replay.py (a real run through the real broker)
    assert "unknown run 'r1'" in one_error_line(cli("replay", "r1", "--rescore", "--runs-dir", str(tmp_path)))
    assert "give one of --into" in one_error_line(cli("replay", "r1", "--runs-dir", str(tmp_path)))


@pytest.mark.parametrize("fmt", ["json", "csv", "table"])
def test_sql_formats_on_a_store(tmp_path: Path, fmt: str) -> None:
    store = tmp_path / "runs" / "r1" / "store"
    setup = subprocess.run([sys.executable, "-c", f"from services import store as st; c = st.connect('chdb://{store}'); "
                            "st.apply_ddl(c)"], capture_output=True, text=True, timeout=120)
    assert setup.returncode == 0, setup.stderr
    res = cli("sql", "SELECT version, name FROM schema_migrations FINAL ORDER BY version", "--run", "r1",
              "--runs-dir", str(tmp_path / "runs"), "--format", fmt)
    assert res.returncode == 0, res.stderr
    assert "001_events.sql" in res.stdout
    bad = cli("sql", "SELECT nope FROM events", "--run", "r1", "--runs-dir", str(tmp_path / "runs"))
    assert "query failed" in one_error_line(bad)


def test_cli_reference_is_current(tmp_path: Path, repo_root: Path) -> None:
    out = tmp_path / "cli.md"
    res = subprocess.run([str(Path(sys.executable).parent / "typer"), "services.cli", "utils", "docs", "--name",
                          "rollstream", "--output", str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert out.read_text() == (repo_root / "docs" / "cli.md").read_text(), (
        "docs/cli.md is stale: run `make docs`")
