"""The Apache Kafka jars of the local broker, downloaded by coordinates into a per-user cache.

``infra/kafka/jars.lock`` lists each jar of the broker (``group:artifact:version sha256 bytes``),
generated once from Maven's resolution of ``infra/kafka/pom.xml`` (``python -m infra.kafka.jars
lock``, maintainers only). :func:`ensure_kafka_jars` downloads them from Maven Central (or
``$ROLLSTREAM_MAVEN_REPO``) over HTTPS, checks each SHA-256, and writes them to
``~/.cache/rollstream`` (or ``$ROLLSTREAM_CACHE``); Maven is not needed. A marker file written
after a complete download makes later calls return at once; editing the lock invalidates it.
Nothing happens at import time.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from infra.kafka.home import KAFKA_VERSION, StackError, file_lock
from infra.kafka.java import cache_root

__all__ = [
    "CACHE_ENV", "INFRA_DIR", "LOCK", "MAVEN_CENTRAL", "REPO_ENV", "LockedJar", "ensure_kafka_jars",
    "jar_cache_dir", "lock_digest", "read_lock",
]  # fmt: skip

CACHE_ENV = "ROLLSTREAM_CACHE"
"""Environment variable naming the per-user download cache (Kafka jars, Java runtime)."""

REPO_ENV = "ROLLSTREAM_MAVEN_REPO"
"""Environment variable naming a Maven repository (a mirror) to download from instead."""

MAVEN_CENTRAL = "https://repo1.maven.org/maven2"

INFRA_DIR = Path(__file__).resolve().parent
"""The lock, the pom and the broker's log4j config in the source tree."""

LOCK = INFRA_DIR / "jars.lock"
_POM = INFRA_DIR / "pom.xml"
_MARKER = ".rollstream-complete"
_TIMEOUT_S = 60.0
_CACHE_LOCK_WAIT_S = 900.0


@dataclass(frozen=True)
class LockedJar:
    """One line of the lock file."""

    group: str
    artifact: str
    version: str
    sha256: str
    size_bytes: int

    @property
    def file_name(self) -> str:
        return f"{self.artifact}-{self.version}.jar"

    def url(self, repo: str) -> str:
        return f"{repo.rstrip('/')}/{self.group.replace('.', '/')}/{self.artifact}/{self.version}/{self.file_name}"


def read_lock(path: Path = LOCK) -> list[LockedJar]:
    """The jars of a lock file; a malformed line is a :class:`StackError` naming it."""
    try:
        text = path.read_text()
    except OSError as e:
        raise StackError(f"cannot read {path} ({e.strerror}); run rollstream from its source tree or a wheel "
                         "that ships it, or point --bootstrap / ROLLSTREAM_BOOTSTRAP at a broker") from None
    jars = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split()
        coords = parts[0].split(":") if parts else []
        if len(parts) != 3 or len(coords) != 3 or len(parts[1]) != 64 or not parts[2].isdigit():
            raise StackError(f"{path}:{n}: expected 'group:artifact:version sha256 bytes', got {line.strip()!r}")
        jars.append(LockedJar(coords[0], coords[1], coords[2], parts[1].lower(), int(parts[2])))
    if not jars:
        raise StackError(f"{path} lists no jars")
    return jars


