"""The travelling stack (infra.kafka.bundle) on small fakes: a fake JDK without jlink (copied), fake
jars with natives for several platforms, no wheels; then unpacking it into an empty cache. The
real bundle's size bound is a bench test (it jlinks and xz-compresses 90 MB: minutes)."""

from __future__ import annotations

import json
import tarfile
import zipfile
from pathlib import Path

import pytest

from infra.kafka import bundle, jars, java
from infra.kafka.home import KAFKA_VERSION, StackError

MiB = 2**20


def _jar(path: Path, entries: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in entries.items():
            z.writestr(name, data)


@pytest.fixture
def src(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache holding fake jars (marked complete for the real lock) and a fake JDK home."""
    monkeypatch.setenv(jars.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(jars.REPO_ENV, (tmp_path / "no-repo").as_uri())  # nothing may be downloaded
    libs = jars.jar_cache_dir()
    libs.mkdir(parents=True)
    _jar(libs / "zstd-jni-1.5.6-10.jar", {"linux/amd64/libzstd-jni.so": b"\x7fELF" * 100,
                                         "darwin/aarch64/libzstd-jni.dylib": b"mac" * 100,
                                         "win/amd64/zstd.dll": b"win" * 100, "com/github/luben/zstd/Zstd.class": b"c"})
    _jar(libs / "snappy-java-1.1.10.7.jar", {"org/xerial/snappy/native/Linux/x86_64/libsnappyjava.so": b"s" * 50,
                                            "org/xerial/snappy/native/Mac/aarch64/libsnappyjava.dylib": b"m" * 50,
                                            "org/xerial/snappy/Snappy.class": b"c"})
    _jar(libs / "scala-reflect-2.13.16.jar", {"scala/reflect/api/Trees.class": b"t" * 1000})
    _jar(libs / f"kafka-clients-{KAFKA_VERSION}.jar", {"org/apache/kafka/Producer.class": b"p" * 100_000})
    jars.write_marker(libs, 4, "test")
    jdk = tmp_path / "jdk"
    for rel, text in {"bin/java": "#!/bin/sh\necho fake\n", "release": 'JAVA_VERSION="25.0.2"\n',
                      "lib/modules": "m" * 1000, "include/jni.h": "h", "man/man1/java.1": "man"}.items():
        (jdk / rel).parent.mkdir(parents=True, exist_ok=True)
        (jdk / rel).write_text(text)
    (jdk / "bin" / "java").chmod(0o755)
    return jdk


def test_bundle_contents_and_sizes(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    manifest = bundle.write_bundle(out, jdk=src, wheels=False, preset=0)
    assert manifest["runtime"] == "copy" and manifest["java_version"] == "25.0.2" and manifest["jars"] == 3
    assert json.loads((out / "manifest.json").read_text()) == manifest
    files = manifest["files"]
    assert isinstance(files, dict) and set(files) == {"runtime.tar.xz", "kafka-libs.tar.xz"}
    assert manifest["total_bytes"] == sum(p.stat().st_size for p in out.iterdir() if p.name != "manifest.json")
    assert manifest["total_bytes"] < 1 * MiB
    with tarfile.open(out / "runtime.tar.xz") as tar:
        names = set(tar.getnames())
        assert {"bin/java", "lib/modules", "release"} <= names and not any(n.startswith(("include", "man")) for n in names)
    unpacked = tmp_path / "libs"
    with tarfile.open(out / "kafka-libs.tar.xz") as tar:
        tar.extractall(unpacked, filter="tar")
    assert sorted(p.name for p in unpacked.iterdir()) == [
        f"kafka-clients-{KAFKA_VERSION}.jar", "snappy-java-1.1.10.7.jar", "zstd-jni-1.5.6-10.jar"]
    with zipfile.ZipFile(unpacked / "zstd-jni-1.5.6-10.jar") as z:
        assert z.namelist() == ["linux/amd64/libzstd-jni.so", "com/github/luben/zstd/Zstd.class"]
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
        assert z.read("linux/amd64/libzstd-jni.so") == b"\x7fELF" * 100
    with zipfile.ZipFile(unpacked / "snappy-java-1.1.10.7.jar") as z:
        assert not any("Mac" in n for n in z.namelist()) and "org/xerial/snappy/Snappy.class" in z.namelist()


def test_a_non_empty_target_is_refused(src: Path, tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(StackError, match="is not an empty directory"):
        bundle.write_bundle(tmp_path / "full", jdk=src, wheels=False, preset=0)


def test_install_bundle_fills_an_empty_cache_offline(src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "bundle"
    bundle.write_bundle(out, jdk=src, wheels=False, preset=0)
    monkeypatch.setenv(jars.CACHE_ENV, str(tmp_path / "node-cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setattr(java.importlib.util, "find_spec", lambda name: None)
    bundle.install_bundle(out)
    libs = jars.ensure_kafka_jars()  # from the marker: the repository is unreachable
    assert libs == tmp_path / "node-cache" / f"kafka-{KAFKA_VERSION}" / "libs"
    assert len(list(libs.glob("*.jar"))) == 3
    assert java.find_java(install=False) == str(tmp_path / "node-cache" / "runtime" / "bin" / "java")
    bundle.install_bundle(out)  # again: replaces what is there
    assert len(list(libs.glob("*.jar"))) == 3


def test_install_bundle_refuses_what_is_not_a_bundle(tmp_path: Path) -> None:
    with pytest.raises(StackError, match="is not a bundle"):
        bundle.install_bundle(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"kafka_version": "3.0.0"}))
    with pytest.raises(StackError, match=r"holds Kafka 3\.0\.0"):
        bundle.install_bundle(tmp_path)


@pytest.mark.bench
def test_the_real_bundle_fits_in_60_mib_with_the_project(tmp_path: Path) -> None:
    manifest = bundle.write_bundle(tmp_path / "bundle")
    assert manifest["runtime"] == "jlink"
    assert isinstance(manifest["total_bytes"], int) and manifest["total_bytes"] <= 60 * MiB, manifest
