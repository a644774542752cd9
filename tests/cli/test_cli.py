"""One subprocess smoke test per CLI command, as a user runs them; user errors are one line."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest


def cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True,
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


def test_stack_status_and_down_of_a_stopped_cluster(tmp_path: Path) -> None:
    """A local cluster recorded in the home (`stack up --brokers 3` ran once) whose brokers are all
    stopped: `stack status` shows each of them, `stack down` has nothing to stop."""
    from infra.kafka.cluster import _plan

    home = tmp_path / "home"
    ports = [n.port for n in _plan(home, 3).nodes]
    env = {k: v for k, v in os.environ.items() if k != "ROLLSTREAM_BOOTSTRAP"}
    env["ROLLSTREAM_HOME"] = str(home)
    status = cli("stack", "status", env=env)
    assert status.returncode == 1, status.stdout + status.stderr
    for i, port in enumerate(ports, 1):
        assert f"broker {i}: 127.0.0.1:{port} — stopped" in status.stdout, status.stdout
    down = cli("stack", "down", env=env)
    assert down.returncode == 0 and down.stdout.strip() == "kafka: no local broker was running", down.stdout


def test_topics_list_and_describe(bootstrap: str, run_id: str) -> None:
    import asyncio

    from runtime.bus import TopicAdmin
    from schemas.config import KafkaSettings

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


def test_init_model_creates_a_loadable_reward_model(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path / "rm"
    res = cli("init-model", str(out), "--reward-model", "--set", "hidden_size=64", "--set", "num_layers=2",
              "--seed", "3")
    assert res.returncode == 0, res.stderr
    (line,) = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert line.startswith(f"created {out}") and "reward model" in line and "M parameters" in line
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert type(model).__name__ == "LlamaForSequenceClassification"
    assert model.config.num_labels == 1 and model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    ids = AutoTokenizer.from_pretrained(out, local_files_only=True)("12+3=15", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape == (1, 1)
    # seeded: the same --seed gives the same weights, head included
    again = tmp_path / "rm2"
    assert cli("init-model", str(again), "--reward-model", "--set", "hidden_size=64", "--set", "num_layers=2",
               "--seed", "3").returncode == 0
    other = AutoModelForSequenceClassification.from_pretrained(again)
    assert torch.equal(other.score.weight, model.score.weight)
    assert "already holds a model" in one_error_line(cli("init-model", str(out), "--reward-model"))
    both = cli("init-model", str(tmp_path / "x"), "--reward-model", "--from", "smollm2-135m-instruct")
    assert "--reward-model" in one_error_line(both) and not (tmp_path / "x").exists()


def test_sql_errors_are_one_line(tmp_path: Path) -> None:
    assert "no runs" in one_error_line(cli("sql", "SELECT 1", "--runs-dir", str(tmp_path)))
    (tmp_path / "r1").mkdir()
    (tmp_path / "r1" / "config.yaml").write_text("{}")
    assert "only read-only" in one_error_line(cli("sql", "DROP TABLE events", "--runs-dir", str(tmp_path)))
    assert "none of its 1 runs has a record" in one_error_line(cli("sql", "SELECT 1", "--runs-dir", str(tmp_path)))
    assert "run r1 has no store" in one_error_line(cli("sql", "SELECT 1", "--run", "r1", "--runs-dir", str(tmp_path)))


def test_replay_subcommands_errors_are_one_line(tmp_path: Path) -> None:
    # replay of a recorded run is tested in test_replay*.py (a real run through the real broker)
    runs = str(tmp_path)
    assert "unknown run 'r1'" in one_error_line(cli("replay", "rescore", "r1", "--runs-dir", runs))
    assert "unknown run 'r1'" in one_error_line(cli("replay", "into", "r1", "r2", "--runs-dir", runs))
    assert "run r1 not found" in one_error_line(cli("replay", "step", "r1", "3", "--runs-dir", runs))
    assert "into itself" in one_error_line(cli("replay", "into", "r1", "r1", "--runs-dir", runs))
    assert "No such option: --topics" in one_error_line(cli("replay", "rescore", "r1", "--topics", "tasks"))


def test_usage_errors_are_one_line() -> None:
    for args, msg in [(("nope",), "No such command 'nope'"), (("replay", "step", "r1"), "Missing argument"),
                      (("run",), "Missing argument"), (("replay", "into", "r1"), "Missing argument")]:
        res = cli(*args)
        assert res.returncode == 2 and msg in one_line_only(res), res.stderr
    assert cli().returncode == 2 and "Usage" in cli().stdout  # no arguments: the help


def one_line_only(res: subprocess.CompletedProcess[str]) -> str:
    """The single line a failed command printed (stdout and stderr together)."""
    assert res.returncode != 0 and "Traceback" not in res.stderr + res.stdout
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.mark.parametrize(("args", "msg"), [
    (("--bootstrap", "127.0.0.1:1", "topics", "list"), "no Kafka broker answers at 127.0.0.1:1"),
    (("--bootstrap", "127.0.0.1:1", "run", "examples/main.yaml"), "no Kafka broker answers at 127.0.0.1:1"),
    (("--store", "bogus://x", "sql", "SELECT 1"), "bad store DSN 'bogus://x'"),
    (("--store", "http://127.0.0.1:1", "sql", "SELECT 1"), "cannot reach ClickHouse at http://127.0.0.1:1"),
    (("run", "examples/main.yaml", "--set", "train.nope=1"), "unknown key 'train.nope'"),
    (("run", "examples/main.yaml", "--set", "train.lr=fast"), "train.lr"),
    (("run", "examples/main.yaml", "--set", "rollout.group_size=0"), "rollout.group_size=0 must be >= 1"),
])
def test_user_errors_are_one_line_within_15s(args: tuple[str, ...], msg: str, tmp_path: Path, repo_root: Path) -> None:
    """Library noise (aiokafka, urllib3, clickhouse_connect) goes to the log file, not the terminal."""
    env = {k: v for k, v in os.environ.items() if k not in ("ROLLSTREAM_BOOTSTRAP", "ROLLSTREAM_STORE")}
    env["ROLLSTREAM_HOME"] = str(tmp_path / "home")
    argv = [str(repo_root / a) if a.endswith(".yaml") else a for a in args]
    if "run" in argv:
        argv += ["--set", f"run.runs_dir={tmp_path / 'runs'}"]
    t0 = time.monotonic()
    res = cli(*argv, env=env, cwd=tmp_path)
    assert time.monotonic() - t0 < 15
    assert msg in one_line_only(res)
    assert not (tmp_path / "runs").exists()
    log = (tmp_path / "home" / "logs" / "cli.log").read_text()
    assert "user error" in log
    if "127.0.0.1:1" in args and "sql" in args:
        assert "urllib3" in log or "clickhouse_connect" in log  # the noise is in the log file


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    env = dict(os.environ, ROLLSTREAM_HOME=str(tmp_path / "home"))
    res = cli("--debug", "--store", "bogus://x", "sql", "SELECT 1", env=env)
    assert res.returncode != 0 and "Traceback" in res.stderr and "StoreError" in res.stderr


@pytest.mark.parametrize("fmt", ["json", "csv", "table"])
def test_sql_formats_on_a_store(tmp_path: Path, fmt: str) -> None:
    store = tmp_path / "runs" / "r1" / "store"
    setup = subprocess.run([sys.executable, "-c", f"import store as st; c = st.connect('chdb://{store}'); "
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
    res = subprocess.run([str(Path(sys.executable).parent / "typer"), "cli", "utils", "docs", "--name",
                          "rollstream", "--output", str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert out.read_text() == (repo_root / "docs" / "cli.md").read_text(), (
        "docs/cli.md is stale: run `make docs`")


def _delete_topics(bootstrap: str, run_id: str) -> None:
    import asyncio

    from runtime.bus import TopicAdmin
    from schemas.config import KafkaSettings

    async def delete() -> None:
        async with TopicAdmin(KafkaSettings(), bootstrap) as admin:
            await admin.delete_run_topics(run_id)

    asyncio.run(delete())


def test_run_prepare_only_prepares_and_starts_nothing(bootstrap: str, tmp_path: Path, repo_root: Path) -> None:
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap, ROLLSTREAM_HOME=str(tmp_path / "home"))
    runs = tmp_path / "runs"
    rid = f"prep-{uuid.uuid4().hex[:8]}"
    args = ["run", str(repo_root / "examples" / "main.yaml"), "--prepare-only", "--run-id", rid,
            "--set", f"run.runs_dir={runs}"]
    try:
        res = cli(*args, env=env)
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == rid  # only the run id on stdout (for scripts and compose)
        assert "devices: rollout on cpu (float32), trainer on cpu (float32)" in res.stderr  # where each service runs
        assert (runs / rid / "config.yaml").is_file() and (runs / rid / "model" / "config.json").is_file()
        assert [p.name for p in (runs / rid / "logs").iterdir()] == ["cli.log"]  # no service was started
        listed = cli("--bootstrap", bootstrap, "topics", "list", rid, env=env)
        assert f"{rid}: 10 topics" in listed.stdout, listed.stdout + listed.stderr  # judge.requests included
        again = cli(*args, env=env)  # preparing the same run again changes nothing
        assert again.returncode == 0 and again.stdout.strip() == rid, again.stderr
        other = cli(*args[:-1], f"run.runs_dir={runs}", "--set", "train.lr=0.5", env=env)
        assert other.returncode == 0, other.stderr  # topics still empty: a different config may take the id
    finally:
        _delete_topics(bootstrap, rid)


def test_service_sql_and_report_agree_on_the_store(bootstrap: str, tmp_path: Path) -> None:
    """`service recorder` records into --store / ROLLSTREAM_STORE (not the run's own store), and
    `sql` and `report` read it from there, as `rollstream run` does."""
    import asyncio
    import json

    from runtime.bus import Producer, TopicAdmin
    from schemas import events as ev
    from schemas.config import KafkaSettings
    from schemas.topics import topic_name

    rid = f"store-{uuid.uuid4().hex[:8]}"
    runs, dsn = tmp_path / "runs", f"chdb://{tmp_path / 'elsewhere'}"
    (runs / rid).mkdir(parents=True)
    (runs / rid / "config.yaml").write_text("{}\n")

    async def publish() -> None:
        async with TopicAdmin(KafkaSettings(), bootstrap) as admin:
            await admin.ensure_run_topics(rid)
        async with Producer(KafkaSettings(bootstrap=bootstrap)) as producer:
            await producer.send_and_wait(topic_name(rid, "control"), ev.RunStarted(run_id=rid, config_json="{}"))
            await producer.send_and_wait(topic_name(rid, "control"), ev.RunFinished(run_id=rid, status="completed"))

    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap, ROLLSTREAM_HOME=str(tmp_path / "home"))
    env.pop("ROLLSTREAM_STORE", None)
    try:
        asyncio.run(publish())
        rec = cli("--store", dsn, "service", "recorder", "--run", rid, "--runs-dir", str(runs), env=env)
        assert rec.returncode == 0, rec.stderr[-2000:]  # exits by itself after RunFinished
    finally:
        _delete_topics(bootstrap, rid)
    assert not (runs / rid / "store").exists()  # recorded into --store, not the run's own store
    query = ("sql", "SELECT kind FROM events WHERE run_id = {r:String} ORDER BY kind", "--param", f"r={rid}",
             "--format", "json")
    res = cli("--store", dsn, *query, env=env)
    assert res.returncode == 0, res.stderr
    assert [r["kind"] for r in json.loads(res.stdout)] == ["RunFinished", "RunStarted"]
    with_env = cli(*query, env=dict(env, ROLLSTREAM_STORE=dsn))
    assert with_env.returncode == 0 and with_env.stdout == res.stdout, with_env.stderr
    report = cli("report", rid, "--runs-dir", str(runs), "--out", str(tmp_path / "rep"), env=dict(env, ROLLSTREAM_STORE=dsn))
    assert report.returncode == 0, report.stderr
    assert (tmp_path / "rep" / "index.html").is_file() and f"{rid}: 0 steps done" in report.stdout
    # without --store: the store the run's config names (what `rollstream run --store` writes there)
    (runs / rid / "config.yaml").write_text(f"store:\n  dsn: {dsn}\n")
    from_cfg = cli(*query, "--run", rid, "--runs-dir", str(runs), env=env)
    assert from_cfg.returncode == 0 and from_cfg.stdout == res.stdout, from_cfg.stderr


def test_init_model_creates_a_loadable_vlm(tmp_path: Path) -> None:
    out = tmp_path / "vlm"
    res = cli("init-model", str(out), "--vlm", "--set", "hidden_size=64", "--set", "num_layers=2")
    assert res.returncode == 0, res.stderr
    (line,) = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert line.startswith(f"created {out}") and "vision-language" in line
    assert (out / "preprocessor_config.json").is_file() and (out / "chat_template.jinja").is_file()
    both = cli("init-model", str(tmp_path / "x"), "--vlm", "--reward-model")
    assert "--vlm" in one_error_line(both) and not (tmp_path / "x").exists()
