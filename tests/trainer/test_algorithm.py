"""The config -> step wiring (trainer/algorithm.py and TorchStrategy): every estimator and loss
runs a real optimizer step; shaping, masks, weights and off-policy corrections by hand values;
the reference model and critic exist only when the config needs them."""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.config import AlgorithmConfig, ConfigError, RunConfig, parse_config
from tests.e2e.test_algos import EXAMPLES
from tests.e2e.test_algos import EXTRA as E2E_EXTRA
from tests.e2e.test_algos import OWN_METRIC as E2E_OWN_METRIC
from tests.e2e.test_algos import TINY as E2E_TINY
from tests.floats import assert_same_update, gradient_terms, rounding_tol
from tests.trainer.test_registry import config_choices
from trainer import algorithm as alg
from trainer.advantages import grpo_advantages_reference, whiten
from trainer.batch import TrainSample, collate
from trainer.strategy import TorchStrategy, strategy_kwargs


def algo(**kw: object) -> AlgorithmConfig:
    return msgspec.convert(kw, AlgorithmConfig)


def samples(n_groups: int = 3, n: int = 4, seed: int = 0, turns: int = 1) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        for i in range(n):
            prompt = [1] + [rng.randrange(4, 60) for _ in range(rng.randrange(2, 5))]
            resp, mask = [], []
            for t in range(turns):
                k = rng.randrange(2, 6)
                resp += [rng.randrange(4, 60) for _ in range(k)]
                mask += [1] * k
                if t < turns - 1:  # environment tokens between agent turns
                    resp += [rng.randrange(4, 60) for _ in range(2)]
                    mask += [0, 0]
            out.append(TrainSample(prompt, resp, [-rng.random() * 2 for _ in resp], mask,
                                   reward=float(rng.random() < 0.5), sample_id=f"{g}/{i}", group_id=f"g{g}",
                                   truncated=i == 0))
    return out


def with_greedy(batch: list[TrainSample]) -> list[TrainSample]:
    """ReMax's input: every sample carries its group's greedy reward (0 or 1 by group)."""
    return [dataclasses.replace(s, baseline=float(int(s.group_id[1:]) % 2)) for s in batch]


ESTIMATORS = sorted(config_choices("adv_estimator"))  # every one the config accepts (= the registry's)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_every_estimator_takes_a_finite_step(model_dir: Path, estimator: str) -> None:
    cfg = algo(adv_estimator=estimator, critic="value_head" if estimator == "gae" else "none")
    s = TorchStrategy(model_dir, lr=1e-3, micro_batch_size=5, algo=cfg, max_len=16)
    s.init_critic()
    before = {k: v.detach().clone() for k, v in s.model.named_parameters()}
    batch = samples(turns=2 if estimator in ("step_reinforce", "gigpo") else 1)
    metrics = s.train_step(with_greedy(batch) if estimator == "remax" else batch)
    assert s.step == 1
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["rollout/advantage_abs_mean"] > 0
    changed = any(not torch.equal(before[k], v) for k, v in s.model.named_parameters())
    assert changed
    if estimator == "gae":
        assert "loss/value" in metrics and metrics["critic/grad_norm"] > 0


ALGOS = Path(__file__).resolve().parents[2] / "examples" / "algos"


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_algos_example_takes_a_step_of_its_own_config(model_dir: Path, name: str) -> None:
    """The in-process half of tests/e2e/test_algos.py: each example's own config (at the e2e test's
    tiny sizes) builds its strategy as the trainer service does and takes a finite step with the
    example's own metrics."""
    text = (ALGOS / f"{name}.yaml").read_text()
    # the synthetic samples' behaviour logprobs are random, nats away from the model's: a threshold
    # the rejection correction then keeps samples at (its own choices are tested in test_losses)
    extra = ["algorithm.rejection_threshold=1000"] if name == "rejection" else []
    cfg = parse_config(text, [*E2E_TINY, *E2E_EXTRA.get(name, []), *extra], source=f"examples/algos/{name}.yaml")
    s = TorchStrategy(model_dir, **{**strategy_kwargs(cfg, "cpu"), "max_len": 16})
    if cfg.algorithm.uses_reference:
        s.init_reference()
    s.init_critic()
    batch = samples(n=cfg.rollout.group_size, turns=2 if name in ("step_reinforce", "gigpo") else 1)
    metrics = s.train_step(with_greedy(batch) if name == "remax" else batch)
    assert s.step == 1
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert "loss/policy" in metrics and "rollout/advantage_abs_mean" in metrics
    if name in E2E_OWN_METRIC:
        assert E2E_OWN_METRIC[name] in metrics, sorted(metrics)


AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
LOSS_AGG = [(v, a) for a in AGG_MODES for v in sorted(config_choices("pg_variant"))
            if v != "gspo" or a == "seq-mean-token-mean"]  # gspo refuses the others (a config rule)


@pytest.mark.parametrize(("variant", "agg"), LOSS_AGG, ids=[f"{a}-{v}" for v, a in LOSS_AGG])
def test_micro_batching_equals_one_batch_for_every_loss_and_aggregation(model_dir: Path, variant: str, agg: str) -> None:
    cfg = algo(pg_variant=variant, loss_agg_mode=agg, old_logprobs="recompute" if variant == "gspo" else "behaviour")
    if variant == "gmpo" and agg != "seq-mean-token-mean":  # GMPO is a per-sequence objective: refused
        with pytest.raises(ConfigError, match="gmpo is a per-sequence objective"):
            RunConfig(algorithm=cfg)
        return
    batch = samples(seed=1)
    a = TorchStrategy(model_dir, lr=1.0, micro_batch_size=12, algo=cfg, max_len=16)
    b = TorchStrategy(model_dir, lr=1.0, micro_batch_size=5, algo=cfg, max_len=16)
    for s in (a, b):  # plain SGD: the parameter change is the gradient (Adam's first step is ~sign(g))
        s.optimizer = torch.optim.SGD(s.model.parameters(), lr=1.0)
    before = {k: v.detach().clone() for k, v in a.model.named_parameters()}
    ma, mb = a.train_step(batch), b.train_step(batch)
    assert ma["actor/grad_norm"] == pytest.approx(mb["actor/grad_norm"], rel=1e-4)
    after_a = {k: v.detach() for k, v in a.model.named_parameters()}
    after_b = {k: v.detach() for k, v in b.model.named_parameters()}
    # micro-batches sum the gradient in another order: the updates agree to its rounding
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in batch]
    assert_same_update(before, after_a, after_b, gradient_terms(a.model.config, lengths))


def test_grpo_advantages_on_tokens_match_the_loop() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    mask = torch.tensor([[1, 1, 0]] * 6, dtype=torch.float)
    adv, returns, _ = alg.compute_advantages(algo(), alg.initial_state(algo()), r, g, mask)
    want = grpo_advantages_reference(r.tolist(), g.tolist())
    assert returns is None
    assert adv[:, 0].tolist() == pytest.approx(want, abs=1e-5)
    assert adv[:, 2].abs().sum() == 0  # masked positions carry no advantage


def test_reward_shaping_order_clip_scale_shift_then_group_norm() -> None:
    cfg = algo(adv_estimator="dr_grpo", reward_clip=1.0, reward_scale=2.0, reward_shift=0.5)
    r = torch.tensor([3.0, -0.5, 0.0, 0.0])
    g = torch.tensor([0, 0, 1, 1])
    adv, _, _ = alg.compute_advantages(cfg, alg.initial_state(cfg), r, g, torch.ones(4, 1))
    shaped = [1.0 * 2 + 0.5, -0.5 * 2 + 0.5, 0.5, 0.5]
    assert adv[:, 0].tolist() == pytest.approx([shaped[0] - 1.0, shaped[1] - 1.0, 0.0, 0.0])  # group mean 1.0


def test_running_normalisation_matches_all_rewards_so_far() -> None:
    cfg = algo(adv_estimator="rloo", norm_mean_type="running", norm_std_type="running")
    state = alg.initial_state(cfg)
    seen: list[float] = []
    rng = random.Random(0)
    for _ in range(4):
        r = torch.tensor([rng.random() * 3 for _ in range(5)])
        seen += r.tolist()
        out = alg.normalize(r, torch.zeros(5, dtype=torch.long), "running", "running", state)
        mean = sum(seen) / len(seen)
        std = math.sqrt(sum((x - mean) ** 2 for x in seen) / (len(seen) - 1))
        assert out.tolist() == pytest.approx([(x - mean) / (std + 1e-6) for x in r.tolist()], rel=1e-5)


