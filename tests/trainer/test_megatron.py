"""``train.strategy: megatron``: HF ↔ megatron-core conversion, and the strategy under 2 gloo
processes (TP=2, then DP=2) against :class:`TorchStrategy` on the same batch.

megatron-core is installed by the lock (``requirements.lock``): without it these tests fail."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from schemas.config import AlgorithmConfig, ConfigError, RunConfig, TrainConfig, parse_config
from tests.floats import assert_same_update, gradient_terms
from tests.trainer import megatron_ranks as R
from trainer.factory import make_strategy
from trainer.megatron import check_megatron
from trainer.megatron.convert import (
    ModelShape,
    hf_to_mcore,
    mcore_to_hf,
    pack_qkv,
    shape_from_hf_config,
    unpack_qkv,
)
from trainer.ranks import MultiRankStrategy
from trainer.strategy import TorchStrategy
from weights import read_weights, weights_sha256

TOL = 1e-5


def _hf_state(shape: ModelShape, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random HF Llama/Qwen2 tensors of ``shape``."""
    g = torch.Generator().manual_seed(seed)
    h, d, f, v = shape.hidden_size, shape.head_dim, shape.ffn_size, shape.vocab_size

    def r(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g)

    out = {"model.embed_tokens.weight": r(v, h), "model.norm.weight": r(h)}
    if not shape.tied:
        out["lm_head.weight"] = r(v, h)
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": r(shape.num_heads * d, h),
                p + "self_attn.k_proj.weight": r(shape.num_groups * d, h),
                p + "self_attn.v_proj.weight": r(shape.num_groups * d, h),
                p + "self_attn.o_proj.weight": r(h, shape.num_heads * d),
                p + "input_layernorm.weight": r(h), p + "post_attention_layernorm.weight": r(h),
                p + "mlp.gate_proj.weight": r(f, h), p + "mlp.up_proj.weight": r(f, h),
                p + "mlp.down_proj.weight": r(h, f)}
        if shape.qkv_bias:
            out |= {p + "self_attn.q_proj.bias": r(shape.num_heads * d),
                    p + "self_attn.k_proj.bias": r(shape.num_groups * d),
                    p + "self_attn.v_proj.bias": r(shape.num_groups * d)}
    return out


