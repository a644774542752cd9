"""The lock-file resolver of the Kafka jars (infra.kafka.jars): downloads from a file:// Maven
repository in a temporary directory (no network), checksum checks, the marker, the real lock."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from infra.kafka import jars
from infra.kafka.home import KAFKA_VERSION, StackError


def _repo(tmp_path: Path, blobs: dict[str, bytes]) -> tuple[Path, Path]:
    """A file:// repository holding ``blobs`` (by artifact, group ``org.example``, version 1.0) and a
    lock listing them; returns (repo, lock)."""
    repo, lines = tmp_path / "repo", []
    for artifact, data in blobs.items():
        d = repo / "org" / "example" / artifact / "1.0"
        d.mkdir(parents=True)
        (d / f"{artifact}-1.0.jar").write_bytes(data)
        lines.append(f"org.example:{artifact}:1.0 {hashlib.sha256(data).hexdigest()} {len(data)}")
    lock = tmp_path / "jars.lock"
    lock.write_text("# test lock\n" + "\n".join(lines) + "\n")
    return repo, lock


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(jars.CACHE_ENV, str(tmp_path / "cache"))


def test_downloads_verifies_and_then_answers_from_the_marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo, lock = _repo(tmp_path, {"a": b"alpha" * 100, "b": b"beta"})
    monkeypatch.setenv(jars.REPO_ENV, repo.as_uri())
    seen: list[str] = []
    libs = jars.ensure_kafka_jars(seen.append, lock=lock)
    assert libs == tmp_path / "cache" / f"kafka-{KAFKA_VERSION}" / "libs"
    assert (libs / "a-1.0.jar").read_bytes() == b"alpha" * 100 and (libs / "b-1.0.jar").read_bytes() == b"beta"
    assert any("2/2" in m for m in seen), seen
    marker = jars.read_marker(libs)
    assert marker is not None and marker["lock_sha256"] == jars.lock_digest(lock) and marker["jars"] == 2
    # Second call: from the marker, with the repository gone.
    import shutil

    shutil.rmtree(repo)
    assert jars.ensure_kafka_jars(lock=lock) == libs
    # An edited lock invalidates the marker: the jar still in the cache is reused, the new one fetched.
    lock.write_text(lock.read_text() + f"org.example:c:1.0 {hashlib.sha256(b'c').hexdigest()} 1\n")
    with pytest.raises(StackError, match=r"org/example/c/1\.0/c-1\.0\.jar"):
        jars.ensure_kafka_jars(lock=lock)
    assert (libs / "a-1.0.jar").is_file()  # the complete cache is left as it was


def test_a_checksum_mismatch_is_one_line_naming_the_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo, lock = _repo(tmp_path, {"a": b"alpha"})
    (repo / "org/example/a/1.0/a-1.0.jar").write_bytes(b"tampered")
    monkeypatch.setenv(jars.REPO_ENV, repo.as_uri())
    with pytest.raises(StackError) as err:
        jars.ensure_kafka_jars(lock=lock)
    msg = str(err.value)
    assert "\n" not in msg and "SHA-256" in msg and f"{repo.as_uri()}/org/example/a/1.0/a-1.0.jar" in msg
    assert hashlib.sha256(b"tampered").hexdigest() in msg
    assert not jars.jar_cache_dir().exists()
    assert not list(jars.jar_cache_dir().parent.glob("libs.tmp-*"))


def test_an_unreachable_repository_is_one_line_naming_the_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, lock = _repo(tmp_path, {"a": b"alpha"})
    monkeypatch.setenv(jars.REPO_ENV, (tmp_path / "nowhere").as_uri())
    with pytest.raises(StackError) as err:
        jars.ensure_kafka_jars(lock=lock)
    assert "\n" not in str(err.value) and "nowhere/org/example/a/1.0/a-1.0.jar" in str(err.value)
    assert jars.REPO_ENV in str(err.value)


@pytest.mark.parametrize("line", ["org.example:a 0123 5", "org.example:a:1.0 abc 5", "org.example:a:1.0 " + "0" * 64])
def test_a_malformed_lock_line_is_named(tmp_path: Path, line: str) -> None:
    lock = tmp_path / "jars.lock"
    lock.write_text(f"# header\n{line}\n")
    with pytest.raises(StackError, match=r"jars\.lock:2: expected 'group:artifact:version sha256 bytes'"):
        jars.read_lock(lock)


def test_the_real_lock_holds_the_broker_and_slf4j_2() -> None:
    locked = {j.artifact: j for j in jars.read_lock()}
    assert locked["kafka_2.13"].version == KAFKA_VERSION == locked["kafka-clients"].version
    assert locked["slf4j-api"].version.startswith("2.")
    assert {"log4j-core", "log4j-slf4j2-impl", "scala-library"} <= set(locked)
    url = locked["kafka_2.13"].url(jars.MAVEN_CENTRAL)
    assert url == f"https://repo1.maven.org/maven2/org/apache/kafka/kafka_2.13/{KAFKA_VERSION}/kafka_2.13-{KAFKA_VERSION}.jar"


def test_a_cache_maven_filled_from_the_same_pom_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    _, lock = _repo(tmp_path, {"a": b"alpha", "b": b"beta"})
    monkeypatch.setenv(jars.REPO_ENV, (tmp_path / "nowhere").as_uri())
    libs = jars.jar_cache_dir()
    libs.mkdir(parents=True)
    (libs / "a-1.0.jar").write_bytes(b"alpha")
    pom = jars.lock_digest(jars.INFRA_DIR / "pom.xml")
    (libs / ".rollstream-complete").write_text(json.dumps({"kafka_version": KAFKA_VERSION, "pom_sha256": pom}))
    with pytest.raises(StackError, match="nowhere/org/example/"):  # b is missing: downloaded (and fails here)
        jars.ensure_kafka_jars(lock=lock)
    (libs / "b-1.0.jar").write_bytes(b"beta")
    assert jars.ensure_kafka_jars(lock=lock) == libs  # complete: kept as Maven left it
