"""`rollstream run` refuses a run id whose topics already hold an earlier run's events (the two
runs would mix), unless the run directory has a checkpoint to resume from."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

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
