"""launch.prepare: a run's visual tasks and its model must agree, refused in one line before anything
starts (a visual task with a text model, a VLM without visual tasks, an image size outside the
processor's bounds, what visual runs do not support yet); the tiny VLM is created when asked."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.prepare import RunError, check_vision, prepare_model
from schemas.config import parse_config

SHAPES = "data: {domains: [{name: see, source: shapes}]}\n"


@pytest.mark.parametrize("config, model, needle", [
    (SHAPES, "text", "data.domains[0] (shapes) shows images: model.path"),
    ("data: {domains: [{name: a, source: arith}]}\n", "vlm", "is a vision-language model but no data.domains"),
    (SHAPES + "train: {strategy: fsdp2}\n", "vlm", "train.strategy: 'fsdp2' is not supported with visual tasks"),
    ("data: {domains: [{name: a, source: arith}]}\ntrain: {freeze_vision: true}\n", "text",
     "train.freeze_vision: true needs a vision-language model"),
    ("data: {domains: [{name: see, source: shapes, kwargs: {size: 224}}]}\n", "vlm",
     "data.domains[0].kwargs.size: image size 224x224 (50176 pixels) is outside"),
    ("data: {domains: [{name: see, source: shapes}, {name: a, source: arith}]}\n", "vlm",
     "'see' shows images but 'a' does not"),
    ("data: {domains: [{name: lake, source: frozenlake_pixels, kwargs: {size: 6, cell_px: 28}}]}\n", "vlm",
     "data.domains[0].kwargs.size and cell_px: image size 168x168"),
])
def test_visual_tasks_and_the_model_must_agree(config: str, model: str, needle: str, vlm_dir: Path,
                                               model_dir: Path) -> None:
    with pytest.raises(RunError) as e:
        check_vision(parse_config(config), vlm_dir if model == "vlm" else model_dir)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_visual_run_creates_the_tiny_vlm(tmp_path: Path) -> None:
    cfg = parse_config(SHAPES + "model: {init: {vision: true, hidden_size: 32, num_layers: 1, num_heads: 2, "
                       "intermediate_size: 64}}")
    path = prepare_model(cfg, tmp_path)
    assert (path / "preprocessor_config.json").is_file()
    check_vision(cfg, path)  # agrees: no error
    check_vision(parse_config("data: {domains: [{name: lake, source: frozenlake_pixels}]}\n"), path)  # 112 px
    check_vision(parse_config("data: {domains: [{name: lake, source: frozenlake_pixels}]}\n"
                              "rollout: {history_turns: 2}\n"), path)  # history windows show images too
    text = parse_config(SHAPES + "model: {init: {hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}}")
    with pytest.raises(RunError, match=r"data.domains\[0\] \(shapes\) shows images"):
        prepare_model(text, tmp_path / "text")  # the run's preparation refuses before any service starts
