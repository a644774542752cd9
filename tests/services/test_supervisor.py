"""`rollstream run` refuses a run id whose topics already hold an earlier run's events (the two
runs would mix), unless the run directory has a checkpoint to resume from."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from schemas import events as ev
from schemas.config import KafkaSettings
from schemas.topics import topic_name
from services.kafka.bus import Producer


async def test_run_id_reuse_is_refused(kafka: KafkaSettings, topics: list[str], run_id: str, tmp_path: Path,
                                       repo_root: Path) -> None:
    async with Producer(kafka) as producer:
        await producer.send_and_wait(topic_name(run_id, "control"), ev.RunFinished(run_id=run_id, status="completed"))
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=kafka.bootstrap)
    res = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "services.cli", "run", str(repo_root / "examples" / "main.yaml"),
                          "--run-id", run_id, "--set", f"run.runs_dir={tmp_path}"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 1
    assert f"run id {run_id} already has 1 messages" in res.stderr and "pick another --run-id" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / run_id / "model").exists()  # refused before anything was created


def test_services_get_the_bootstrap_and_the_store_in_their_environment(tmp_path: Path, monkeypatch: Any) -> None:
    import io

    from rich.console import Console

    from schemas.config import parse_config
    from services.launch import supervisor

    started: list[tuple[list[str], dict[str, str]]] = []

    class FakePopen:
        def __init__(self, cmd: list[str], **kw: Any) -> None:
            started.append((cmd, kw["env"]))

    monkeypatch.setattr(supervisor.subprocess, "Popen", FakePopen)
    for overrides, dsn in [([], f"chdb://{tmp_path.resolve() / 'r1' / 'store'}"),
                           (["store.dsn=http://clickhouse:8123"], "http://clickhouse:8123")]:
        started.clear()
        cfg = parse_config("", [f"run.runs_dir={tmp_path}", *overrides])
        supervisor.Supervisor(cfg, "r1", "kafka:9092", Console(file=io.StringIO())).start_children()
        assert [cmd[4] for cmd, _ in started] == ["recorder", "feeder", "reward", "rollout", "trainer"]
        for cmd, env in started:
            assert env["ROLLSTREAM_BOOTSTRAP"] == "kafka:9092" and env["ROLLSTREAM_STORE"] == dsn
            assert cmd[-2:] == ["--runs-dir", str(tmp_path)]
