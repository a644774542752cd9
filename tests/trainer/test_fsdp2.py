"""``train.strategy: fsdp2`` over 2 CPU processes (gloo) against the single-process torch strategy
on the same batches: metrics and updated weights, the exported HF directory, warm-up, checkpoint
resume, the KL reference and the critic, packed micro-batches (one rank). FSDP2 computes its token logprobs
(and the warm-up's) in chunks from the hidden states; the torch strategy it is compared with takes
the whole-logits path, padded: the same numbers up to float summation order."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from schemas.config import RunConfig, parse_config
from tests.floats import assert_same_update, gradient_terms
from tests.trainer.test_strategy import grad_terms, make_samples
from trainer.factory import make_strategy
from trainer.fsdp2 import deal, merge_rank_metrics
from trainer.ranks import MultiRankStrategy
from trainer.sft import SFTExample
from trainer.strategy import TorchStrategy, strategy_kwargs
from weights import read_weights

TOL = 1e-5

BASE = ["train.strategy=fsdp2", "train.ranks=2", "train.lr=0.01", "train.micro_batch_size=2",
        "train.dist_timeout_s=60"]


def pair(cfg: RunConfig, model_dir: Path, whole: bool = True) -> tuple[MultiRankStrategy, TorchStrategy]:
    """FSDP2 as ``cfg`` says, and the torch strategy on whole logits (``whole``), padded: with
    ``micro_batch_tokens`` it groups the samples as FSDP2 does but pads each group (its packing
    belongs to the chunked path)."""
    torch.manual_seed(0)
    multi = make_strategy(cfg, model_dir)
    assert isinstance(multi, MultiRankStrategy)
    torch.manual_seed(0)
    ref = TorchStrategy(model_dir, **strategy_kwargs(cfg, "cpu"))
    ref.chunked_head = not whole
    return multi, ref


@pytest.fixture
def closing() -> Iterator[list[MultiRankStrategy]]:
    started: list[MultiRankStrategy] = []
    yield started
    for s in started:
        s.close()


def assert_metrics_match(a: dict[str, float], b: dict[str, float]) -> None:
    assert set(a) == set(b)
    for key in b:
        if math.isnan(b[key]):
            assert math.isnan(a[key]), key
        else:
            assert a[key] == pytest.approx(b[key], rel=TOL, abs=TOL), key


def max_weight_diff(a: Path, b: Path) -> float:
    wa, wb = read_weights(a), read_weights(b)
    assert set(wa) == set(wb)
    return max(float((wa[k] - wb[k]).abs().max()) for k in wb)


def assert_same_weights(a: Path, b: Path, start: Path, terms: int) -> None:
    """The steps since ``start`` agree to the rounding of their gradients (tests/floats.py): the
    ranks sum each gradient in another order (all-reduce of their shares)."""
    assert_same_update(read_weights(start), read_weights(a), read_weights(b), terms)


def test_helpers() -> None:
    assert deal(3, 2, 0) == ([0, 2], 2) and deal(3, 2, 1) == ([1], 2)
    assert deal(0, 2, 1) == ([], 0)
    merged = merge_rank_metrics([{"loss/policy": 0.25, "actor/ratio_min": 0.9, "actor/ratio_max": 1.1},
                                 {"loss/policy": 0.5, "actor/ratio_min": 0.8, "actor/ratio_max": 1.05}, {}])
    assert merged == {"loss/policy": 0.75, "actor/ratio_min": 0.8, "actor/ratio_max": 1.1}


def test_steps_export_and_resume_match_the_torch_strategy(model_dir: Path, tmp_path: Path,
                                                          closing: list[MultiRankStrategy]) -> None:
    multi, ref = pair(parse_config("", BASE), model_dir)
    closing.append(multi)
    assert multi.tokenizer.get_vocab() == ref.tokenizer.get_vocab()

    # warm-up: every rank trains on the whole batch; same losses as one process
    examples = [SFTExample(s.prompt_ids, s.response_ids) for s in make_samples(4, seed=3)]
    wm, wr = multi.warmup([examples] * 3, lr=3e-3, grad_clip=1.0), ref.warmup([examples] * 3, lr=3e-3, grad_clip=1.0)
    assert len(wm) == 3 and wm == pytest.approx(wr, rel=TOL)

    # 8 samples = 4 micro-batches (2 per rank), then 6 = 3 (rank 1 runs a zero-weighted one)
    terms = 3 * gradient_terms(ref.model.config, [len(e.prompt_ids) + len(e.target_ids) for e in examples])
    for samples in (make_samples(8, seed=1), make_samples(6, seed=2)):
        assert_metrics_match(multi.train_step(samples), ref.train_step(samples))
        terms += grad_terms(ref, samples)
    assert multi.step == ref.step == 2

    path, checksum = multi.export_weights(tmp_path / "fsdp2")
    tpath, _ = ref.export_weights(tmp_path / "torch")
    assert path == tmp_path / "fsdp2" and len(checksum) == 64
    assert sorted(p.name for p in path.iterdir()) == sorted(p.name for p in tpath.iterdir())
    assert json.loads((path / "config.json").read_text()) == json.loads((tpath / "config.json").read_text())
    assert "lm_head.weight" not in read_weights(path)  # tied, as save_pretrained writes it
    assert_same_weights(path, tpath, model_dir, terms)
    loaded = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    ids = torch.tensor([[1, 5, 9, 12]])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, ref.model(ids).logits, atol=1e-4)

    # checkpoint, one more step, restore, the same step again: the same result
    ckpt = multi.save_checkpoint(tmp_path / "ckpt")
    assert ckpt == tmp_path / "ckpt" and (ckpt / "model" / "model.safetensors").exists()
    third = make_samples(8, seed=4)
    first_try = multi.train_step(third)
    multi.export_weights(tmp_path / "after")
    assert multi.load_checkpoint(ckpt) == 2 and multi.step == 2
    second_try = multi.train_step(third)
    assert multi.export_weights(tmp_path / "again")[1] == multi.export_weights(tmp_path / "after2")[1]
    assert_metrics_match(second_try, first_try)
    assert max_weight_diff(tmp_path / "again", tmp_path / "after") < 1e-6
    # and still the torch strategy's step
    assert_metrics_match(second_try, ref.train_step(third))
    assert_same_weights(tmp_path / "again", ref.export_weights(tmp_path / "torch3")[0], model_dir,
                        terms + grad_terms(ref, third))
    multi.close()
    multi.close()  # idempotent


@pytest.mark.parametrize("critic", ["value_head", "separate"])
def test_kl_reference_and_critic_match_the_torch_strategy(model_dir: Path, tmp_path: Path, critic: str,
                                                          closing: list[MultiRankStrategy]) -> None:
    cfg = parse_config("", [*BASE, "algorithm.adv_estimator=gae", f"algorithm.critic={critic}",
                            "algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.5"])
    # both chunked: with a value head's and a KL term's gradients, an element of the tied embedding's
    # gradient cancels to ~1e-8 (Adam's eps), where Adam's first step turns the whole-logits path's
    # other rounding into a 0.2·lr difference that the second step's metrics show
    multi, ref = pair(cfg, model_dir, whole=False)
    closing.append(multi)
    start, _ = ref.export_weights(tmp_path / "reference")
    multi.init_reference(start)
    ref.init_reference(start)
    multi.init_critic()
    ref.init_critic()
    terms = 0
    for seed in (5, 6):
        samples = make_samples(6, seed=seed)
        a, b = multi.train_step(samples), ref.train_step(samples)
        assert "critic/grad_norm" in a and "loss/kl" in a
        assert_metrics_match(a, b)
        terms += grad_terms(ref, samples)
    assert_same_weights(multi.export_weights(tmp_path / "m")[0], ref.export_weights(tmp_path / "t")[0], model_dir,
                        terms)


@pytest.mark.parametrize("sizing", ["train.micro_batch_size=3", "train.micro_batch_tokens=24"])
def test_one_rank_takes_the_same_path(model_dir: Path, closing: list[MultiRankStrategy], sizing: str) -> None:
    """Also packed (``micro_batch_tokens``): the torch strategy pads the same groups of samples."""
    cfg = parse_config("", ["train.strategy=fsdp2", "train.ranks=1", "train.lr=0.01", sizing])
    multi, ref = pair(cfg, model_dir)
    closing.append(multi)
    assert multi._procs == []  # rank 0 alone: no worker process
    kept: list[int] = []  # positions the head module is called on: none, the logprobs are chunked apart
    multi.local.model.lm_head.register_forward_hook(lambda _m, args, _o: kept.append(args[0].shape[-2]))
    samples = make_samples(7, seed=8)
    assert_metrics_match(multi.train_step(samples), ref.train_step(samples))
    assert kept and set(kept) == {0}
