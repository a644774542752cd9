"""The Apache Kafka jars of the local broker, resolved from Maven Central into a per-user cache.

:func:`ensure_kafka_jars` runs Maven once on ``infra/kafka/pom.xml`` to copy the Apache Kafka
broker and its runtime dependencies into ``~/.cache/rollstream`` (or ``$ROLLSTREAM_CACHE``). A
marker file written after a complete copy makes later calls return at once; editing the pom
invalidates it. Nothing happens at import time.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from infra.kafka.home import KAFKA_VERSION, StackError, file_lock, tail_lines

__all__ = ["CACHE_ENV", "INFRA_DIR", "ensure_kafka_jars", "jar_cache_dir"]

CACHE_ENV = "ROLLSTREAM_CACHE"
"""Environment variable naming the per-user download cache (Kafka jars)."""

INFRA_DIR = Path(__file__).resolve().parent
"""The pom and the broker's log4j config in the source checkout."""

_POM = INFRA_DIR / "pom.xml"
_MARKER = ".rollstream-complete"
_MVN_TIMEOUT_S = 900.0
_CACHE_LOCK_WAIT_S = _MVN_TIMEOUT_S + 60.0


def jar_cache_dir() -> Path:
    """Where the Kafka jars go: ``$ROLLSTREAM_CACHE`` (else ``~/.cache/rollstream``) then
    ``kafka-<KAFKA_VERSION>/libs``. Not created here."""
    base = os.environ.get(CACHE_ENV) or str(Path.home() / ".cache" / "rollstream")
    return Path(base).expanduser().absolute() / f"kafka-{KAFKA_VERSION}" / "libs"


def _pom_digest() -> str:
    return hashlib.sha256(_POM.read_bytes()).hexdigest()


def _read_marker(libs: Path) -> dict[str, object] | None:
    try:
        data = json.loads((libs / _MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def ensure_kafka_jars(progress: Callable[[str], None] | None = None) -> Path:
    """Return the directory holding the Kafka broker's jars, resolving them first if needed.

    Fast path (no subprocess): the marker file in :func:`jar_cache_dir` exists and records the
    current pom's SHA-256 (or the pom is not available and the marker's Kafka version matches).
    Otherwise runs ``mvn dependency:copy-dependencies`` into a temporary sibling directory (output
    in ``<cache>/kafka-<version>/mvn.log``), writes the marker, and swaps it into place, under a
    file lock so that concurrent callers resolve once. Raises :class:`StackError` if ``mvn`` is
    missing, Maven fails or runs past 15 minutes, or the pom cannot be found.
    """
    libs = jar_cache_dir()
    pom_present = _POM.is_file()

    def ready() -> bool:
        marker = _read_marker(libs)
        if marker is None or marker.get("kafka_version") != KAFKA_VERSION:
            return False
        return not pom_present or marker.get("pom_sha256") == _pom_digest()

    if ready():
        return libs
    if not pom_present:
        raise StackError(
            f"{_POM} not found, so the Kafka jars cannot be resolved; run rollstream from a source "
            "checkout (pip install -e .) or point --bootstrap / ROLLSTREAM_BOOTSTRAP at a broker"
        )
    mvn = shutil.which("mvn")
    if not mvn:
        raise StackError(
            "mvn (Apache Maven) not found; it is needed once to fetch the Kafka jars from Maven Central: "
            "install it (e.g. `apt-get install maven`) or point --bootstrap / ROLLSTREAM_BOOTSTRAP at a broker"
        )
    root = libs.parent
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / ".lock", _CACHE_LOCK_WAIT_S, "fetching the Kafka jars"):
        if ready():  # another process finished while we waited
            return libs
        if progress:
            progress(f"fetching Apache Kafka {KAFKA_VERSION} jars from Maven Central into {root} (once)")
        tmp = root / f"libs.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        log = root / "mvn.log"
        cmd = [
            mvn, "-B", "-ntp", "-Dstyle.color=never", "-f", str(_POM),
            "dependency:copy-dependencies", f"-DoutputDirectory={tmp}", "-DincludeScope=runtime",
        ]  # fmt: skip
        try:
            with log.open("wb") as out:
                rc = subprocess.run(
                    cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    cwd=root, timeout=_MVN_TIMEOUT_S, check=False,
                ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            shutil.rmtree(tmp, ignore_errors=True)
            raise StackError(
                f"Maven ran past {_MVN_TIMEOUT_S:.0f} s fetching the Kafka jars (network?); see {log}"
            ) from None
        jars = sorted(tmp.glob("*.jar")) if tmp.is_dir() else []
        if rc != 0 or not any(j.name.startswith("kafka_2.13-") for j in jars):
            shutil.rmtree(tmp, ignore_errors=True)
            errors = [
                ln.strip().removeprefix("[ERROR]").strip()
                for ln in tail_lines(log)
                if ln.startswith("[ERROR]") and ln.strip() != "[ERROR]"
            ]
            why = errors[0] if errors else f"exit code {rc}"
            raise StackError(f"Maven could not fetch the Kafka jars: {why[:300]}; full output: {log}")
        marker = {"kafka_version": KAFKA_VERSION, "pom_sha256": _pom_digest(), "jars": len(jars)}
        (tmp / _MARKER).write_text(json.dumps(marker))
        old = root / f"libs.old-{os.getpid()}"
        if libs.exists():
            os.replace(libs, old)
        os.replace(tmp, libs)
        shutil.rmtree(old, ignore_errors=True)
        if progress:
            progress(f"Kafka jars ready in {libs} ({len(jars)} jars)")
    return libs
