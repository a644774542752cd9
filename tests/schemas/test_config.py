from __future__ import annotations

import copy
import re
import types
import typing
from pathlib import Path
from typing import Any

import msgspec
import pytest

from schemas.config import (
    AlgorithmConfig,
    ConfigError,
    RolloutConfig,
    RunConfig,
    TinyModelSpec,
    TrainConfig,
    check_tiny_spec,
    parse_config,
    parse_raw,
    to_dict,
)
from schemas.config.base import bounds, split_annotated


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


# --------------------------------------------------------------------------- declared bounds

def _placed(path: str) -> tuple[list[str], dict[str, Any]]:
    """Where a section of ``docgen.SECTIONS`` sits in a raw config: its key names (one concrete
    item for a list or dict of sections) and the keys that item needs."""
    if path == "data.domains[]":
        return ["data", "domains", "0"], {"name": "a"}
    if path == "judge.models.<name>":
        return ["judge", "models", "q"], {"path": "m"}
    if path == "placement.<service>":
        return ["placement", "trainer"], {}
    return path.split("."), {}


def _violation(tp: Any) -> tuple[str, Any] | None:
    """A value just outside the bounds ``tp`` declares, with the key suffix it is reported at
    (``""``, or ``.0`` / ``.x`` for an item of a list or dict); None when ``tp`` declares none."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next(filter(None, (_violation(a) for a in typing.get_args(tp))), None)
    base, metas = split_annotated(tp)
    for m in metas:
        if m.pattern is not None:
            return "", "not a valid value!"
        if m.min_length is not None:
            return "", base() if isinstance(base, type) else []
        step = 1 if base is int else 0.5
        if m.ge is not None or m.le is not None:
            return "", m.ge - step if m.ge is not None else m.le + step
        if m.gt is not None or m.lt is not None:
            return "", m.gt if m.gt is not None else m.lt
    if typing.get_origin(base) in (list, dict):
        inner = _violation(typing.get_args(base)[-1])
        if inner:
            return (".0", [inner[1]]) if typing.get_origin(base) is list else (".x", {"x": inner[1]})
    return None


def _bounded_fields() -> list[tuple[str, str, Any]]:
    from schemas.docgen import SECTIONS

    return [(path, name, tp) for path, cls in SECTIONS
            for name, tp in typing.get_type_hints(cls, include_extras=True).items() if _violation(tp)]


@pytest.mark.parametrize(("path", "name", "tp"), _bounded_fields(), ids=[f"{p}.{n}" for p, n, _ in _bounded_fields()])
def test_every_declared_bound_is_enforced_by_parsing_and_by_constructors(path: str, name: str, tp: Any) -> None:
    """A value just outside a field's ``Meta`` bound is refused in one line naming the key, the
    value and what the bound allows (the words docs/config.md shows), parsed or built in code."""
    from schemas.docgen import allowed_column

    names, needs = _placed(path)
    suffix, bad = typing.cast(tuple[str, Any], _violation(tp))
    raw = _raw_with(names, {**needs, name: bad})
    key = ".".join([*names, name]) + suffix
    allowed = bounds(tp) or allowed_column(tp).removeprefix("each ")
    assert allowed and allowed in allowed_column(tp)  # docs/config.md shows what is enforced
    with pytest.raises(ConfigError) as parsed:
        parse_raw(copy.deepcopy(raw))
    line = str(parsed.value)
    assert line.startswith(f"config: {key}=") and line.endswith(f" must be {allowed}") and "\n" not in line, line
    with pytest.raises(ConfigError) as built:  # in code, by constructors, which check no bound themselves
        _build(RunConfig, raw)
    assert str(built.value) == line.removeprefix("config: ")


def _raw_with(names: list[str], item: dict[str, Any]) -> dict[str, Any]:
    """A raw config holding ``item`` at ``names`` (``[..., "domains", "0"]``: as the list's only item)."""
    *parents, last = names
    value: Any = item
    if last == "0":
        *parents, last = parents
        value = [item]
    raw: dict[str, Any] = {}
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return raw


def _build(tp: Any, value: Any) -> Any:
    """``value`` (builtins) made into ``tp`` by calling the Structs' constructors."""
    tp, _ = split_annotated(tp)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        hints = typing.get_type_hints(tp, include_extras=True)
        return tp(**{k: _build(hints[k], v) for k, v in value.items()})
    if typing.get_origin(tp) is list:
        return [_build(typing.get_args(tp)[0], v) for v in value]
    if typing.get_origin(tp) is dict:
        return {k: _build(typing.get_args(tp)[1], v) for k, v in value.items()}
    return value


def test_a_bound_without_a_key_in_the_path_names_the_entry() -> None:
    with pytest.raises(ConfigError, match=r"^config: judge\.models\.q2\.max_new_tokens=0 must be >= 1$"):
        parse_config("", ["judge.models={q1: {path: m}, q2: {path: m, max_new_tokens: 0}}"])
    with pytest.raises(ConfigError, match=r"^config: unknown key 'judge\.models\.q\.bogus' \(keys: kind, path"):
        parse_config("", ["judge.models={q: {path: m, bogus: 1}}"])
    with pytest.raises(ConfigError, match=r"^config: placement\.trainer\.resources\.fast: Expected `float`, got `str` "
                                          r"\(got 'x'; allowed type: float\)$"):
        parse_config("", ["placement.trainer.resources={slow: 1, fast: x}"])


def test_non_finite_numbers_are_refused_whether_bounded_or_not() -> None:
    for override, line in (("train.lr=.nan", "config: train.lr=nan must be a finite number > 0"),
                           ("rollout.temperature=.inf", "config: rollout.temperature=inf must be a finite number"),
                           ("algorithm.reward_shift=-.inf", "config: algorithm.reward_shift=-inf must be a finite number"),
                           ("data.domains=[{name: a, kwargs: {x: .nan}}]",
                            "config: data.domains.0.kwargs.x=nan must be a finite number")):
        with pytest.raises(ConfigError) as e:
            parse_config("", [override])
        assert str(e.value) == line
    with pytest.raises(ConfigError, match=r"^train\.lr=nan must be a finite number > 0$"):
        RunConfig(train=TrainConfig(lr=float("nan")))


# --------------------------------------------------------------------------- rules between keys

RULE_CASES = [
    (["train.batch_size=12"], "train.batch_size=12 must be a multiple of rollout.group_size=8"),
    (["run.restart_backoff_s=40"], "run.restart_backoff_s=40 must be <= run.restart_backoff_max_s=30"),
    (["algorithm.adv_estimator=gae"], "algorithm.adv_estimator=gae needs a critic"),
    (["algorithm.critic=value_head"], "algorithm.critic=value_head is only used by algorithm.adv_estimator=gae"),
    (["algorithm.off_policy_correction=tis"], "algorithm.off_policy_correction=tis needs algorithm.old_logprobs=recompute"),
    (["algorithm.old_logprobs=recompute", "algorithm.off_policy_correction=decoupled", "algorithm.pg_variant=cispo"],
     "algorithm.off_policy_correction=decoupled is decoupled PPO: needs algorithm.pg_variant=ppo"),
    (["algorithm.dual_clip_loss=true", "algorithm.pg_variant=topr"], "algorithm.dual_clip_loss needs algorithm.pg_variant=ppo"),
    (["algorithm.norm_std=true", "algorithm.norm_std_type=group"], "algorithm.norm_std is the deprecated form"),
    (["algorithm.adv_estimator=dr_grpo", "algorithm.norm_std_type=group"], "algorithm.norm_std_type must be none"),
    (["algorithm.difficulty_low_threshold=0.96"],
     "algorithm.difficulty_low_threshold=0.96 must be < algorithm.difficulty_high_threshold=0.95"),
    (["algorithm.dynamic_filter=mean", "algorithm.dynamic_filter_low=0.9", "algorithm.dynamic_filter_high=0.1"],
     "algorithm.dynamic_filter_low=0.9 must be <= algorithm.dynamic_filter_high=0.1"),
    (["algorithm.target_kl_per_token=0.1"],
     "algorithm.target_kl_per_token adapts the coefficient of algorithm.add_token_level_kl"),
    (["algorithm.pg_variant=gspo"], "algorithm.pg_variant=gspo is a sequence-level objective"),
    (["data.domains=[{name: a}, {name: a}]"], "data.domains[1].name='a' must be unique"),
    (["data.domains=[{name: a, ratio: 0}]"], "data.domains: the ratios must not all be 0"),
    (["data.domains=[{name: a, format_reward: 0.1}]"], "data.domains[0].format_reward=0.1 needs data.domains[0].answer"),
    (["data.domains=[{name: a, system_prompt: hi}]", "model.chat_template=false"],
     "data.domains[0].system_prompt is set but model.chat_template=false"),
    (["model.chat_template=true"], "model.chat_template=true but the tiny model gets no chat template"),
    (["model.system_prompt=hi", "model.chat_template=false"], "model.system_prompt is set but model.chat_template=false"),
    (["train.lora_rank=8", "train.strategy=fsdp2", "train.ranks=2"], "train.lora_rank=8 works with train.strategy='torch' only"),
    (["train.weights_handoff=memory", "train.strategy=fsdp2", "train.ranks=2"],
     "train.weights_handoff=memory needs train.strategy=torch (got fsdp2)"),
    (["train.weights_handoff=memory", "rollout.engine=server", "rollout.server_urls=[http://h:1]"],
     "train.weights_handoff=memory needs rollout.engine=torch (got server"),
    (["train.weights_handoff=shm"], "train.weights_handoff"),
    (["train.weights_broadcast=gloo", "train.weights_handoff=disk"],
     "train.weights_broadcast=gloo sends the memory handoff's copies, and train.weights_handoff=disk makes none"),
    (["train.weights_broadcast=gloo", "train.strategy=fsdp2", "train.ranks=2"],
     "train.weights_broadcast=gloo needs train.strategy=torch and rollout.engine=torch (got fsdp2 and torch)"),
    (["train.weights_broadcast=nccl"], "train.weights_broadcast"),
    (["train.weights_broadcast_port=70000"], "train.weights_broadcast_port"),
    (["train.ranks=2"], "train.ranks=2 needs train.strategy=fsdp2 or megatron"),
    (["rollout.release_between_steps=kv"], "rollout.release_between_steps=kv needs rollout.async_ratio=0 (got 1"),
    (["rollout.release_between_steps=kv_and_weights", "rollout.async_ratio=0", "rollout.engine=server",
      "rollout.server_urls=[http://h:1]"], "rollout.release_between_steps=kv_and_weights needs rollout.engine=torch"),
    (["train.strategy=megatron", "train.ranks=2", "train.tensor_parallel=3"], "train.tensor_parallel=3 must divide train.ranks=2"),
    (["train.strategy=fsdp2", "train.ranks=2", "train.tensor_parallel=2"], "train.tensor_parallel=2 needs train.strategy=megatron"),
    (["train.micro_batch_size=16", "train.micro_batch_tokens=4096"],
     "train.micro_batch_size=16 and train.micro_batch_tokens=4096 are both set"),
    (["train.strategy=megatron", "train.ranks=2", "train.micro_batch_tokens=4096"],
     "train.micro_batch_tokens=4096 does not work with train.strategy='megatron'"),
    (["tracking.wandb=true", "tracking.wandb_project="], "tracking.wandb_project must not be empty"),
    (["store.record_live=false", "tracking.tensorboard=true"], "need the live recorder, but store.record_live=false"),
    (["reward.latency=lognormal"], "reward.latency='lognormal' needs reward.latency_mean_s > 0, got 0"),
    (["env.latency=pareto", "env.latency_mean_s=1", "env.latency_sigma=1"], "env.latency_sigma=1 must be > 0 (> 1 for pareto"),
    (["judge.models={'': {path: m}}"], "judge.models: a judge needs a non-empty name"),
    (["judge.models={q: {}}"], "judge.models.q.path is empty"),
    (["judge.models={q: {path: m, kind: reward_model, rubric: x}}"],
     "judge.models.q.rubric is set but judge.models.q.kind='reward_model' does not use it"),
    (["judge.models={q: {path: m, min_score: 5, max_score: 5}}"], "judge.models.q: min_score=5 must be < max_score=5"),
    (["judge.models={q: {path: m, score: choice}}"], "judge.models.q.score='choice' needs judge.models.q.choices"),
    (["judge.models={q: {path: m, choices: {'y': 1}}}"], "judge.models.q.choices is set but judge.models.q.score='number'"),
    (["judge.models={q: {path: m, score: choice, choices: {' ': 1}}}"], "judge.models.q.choices: ' ': 1 needs a non-empty label"),
    (["data.domains=[{name: a, judge: nope}]"], "data.domains[0].judge='nope' is not in judge.models (none defined)"),
    (["data.domains=[{name: a, rewards: {verifer: 1}}]"], "data.domains[0].rewards: unknown component 'verifer'"),
    (["data.domains=[{name: a, rewards: {judge: 1}}]"], "data.domains[0].rewards weights 'judge' but the domain has no judge"),
    (["data.domains=[{name: a, answer: raw, rewards: {format: 1}}]"], "data.domains[0].rewards weights 'format'"),
    (["placement.trainer.gpus=1.5"], "placement.trainer.gpus=1.5 must be >= 0 and, above 1, a whole number"),
    (["placement.trainer.resources={GPU: 1}"], "placement.trainer.resources: 'GPU' is not a custom resource name"),
    (["model.init.hidden_size=30"], "model.init.hidden_size=30 must be a multiple of model.init.num_heads=4"),
    (["model.init.max_position_embeddings=32"], "rollout.max_new_tokens=32 must be < model.init.max_position_embeddings=32"),
]


@pytest.mark.parametrize(("overrides", "words"), RULE_CASES, ids=[" ".join(o) for o, _ in RULE_CASES])
def test_every_rule_is_one_line_naming_the_keys(overrides: list[str], words: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config("", overrides)
    line = str(e.value)
    assert line.startswith("config: ") and words in line and "\n" not in line, line


def test_rules_hold_however_a_config_is_built() -> None:
    """A constructor and ``msgspec.structs.replace`` refuse what parsing refuses, and a config
    that breaks no rule or bound is accepted every way."""
    words = re.escape("train.batch_size=12 must be a multiple of rollout.group_size=8")
    with pytest.raises(ConfigError, match=words):
        RunConfig(train=TrainConfig(batch_size=12))
    with pytest.raises(ConfigError, match=words):
        msgspec.structs.replace(RunConfig(), train=TrainConfig(batch_size=12))
    with pytest.raises(ConfigError, match=r"^train\.steps=0 must be >= 1$"):
        msgspec.structs.replace(RunConfig(), train=TrainConfig(steps=0))
    with pytest.raises(ConfigError, match=r"algorithm\.adv_estimator=gae needs a critic"):
        RunConfig(algorithm=AlgorithmConfig(adv_estimator="gae"))
    ok = RunConfig(train=TrainConfig(batch_size=16), rollout=RolloutConfig(group_size=4))
    assert ok == parse_config("train: {batch_size: 16}\nrollout: {group_size: 4}")


def test_the_tiny_model_spec_is_checked_alone_too() -> None:
    check_tiny_spec(TinyModelSpec(hidden_size=32, num_heads=2))
    with pytest.raises(ConfigError, match=r"^hidden_size=30 must be a multiple of num_heads=4$"):
        check_tiny_spec(TinyModelSpec(hidden_size=30))
    with pytest.raises(ConfigError, match=r"^num_layers=0 must be >= 1$"):
        check_tiny_spec(TinyModelSpec(num_layers=0))
    with pytest.raises(ConfigError, match=r"^config: num_layers=0 must be >= 1$"):
        parse_raw({}, ["num_layers=0"], root=TinyModelSpec)


# --------------------------------------------------------------------------- the newer objectives' rules (issue 37)

NEWER_RULE_CASES = [
    (["algorithm.sapo_tau_neg=2"], "algorithm.sapo_tau_neg is set but only algorithm.pg_variant=sapo reads it"),
    (["algorithm.pg_variant=ppo", "algorithm.kl_cov_ratio=0.01"],
     "algorithm.kl_cov_ratio is set but only algorithm.pg_variant=kl_cov reads it (got pg_variant=ppo)"),
    (["algorithm.pass_k=2"], "algorithm.pass_k is set but only algorithm.adv_estimator=pass_at_k reads it"),
    (["algorithm.pg_variant=sapo", "algorithm.pg_clip_high=0.3"], "algorithm.pg_variant=sapo has no ratio clip"),
    (["algorithm.pg_variant=gmpo"], "algorithm.pg_variant=gmpo is a per-sequence objective: set "
                                    "algorithm.loss_agg_mode=seq-mean-token-mean (got token-mean)"),
    (["algorithm.pg_variant=clip_cov", "algorithm.clip_cov_lb=5"], "algorithm.clip_cov_lb=5 must be < algorithm.clip_cov_ub=5"),
    (["algorithm.pg_variant=kl_cov", "algorithm.old_logprobs=recompute"], "use old_logprobs=behaviour"),
    (["algorithm.adv_estimator=pass_at_k", "algorithm.pass_k=8"], "algorithm.pass_k=8 must be < rollout.group_size=8"),
    (["algorithm.adv_estimator=pass_at_k", "algorithm.whiten_rewards=true"],
     "algorithm.adv_estimator=pass_at_k reads correctness from the shaped rewards"),
    (["algorithm.adv_estimator=opo", "algorithm.norm_mean_type=group"],
     "algorithm.adv_estimator=opo subtracts its own baseline"),
    (["algorithm.clip_cov_ratio=0"], "algorithm.clip_cov_ratio=0"),
    (["algorithm.adv_estimator=remax", "algorithm.norm_std_type=group"],
     "algorithm.norm_std_type=group does not apply to adv_estimator=remax"),
    (["algorithm.adv_estimator=remax", "algorithm.whiten_rewards=true"],
     "algorithm.whiten_rewards does not apply to adv_estimator=remax"),
]


@pytest.mark.parametrize(("overrides", "words"), NEWER_RULE_CASES, ids=[" ".join(o) for o, _ in NEWER_RULE_CASES])
def test_the_newer_objectives_refuse_what_they_do_not_read(overrides: list[str], words: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config("", overrides)
    line = str(e.value)
    assert line.startswith("config: ") and words in line and "\n" not in line, line


def test_the_newer_objectives_accept_their_own_keys() -> None:
    cfg = parse_config("", ["algorithm.pg_variant=gmpo", "algorithm.loss_agg_mode=seq-mean-token-mean",
                            "algorithm.adv_estimator=pass_at_k", "algorithm.pass_k=2"])
    assert (cfg.algorithm.clip_low, cfg.algorithm.clip_high) == (0.4, 0.4)  # GMPO's log-space range
    assert parse_config("", ["algorithm.pg_variant=sapo", "algorithm.sapo_tau_neg=2"]).algorithm.sapo_tau_neg == 2.0
    assert parse_config("", ["algorithm.pg_variant=kl_cov", "algorithm.kl_cov_coef=0.5"]).algorithm.kl_cov_coef == 0.5


EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").rglob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_config_parses(path: Path) -> None:
    cfg = parse_config(path.read_text(), source=str(path))
    assert msgspec.convert(to_dict(cfg, reveal_secrets=True), RunConfig) == cfg


def test_the_removed_key_target_kl_is_refused_saying_what_changed() -> None:
    """``algorithm.target_kl`` was a KL summed over each sequence; its replacement is per token, so
    an old value is refused (not silently reinterpreted). A recorded ``null`` still loads."""
    for text, overrides in (("algorithm: {add_token_level_kl: true, target_kl: 0.1}", []),
                            ("", ["algorithm.add_token_level_kl=true", "algorithm.target_kl=0.1"])):
        with pytest.raises(ConfigError) as e:
            parse_config(text, overrides)
        line = str(e.value)
        assert line.startswith("config: algorithm.target_kl=0.1 ") and "\n" not in line, line
        assert "per sequence" in line and "algorithm.target_kl_per_token" in line, line
    assert parse_config("algorithm: {target_kl: null}") == parse_config("")
