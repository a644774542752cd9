"""LoRA training through peft (``TorchStrategy(lora_rank > 0)``): only the adapters train, the
published weights are merged under the plain model's names (the rollout engine loads them without
peft), the KL reference is the base with the adapters disabled, checkpoints resume exactly, the
warm-up folds its adapters into the base."""

from __future__ import annotations

import json
import random
from pathlib import Path

import msgspec
import pytest
import torch

from rollout.model_init import load_model
from schemas.config import AlgorithmConfig, parse_config
from tests.floats import assert_close
from trainer.batch import TrainSample, collate
from trainer.factory import make_strategy
from trainer.logprobs import token_logprobs
from trainer.sft import SFTExample
from trainer.strategy import TorchStrategy
from weights import copy_weights_, read_weights, weights_sha256

IDS = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11], [1, 12, 13, 14, 15, 16, 17, 18]])


def samples(n: int = 8, seed: int = 0) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [1] + [rng.randrange(4, 60) for _ in range(rng.randrange(2, 6))]
        resp = [rng.randrange(4, 60) for _ in range(rng.randrange(2, 7))] + [2]
        out.append(TrainSample(prompt, resp, [-rng.random() * 3 for _ in resp], [1] * len(resp),
                               float(i % 2), f"s{i}", group_id=f"g{i // 4}"))
    return out


def lora(model_dir: Path, **kw: object) -> TorchStrategy:
    args: dict[str, object] = {"lr": 1e-2, "lora_rank": 4, "lora_alpha": 8.0}
    args.update(kw)
    return TorchStrategy(model_dir, **args)  # type: ignore[arg-type]


def algo(**kw: object) -> AlgorithmConfig:
    return msgspec.convert(kw, AlgorithmConfig)


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def base_params(s: TorchStrategy) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in s.model.named_parameters() if "lora_" not in k}


def adapters(s: TorchStrategy) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in s.model.named_parameters() if "lora_" in k}


def test_only_the_adapters_train(model_dir: Path) -> None:
    s = lora(model_dir)
    trainable = [k for k, p in s.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in k or ".lora_B." in k for k in trainable)
    assert len(trainable) == 2 * 7 * 2  # A and B on the 7 projections of the 2 layers
    in_optimizer = {id(p) for g in s.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in s.model.parameters() if p.requires_grad}
    base, ada = base_params(s), adapters(s)
    metrics = s.train_step(samples())
    assert metrics["actor/grad_norm"] > 0
    assert all(torch.equal(base[k], v) for k, v in base_params(s).items())  # base weights untouched
    after = adapters(s)
    assert all(not torch.equal(ada[k], after[k]) for k in ada if ".lora_B." in k)  # every B moved (from 0)
    s.train_step(samples(seed=1))  # (A has no gradient while B = 0)
    assert all(torch.equal(base[k], v) for k, v in base_params(s).items())
    after = adapters(s)
    assert all(not torch.equal(ada[k], after[k]) for k in ada)  # now every A and B moved
    plain = load_model(model_dir)  # ... and still the model directory's weights
    state = s._plain_state(merged=False)
    assert all(torch.equal(state[k], v) for k, v in plain.state_dict().items())


def test_export_is_merged_under_the_plain_names(model_dir: Path, tmp_path: Path) -> None:
    plain_strategy = TorchStrategy(model_dir)
    plain_dir, plain_sha = plain_strategy.export_weights(tmp_path / "plain")
    s = lora(model_dir)
    # fresh adapters (B = 0): the merged export is byte for byte the plain model's export
    fresh_dir, fresh_sha = s.export_weights(tmp_path / "fresh")
    assert fresh_sha == plain_sha
    assert json.loads((fresh_dir / "config.json").read_text()) == json.loads((plain_dir / "config.json").read_text())
    s.train_step(samples())
    s.train_step(samples(seed=1))
    training_state = {k: v.clone() for k, v in s.model.state_dict().items()}
    path, sha = s.export_weights(tmp_path / "v1")
    assert sha == weights_sha256(path) and sha != plain_sha
    assert all(torch.equal(training_state[k], v) for k, v in s.model.state_dict().items())  # not mutated
    exported, reference = read_weights(path), read_weights(plain_dir)
    assert exported.keys() == reference.keys()  # tied lm_head left out as in the plain export
    assert all(exported[k].shape == reference[k].shape and exported[k].dtype == reference[k].dtype
               for k in exported)

    engine_model = load_model(model_dir)  # no peft: what the rollout engine does
    base_logits = logits(engine_model)
    copy_weights_(engine_model, exported)
    s.model.eval()
    want = logits(s.model)
    got = logits(engine_model)
    assert_close(got, want, engine_model.config.hidden_size)  # W + BA merged vs Wx + B(Ax): other roundings
    assert (base_logits - want).abs().max() > 1e-3  # the adapters matter: the merge is really in there


