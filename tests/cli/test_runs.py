"""`rollstream runs list|rm`, `logs`, `export`, `resume` and `run --dry-run` as a user runs them (a
subprocess each), on run folders as `rollstream run` leaves them (:func:`tests.launch.test_runs.make_run`)
and the real broker; user errors are one line."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import yaml

from runtime.bus import TopicAdmin
from schemas.config import KafkaSettings
from tests.cli.test_cli import cli, one_error_line
from tests.launch.test_runs import make_run


def run_topics(bootstrap: str, run_id: str, create: bool = False) -> list[str]:
    async def go() -> list[str]:
        async with TopicAdmin(KafkaSettings(), bootstrap) as admin:
            if create:
                await admin.ensure_run_topics(run_id)
            return await admin.run_topics(run_id)

    return asyncio.run(go())


def test_runs_list_logs_and_export(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    make_run(runs, "a-done", done=4)
    make_run(runs, "b-killed", phase="running")
    d = ["--runs-dir", str(runs)]

    listed = cli("runs", "list", *d)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split() == ["run", "name", "state", "steps", "accuracy", "wall", "disk"]
    assert lines[1].split()[:6] == ["a-done", "toy", "finished", "4/4", "0.750", "1.6"]
    assert lines[2].split()[:5] == ["b-killed", "toy", "interrupted", "3/4", "-"]
    rows = json.loads(cli("runs", "list", *d, "--format", "json").stdout)
    assert [(r["run_id"], r["state"], r["final_model"]) for r in rows] == [
        ("a-done", "finished", str(runs / "a-done" / "final")), ("b-killed", "interrupted", None)]

    logs = cli("logs", "a-done", *d)
    assert logs.returncode == 0 and [ln.split()[0] for ln in logs.stdout.splitlines()] == ["service", "feeder", "trainer"]
    assert cli("logs", "a-done", "trainer", *d).stdout == "a\nb\nc\n"
    # -f on a run that is not running prints what is there and ends; -n: the last lines
    assert cli("logs", "a-done", "trainer", "-f", "-n", "2", *d).stdout == "b\nc\n"
    assert "has no log of 'judge'; it has: feeder, trainer" in one_error_line(cli("logs", "a-done", "judge", *d))

    out = tmp_path / "model"
    exported = cli("export", "a-done", str(out), "--step", "3", *d)
    assert exported.returncode == 0, exported.stderr
    assert f"step 3 (weights/v00003): {out}" in exported.stdout
    assert json.loads((out / "config.json").read_text()) == {"tag": "v3"}
    assert "step 1 of run a-done is not kept; kept steps: 0, 2, 3, 4" in one_error_line(
        cli("export", "a-done", str(tmp_path / "m1"), "--step", "1", *d))
    assert "exists and is not empty" in one_error_line(cli("export", "a-done", str(out), *d))


def test_runs_rm_deletes_the_folder_and_the_topics(bootstrap: str, run_id: str, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    run_dir = make_run(runs, run_id, done=4)
    assert run_topics(bootstrap, run_id, create=True)
    live = make_run(runs, "live", phase="running", pid=os.getpid())
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)
    d = ["--runs-dir", str(runs)]
    assert "needs confirmation: add --yes" in one_error_line(cli("runs", "rm", run_id, *d, env=env))
    assert "run live is running" in one_error_line(cli("runs", "rm", "live", "--yes", *d, env=env))
    gone = cli("runs", "rm", run_id, "--yes", *d, env=env)
    assert gone.returncode == 0, gone.stderr
    assert f"deleted run {run_id}: {run_dir}" in gone.stdout and "and 10 topics" in gone.stdout
    assert not run_dir.exists() and live.exists()
    assert run_topics(bootstrap, run_id) == []
    assert "not found" in one_error_line(cli("runs", "rm", run_id, "--yes", *d, env=env))


def test_resume_leaves_finished_and_running_runs_alone(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    make_run(runs, "done", done=4)
    make_run(runs, "live", phase="running", pid=os.getpid())
    d = ["--runs-dir", str(runs)]
    finished = cli("resume", "done", *d)
    assert finished.returncode == 0 and "run done already finished (finished;" in finished.stdout
    assert finished.stdout.rstrip().endswith("nothing to resume") and len(finished.stdout.splitlines()) == 1
    assert "run live is running (supervisor pid" in one_error_line(cli("resume", "live", *d))
    assert "run nope not found" in one_error_line(cli("resume", "nope", *d))


def test_run_dry_run_prints_the_config_and_creates_nothing(bootstrap: str, run_id: str, tmp_path: Path,
                                                          repo_root: Path) -> None:
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap)
    runs = tmp_path / "runs"
    res = cli("run", str(repo_root / "examples" / "main.yaml"), "--dry-run", "--run-id", run_id,
              "--set", "train.steps=7", "--set", f"run.runs_dir={runs}", env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    cfg = yaml.safe_load(res.stdout)
    assert cfg["train"]["steps"] == 7 and cfg["run"]["runs_dir"] == str(runs)
    assert f"dry run: the config passed every check; run id {run_id}" in res.stderr
    assert "nothing was created" in res.stderr
    assert not runs.exists() and run_topics(bootstrap, run_id) == []
