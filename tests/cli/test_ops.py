"""`rollstream status RUN` and `rollstream stop RUN` as a user runs them (a subprocess each),
against the real broker: a run made of its topics, its config and a supervisor state file."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from launch.prepare import write_run_config
from launch.state import write_state
from runtime.bus import Consumer, Producer, TopicAdmin
from schemas import events as ev
from schemas.config import KafkaSettings, parse_config
from schemas.topics import topic_name
from tests.cli.test_cli import cli, one_error_line


def make_run(bootstrap: str, run_id: str, runs: Path, events: list[tuple[str, ev.Event]],
             state: dict[str, Any] | None = None, overrides: tuple[str, ...] = ()) -> None:
    """Topics, ``config.yaml`` and (optionally) ``supervisor.json`` of a run, with ``events``."""

    async def go() -> None:
        async with TopicAdmin(KafkaSettings(), bootstrap) as admin:
            await admin.ensure_run_topics(run_id)
        async with Producer(KafkaSettings(), bootstrap) as producer:
            for name, event in events:
                await producer.send_and_wait(topic_name(run_id, name), event)

    asyncio.run(go())
    write_run_config(parse_config("", [f"run.runs_dir={runs}", "train.steps=6", "run.stall_after_s=30", *overrides]),
                     runs / run_id)
    if state is not None:
        write_state(runs / run_id, state)


def env(bootstrap: str) -> dict[str, str]:
    return dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)


def test_status_of_a_running_run_with_a_dead_supervisor_and_a_stall(bootstrap: str, run_id: str,
                                                                     tmp_path: Path) -> None:
    old = time.time() - 300
    make_run(bootstrap, run_id, tmp_path, [
        ("control", ev.RunStarted(run_id=run_id, config_json="{}", ts=old - 60)),
        ("tasks", ev.RolloutTask(run_id=run_id, sample_id="g0/0", group_id="g0", index=0, group_size=1,
                                 prompt_id="p", domain="arith", prompt="1+1=", ts=old)),
        ("weights", ev.WeightsPublished(run_id=run_id, policy_version=3, step=3, uri="/w/3", ts=old)),
        ("control", ev.ServiceRestarted(run_id=run_id, service="rollout", pid=4, exit_code=-9, restarts=1)),
    ], state={
        "run_id": run_id, "supervisor_pid": 999_999_999, "bootstrap": bootstrap, "phase": "running",
        "started_at": old - 60, "updated_at": old,
        "services": {"rollout": {"state": "running", "pid": 999_999_998, "restarts": 1, "last_exit_code": -9,
                                 "last_error": "ERROR boom"},
                     "trainer": {"state": "running", "pid": os.getpid(), "restarts": 0}},
    }, overrides=("rollout.engine=server", "rollout.server_urls=['http://127.0.0.1:1']"))  # its server is gone
    res = cli("status", run_id, "--runs-dir", str(tmp_path), "--format", "json", env=env(bootstrap))
    assert res.returncode == 3, res.stderr  # ended before it finished: resumable
    report = json.loads(res.stdout)
    assert report["phase"] == "abandoned" and report["supervisor"]["alive"] is False
    assert report["resume"] == f"rollstream resume {run_id} --runs-dir {tmp_path}"
    assert (report["step"], report["steps"], report["policy_version"]) == (None, 6, 3)
    rollout, trainer = report["services"]["rollout"], report["services"]["trainer"]
    assert (rollout["state"], rollout["alive"], rollout["restarts"], rollout["last_exit_code"]) == ("gone", False, 1, -9)
    assert (trainer["state"], trainer["alive"]) == ("running", True)
    assert report["feeder"]["tasks_issued"] == 1 and report["feeder"]["last_issued_s_ago"] >= 299
    assert report["stall"].startswith("no training step for 3")  # 300 s and a bit
    assert "rollout lag ?, reward lag ?, scored lag ?; feeder has issued nothing for 3" in report["stall"]
    assert report["servers_down"] == {"http://127.0.0.1:1": "connection refused"}
    assert report["stall"].endswith("generation server http://127.0.0.1:1 not answering (connection refused; "
                                    "rollout.server_urls)")
    table = cli("status", run_id, "--runs-dir", str(tmp_path), env=env(bootstrap))
    assert table.returncode == 3, table.stderr
    assert f"run {run_id}: abandoned (supervisor pid 999999999 gone)" in table.stdout
    assert f"interrupted before it finished: resume it with `rollstream resume {run_id} --runs-dir {tmp_path}`" \
        in table.stdout
    assert "stalled: no training step" in table.stdout and "ERROR boom" in table.stdout
    assert "generation server http://127.0.0.1:1 not answering" in table.stdout
    assert "the supervisor is gone; still running: trainer" in table.stdout


def test_status_and_stop_of_unknown_runs_are_one_line(bootstrap: str, tmp_path: Path) -> None:
    for cmd in ("status", "stop"):
        line = one_error_line(cli(cmd, "no-such-run-x", "--runs-dir", str(tmp_path), env=env(bootstrap)))
        assert "run no-such-run-x not found" in line and "no topics on the broker" in line
        assert "run id" in one_error_line(cli(cmd, "bad id!", "--runs-dir", str(tmp_path), env=env(bootstrap)))
    assert "--format" in one_error_line(cli("status", "r", "--format", "xml", env=env(bootstrap)))


def test_record_errors_are_one_line(bootstrap: str, tmp_path: Path) -> None:
    """``rollstream record`` of a run the broker does not have, with no broker, or a bad id (its
    success is tests/launch/test_record.py's: a record built by it equals the live one)."""
    store = f"chdb://{tmp_path / 'store'}"
    line = one_error_line(cli("record", "no-such-run-x", "--runs-dir", str(tmp_path), "--store", store,
                              env=env(bootstrap)))
    assert f"run no-such-run-x has no topics on the Kafka broker at {bootstrap}" in line
    assert not (tmp_path / "store").exists()  # nothing made for a run that is not there
    line = one_error_line(cli("record", "r", "--runs-dir", str(tmp_path), "--bootstrap", "127.0.0.1:1",
                              env=env(bootstrap)))
    assert "no Kafka broker answers at 127.0.0.1:1" in line
    assert "run id" in one_error_line(cli("record", "bad id!", "--runs-dir", str(tmp_path), env=env(bootstrap)))


def test_stop_publishes_a_drain_and_waits_for_the_run_to_finish(bootstrap: str, run_id: str, tmp_path: Path) -> None:
    make_run(bootstrap, run_id, tmp_path, [("control", ev.RunStarted(run_id=run_id, config_json="{}"))])
    e = env(bootstrap)
    # nobody reacts to the drain here: a short timeout ends the wait with one line
    late = cli("stop", run_id, "--runs-dir", str(tmp_path), "--timeout", "2", env=e)
    assert f"run {run_id} did not finish within 2 s of the drain" in one_error_line(late)
    quick = cli("stop", run_id, "--runs-dir", str(tmp_path), "--no-wait", env=e)
    assert quick.returncode == 0 and "drain published" in quick.stdout

    async def control() -> list[Any]:
        async with Consumer(KafkaSettings(), bootstrap, group_id=None, topics=[topic_name(run_id, "control")]) as c:
            got: list[Any] = []
            deadline = time.monotonic() + 20
            while len(got) < 3 and time.monotonic() < deadline:
                got += [r.event for r in await c.getmany(timeout_ms=300)]
            return got

    drains = [x for x in asyncio.run(control()) if isinstance(x, ev.Drain)]
    assert [(d.reason, d.origin) for d in drains] == [("stopped by user", "user")] * 2

    async def finish_soon() -> None:
        await asyncio.sleep(3)
        async with Producer(KafkaSettings(), bootstrap) as producer:
            await producer.send_and_wait(topic_name(run_id, "control"), ev.RunFinished(run_id=run_id, status="completed"))

    async def stop_while_finishing() -> Any:
        task = asyncio.create_task(finish_soon())
        res = await asyncio.to_thread(cli, "stop", run_id, "--runs-dir", str(tmp_path), "--timeout", "60", env=e)
        await task
        return res

    done = asyncio.run(stop_while_finishing())
    assert done.returncode == 0, done.stderr
    assert f"run {run_id} finished (completed)" in done.stdout and "after the drain" in done.stdout
    again = cli("stop", run_id, "--runs-dir", str(tmp_path), env=e)
    assert again.returncode == 0 and "already finished (completed); nothing to stop" in again.stdout
    status = json.loads(cli("status", run_id, "--runs-dir", str(tmp_path), "--format", "json", env=e).stdout)
    assert status["phase"] == "stopped" and status["finished"]["status"] == "completed" and status["stall"] is None