def test_checkpoint_resumes_identically(model_dir: Path, tmp_path: Path) -> None:
    examples = [SFTExample([1, 5 + i], [20 + i, 2]) for i in range(4)]
    a = lora(model_dir, lora_dropout=0.1, micro_batch_size=3)  # dropout: the RNG must be restored too
    a.warmup([examples] * 3, lr=1e-2, grad_clip=1.0)  # folds into the base: the base must be restored
    a.train_step(samples())
    a.save_checkpoint(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "adapter.safetensors").exists()
    for k in range(2):
        a.train_step(samples(seed=10 + k))
    want = {k: v.clone() for k, v in a.model.state_dict().items()}

    b = lora(model_dir, lora_dropout=0.1, micro_batch_size=3)
    torch.manual_seed(1234)
    assert b.load_checkpoint(tmp_path / "ckpt") == 1
    for k in range(2):
        b.train_step(samples(seed=10 + k))
    got = b.model.state_dict()
    assert b.step == 3
    assert all(torch.equal(want[k], got[k]) for k in want)

    with pytest.raises(ValueError, match="lora_rank"):
        TorchStrategy(model_dir).load_checkpoint(tmp_path / "ckpt")
    TorchStrategy(model_dir).save_checkpoint(tmp_path / "full")
    with pytest.raises(ValueError, match="lora_rank"):
        lora(model_dir).load_checkpoint(tmp_path / "full")


