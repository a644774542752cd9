"""launch/models.py: packaged models convert once, also when runs start together."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from launch import models


def test_runs_started_together_convert_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def install(model: models.PackagedModel, progress: object) -> Path:
        return tmp_path

    def convert_gguf(src: Path, gguf_file: str, out: Path) -> Path:
        calls.append(threading.get_ident())
        partial = out.with_name(out.name + ".partial")  # the real one's shared temporary name
        partial.mkdir()
        time.sleep(0.3)  # a second converter in this window collided before the lock
        (partial / "config.json").write_text("{}")
        partial.rename(out)
        return out

    monkeypatch.setattr(models, "install", install)
    import rollout.model_init

    monkeypatch.setattr(rollout.model_init, "convert_gguf", convert_gguf)
    out = tmp_path / "models" / "smollm2-135m-instruct"
    results: list[Path | BaseException] = []
    waits: list[str] = []

    def one() -> None:
        try:
            results.append(models.ensure_model("smollm2-135m-instruct", out, progress=waits.append))
        except BaseException as e:
            results.append(e)

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == [out, out, out]
    assert len(calls) == 1
    assert any("waiting for it" in w for w in waits)  # the others were told why they wait
    assert (out / "config.json").is_file()


def test_a_directory_holding_something_else_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "m"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(models.ModelSourceError, match="exists and is not empty"):
        models.ensure_model("smollm2-135m-instruct", out)
