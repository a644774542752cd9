from __future__ import annotations

import typing

import msgspec
import pytest

from schemas.config import ConfigError, RunConfig, parse_config, to_dict


def test_empty_config_is_all_defaults() -> None:
    cfg = parse_config("")
    assert cfg == RunConfig()
    assert cfg.max_inflight == cfg.train.batch_size * 2


@pytest.mark.parametrize(
    ("text", "overrides", "needle"),
    [
        ("train: {foo: 1}", [], "unknown key 'train.foo'"),
        ("bogus: {}", [], "unknown key 'bogus'"),
        ("train: {lr: abc}", [], "train.lr"),
        ("algorithm: {adv_estimator: nope}", [], "allowed one of: 'grpo'"),
        ("data: {domains: [{name: a, ratio: x}]}", [], "data.domains.0.ratio"),
        ("train: {batch_size: 10}", [], "multiple of rollout.group_size"),
        ("rollout: {temperature: 0}", [], "rollout.temperature"),
        ("", ["train.batch_size=abc"], "train.batch_size"),
        ("", ["nokey"], "expected KEY=VALUE"),
        ("", ["train.nope=1"], "unknown key 'train.nope'"),
        ("train: [", [], "not valid YAML"),
        ("- a\n- b", [], "top level must be a mapping"),
    ],
)
def test_errors_name_the_key(text: str, overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text, overrides)
    msg = str(info.value)
    assert needle in msg
    assert "\n" not in msg


def test_overrides_are_typed_like_the_file() -> None:
    cfg = parse_config(
        "train: {lr: 0.1}\ndata: {domains: [{name: a}]}",
        ["train.lr=1e-5", "rollout.async_ratio=0", "data.domains.0.ratio=2"],
    )
    assert cfg.train.lr == pytest.approx(1e-5)
    assert cfg.rollout.async_ratio == 0
    assert cfg.max_inflight == cfg.train.batch_size
    assert cfg.data.domains[0].ratio == 2.0


def test_roundtrip_through_builtins() -> None:
    cfg = parse_config("rollout: {group_size: 4}\ntrain: {batch_size: 16}")
    again = msgspec.convert(to_dict(cfg), RunConfig)
    assert again == cfg


def test_every_config_field_is_documented_and_docs_are_current() -> None:
    from pathlib import Path

    from schemas.docgen import SECTIONS, field_docs, render

    documented = {cls for _, cls in SECTIONS}

    def sections(cls: type, prefix: str) -> list[tuple[str, type]]:  # every Struct reachable from RunConfig
        hints = typing.get_type_hints(cls)
        out = []
        for name in cls.__struct_fields__:
            for tp in (hints[name], *typing.get_args(hints[name])):
                if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
                    out += [(f"{prefix}{name}", tp), *sections(tp, f"{prefix}{name}.")]
        return out

    undocumented = [path for path, cls in sections(RunConfig, "") if cls not in documented]
    assert not undocumented, f"config sections missing from schemas.docgen.SECTIONS: {undocumented}"
    for path, cls in SECTIONS:
        docs = field_docs(cls)
        missing = [f for f in cls.__struct_fields__ if not docs.get(f)]
        assert not missing, f"{path}: fields without a docstring: {missing}"
    committed = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    assert committed == render(), "docs/config.md is stale: run `python -m schemas.docgen > docs/config.md`"
