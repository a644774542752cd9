"""Backends the config names but this version does not implement (``rollout.engine: vllm``,
``train.strategy: fsdp2 | megatron``) are refused in one line, before anything starts.

``make_engine`` / ``make_strategy`` are the only places that pick a backend; ``check_engine`` /
``check_strategy`` are what the CLI calls right after parsing the config. The subprocess tests
check what a user sees: ``rollstream run`` and ``rollstream service`` exit non-zero in under 5 s
with exactly one line, and start no broker, create no run directory and no topics.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout.factory import check_engine, make_engine
from schemas.config import ConfigError, parse_config
from trainer.factory import check_strategy, make_strategy

REFUSED = [  # (train.strategy fsdp2 / megatron are implemented: tests/trainer/test_ranks.py, test_megatron.py)
    ("rollout.engine=vllm", ["rollout.engine='vllm'", "needs rollout.server_urls", "vllm serve",
                             "use rollout.engine=torch"]),
]


@pytest.mark.parametrize(("override", "words"), REFUSED)
def test_check_and_make_refuse_in_one_line(override: str, words: list[str], tmp_path: Path) -> None:
    cfg = parse_config("", [override])  # the schema keeps the values (a later version implements them)
    check, make = (check_engine, make_engine) if override.startswith("rollout.") else (check_strategy, make_strategy)
    with pytest.raises(ConfigError) as err:
        check(cfg)
    msg = str(err.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    with pytest.raises(ConfigError, match=r"not implemented|needs rollout\.server_urls"):
        make(cfg, tmp_path / "no-model")  # refused before the model directory is even looked at


def test_torch_backends_pass_the_checks() -> None:
    cfg = parse_config("")
    check_engine(cfg)
    check_strategy(cfg)


def _rollstream(args: list[str], env: dict[str, str], cwd: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True, env=env,
                         cwd=cwd, timeout=60)
    return res, time.monotonic() - t0


def _assert_refused(res: subprocess.CompletedProcess[str], elapsed: float, words: list[str]) -> None:
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]
    assert res.returncode != 0
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ") and all(w in lines[0] for w in words), lines[0]
    assert elapsed < 5, f"took {elapsed:.1f}s"


@pytest.mark.parametrize(("override", "words"), REFUSED)
def test_run_refuses_before_anything_starts(override: str, words: list[str], tmp_path: Path,
                                            repo_root: Path) -> None:
    home, runs = tmp_path / "home", tmp_path / "runs"
    # no broker anywhere: had the run got past the check, it would have started a local one in `home`
    env = {k: v for k, v in os.environ.items() if k not in ("ROLLSTREAM_BOOTSTRAP", "ROLLSTREAM_STORE")}
    env["ROLLSTREAM_HOME"] = str(home)
    res, elapsed = _rollstream(["run", str(repo_root / "examples" / "main.yaml"), "--run-id", "refused",
                                "--set", override, "--set", f"run.runs_dir={runs}"], env, tmp_path)
    _assert_refused(res, elapsed, words)
    assert not runs.exists()
    assert not (home / "kafka").exists()  # no broker was started
    prepared, elapsed = _rollstream(["run", str(repo_root / "examples" / "main.yaml"), "--prepare-only",
                                     "--set", override, "--set", f"run.runs_dir={runs}"], env, tmp_path)
    _assert_refused(prepared, elapsed, words)
    assert not runs.exists()


@pytest.mark.parametrize(("override", "words"), REFUSED)
def test_service_refuses_before_anything_starts(override: str, words: list[str], tmp_path: Path,
                                                bootstrap: str) -> None:
    import asyncio

    from runtime.bus import TopicAdmin
    from schemas.config import KafkaSettings

    run_id = f"refused-{os.getpid()}-{override.split('=')[1]}"
    runs = tmp_path / "runs"
    (runs / run_id).mkdir(parents=True)
    key, value = override.split("=")
    section, name = key.split(".")
    (runs / run_id / "config.yaml").write_text(f"{section}:\n  {name}: {value}\n")
    env = dict(os.environ, ROLLSTREAM_BOOTSTRAP=bootstrap, ROLLSTREAM_HOME=str(tmp_path / "home"))
    for service in ("trainer", "rollout", "recorder"):
        res, elapsed = _rollstream(["service", service, "--run", run_id, "--runs-dir", str(runs)], env, tmp_path)
        _assert_refused(res, elapsed, words)
    # a good config file with the override on the command line: refused the same way
    (runs / run_id / "config.yaml").write_text("{}\n")
    res, elapsed = _rollstream(["service", "feeder", "--run", run_id, "--runs-dir", str(runs), "--set", override],
                               env, tmp_path)
    _assert_refused(res, elapsed, words)
    assert sorted(p.name for p in (runs / run_id).iterdir()) == ["config.yaml"]

    async def run_topics() -> dict[str, object]:
        async with TopicAdmin(KafkaSettings(), bootstrap) as admin:
            return dict(await admin.describe(run_id))

    assert asyncio.run(run_topics()) == {}
