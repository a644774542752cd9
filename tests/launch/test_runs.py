"""The runs of a runs directory from their files (:mod:`launch.runs`): a run's state, its row in
``runs list``, the models it kept and their export, following its logs, deleting it."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import pytest

from launch import runs as rn
from launch.prepare import write_run_config
from launch.state import write_state
from schemas.config import parse_config

DEAD_PID = 999_999_999


def hf_dir(path: Path, tag: str) -> Path:
    """A stand-in Hugging Face directory (what the copy sees: files; ``tag`` tells them apart)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"tag": tag}))
    (path / "model.safetensors").write_bytes(tag.encode() * 10)
    (path / "tokenizer.json").write_text("{}")
    return path


@functools.cache
def config(steps: int) -> Any:
    return parse_config("", [f"train.steps={steps}", "run.name=toy"])


def make_run(runs: Path, run_id: str, *, steps: int = 4, done: int | None = None, phase: str = "finished",
             pid: int = DEAD_PID, lora_ckpt: bool = False) -> Path:
    """A run folder as `rollstream run` leaves it: config, supervisor state, a summary when ``done``
    steps were trained to the end, weights v<done-2..done>, checkpoints of steps 0 and 2, final/."""
    run_dir = runs / run_id
    write_run_config(config(steps), run_dir)
    write_state(run_dir, {"run_id": run_id, "supervisor_pid": pid, "phase": phase, "started_at": 1000.0,
                          "updated_at": 1090.0, "progress": {"step": 3, "steps": steps},
                          "services": {"trainer": {"state": "exited", "pid": DEAD_PID}}})
    if done is not None:
        (run_dir / "summary.json").write_text(json.dumps({
            "steps": done, "wall_s": 95.5, "config": {"train": {"steps": steps}},
            "eval": {"final": {"accuracy": 0.75, "step": done}}}))
        hf_dir(run_dir / "final", "final")
        for v in range(max(0, done - 2), done + 1):
            hf_dir(run_dir / "weights" / f"v{v:05d}", f"v{v}")
    for k in (0, 2):
        hf_dir(run_dir / "checkpoints" / f"step_{k:06d}" / "model", f"ckpt{k}")
    if lora_ckpt:
        (run_dir / "checkpoints" / "step_000002" / "adapter.safetensors").write_bytes(b"x")
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "trainer.log").write_text("a\nb\nc\n")
    (run_dir / "logs" / "feeder.log").write_text("f1\nf2")
    return run_dir


def test_states_from_the_files(tmp_path: Path) -> None:
    assert rn.state_of(make_run(tmp_path, "fin", done=4)) == "finished"
    assert rn.state_of(make_run(tmp_path, "early", done=2)) == "stopped"
    assert rn.state_of(make_run(tmp_path, "live", phase="running", pid=os.getpid())) == "running"
    assert rn.state_of(make_run(tmp_path, "killed", phase="running")) == "interrupted"
    assert rn.state_of(make_run(tmp_path, "ctrlc", phase="interrupted")) == "interrupted"
    assert rn.state_of(make_run(tmp_path, "bad", phase="failed")) == "failed"
    prepared = tmp_path / "prep"
    write_run_config(parse_config(""), prepared)
    assert rn.state_of(prepared) == "prepared"


def test_rows_of_a_runs_dir(tmp_path: Path) -> None:
    make_run(tmp_path, "b-fin", done=4)
    make_run(tmp_path, "a-killed", phase="running")
    (tmp_path / "not-a-run").mkdir()
    rows = rn.list_runs(tmp_path)
    assert [r.run_id for r in rows] == ["a-killed", "b-fin"]  # same start: by id
    killed, fin = rows
    assert (killed.name, killed.state, killed.step, killed.steps, killed.accuracy, killed.wall_s) == \
        ("toy", "interrupted", 3, 4, None, 90.0)
    assert (fin.state, fin.step, fin.accuracy, fin.wall_s) == ("finished", 4, 0.75, 95.5)
    assert fin.final_model == str(tmp_path / "b-fin" / "final") and killed.final_model is None
    assert fin.disk_bytes == sum(p.stat().st_size for p in (tmp_path / "b-fin").rglob("*") if p.is_file())
    assert rn.list_runs(tmp_path / "nowhere") == []


