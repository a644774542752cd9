"""A stack that travels: ``rollstream stack bundle DIR`` and ``stack up --from DIR``.

:func:`write_bundle` writes into DIR what an offline Linux x86-64 node needs to run the broker:
``runtime.tar.xz`` (a Java runtime jlink'd down to :data:`MODULES` when the JDK has ``jlink``, else a
copy of the runtime without headers and man pages), ``kafka-libs.tar.xz`` (the locked jars less
:data:`DROP_JARS`, zstd-jni's and snappy's natives cut to linux-x86_64, every jar re-stored without
deflate so that xz compresses across them), ``wheels/`` (:data:`WHEELS` and the project's own wheel
for CPython :data:`TARGET_PYTHON`, from PyPI) and ``manifest.json`` (versions, sizes).
:func:`install_bundle` unpacks a bundle into the cache (no network): the jars where
:func:`~infra.kafka.jars.ensure_kafka_jars` finds them, the runtime where
:func:`~infra.kafka.java.find_java` does. Sizes measured: infra/kafka/README.md.
"""

from __future__ import annotations

import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from infra.kafka.home import KAFKA_VERSION, StackError
from infra.kafka.jars import LOCK, ensure_kafka_jars, jar_cache_dir, lock_digest, write_marker
from infra.kafka.java import bundle_runtime_dir, find_java

__all__ = ["DROP_JARS", "MODULES", "TARGET_PYTHON", "WHEELS", "install_bundle", "trim_jar", "write_bundle"]

MODULES = (
    "java.base", "java.desktop", "java.logging", "java.management", "java.naming", "java.security.jgss",
    "java.security.sasl", "java.sql", "java.xml", "java.xml.crypto", "jdk.management", "jdk.net",
    "jdk.security.auth", "jdk.unsupported",
)  # fmt: skip
"""The JDK modules a KRaft broker (PLAINTEXT and SASL_SSL, every compression) loads classes from,
found with ``-Xlog:class+load`` (java.desktop for java.beans)."""

DROP_JARS = (
    "scala-reflect", "jose4j", "commons-beanutils", "commons-collections", "commons-digester",
    "commons-logging", "jackson-dataformat-csv",
)  # fmt: skip
"""Locked jars a KRaft broker without OAuth never loads (``-Xlog:class+load``; scala-reflect is for
scala-logging's compile-time macros, jose4j for OAUTHBEARER, the commons for XML validators)."""

_NATIVES = {"zstd-jni": ("linux/amd64/", ("aix/", "darwin/", "freebsd/", "linux/", "win/")),
            "snappy-java": ("org/xerial/snappy/native/Linux/x86_64/", ("org/xerial/snappy/native/",))}

TARGET_PYTHON = "3.12"
WHEELS = ("msgspec>=0.22,<0.23", "aiokafka>=0.14,<0.15", "async-timeout", "cramjam>=2.8")
"""What a plain PyTorch image (torch, transformers, typer, rich, uvloop, aiohttp, pyyaml) lacks for
the Kafka side of the services; chDB (hundreds of MB) stays out."""

_PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
_REPO = Path(__file__).resolve().parents[2]


def trim_jar(src: Path, dest: Path) -> None:
    """Copy a jar with every entry stored (no deflate), dropping other platforms' natives."""
    keep, native_roots = next((v for k, v in _NATIVES.items() if src.name.startswith(k + "-")), ("", ()))
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            name = info.filename
            if native_roots and name.startswith(native_roots) and not name.startswith(keep) and not name.endswith("/"):
                continue
            out = zipfile.ZipInfo(name, info.date_time)
            out.external_attr = info.external_attr
            zout.writestr(out, zin.read(info), zipfile.ZIP_STORED)


def _tar_into(src: Path, sink: IO[bytes]) -> None:
    with tarfile.open(fileobj=sink, mode="w|") as tar:
        for path in sorted(src.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(src)), recursive=False)


def _xz_dir(src: Path, out: Path, preset: int) -> None:
    """``src`` as a tar compressed by xz: the ``xz`` program on all cores if there is one (Python's
    lzma is single-threaded: many minutes for the runtime), else :mod:`lzma`."""
    xz = shutil.which("xz")
    if xz is None:
        with lzma.open(out, "wb", preset=preset) as sink:
            _tar_into(src, sink)  # type: ignore[arg-type]
        return
    with out.open("wb") as f, subprocess.Popen([xz, f"-{preset}", "-T0", "-c"], stdin=subprocess.PIPE, stdout=f) as proc:
        assert proc.stdin is not None
        with proc.stdin as sink:
            _tar_into(src, sink)
    if proc.returncode != 0:
        raise StackError(f"xz failed (exit code {proc.returncode}) writing {out}")


def _java_home(jdk: Path | None) -> Path:
    if jdk is not None:
        return jdk
    return Path(os.path.realpath(find_java(install=False))).parent.parent