def test_token_level_kl_enters_the_rewards() -> None:
    cfg = algo(adv_estimator="dr_grpo", add_token_level_kl=True, init_kl_coef=0.5)
    kl = torch.tensor([[0.2, 0.2], [0.0, 0.0]])
    adv, _, m = alg.compute_advantages(cfg, alg.initial_state(cfg), torch.tensor([1.0, 1.0]), torch.tensor([0, 0]),
                                       torch.ones(2, 2), kl=kl)
    # r = 1 - 0.5 * 0.4 = 0.8 and 1.0 -> centred -0.1, +0.1
    assert adv[:, 0].tolist() == pytest.approx([-0.1, 0.1], abs=1e-6)
    assert m["actor/reward_kl"] == pytest.approx(0.2)


def test_adaptive_kl_controller() -> None:
    cfg = algo(add_token_level_kl=True, init_kl_coef=0.1, target_kl_per_token=0.01, kl_horizon=100)
    state = alg.initial_state(cfg)
    mask = torch.ones(2, 3)
    alg.update_kl_coef(cfg, state, torch.full((2, 3), 0.1), mask, num_samples=10)  # far above: +20% · 10/100
    assert state.kl_coef == pytest.approx(0.1 * 1.02)
    alg.update_kl_coef(cfg, state, torch.zeros(2, 3), mask, num_samples=10)
    assert state.kl_coef == pytest.approx(0.1 * 1.02 * 0.98)


def test_data_masks_by_hand() -> None:
    cfg = algo(max_len_mask=True, difficulty_mask=True, difficulty_low_threshold=0.1, difficulty_high_threshold=0.9,
               error_max_len_clip=True, error_max_len_threshold=2)
    mask = torch.ones(6, 4)
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])  # group 1 all right (easy), group 2 all wrong (hard)
    truncated = torch.tensor([False, True, False, False, False, False])
    out, m = alg.data_masks(cfg, mask, rewards, groups, truncated)
    assert out.tolist() == [[1, 1, 1, 1], [0, 0, 0, 0], [0] * 4, [0] * 4, [0] * 4, [0] * 4]
    cfg2 = algo(error_max_len_clip=True, error_max_len_threshold=2)
    out2, _ = alg.data_masks(cfg2, torch.tensor([[0.0, 1, 1, 1, 1]]), torch.tensor([0.0]), torch.tensor([0]),
                             torch.tensor([False]))
    assert out2.tolist() == [[0, 1, 1, 0, 0]]  # a wrong answer trains on its first 2 tokens only
    assert m["mask/masked_frac"] == pytest.approx(20 / 24)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 2), st.booleans(), st.lists(st.booleans(), min_size=5, max_size=5)),
                min_size=1, max_size=8),
       st.booleans(), st.booleans(), st.booleans())
def test_masks_never_switch_a_token_on(rows: list, max_len_mask: bool, difficulty: bool, err: bool) -> None:
    cfg = algo(max_len_mask=max_len_mask, difficulty_mask=difficulty, error_max_len_clip=err, error_max_len_threshold=2)
    mask = torch.tensor([[float(b) for b in r[3]] for r in rows])
    rewards = torch.tensor([float(r[0]) for r in rows])
    groups = torch.tensor([r[1] for r in rows])
    trunc = torch.tensor([r[2] for r in rows])
    out, _ = alg.data_masks(cfg, mask, rewards, groups, trunc)
    assert bool((out <= mask).all())
    if not (max_len_mask or difficulty or err):
        assert torch.equal(out, mask)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=2, max_size=12), st.integers(0, 2**16))