def lock_digest(path: Path = LOCK) -> str:
    """SHA-256 of a file (the lock, the pom)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def jar_cache_dir() -> Path:
    """Where the Kafka jars go: ``$ROLLSTREAM_CACHE`` (else ``~/.cache/rollstream``) then
    ``kafka-<KAFKA_VERSION>/libs``. Not created here."""
    return cache_root() / f"kafka-{KAFKA_VERSION}" / "libs"


def read_marker(libs: Path) -> dict[str, object] | None:
    try:
        data = json.loads((libs / _MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_marker(libs: Path, jars: int, source: str, lock: Path = LOCK) -> None:
    marker = {"kafka_version": KAFKA_VERSION, "lock_sha256": lock_digest(lock), "jars": jars, "source": source,
              **({"pom_sha256": lock_digest(_POM)} if _POM.is_file() else {})}  # earlier rollstreams read it
    (libs / _MARKER).write_text(json.dumps(marker))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _fetch(jar: LockedJar, repo: str, dest: Path, seen: list[Path]) -> Path:
    """Download one jar into ``dest`` (or copy it from an earlier cache ``seen`` when its SHA-256
    matches), checking the SHA-256; one-line :class:`StackError` naming the URL on failure."""
    out = dest / jar.file_name
    for old in seen:
        if (old / jar.file_name).is_file() and _sha256(old / jar.file_name) == jar.sha256:
            shutil.copyfile(old / jar.file_name, out)
            return out
    url = jar.url(repo)
    h = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as resp, out.open("wb") as f:
            while chunk := resp.read(1 << 16):
                h.update(chunk)
                f.write(chunk)
    except (urllib.error.URLError, OSError, ValueError) as e:
        why = getattr(e, "reason", None) or e
        raise StackError(f"downloading {url} failed ({why}); check the network or set {REPO_ENV} to a "
                         "Maven mirror, or point --bootstrap / ROLLSTREAM_BOOTSTRAP at a broker") from None
    if h.hexdigest() != jar.sha256:
        raise StackError(f"{url}: SHA-256 {h.hexdigest()} differs from {jar.sha256} in {LOCK.name}; the download "
                         f"or the mirror ({REPO_ENV}) is corrupt: retry, or use another mirror")
    return out


def ensure_kafka_jars(progress: Callable[[str], None] | None = None, lock: Path = LOCK) -> Path:
    """Return the directory holding the Kafka broker's jars, downloading them first if needed.

    Fast path (no network): the marker file in :func:`jar_cache_dir` records the Kafka version and
    the current lock's SHA-256. Otherwise downloads every jar of the lock (four at a time, jars of an
    earlier cache with the right SHA-256 are copied) into a temporary sibling directory, writes the
    marker and swaps it into place, under a file lock so that concurrent callers download once.
    Raises :class:`StackError` (one line naming the URL) on a failed download or a SHA-256 mismatch.
    """
    libs = jar_cache_dir()

    def ready() -> bool:
        marker = read_marker(libs) or {}
        if marker.get("kafka_version") != KAFKA_VERSION:
            return False
        if not lock.is_file() or marker.get("lock_sha256") == lock_digest(lock):
            return True
        # A cache that Maven filled from the pom this lock was made from (earlier rollstream): kept.
        return (_POM.is_file() and marker.get("pom_sha256") == lock_digest(_POM)
                and {j.file_name for j in read_lock(lock)} <= {p.name for p in libs.glob("*.jar")})

    if ready():
        return libs
    jars = read_lock(lock)
    repo = os.environ.get(REPO_ENV) or MAVEN_CENTRAL
    root = libs.parent
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / ".lock", _CACHE_LOCK_WAIT_S, "fetching the Kafka jars"):
        if ready():  # another process finished while we waited
            return libs
        total_mb = sum(j.size_bytes for j in jars) / 1e6
        tmp = root / f"libs.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        done, count = [0, 0], threading.Lock()

        def one(jar: LockedJar) -> None:
            _fetch(jar, repo, tmp, [libs])
            with count:
                done[0] += 1
                done[1] += jar.size_bytes
                if progress:
                    progress(f"fetching Kafka {KAFKA_VERSION} jars from {repo}: {done[0]}/{len(jars)} "
                             f"({done[1] / 1e6:.1f} of {total_mb:.1f} MB) into {root} (once)")

        try:
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(one, jars))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        write_marker(tmp, len(jars), repo, lock)
        old = root / f"libs.old-{os.getpid()}"
        if libs.exists():
            os.replace(libs, old)
        os.replace(tmp, libs)
        shutil.rmtree(old, ignore_errors=True)
        if progress:
            progress(f"Kafka jars ready in {libs} ({len(jars)} jars, {total_mb:.1f} MB)")
    return libs


def write_lock(out: Path = LOCK) -> int:
    """Regenerate the lock from Maven's resolution of the pom (needs ``mvn``); returns the jar count."""
    with tempfile.TemporaryDirectory() as d:
        listing, copies = Path(d) / "deps.txt", Path(d) / "libs"
        base = ["mvn", "-B", "-ntp", "-q", "-f", str(_POM)]
        subprocess.run([*base, "dependency:list", "-DincludeScope=runtime", f"-DoutputFile={listing}"], check=True)
        subprocess.run([*base, "dependency:copy-dependencies", "-DincludeScope=runtime",
                        f"-DoutputDirectory={copies}"], check=True)  # fmt: skip
        lines = []
        for m in re.finditer(r"^\s+([\w.\-]+):([\w.\-]+):jar:([\w.\-]+):(?:compile|runtime)", listing.read_text(), re.M):
            g, a, v = m.groups()
            path = copies / f"{a}-{v}.jar"
            lines.append(f"{g}:{a}:{v} {_sha256(path)} {path.stat().st_size}")
    header = [ln for ln in out.read_text().splitlines() if ln.startswith("#")] if out.is_file() else []
    out.write_text("\n".join([*header, *sorted(lines)]) + "\n")
    return len(lines)


if __name__ == "__main__":
    if sys.argv[1:] != ["lock"]:
        sys.exit("usage: python -m infra.kafka.jars lock")
    print(f"{LOCK}: {write_lock()} jars")