def test_kept_models_and_their_export(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "r", done=4, lora_ckpt=True)
    kept = rn.kept_models(run_dir)
    # weights v2..v4 and checkpoint 0; the LoRA checkpoint of step 2 holds the base, not the policy:
    # its step is kept as weights v2
    assert {k: p.relative_to(run_dir).as_posix() for k, p in kept.items()} == {
        0: "checkpoints/step_000000/model", 2: "weights/v00002", 3: "weights/v00003", 4: "weights/v00004"}
    step, source = rn.export_model(run_dir, 3, tmp_path / "out3")
    assert (step, source) == (3, run_dir / "weights" / "v00003")
    assert json.loads((tmp_path / "out3" / "config.json").read_text()) == {"tag": "v3"}
    empty = tmp_path / "empty"
    empty.mkdir()
    assert rn.export_model(run_dir, None, empty)[0] == 4  # default: final/, at the summary's step
    assert json.loads((empty / "config.json").read_text()) == {"tag": "final"}
    with pytest.raises(rn.RunFilesError, match="step 1 of run r is not kept; kept steps: 0, 2, 3, 4"):
        rn.export_model(run_dir, 1, tmp_path / "out1")
    with pytest.raises(rn.RunFilesError, match="exists and is not empty"):
        rn.export_model(run_dir, 3, tmp_path / "out3")
    assert not (tmp_path / "out1").exists() and not list(tmp_path.glob(".out*"))


def test_follow_prints_from_the_last_lines_then_what_is_appended(tmp_path: Path) -> None:
    log = tmp_path / "trainer.log"
    log.write_text("1\n2\n3\n")
    assert rn.tail_offset(log, 2) == 2 and rn.tail_offset(log, 5) == 0 and rn.tail_offset(log, 0) == 6
    got: list[str] = []
    polls: list[int] = []

    def until() -> bool:  # appends between polls, ends on the third
        polls.append(1)
        if len(polls) == 2:
            with log.open("a") as fh:
                fh.write("4\npart")
        return len(polls) == 3

    rn.follow({"trainer": log}, got.append, until=until, last_lines=1, poll_s=0.01)
    assert got == ["3", "4", "part"]
    other = tmp_path / "feeder.log"
    other.write_text("x\n")
    both: list[str] = []
    rn.follow({"trainer": log, "feeder": other}, both.append, until=lambda: True)
    # complete lines first, then a last line still without its newline
    assert both == ["[trainer] 1", "[trainer] 2", "[trainer] 3", "[trainer] 4", "[feeder] x", "[trainer] part"]


def test_a_removed_run_takes_its_shared_memory_weights_along(tmp_path: Path, shm_dir: Path) -> None:
    import torch

    from weights import new_segment_path, segment_prefix, write_segment

    gone, other = make_run(tmp_path, "gone", done=4), make_run(tmp_path, "other", done=4)
    seg = write_segment(new_segment_path(segment_prefix(gone), 4), {"w": torch.ones(1000)})
    kept = write_segment(new_segment_path(segment_prefix(other), 4), {"w": torch.ones(10)})
    size = rn.disk_bytes(gone) + seg.num_bytes
    assert seg.path.parent == shm_dir and rn.remove_run(gone) == size
    assert list(shm_dir.iterdir()) == [kept.path]


def test_a_running_run_is_not_removed(tmp_path: Path) -> None:
    live = make_run(tmp_path, "live", phase="running", pid=os.getpid())
    with pytest.raises(rn.RunFilesError, match="run live is running"):
        rn.remove_run(live)
    orphan = make_run(tmp_path, "orphan", phase="running")
    state: dict[str, Any] = json.loads((orphan / "supervisor.json").read_text())
    state["services"]["trainer"]["pid"] = os.getpid()
    write_state(orphan, state)
    with pytest.raises(rn.RunFilesError, match=rf"still has running services: trainer \(pid {os.getpid()}\)"):
        rn.remove_run(orphan)
    gone = make_run(tmp_path, "gone", done=4)
    size = rn.disk_bytes(gone)
    assert rn.remove_run(gone) == size > 0 and not gone.exists()


def test_resume_command_names_a_runs_dir_other_than_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert rn.resume_command("r1") == "rollstream resume r1"
    assert rn.resume_command("r1", tmp_path / "runs") == "rollstream resume r1"
    assert rn.resume_command("r1", "/elsewhere") == "rollstream resume r1 --runs-dir /elsewhere"
