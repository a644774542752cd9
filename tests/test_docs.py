"""The configs that the docs show are real configs: every ``yaml`` block of docs/scaling.md parses
strictly (unknown keys and bad values fail), and every command-line override it shows applies."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from schemas.config import parse_config

DOC = Path(__file__).resolve().parents[1] / "docs" / "scaling.md"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)


@pytest.mark.parametrize("text", blocks("yaml"))
def test_scaling_doc_configs_parse(text: str) -> None:
    cfg = parse_config(text, source="docs/scaling.md")
    assert cfg.train.strategy == "megatron" and cfg.train.ranks % cfg.train.tensor_parallel == 0
    assert cfg.placement.trainer.gpus == cfg.train.ranks  # all ranks on one node, one GPU each


def test_scaling_doc_overrides_apply() -> None:
    overrides = [shlex.split(line) for text in blocks("bash") for line in text.splitlines()
                 if line.startswith("rollstream run") and "--set" in line]
    assert overrides, "docs/scaling.md shows no rollstream run --set line"
    for words in overrides:
        sets = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
        cfg = parse_config("", sets, source="docs/scaling.md")
        assert cfg.rollout.engine in ("server", "vllm") and cfg.rollout.server_urls