def test_whitened_advantages_have_zero_mean_unit_var_on_the_mask(values: list[float], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.tensor(values).unsqueeze(1).repeat(1, 3)
    mask = (torch.rand(x.shape, generator=g) > 0.3).float()
    out = whiten(x, mask)
    n = mask.sum()
    if n >= 2 and float(((x - (x * mask).sum() / n) * mask).pow(2).sum()) > 1e-3:
        assert float((out * mask).sum() / n) == pytest.approx(0.0, abs=1e-4)
        assert float((out**2 * mask).sum() / n) == pytest.approx(1.0, rel=1e-2)
    assert float((out * (1 - mask)).abs().sum()) == 0.0


def test_loss_weights_by_hand() -> None:
    cfg = algo(difficulty_loss_weight=True)
    w = alg.loss_weights(cfg, torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]), torch.ones(4))
    assert w is not None and w.tolist() == pytest.approx([2.0, 2.0, 0.0, 0.0])  # (1 - acc) / mean
    w = alg.loss_weights(algo(length_loss_weight=True), torch.zeros(2), torch.tensor([0, 0]), torch.tensor([1.0, 3.0]))
    assert w is not None and w.tolist() == pytest.approx([1.5, 0.5])
    assert alg.loss_weights(algo(), torch.zeros(2), torch.tensor([0, 0]), torch.ones(2)) is None


def test_dynamic_filter_reasons() -> None:
    assert alg.group_filter_reason(algo(dynamic_filter="all_equal"), [1.0, 1.0]) is not None
    assert alg.group_filter_reason(algo(dynamic_filter="all_equal"), [1.0, 0.0]) is None
    mean = algo(dynamic_filter="mean", dynamic_filter_low=0.2, dynamic_filter_high=0.8)
    assert alg.group_filter_reason(mean, [1.0, 1.0, 1.0, 0.0]) is None
    assert "outside" in (alg.group_filter_reason(mean, [1.0, 1.0, 1.0, 1.0]) or "")
    std = algo(dynamic_filter="std", dynamic_filter_low=0.4)
    assert alg.group_filter_reason(std, [1.0, 0.0]) is None  # population std 0.5
    assert alg.group_filter_reason(std, [1.0, 1.0, 1.0, 0.0]) is None  # 0.433
    assert alg.group_filter_reason(std, [1.0] * 7 + [0.0]) is not None  # 0.331
    assert alg.group_filter_reason(algo(), [1.0, 1.0]) is None


def test_off_policy_corrections() -> None:
    mask = torch.ones(2, 2)
    behav = torch.zeros(2, 2)
    prox = torch.tensor([[math.log(3.0), 0.0], [math.log(0.25), 0.0]])
    old, w, m, _ = alg.off_policy(algo(), mask, behav, None)
    assert old is behav and w is None and m is mask
    old, w, m, metrics = alg.off_policy(algo(old_logprobs="recompute", off_policy_correction="tis", is_cap=2.0),
                                        mask, behav, prox)
    assert old is prox and w is not None and w.flatten().tolist() == pytest.approx([2.0, 1.0, 0.25, 1.0])
    assert metrics["offpolicy/truncated_frac"] == pytest.approx(0.25)
    _, w, m, metrics = alg.off_policy(algo(old_logprobs="recompute", off_policy_correction="masked_is"), mask, behav, prox)
    assert w is None and m.tolist() == [[0, 1], [0, 1]] and metrics["offpolicy/masked_frac"] == pytest.approx(0.5)
    # rejection, sequence level, k3: seq 0 mean k3 = (3 − 1 − ln 3)/2 ≈ 0.45, seq 1 = (0.25 − 1 + ln 4)/2 ≈ 0.32
    rej = algo(old_logprobs="recompute", off_policy_correction="rejection", rejection_threshold=0.4)
    _, w, m, metrics = alg.off_policy(rej, mask, behav, prox)
    assert w is None and m.tolist() == [[0, 0], [1, 1]]
    assert (metrics["offpolicy/rejected_tokens"], metrics["offpolicy/rejected_seqs"]) == (2.0, 1.0)
    # icepop [0.5, 5]: ratio 3 keeps its weight, 0.25 leaves the band (weight 0, still in the mask)
    _, w, m, metrics = alg.off_policy(algo(old_logprobs="recompute", off_policy_correction="icepop"), mask, behav, prox)
    assert w is not None and w.flatten().tolist() == pytest.approx([3.0, 1.0, 0.0, 1.0]) and m.tolist() == mask.tolist()
    assert (metrics["offpolicy/rejected_tokens"], metrics["offpolicy/rejected_seqs"]) == (1.0, 0.0)