def _runtime(jdk_home: Path, out: Path, progress: Callable[[str], None]) -> str:
    """Write the runtime into ``out``; returns how (``jlink`` or ``copy``)."""
    jlink = jdk_home / "bin" / "jlink"
    if jlink.is_file():
        progress(f"jlink: a runtime of {len(MODULES)} modules from {jdk_home}")
        for compress in ("--compress=zip-0", "--compress=0"):
            shutil.rmtree(out, ignore_errors=True)
            cmd = [str(jlink), "--add-modules", ",".join(MODULES), "--output", str(out), "--strip-debug",
                   "--no-header-files", "--no-man-pages", compress]
            if subprocess.run(cmd, capture_output=True, timeout=600, check=False).returncode == 0:
                strip = shutil.which("strip")
                if strip:  # libjvm.so and friends carry symbols
                    libs = [str(p) for p in out.rglob("*.so")]
                    subprocess.run([strip, "--strip-unneeded", *libs], capture_output=True, timeout=300, check=False)
                return "jlink"
        progress(f"jlink of {jdk_home} failed (no jmods?): copying the runtime whole")
    shutil.copytree(jdk_home, out, symlinks=True, ignore=shutil.ignore_patterns("include", "man", "jmods", "src.zip", "demo"))
    return "copy"


def _wheels(out: Path, progress: Callable[[str], None]) -> None:
    out.mkdir()
    progress(f"downloading wheels for CPython {TARGET_PYTHON} linux-x86_64: {', '.join(WHEELS)}")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    plat = [a for p in _PLATFORMS for a in ("--platform", p)]
    cmds = [[*pip, "download", "--no-deps", "--only-binary", ":all:", "--python-version", TARGET_PYTHON, *plat,
             "-d", str(out), *WHEELS],
            [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(_REPO)]]
    for cmd in cmds:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        if proc.returncode != 0:
            tail = ((proc.stderr or proc.stdout).strip().splitlines() or ["(no output)"])[-1]
            raise StackError(f"building the bundle's wheels failed: {tail[:200]} (run: {' '.join(cmd)})")


def write_bundle(out: Path, progress: Callable[[str], None] = lambda _: None, jdk: Path | None = None,
                 wheels: bool = True, preset: int = 9) -> dict[str, object]:
    """Write the bundle into ``out`` (absent or empty); returns the manifest (also ``manifest.json``).

    ``jdk``: the JDK (home) to jlink from (default: the one that runs the broker here);
    ``wheels=False`` leaves ``wheels/`` out; ``preset``: the xz level.
    """
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise StackError(f"{out} exists and is not an empty directory; name a new one")
    libs = ensure_kafka_jars(progress)
    home = _java_home(jdk)
    if not (home / "bin" / "java").is_file():
        raise StackError(f"{home} holds no bin/java; --jdk names a JDK's home directory")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        runtime, trimmed = Path(tmp) / "runtime", Path(tmp) / "libs"
        how = _runtime(home, runtime, progress)
        trimmed.mkdir()
        jars = [j for j in sorted(libs.glob("*.jar")) if not j.name.startswith(tuple(d + "-" for d in DROP_JARS))]
        progress(f"trimming {len(jars)} jars (natives of linux-x86_64 only, entries stored)")
        for jar in jars:
            trim_jar(jar, trimmed / jar.name)
        progress(f"xz -{preset}: the runtime and the jars")
        _xz_dir(runtime, out / "runtime.tar.xz", preset)
        _xz_dir(trimmed, out / "kafka-libs.tar.xz", preset)
        java_release = (runtime / "release").read_text() if (runtime / "release").is_file() else ""
    if wheels:
        _wheels(out / "wheels", progress)
    files = {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
    version = next((ln.split("=", 1)[1].strip('"') for ln in java_release.splitlines()
                    if ln.startswith("JAVA_VERSION=")), "?")
    manifest: dict[str, object] = {
        "kafka_version": KAFKA_VERSION, "lock_sha256": lock_digest(LOCK), "java_version": version,
        "runtime": how, "jdk": str(home), "jars": len(jars), "dropped_jars": list(DROP_JARS), "files": files,
        "total_bytes": sum(files.values()),
    }  # fmt: skip
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _extract(archive: Path, dest: Path) -> Path:
    tmp = dest.with_name(dest.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with tarfile.open(archive, "r:xz") as tar:
            tar.extractall(tmp, filter="tar")
    except (OSError, tarfile.TarError, EOFError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise StackError(f"cannot unpack {archive} ({e}); write the bundle again (`rollstream stack bundle`)") from None
    return tmp


def install_bundle(src: Path, progress: Callable[[str], None] = lambda _: None) -> dict[str, object]:
    """Unpack the bundle ``src`` into the cache (the runtime and the jars); returns its manifest.
    A missing or foreign bundle is a one-line :class:`StackError`."""
    try:
        manifest = json.loads((src / "manifest.json").read_text())
    except (OSError, ValueError):
        raise StackError(f"{src} is not a bundle (no readable manifest.json); write one with "
                         "`rollstream stack bundle DIR`") from None
    if manifest.get("kafka_version") != KAFKA_VERSION:
        raise StackError(f"the bundle {src} holds Kafka {manifest.get('kafka_version')}, this rollstream runs "
                         f"{KAFKA_VERSION}; write the bundle with this version")
    progress(f"unpacking the bundle {src} (Java {manifest.get('java_version')}, Kafka {KAFKA_VERSION})")
    pairs = [(src / "runtime.tar.xz", bundle_runtime_dir()), (src / "kafka-libs.tar.xz", jar_cache_dir())]
    for archive, dest in pairs:
        tmp = _extract(archive, dest)
        if dest == jar_cache_dir():
            write_marker(tmp, len(list(tmp.glob("*.jar"))), f"bundle {src}")
        old = dest.with_name(dest.name + f".old-{os.getpid()}")
        if dest.exists():
            os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    return dict(manifest)

