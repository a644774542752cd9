"""Where a run's files and record are: light helpers shared by the CLI, the supervisor, the
report and replay (no Kafka, no model code)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import store as st
from schemas.config import RunConfig

PRODUCERS_DONE = "producers.done"
"""In a run's folder: written by ``rollstream run``'s supervisor at the end of the run once every
service but the recorder has exited; the recorder then exits as soon as it has recorded everything
(``RecorderSettings.producers_done_file``)."""

FINAL_DIR = "final"
"""In a run's folder: the run's final model, a plain Hugging Face directory with its tokenizer
(the trainer writes it when it finishes: ``services.trainer.checkpoint.export_final``)."""


def run_dir_of(cfg: RunConfig, run_id: str) -> Path:
    """``<run.runs_dir>/<run_id>`` (absolute)."""
    return Path(cfg.run.runs_dir).resolve() / run_id


def store_dsn_of(cfg: RunConfig, run_id: str) -> str:
    """The store a run records to: ``store.dsn``, else its embedded store ``runs/<run_id>/store``."""
    return cfg.store.dsn or st.default_dsn(cfg.run.runs_dir, run_id)


def record_dsn(runs_dir: str | Path, run_id: str, explicit: str | None = None) -> str:
    """Where the record of ``run_id`` (found in ``runs_dir``) is read from, as ``rollstream run``
    wrote it: ``explicit`` (``--store`` / ``$ROLLSTREAM_STORE``), else ``store.dsn`` of the run's
    ``config.yaml``, else the run's embedded store ``<runs_dir>/<run_id>/store``."""
    if explicit:
        return explicit
    import yaml

    raw: Any = None
    try:
        raw = yaml.safe_load((Path(runs_dir) / run_id / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        pass
    section = raw.get("store") if isinstance(raw, dict) else None
    dsn = section.get("dsn") if isinstance(section, dict) else None
    return dsn if isinstance(dsn, str) and dsn else st.default_dsn(runs_dir, run_id)


def has_record(runs_dir: str | Path, run_id: str) -> bool:
    """True when the run's record can be read: its config names a store server (or a DSN that
    :func:`record_dsn` cannot judge), or its embedded store exists (a chDB directory with its
    ``metadata``)."""
    dsn = record_dsn(runs_dir, run_id)
    try:
        if st.check_dsn(dsn) != "chdb":
            return True
    except st.StoreError:
        return True  # reading it says what is wrong with it
    return (Path(st.chdb_path(dsn)) / "metadata").is_dir()


def latest_recorded_run(runs_dir: str | Path) -> str | None:
    """The run of ``runs_dir`` started last (its ``config.yaml`` written last) that has a record
    (:func:`has_record`); None when there is none."""
    configs = sorted(Path(runs_dir).glob("*/config.yaml"), key=lambda p: p.stat().st_mtime, reverse=True)
    return next((p.parent.name for p in configs if has_record(runs_dir, p.parent.name)), None)