def test_turn_index_splits_agent_turns() -> None:
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 0], [1, 0, 1, 0, 1, 1, 1]])
    assert alg.turn_index(mask).tolist() == [[-1, 0, 0, -1, -1, 1, -1], [0, -1, 1, -1, 2, 2, 2]]


def test_step_rewards_reach_their_turns() -> None:
    cfg = algo(adv_estimator="step_reinforce", episode_reward_weight=0.0, step_reward_gamma=1.0)
    mask = torch.tensor([[1.0, 1, 0, 1], [1.0, 1, 0, 1]])
    adv, _, _ = alg.compute_advantages(cfg, alg.initial_state(cfg), torch.tensor([0.0, 0.0]), torch.tensor([0, 0]),
                                       mask, step_rewards=[(1.0, 0.0), (0.0, 0.0)])
    # returns per step: sample 0 -> (1, 0), sample 1 -> (0, 0); whitened over the 4 steps
    assert adv[0, 0] > 0 and adv[0, 0] == adv[0, 1] and adv[0, 2] == 0 and adv[0, 3] < adv[0, 0]
    assert adv[1, 0] == adv[1, 3]


def test_gigpo_anchors_group_steps_by_state_hash() -> None:
    """Two episodes of one group: their step-1 turns acted from the same state ("b"), so GiGPO compares
    them (different step returns -> opposite step advantages); their step-0 turns share the start
    state; turns without a hash are their own anchors."""
    episodes, steps = torch.tensor([0, 0, 1, 1, 2]), torch.tensor([0, 1, 0, 1, 1])
    anchors = alg.step_anchors(episodes, steps, [("a", "b"), ("a", "b"), ("a", "")])
    assert anchors[0] == anchors[2] and anchors[1] == anchors[3] and anchors[0] != anchors[1]
    assert int(anchors[4]) not in anchors[:4].tolist()
    fallback = alg.step_anchors(episodes, steps, None)
    assert fallback[0] == fallback[2] == 0 and len(set(fallback[[1, 3, 4]].tolist())) == 3
    cfg = algo(adv_estimator="gigpo", episode_reward_weight=0.0, step_reward_weight=1.0, step_reward_gamma=1.0)
    mask = torch.tensor([[1.0, 0, 1], [1.0, 0, 1]])
    adv, _, _ = alg.compute_advantages(cfg, alg.initial_state(cfg), torch.tensor([1.0, 0.0]), torch.tensor([0, 0]),
                                       mask, step_rewards=[(0.0, 1.0), (0.0, 0.0)], state_hashes=[("s", "t"), ("s", "t")])
    assert adv[0, 2] > 0 > adv[1, 2]  # same state "t": the better action wins
    blind, _, _ = alg.compute_advantages(cfg, alg.initial_state(cfg), torch.tensor([1.0, 0.0]), torch.tensor([0, 0]),
                                         mask, step_rewards=[(0.0, 1.0), (0.0, 0.0)], state_hashes=[("s", ""), ("s", "")])
    assert blind[0, 2] == 0 and blind[1, 2] == 0  # no shared state: no step-level comparison


def test_impossible_combinations_name_the_keys() -> None:
    cases = [
        ("algorithm: {adv_estimator: gae}", "algorithm.critic"),
        ("algorithm: {critic: value_head}", "algorithm.adv_estimator=gae"),
        ("algorithm: {off_policy_correction: tis}", "algorithm.old_logprobs=recompute"),
        ("algorithm: {old_logprobs: recompute, off_policy_correction: decoupled, pg_variant: cispo}",
         "algorithm.pg_variant=ppo"),
        ("algorithm: {dual_clip_loss: true, pg_variant: topr}", "algorithm.pg_variant=ppo"),
        ("algorithm: {target_kl_per_token: 0.1}", "algorithm.add_token_level_kl"),
        ("algorithm: {add_token_level_kl: true, target_kl: 0.1}", "algorithm.target_kl_per_token"),
        ("algorithm: {pg_variant: gspo}", "algorithm.loss_agg_mode=seq-mean-token-mean"),
        ("algorithm: {add_token_level_kl: true, kl_penalty: k3+}", "algorithm.kl_loss_type"),
        ("algorithm: {adv_estimator: dr_grpo, norm_std_type: group}", "norm_std_type"),
        ("algorithm: {reward_clip: -1}", "reward_clip"),
        ("algorithm: {loss_agg_mode: sum}", "algorithm.loss_agg_mode"),
    ]
    for text, key in cases:
        with pytest.raises(ConfigError) as e:
            parse_config(text)
        assert key in str(e.value) and "\n" not in str(e.value), (text, str(e.value))


