"""The docs show what the code does: every ``yaml`` block of docs/scaling.md parses strictly
(unknown keys and bad values fail) and every command-line override it shows applies; the tables of
docs/architecture.md list the services and topics the code has."""

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


ARCHITECTURE = DOC.parent / "architecture.md"


def section(title: str) -> str:
    text = ARCHITECTURE.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def test_the_services_table_of_the_architecture_is_the_table_of_services() -> None:
    """docs/architecture.md, "Services", shows :data:`schemas.services.SERVICES` as it is."""
    from schemas.services import markdown_table

    lines = section("Services").splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("| service |"))
    table = lines[first:first + next(i for i, line in enumerate(lines[first:]) if not line.startswith("|"))]
    assert "\n".join(table) + "\n" == markdown_table(), (
        "docs/architecture.md's services table is stale: paste schemas.services.markdown_table() into it")


def test_every_topic_is_in_the_architectures_topic_table() -> None:
    from schemas.topics import TOPICS

    rows = [line for line in section("Events and topics").splitlines() if line.startswith("| `")]
    named = {t.split("`")[1] for row in rows for t in row.split("|")[1].split("/")}
    assert named == set(TOPICS)