def test_reference_is_the_base_with_adapters_disabled(model_dir: Path) -> None:
    s = lora(model_dir, algo=algo(use_kl_loss=True, kl_loss_coef=0.1))
    s.init_reference()
    assert s.ref_model is not None and not list(s.ref_model.parameters())  # no copy of the weights
    first = s.train_step(samples())
    assert first["actor/kl"] == pytest.approx(0.0, abs=1e-7)  # fresh adapters: the policy is the base
    s.train_step(samples(seed=1))
    batch = collate(samples(seed=2), s.pad_id)
    ref = s.logprobs(batch, s.ref_model)
    plain = load_model(model_dir)
    with torch.no_grad():
        want = token_logprobs(plain(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits,
                              batch.input_ids, s.temperature)
    mask = batch.loss_mask.bool()
    assert_close(ref[mask], want[mask], plain.config.hidden_size)  # micro-batched vs one pass: other blocking
    assert (s.logprobs(batch)[mask] - want[mask]).abs().max() > 1e-3  # while the policy moved away
    assert s.model.training  # the reference pass left the policy in training mode
    assert s.train_step(samples(seed=3))["actor/kl"] > 0


def test_reference_dir_after_warmup_and_on_resume(model_dir: Path, tmp_path: Path) -> None:
    """The service's order: warm up, export the reference dir, init_reference(dir); on resume
    init_reference(dir) comes before load_checkpoint (which restores the warmed-up base)."""
    cfg = algo(use_kl_loss=True, kl_loss_coef=0.1)
    examples = [SFTExample([1, 5 + i], [20 + i, 2]) for i in range(4)]
    a = lora(model_dir, algo=cfg)
    a.warmup([examples] * 5, lr=1e-2, grad_clip=1.0)
    ref_dir, _ = a.export_weights(tmp_path / "reference")
    a.init_reference(ref_dir)
    assert a.train_step(samples())["actor/kl"] == pytest.approx(0.0, abs=1e-7)
    assert not list(a.ref_model.parameters())  # type: ignore[union-attr]  # still the adapters-disabled base
    a.save_checkpoint(tmp_path / "ckpt")

    b = lora(model_dir, algo=cfg)
    b.init_reference(ref_dir)  # the base is still the model dir's here ...
    b.load_checkpoint(tmp_path / "ckpt")  # ... and the warmed-up one from here on
    mb = b.train_step(samples(seed=1))
    assert b.ref_model is not None and not list(b.ref_model.parameters())
    ma = a.train_step(samples(seed=1))
    assert mb["actor/kl"] == pytest.approx(ma["actor/kl"], rel=1e-6)

    c = lora(model_dir, algo=cfg)  # a reference that is not the base: a separate frozen copy
    c.init_reference(ref_dir)
    c.train_step(samples())
    assert c.ref_model is not None and list(c.ref_model.parameters())
    batch = collate(samples(seed=2), c.pad_id)
    want = load_model(model_dir)
    copy_weights_(want, read_weights(ref_dir))
    mask = batch.loss_mask.bool()
    # two models with the same weights, in separate passes
    assert_close(c.logprobs(batch, c.ref_model)[mask], c.logprobs(batch, want)[mask], want.config.hidden_size)


def test_warmup_trains_the_adapters_then_folds_them(model_dir: Path) -> None:
    s = lora(model_dir)
    examples = [SFTExample([1, 5 + i], [20 + i, 2]) for i in range(4)]
    base = base_params(s)
    losses = s.warmup([examples] * 20, lr=3e-2, grad_clip=1.0)
    # (the tiny model's floor with frozen embeddings and norms is ~3.95 from ln(99) = 4.59)
    assert losses[-1] < losses[0] - 0.4, losses
    assert any(not torch.equal(base[k], v) for k, v in base_params(s).items())  # folded into the base
    assert all(not v.any() for k, v in adapters(s).items() if ".lora_B." in k)  # fresh adapters
    s.model.eval()
    folded = logits(s.model)
    with torch.no_grad(), s.model.disable_adapter():
        assert torch.allclose(logits(s.model), folded)  # the policy is the base now
    s.model.train()
    assert s.step == 0 and not s.optimizer.state


@pytest.mark.parametrize("critic", ["value_head", "separate"])
def test_critic_with_lora(model_dir: Path, tmp_path: Path, critic: str) -> None:
    s = lora(model_dir, algo=algo(adv_estimator="gae", critic=critic))
    s.init_critic()
    assert s.critic is not None
    base, ada = base_params(s), adapters(s)
    metrics = s.train_step(samples())
    assert metrics["critic/grad_norm"] > 0 and "loss/value" in metrics
    assert all(torch.equal(base[k], v) for k, v in base_params(s).items())
    assert all(not torch.equal(ada[k], v) for k, v in adapters(s).items() if ".lora_B." in k)
    trainable = {k for k, p in s.critic.named_parameters() if p.requires_grad}
    if critic == "separate":
        assert trainable - {"head.weight", "head.bias"} and all("lora_" in k for k in trainable - {
            "head.weight", "head.bias"})
    else:
        assert trainable == {"head.weight", "head.bias"}
    s.save_checkpoint(tmp_path / "c")
    ma = s.train_step(samples(seed=1))
    b = lora(model_dir, algo=algo(adv_estimator="gae", critic=critic))
    b.load_checkpoint(tmp_path / "c")
    mb = b.train_step(samples(seed=1))
    assert ma["loss/value"] == pytest.approx(mb["loss/value"], rel=1e-6)


def test_make_strategy_passes_the_lora_settings(model_dir: Path) -> None:
    cfg = parse_config("train: {lora_rank: 2, lora_alpha: 4, lora_target_modules: [q_proj, v_proj]}")
    s = make_strategy(cfg, model_dir)
    assert isinstance(s, TorchStrategy) and s.lora
    trainable = [k for k, p in s.model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 2 * 2 and all("q_proj" in k or "v_proj" in k for k in trainable)
    layer = s.model.get_base_model().model.layers[0].self_attn.q_proj
    assert layer.r["default"] == 2 and layer.scaling["default"] == pytest.approx(2.0)
    assert not make_strategy(parse_config(""), model_dir).lora  # type: ignore[attr-defined]