def test_cispo_defaults_and_clip_resolution() -> None:
    assert (algo(pg_variant="cispo").clip_low, algo(pg_variant="cispo").clip_high) == (1.0, 0.28)
    assert (algo(pg_clip=0.1).clip_low, algo(pg_clip=0.1, pg_clip_high=0.3).clip_high) == (0.1, 0.3)


def test_reference_and_critic_only_when_configured(model_dir: Path) -> None:
    plain = TorchStrategy(model_dir, algo=algo())
    plain.init_critic()
    assert plain.ref_model is None and plain.critic is None
    kl = TorchStrategy(model_dir, algo=algo(use_kl_loss=True, kl_loss_coef=0.1))
    kl.init_reference()
    metrics = kl.train_step(samples())
    assert metrics["actor/kl"] == pytest.approx(0.0, abs=1e-6)  # the reference is the start policy
    assert "loss/kl" in metrics
    metrics = kl.train_step(samples(seed=3))
    assert metrics["actor/kl"] > 0  # one step later the policy moved away from it


def test_decoupled_ppo_on_stale_samples_reports_is_stats(model_dir: Path) -> None:
    cfg = algo(old_logprobs="recompute", off_policy_correction="decoupled", is_cap=1.5)
    s = TorchStrategy(model_dir, lr=1e-3, algo=cfg)
    stale = [  # behaviour logprobs far below the current policy's: far off-policy
        TrainSample(x.prompt_ids, x.response_ids, [-8.0] * len(x.response_ids), x.loss_mask, x.reward,
                    x.sample_id, x.group_id) for x in samples()]
    lp = s.logprobs(collate(stale, s.pad_id))
    metrics = s.train_step(stale)
    # ratio vs the proximal policy: 1 up to the rounding of two logprob passes (terms: the hidden size)
    lp_tol = rounding_tol(float(lp.abs().max()), s.model.config.hidden_size)
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=lp_tol)
    assert metrics["offpolicy/is_ratio_max"] > 1.5 and metrics["offpolicy/truncated_frac"] > 0


def test_checkpoint_keeps_critic_and_algorithm_state(model_dir: Path, tmp_path: Path) -> None:
    cfg = algo(adv_estimator="gae", critic="separate", add_token_level_kl=True, target_kl_per_token=0.01)
    a = TorchStrategy(model_dir, lr=1e-2, algo=cfg)
    a.init_reference()
    a.init_critic()
    a.train_step(samples())
    a.save_checkpoint(tmp_path / "c")
    saved_state = msgspec.structs.replace(a.algo_state)
    assert saved_state.kl_coef != 0.05  # adapted by the first step
    ma = a.train_step(samples(seed=5))
    b = TorchStrategy(model_dir, lr=1e-2, algo=cfg)
    b.init_reference()
    b.load_checkpoint(tmp_path / "c")
    assert b.algo_state == saved_state
    mb = b.train_step(samples(seed=5))
    assert ma["loss/value"] == pytest.approx(mb["loss/value"], rel=1e-5)
    assert ma["actor/grad_norm"] == pytest.approx(mb["actor/grad_norm"], rel=1e-5)
    assert a.algo_state == b.algo_state


def test_collate_carries_reward_group_and_truncation() -> None:
    batch = collate(samples(2, 2), pad_id=0)
    assert batch.extras["group_ids"].tolist() == [0, 0, 1, 1]
    assert batch.extras["truncated"].tolist() == [True, False, True, False]
    micro = batch.rows(1, 3)
    assert micro.extras["group_ids"].tolist() == [0, 1]


