"""The registries of advantage estimators and policy losses (trainer/registry.py): their names are
exactly the config's choices, so a config value always has code and code always has a config value."""

from __future__ import annotations

import typing

import pytest
import torch

from schemas.config import AlgorithmConfig
from trainer import algorithm as alg
from trainer import registry


def config_choices(key: str) -> set[str]:
    """The values the run config accepts for ``algorithm.<key>`` (its ``Literal`` type)."""
    return set(typing.get_args(typing.get_type_hints(AlgorithmConfig)[key]))


def test_registered_names_are_exactly_the_configs_choices() -> None:
    estimators, losses = config_choices("adv_estimator"), config_choices("pg_variant")
    assert "grpo" in estimators and "ppo" in losses  # the Literal is read, not an empty set
    assert set(registry.ESTIMATORS) == estimators
    assert set(registry.POLICY_LOSSES) == losses


def test_estimators_declare_how_they_take_the_kl_and_their_normalisation() -> None:
    token_level = {name for name, est in registry.ESTIMATORS.items() if est.token_level}
    assert token_level == {"reinforce", "gae"}
    assert alg.resolved_norm(AlgorithmConfig(adv_estimator="grpo")) == ("group", "group")
    assert alg.resolved_norm(AlgorithmConfig(adv_estimator="dr_grpo")) == ("group", "none")
    assert alg.resolved_norm(AlgorithmConfig(adv_estimator="rloo")) == ("none", "none")


def test_a_name_is_registered_once() -> None:
    with pytest.raises(ValueError, match="advantage estimator 'grpo' is registered twice"):
        registry.advantage_estimator("grpo")(lambda cfg, x: registry.Estimate(x.r))
    with pytest.raises(ValueError, match="policy loss 'cispo' is registered twice"):
        registry.policy_loss("cispo")(alg.policy_loss)
    assert registry.ESTIMATORS["grpo"].fn is alg._grpo and registry.POLICY_LOSSES["cispo"] is alg._cispo


def test_an_unknown_name_is_one_line_listing_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown policy loss 'sppo' \(registered: cispo, clip_cov, gmpo, gspo, "):
        registry.loss("sppo")
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'vapo' \(registered: dr_grpo, gae, "):
        registry.estimator("vapo")


def test_a_new_estimator_and_loss_are_one_function_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """What docs/architecture.md ("Algorithms") tells a contributor to write, end to end (the config's
    Literal is bypassed here with ``msgspec.structs.replace``, which does not validate)."""
    import msgspec

    monkeypatch.setattr(registry, "ESTIMATORS", dict(registry.ESTIMATORS))
    monkeypatch.setattr(registry, "POLICY_LOSSES", dict(registry.POLICY_LOSSES))

    @registry.advantage_estimator("sign", norm=("batch", "none"))
    def _sign(cfg: AlgorithmConfig, x: registry.EstimatorInput) -> registry.Estimate:
        return registry.Estimate(x.r.sign().unsqueeze(1) * x.mask)  # (B, T)

    @registry.policy_loss("neg_logprob")
    def _neg(cfg: AlgorithmConfig, lp: torch.Tensor, old_lp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
             max_len: int | None) -> tuple[torch.Tensor, dict[str, float]]:
        loss = -(adv * lp * mask).sum()
        return loss, {"loss/policy": float(loss)}

    cfg = msgspec.structs.replace(AlgorithmConfig(), adv_estimator="sign", pg_variant="neg_logprob")
    adv, returns, _ = alg.compute_advantages(cfg, alg.initial_state(cfg), torch.tensor([3.0, 1.0, -4.0]),
                                             torch.tensor([0, 0, 1]), torch.ones(3, 2))
    assert returns is None and adv.tolist() == [[1.0, 1.0], [1.0, 1.0], [-1.0, -1.0]]  # r − batch mean 0
    loss, metrics = alg.policy_loss(cfg, torch.full((3, 2), -0.5), torch.zeros(3, 2), adv, torch.ones(3, 2))
    assert float(loss) == metrics["loss/policy"] == 1.0
