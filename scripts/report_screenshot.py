"""Render a run's report (``rollstream report``) in headless Chromium and save its first screen.

Makes ``docs/img/report.png``, the picture of the report in ``docs/analytics.md``::

    apt-get install -y chromium            # Debian's package (any Chromium or Chrome will do)
    python scripts/report_screenshot.py RUN --runs-dir runs            # -> docs/img/report.png
    python scripts/report_screenshot.py --html runs/RUN/report/index.html --out /tmp/report.png

The report is written to a temporary directory (the run's own ``report/`` is left alone) unless
``--html`` names a page already made. The browser gets a window of ``--size`` (default 1280x900)
and no network; it exits 1 with one line when no Chromium is found or it fails.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_browser(given: str) -> str:
    for name in (given, *BROWSERS) if given else BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    sys.exit("error: no Chromium found (apt-get install -y chromium, or pass --chromium PATH)")


def make_report(run: str, runs_dir: Path, out_dir: Path) -> Path:
    cmd = [sys.executable, "-m", "cli", "report", run, "--runs-dir", str(runs_dir), "--out", str(out_dir)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"error: {' '.join(cmd)} failed")
    return out_dir / "index.html"


def screenshot(browser: str, page: Path, png: Path, width: int, height: int) -> None:
    png.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as profile:
        cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--mute-audio",
               "--no-first-run", "--force-device-scale-factor=1", f"--user-data-dir={profile}",
               f"--window-size={width},{height}", f"--screenshot={png.resolve()}", page.resolve().as_uri()]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if res.returncode != 0 or not png.is_file():
        tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
        sys.exit(f"error: {Path(browser).name} exited {res.returncode} without a screenshot: {tail}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", nargs="?", help="Run id (its report is made first).")
    ap.add_argument("--runs-dir", type=Path, default=Path("runs"), help="Directory of run folders.")
    ap.add_argument("--html", type=Path, help="A report page already made (instead of a run).")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "report.png", help="The PNG to write.")
    ap.add_argument("--size", default="1280x900", help="Window WIDTHxHEIGHT in pixels.")
    ap.add_argument("--chromium", default="", help="The browser binary (default: the first of chromium, "
                    "chromium-browser, google-chrome on PATH).")
    a = ap.parse_args()
    if bool(a.run) == bool(a.html):
        ap.error("give a run or --html, one of them")
    try:
        width, height = (int(v) for v in a.size.lower().split("x"))
    except ValueError:
        ap.error(f"--size {a.size!r}: expected WIDTHxHEIGHT, e.g. 1280x900")
    browser = find_browser(a.chromium)
    with tempfile.TemporaryDirectory() as tmp:
        page = a.html or make_report(a.run, a.runs_dir.resolve(), Path(tmp) / "report")
        screenshot(browser, page, a.out, width, height)
    print(a.out)


if __name__ == "__main__":
    main()