def test_deprecated_norm_std_still_loads() -> None:
    old = parse_config("algorithm: {pg_clip: 0.2, norm_std: false}")
    assert alg.resolved_norm(old.algorithm) == ("group", "none")
    assert alg.resolved_norm(parse_config("algorithm: {norm_std: true}").algorithm) == ("group", "group")
    with pytest.raises(ConfigError, match="norm_std_type"):
        parse_config("algorithm: {norm_std: false, norm_std_type: batch}")


def test_a_selective_loss_chooses_over_the_whole_batch_and_keeps_its_rows(model_dir: Path) -> None:
    """kl_cov: the prepared batch carries the choice (at most ``⌊ratio·N⌋`` trained tokens,
    ``pg_select``), and ``skip_zero_advantage`` keeps a row with a chosen token even when its
    advantage is 0 (its penalty still has a gradient)."""
    import dataclasses

    cfg = algo(pg_variant="kl_cov", kl_cov_ratio=0.5)
    s = TorchStrategy(model_dir, lr=1e-3, micro_batch_size=5, algo=cfg, max_len=16, skip_zero_advantage=True)
    data = [dataclasses.replace(x, reward=1.0) if x.group_id == "g0" else x for x in samples(seed=2)]
    batch, metrics = s.prepare(data)  # group g0: all rewards equal, advantage 0
    chosen = batch.extras["pg_select"]  # (B, T)
    assert 0 < float(chosen.sum()) == metrics["loss/cov_selected"] <= int(0.5 * batch.num_tokens)
    assert bool((batch.loss_mask[chosen > 0] > 0).all())
    zero_rows = (batch.advantages == 0).all(dim=1) & (chosen > 0).any(dim=1)  # (B,)
    assert bool(zero_rows.any())  # the case this checks is there: a chosen token in a zero-advantage row
    kept = s.gradient_rows(batch)
    assert kept.num_rows == int(((batch.advantages != 0).any(dim=1) | (chosen > 0).any(dim=1)).sum())


@pytest.mark.parametrize("where", ["reward", "loss"])
def test_full_kl_over_the_vocabulary(model_dir: Path, where: str) -> None:
    cfg = algo(add_token_level_kl=True, kl_penalty="full") if where == "reward" else \
        algo(use_kl_loss=True, kl_loss_type="full", kl_loss_coef=0.5)
    s = TorchStrategy(model_dir, lr=1e-2, micro_batch_size=5, algo=cfg)
    s.init_reference()
    batch = collate(samples(), s.pad_id)
    kl0 = s.full_kl(batch)
    assert float(kl0.abs().max()) < 1e-6  # the reference is the current policy
    first = s.train_step(samples())
    kl1 = s.full_kl(batch)
    mask = batch.loss_mask > 0
    assert float(kl1[mask].min()) >= -1e-6 and float(kl1[mask].mean()) > 0  # exact KL: never negative
    if where == "reward":
        assert first["actor/reward_kl"] == pytest.approx(0.0, abs=1e-5)
        assert s.train_step(samples())["actor/reward_kl"] > 0
    else:
        assert first["actor/kl"] == pytest.approx(0.0, abs=1e-6)
        assert s.train_step(samples())["actor/kl"] > 0


def test_the_adaptive_kl_target_is_per_token() -> None:
    """The controller was fed the KL summed over each sequence, so a per-token target pushed β up
    step after step; it now compares the mean KL per trained token with ``target_kl_per_token``."""
    cfg = algo(add_token_level_kl=True, init_kl_coef=0.1, target_kl_per_token=0.01, kl_horizon=100)
    state = alg.initial_state(cfg)
    mask = torch.tensor([[1.0] * 10, [1.0] * 4 + [0.0] * 6])
    kl = torch.full((2, 10), 0.01) * mask + (1 - mask) * 5.0  # on target at every trained token
    alg.update_kl_coef(cfg, state, kl, mask, num_samples=10)
    assert state.kl_coef == pytest.approx(0.1)  # sums of 0.1 and 0.04 per sequence would have raised it
    alg.update_kl_coef(cfg, state, kl * 10, mask, num_samples=10)  # 10x the target: +20% · 10/100
    assert state.kl_coef == pytest.approx(0.1 * 1.02)