def test_pack_qkv_groups_queries_with_their_key_and_value() -> None:
    shape = ModelShape(num_layers=1, hidden_size=2, num_heads=4, num_groups=2, head_dim=1, ffn_size=2,
                       vocab_size=3, tied=True)
    q = torch.tensor([[0.0, 0], [1, 1], [2, 2], [3, 3]])  # heads 0..3, one row each
    k = torch.tensor([[10.0, 10], [11, 11]])
    v = torch.tensor([[20.0, 20], [21, 21]])
    packed = pack_qkv(q, k, v, shape)
    assert packed[:, 0].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]  # group 0: q0 q1 k0 v0, group 1: q2 q3 k1 v1
    assert all(torch.equal(a, b) for a, b in zip(unpack_qkv(packed, shape), (q, k, v), strict=True))


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("tied,qkv_bias", [(True, False), (False, True)])
def test_hf_megatron_hf_round_trip_is_exact(tp: int, tied: bool, qkv_bias: bool) -> None:
    # vocab 13 is padded to a multiple of tp (the padding rows are zero and dropped on the way back)
    shape = ModelShape(num_layers=2, hidden_size=8, num_heads=4, num_groups=4 if tp == 4 else 2, head_dim=2,
                       ffn_size=12, vocab_size=13, tied=tied, qkv_bias=qkv_bias)
    hf = _hf_state(shape)
    shards = [hf_to_mcore(hf, shape, r, tp) for r in range(tp)]
    vp = shape.padded_vocab(tp)
    assert vp % tp == 0 and vp >= 13
    emb = torch.cat([s["embedding.word_embeddings.weight"] for s in shards])
    assert emb.shape == (vp, 8) and not emb[13:].any()
    assert shards[0]["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 12 // tp, 8)
    assert ("output_layer.weight" in shards[0]) == (not tied)
    back = mcore_to_hf(shards, shape)
    assert sorted(back) == sorted(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)
    fused = mcore_to_hf([hf_to_mcore(hf, shape, r, tp, fused_norm=True) for r in range(tp)], shape, fused_norm=True)
    assert all(torch.equal(fused[k], hf[k]) for k in hf)


def test_check_megatron_refuses_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = RunConfig(train=TrainConfig(strategy="megatron"))
    check_megatron(cfg)  # installed (the lock has megatron-core): accepted
    critic = RunConfig(train=TrainConfig(strategy="megatron"),
                       algorithm=AlgorithmConfig(adv_estimator="gae", critic="value_head"))
    with pytest.raises(ConfigError, match=r"algorithm.critic='value_head'.*train.strategy='megatron'") as e:
        check_megatron(critic)
    assert "\n" not in str(e.value)
    monkeypatch.setattr("trainer.megatron.megatron_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"pip install 'rollstream\[megatron\]'") as e:
        check_megatron(cfg)
    assert "\n" not in str(e.value)
    check_megatron(RunConfig())  # torch strategy: nothing to check


def test_model_checks_name_the_problem(model_dir: Path) -> None:
    from transformers import AutoConfig, LlamaConfig

    shape = shape_from_hf_config(AutoConfig.from_pretrained(model_dir))
    assert (shape.num_heads, shape.num_groups, shape.vocab_size, shape.tied) == (2, 2, 98, True)
    assert shape.check_tp(2) is None
    assert shape.check_tp(4) == "num_attention_heads=2 is not a multiple of train.tensor_parallel=4"
    scaled = LlamaConfig(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192})
    with pytest.raises(ValueError, match="rope_type='llama3' is not supported"):
        shape_from_hf_config(scaled)
    with pytest.raises(ValueError, match="model_type='gpt2' is not supported"):
        shape_from_hf_config(AutoConfig.for_model("gpt2"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torch(model_dir: Path, algo: AlgorithmConfig) -> TorchStrategy:
    cfg = R.config(1, algo)
    s = TorchStrategy(model_dir, lr=R.LR, grad_clip=R.GRAD_CLIP, micro_batch_size=R.MICRO, algo=algo,
                      temperature=cfg.rollout.temperature, max_len=cfg.rollout.max_new_tokens,
                      total_steps=cfg.train.steps)
    s.chunked_head = False  # whole logits: megatron's chunked vocabulary-parallel logprobs are compared with them
    return s


def _assert_metrics_match(got: dict[str, float], want: dict[str, float]) -> None:
    assert sorted(got) == sorted(want)
    bad = {k: (got[k], want[k]) for k in want if abs(got[k] - want[k]) > TOL}
    assert not bad


def _assert_weights_match(path: Path, model: torch.nn.Module, start: Path) -> None:
    """One step from the weights in ``start``: Megatron's sums run in another order (TP shards, DP
    all-reduce), so the updates agree to the rounding of one batch's gradient (tests/floats.py)."""
    got, want = read_weights(path), {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert sorted(got) == sorted(want)
    terms = gradient_terms(model.config, [len(s.prompt_ids) + len(s.response_ids) for s in R.samples()])
    assert_same_update(read_weights(start), want, got, terms)


def test_megatron_tp2_and_dp2_match_the_torch_strategy(model_dir: Path, tmp_path: Path) -> None:
    # the tiny model's 2 heads, 2 kv heads, MLP width 64 and vocabulary 98 all divide by TP=2
    mp.spawn(R.run, args=(2, _free_port(), str(model_dir), str(tmp_path)), nprocs=2, join=True)

    def metrics(name: str) -> dict[str, float]:
        return json.loads((tmp_path / f"{name}.json").read_text())

    batch = R.samples()
    # HF → Megatron (TP=2) → HF through the model: bitwise the original weights
    original = read_weights(model_dir)
    exported = read_weights(tmp_path / "tp2_init")
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], original[k]) for k in original)

    ref = _torch(model_dir, R.ALGO["tp2"])
    # ... and the same HF directory, file for file, as the torch strategy exports
    torch_dir, sha = ref.export_weights(tmp_path / "torch_init")
    assert sha == weights_sha256(tmp_path / "tp2_init")
    files = sorted(p.name for p in torch_dir.iterdir())
    assert files == sorted(p.name for p in (tmp_path / "tp2_init").iterdir())
    assert all((torch_dir / f).read_bytes() == (tmp_path / "tp2_init" / f).read_bytes() for f in files)
    want1 = ref.train_step(batch)
    assert want1["actor/grad_norm"] > R.GRAD_CLIP and "actor/entropy" in want1
    _assert_metrics_match(metrics("tp2_step1"), want1)
    _assert_weights_match(tmp_path / "tp2_step1", ref.model, model_dir)
    assert not torch.equal(read_weights(tmp_path / "tp2_step1")["model.norm.weight"], original["model.norm.weight"])
    want2 = ref.train_step(batch)
    _assert_metrics_match(metrics("tp2_step2"), want2)
    # the checkpoint restores weights (exactly), optimizer and step: the second step repeats
    step1, restored = read_weights(tmp_path / "tp2_step1"), read_weights(tmp_path / "tp2_restored")
    assert all(torch.equal(restored[k], step1[k]) for k in step1)
    again = metrics("tp2_step2_again")
    assert again.pop("step") == 1
    assert again == metrics("tp2_step2")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "algo_state.msgpack", "model", "optimizer_tp0of2.pt", "optimizer_tp1of2.pt", "trainer_state.pt"]

    # DP=2 (TP=1): each replica trains its share of the 3 micro-batches; KL loss against a reference
    # (the weights after the TP=2 step)
    dp = _torch(model_dir, R.ALGO["dp2"])
    dp.init_reference(tmp_path / "tp2_step1")
    want = dp.train_step(batch)
    assert want["loss/kl"] > 0 and want["actor/grad_norm"] > R.GRAD_CLIP
    _assert_metrics_match(metrics("dp2_step1"), want)
    _assert_weights_match(tmp_path / "dp2_step1", dp.model, model_dir)
    # then the supervised warm-up (2 steps: the second loss follows the first step)
    warm = dp.warmup(R.sft_batches(), lr=1e-3, grad_clip=0.5)
    assert json.loads((tmp_path / "dp2_warmup.json").read_text()) == pytest.approx(warm, abs=TOL)
    assert json.loads((tmp_path / "gathered_logits.json").read_text()) == 0


def test_megatron_under_the_multi_rank_driver(model_dir: Path, tmp_path: Path) -> None:
    """``make_strategy`` → :class:`MultiRankStrategy` (rank 1 a subprocess): one TP=2 step and its export."""
    cfg = parse_config("", ["train.strategy=megatron", "train.ranks=2", "train.tensor_parallel=2",
                            f"train.lr={R.LR}", f"train.grad_clip={R.GRAD_CLIP}", f"train.micro_batch_size={R.MICRO}",
                            "algorithm.entropy_loss_coef=0.01", "train.dist_timeout_s=120"])
    multi = make_strategy(cfg, model_dir)
    assert isinstance(multi, MultiRankStrategy)
    try:
        got = multi.train_step(R.samples())
        path, sha = multi.export_weights(tmp_path / "w")
    finally:
        multi.close()
    ref = _torch(model_dir, R.ALGO["tp2"])
    _assert_metrics_match(got, ref.train_step(R.samples()))
    _assert_weights_match(path, ref.model, model_dir)
    assert len(sha) == 64
