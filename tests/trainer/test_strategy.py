from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from schemas.config import AlgorithmConfig
from tests.floats import assert_close, assert_same_update, gradient_terms, rounding_tol
from trainer.batch import TrainSample, collate
from trainer.sft import SFTExample, sft_batch, sft_loss, sft_warmup
from trainer.strategy import Strategy, TorchStrategy, token_logprobs
from weights import weights_sha256


def make_samples(n: int = 6, seed: int = 0) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [1] + [rng.randrange(4, 60) for _ in range(rng.randrange(2, 6))]
        resp = [rng.randrange(4, 60) for _ in range(rng.randrange(1, 7))] + [2]
        out.append(
            TrainSample(
                prompt, resp, [-rng.random() * 3 for _ in resp], [1] * len(resp), rng.uniform(-1, 1), f"s{i}",
                group_id=f"g{i // 2}",
            )
        )
    return out


def params(strategy: TorchStrategy) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in strategy.model.named_parameters()}


def grad_terms(strategy: TorchStrategy, samples: list[TrainSample]) -> int:
    """Rounding terms of a weight-gradient element on this batch (for tolerances, tests/floats.py)."""
    return gradient_terms(strategy.model.config, [len(s.prompt_ids) + len(s.response_ids) for s in samples])


def hidden_size(strategy: TorchStrategy) -> int:
    """Length of the dot products that give a logit: the terms of a logprob's rounding (for tolerances)."""
    return int(strategy.model.config.hidden_size)


def test_collate_aligns_targets() -> None:
    s = TrainSample([1, 10, 11], [20, 21, 2], [-0.1, -0.2, -0.3], [1, 0, 1], 0.5)
    b = collate([s, TrainSample([1, 9], [30], [-1.0], [1], -1.0)], pad_id=0)
    assert b.input_ids.tolist() == [[1, 10, 11, 20, 21, 2], [1, 9, 30, 0, 0, 0]]
    assert b.attention_mask.tolist() == [[1] * 6, [1, 1, 1, 0, 0, 0]]
    # column t predicts input_ids[:, t + 1]
    assert b.loss_mask.tolist() == [[0, 0, 1, 0, 1], [0, 1, 0, 0, 0]]
    assert b.old_logprobs[0, 2:].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert b.old_logprobs[1, 1].item() == pytest.approx(-1.0)
    assert b.num_tokens == 3
    assert b.rows(1, 2).input_ids.tolist() == [[1, 9, 30]]


def test_is_a_strategy(model_dir: Path) -> None:
    assert isinstance(TorchStrategy(model_dir), Strategy)


def test_logprobs_are_padding_independent(model_dir: Path) -> None:
    strategy = TorchStrategy(model_dir, temperature=0.7, micro_batch_size=2)
    samples = make_samples()
    batch = collate(samples, strategy.pad_id)
    lp = strategy.logprobs(batch)
    for i, s in enumerate(samples):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            alone = token_logprobs(strategy.model(ids).logits, ids, 0.7)[0]
        n = ids.shape[1] - 1
        m = batch.loss_mask[i, :n].bool()
        assert_close(lp[i, :n][m], alone[m], hidden_size(strategy))  # padding changes the matmul blocking


def test_micro_batching_gives_the_same_step(model_dir: Path) -> None:
    samples = make_samples(8)
    a = TorchStrategy(model_dir, lr=1e-2, micro_batch_size=8)
    b = TorchStrategy(model_dir, lr=1e-2, micro_batch_size=3)
    before = params(a)
    ma, mb = a.train_step(samples), b.train_step(samples)
    assert ma["actor/grad_norm"] == pytest.approx(mb["actor/grad_norm"], rel=1e-4)
    assert ma["loss/policy"] == pytest.approx(mb["loss/policy"], rel=1e-4, abs=1e-6)
    # the grouping changes the gradient's summation order: the updates agree to its rounding
    assert_same_update(before, params(a), params(b), grad_terms(a, samples))
    assert a.step == b.step == 1


def test_positive_advantage_raises_logprob(model_dir: Path) -> None:
    strategy = TorchStrategy(model_dir, lr=1e-2)
    good, bad = make_samples(2)
    batch = collate([good, bad], strategy.pad_id)
    before = strategy.logprobs(batch)
    old = [[float(x) for x in before[i][batch.loss_mask[i].bool()]] for i in range(2)]
    samples = [TrainSample(s.prompt_ids, s.response_ids, lp, s.loss_mask, reward=r, group_id="g")
               for s, lp, r in zip([good, bad], old, [1.0, 0.0], strict=True)]  # GRPO: A = +0.71, -0.71
    metrics = strategy.train_step(samples)
    lp_size = max(abs(x) for row in old for x in row)  # on-policy: ρ = 1 up to the logprobs' rounding
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=rounding_tol(lp_size, hidden_size(strategy)))
    after = strategy.logprobs(batch)
    m = batch.loss_mask[0].bool()
    assert after[0][m].sum() > before[0][m].sum()


def test_export_weights_loads_and_has_stable_checksum(model_dir: Path, tmp_path: Path) -> None:
    strategy = TorchStrategy(model_dir)
    path, sha = strategy.export_weights(tmp_path / "v1")
    assert len(sha) == 64 and sha == weights_sha256(path)
    again, sha2 = strategy.export_weights(tmp_path / "v1")  # overwrite in place
    assert again == path and sha2 == sha
    reloaded = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, strategy.model(ids).logits, atol=1e-6)
    assert not list(tmp_path.glob(".*tmp*"))


def test_checkpoint_round_trip(model_dir: Path, tmp_path: Path) -> None:
    samples = make_samples(6)
    a = TorchStrategy(model_dir, lr=1e-2)
    a.train_step(samples[:3])
    a.save_checkpoint(tmp_path / "ckpt")
    draw_after_save = torch.rand(3)
    a.train_step(samples[3:])
    want = params(a)

    b = TorchStrategy(model_dir, lr=1e-2)
    torch.manual_seed(999)
    assert b.load_checkpoint(tmp_path / "ckpt") == 1
    assert torch.equal(torch.rand(3), draw_after_save)  # RNG restored to the checkpoint's
    b.train_step(samples[3:])  # same optimizer state (Adam moments) => same update
    got = params(b)
    assert b.step == 2
    assert all(torch.allclose(want[k], got[k], atol=1e-6) for k in want)


def test_sft_warmup_learns_a_fixed_set(model_dir: Path) -> None:
    strategy = TorchStrategy(model_dir)
    examples = [SFTExample([1, 5 + i], [20 + i, 2]) for i in range(4)]
    batch = sft_batch(examples, strategy.pad_id)
    assert batch.loss_mask.sum() == 8
    with torch.no_grad():
        start = sft_loss(strategy.model, batch).item()
    losses = sft_warmup(strategy.model, [examples] * 60, lr=3e-3, pad_id=strategy.pad_id)
    assert len(losses) == 60 and losses[0] == pytest.approx(start, rel=1e-4)
    assert losses[-1] < 0.5 * start


def test_sft_loss_chunked_equals_whole_logits(model_dir: Path) -> None:
    """The warm-up's loss from the hidden states in chunks of positions (that do and do not divide
    the trained positions) against whole logits (``chunk=0``): value and every parameter's gradient."""
    strategy = TorchStrategy(model_dir)
    samples = make_samples(5, seed=11)
    examples = [SFTExample(s.prompt_ids, s.response_ids) for s in samples]
    batch = sft_batch(examples, strategy.pad_id)
    named = dict(strategy.model.named_parameters())

    def loss_and_grads(chunk: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = sft_loss(strategy.model, batch, chunk)
        return loss.detach(), dict(zip(named, torch.autograd.grad(loss, list(named.values())), strict=True))

    want, g_want = loss_and_grads(0)
    terms = gradient_terms(strategy.model.config, [len(s.prompt_ids) + len(s.response_ids) for s in samples])
    for chunk in (1, 5, 1024):
        got, g_got = loss_and_grads(chunk)
        assert_close(got, want, hidden_size(strategy) + int(strategy.model.config.vocab_size))
        assert_same_grads(g_got, g_want, terms)


def test_strategy_warmup_trains_its_own_model_and_leaves_it_in_train_mode(model_dir: Path) -> None:
    strategy = TorchStrategy(model_dir)
    examples = [SFTExample([1, 5 + i], [20 + i, 2]) for i in range(4)]
    strategy.model.eval()
    losses = strategy.warmup([examples] * 30, lr=3e-3, grad_clip=1.0)
    assert len(losses) == 30 and losses[-1] < 0.7 * losses[0]
    assert strategy.model.training
    assert strategy.step == 0 and not strategy.optimizer.state  # the RL optimizer is untouched


def test_protocols_hold_exactly_what_services_call() -> None:
    """The members services call (trainer_service, replay, rollout worker): keep in sync with them."""
    from rollout.engine import Engine

    def members(proto: type) -> set[str]:
        return {n for n in vars(proto) if not n.startswith("_")} | set(getattr(proto, "__annotations__", {}))

    assert members(Strategy) == {"step", "tokenizer", "warmup", "init_reference", "init_critic", "train_step",
                                 "save_checkpoint", "load_checkpoint", "export_weights"}
    # chat: the warm-up renders as rollout does; tokenizer, max_positions: the agent loop renders turns and fits them
    assert members(Engine) == {"policy_version", "chat", "tokenizer", "max_positions", "encode", "generate",
                               "load_weights"}


def test_cosine_lr_schedule(model_dir: Path) -> None:
    constant = TorchStrategy(model_dir, lr=1e-3)
    assert constant.lr_at(0) == constant.lr_at(500) == 1e-3
    cosine = TorchStrategy(model_dir, lr=1e-3, total_steps=11, min_lr_ratio=0.1)
    assert cosine.lr_at(0) == pytest.approx(1e-3)
    assert cosine.lr_at(5) == pytest.approx(0.55e-3)
    assert cosine.lr_at(10) == cosine.lr_at(99) == pytest.approx(1e-4)
    metrics = cosine.train_step(make_samples(2))
    assert metrics["actor/lr"] == pytest.approx(1e-3)
    warm = TorchStrategy(model_dir, lr=1e-3, total_steps=11, min_lr_ratio=0.1, lr_warmup_steps=4)
    assert [warm.lr_at(k) for k in range(3)] == pytest.approx([cosine.lr_at(k) * (k + 1) / 4 for k in range(3)])
    assert warm.lr_at(3) == pytest.approx(cosine.lr_at(3)) and warm.lr_at(10) == pytest.approx(1e-4)
    assert warm.train_step(make_samples(2))["actor/lr"] == pytest.approx(0.25e-3)


def windowed_episodes(strategy: TorchStrategy, episodes: int = 4, turns: int = 3, seed: int = 0,
                      ) -> tuple[list[TrainSample], list[TrainSample]]:
    """Episodes under a history window (each turn a segment: its own prompt, then its reply), with
    behaviour logprobs from each segment read on its own; and the same turns as separate samples."""
    rng = random.Random(seed)
    windowed, split = [], []
    for e in range(episodes):
        segs = []
        for _ in range(turns):
            prompt = [1] + [rng.randrange(4, 60) for _ in range(rng.randrange(3, 9))]
            reply = [rng.randrange(4, 60) for _ in range(rng.randrange(1, 4))] + [2]
            row = collate([TrainSample(prompt, reply, [0.0] * len(reply), [1] * len(reply), 0.0)], strategy.pad_id)
            lp = strategy.logprobs(row)[0, len(prompt) - 1:].tolist()
            segs.append((prompt, reply, lp))
        reward = float(e % 2)
        group = f"g{e // 2}"
        response, lps, mask, starts = [], [], [], []
        for t, (prompt, reply, lp) in enumerate(segs):
            if t:
                starts.append(len(response))
                response += prompt
                lps += [0.0] * len(prompt)
                mask += [0] * len(prompt)
            response += reply
            lps += lp
            mask += [1] * len(reply)
            split.append(TrainSample(prompt, reply, lp, [1] * len(reply), reward, f"e{e}/t{t}", group_id=group))
        windowed.append(TrainSample(segs[0][0], response, lps, mask, reward, f"e{e}", group_id=group,
                                    segment_starts=tuple(starts)))
    return windowed, split


def test_windowed_episodes_train_as_their_turns_would_on_their_own(model_dir: Path) -> None:
    """A windowed episode is scored one row per turn: behaviour logprobs read on each turn's own
    window are the strategy's own (ratio 1), and with an episode-level advantage (Dr. GRPO,
    token-mean) the step equals the step on the same turns given as separate samples."""
    from schemas.config import AlgorithmConfig

    algo = AlgorithmConfig(adv_estimator="dr_grpo", old_logprobs="recompute")
    a = TorchStrategy(model_dir, lr=1e-2, micro_batch_size=4, algo=algo)
    b = TorchStrategy(model_dir, lr=1e-2, micro_batch_size=4, algo=algo)
    windowed, split = windowed_episodes(a)
    batch, _ = a.prepare(windowed)
    assert batch.num_rows == len(split) == 12
    trained = batch.loss_mask.bool()
    old = torch.tensor([x for s in split for x in s.old_logprobs])
    # recomputed on the rows (no cross-turn attention), in a batch of another width than each turn alone
    assert_close(batch.old_logprobs[trained], old, hidden_size(a))
    before = params(a)
    ma, mb = a.train_step(windowed), b.train_step(split)
    assert ma["train/tokens"] == mb["train/tokens"] and ma["train/samples"] == 4
    # a token mean of −A·ρ with ρ ≈ 1: terms of size mean |A|, one per trained token
    loss_tol = rounding_tol(ma["rollout/advantage_abs_mean"], int(ma["train/tokens"]))
    assert ma["loss/policy"] == pytest.approx(mb["loss/policy"], rel=0, abs=loss_tol)
    # ρ = exp(log π − log μ), both logprobs read on rows of different widths
    assert ma["actor/ratio_max"] == pytest.approx(1.0, abs=rounding_tol(float(old.abs().max()), hidden_size(a)))
    assert_same_update(before, params(a), params(b), grad_terms(a, split))  # rows in another batch layout


def test_windowed_gigpo_advantages_follow_the_episode(model_dir: Path) -> None:
    """GiGPO on windowed episodes: per-turn advantages are computed over the episode (its step
    rewards and anchors), then land on that turn's row."""
    from schemas.config import AlgorithmConfig
    from trainer import algorithm as alg
    from trainer.batch import merge_rows, segment_layout

    s = TorchStrategy(model_dir, algo=AlgorithmConfig(adv_estimator="gigpo"))
    windowed, _ = windowed_episodes(s, seed=1)
    windowed = [dataclasses.replace(w, step_rewards=(0.0, float(i % 2), 1.0), state_hashes=("a", f"b{i % 2}", "c"))
                for i, w in enumerate(windowed)]
    batch, _ = s.prepare(windowed)
    whole = collate(windowed, s.pad_id)
    adv, _, _ = alg.compute_advantages(s.algo, s.algo_state, whole.extras["rewards"], whole.extras["group_ids"],
                                       whole.loss_mask, step_rewards=[w.step_rewards for w in windowed],
                                       state_hashes=[w.state_hashes for w in windowed])
    layout = segment_layout(windowed)
    assert layout is not None
    back = merge_rows(batch.advantages, layout, len(windowed), whole.input_ids.shape[1])
    assert torch.allclose(back, adv, atol=1e-6) and adv.abs().sum() > 0
    per_row = [set(batch.advantages[r][batch.loss_mask[r] > 0].tolist()) for r in range(batch.num_rows)]
    assert all(len(v) == 1 for v in per_row)  # one advantage per turn


def tied_groups(n_groups: int = 6, tied: tuple[int, ...] = (0, 2, 3), seed: int = 1) -> list[TrainSample]:
    """Groups of 2; the groups ``tied`` get one reward for both members (GRPO advantage 0)."""
    samples = make_samples(2 * n_groups, seed=seed)
    return [dataclasses.replace(s, reward=0.5) if i // 2 in tied else s for i, s in enumerate(samples)]


@pytest.mark.parametrize(("variant", "agg"), [("ppo", "token-mean"), ("ppo", "seq-mean-token-sum-norm"),
                                              ("gspo", "seq-mean-token-mean"), ("cispo", "token-mean")])
def test_skipping_zero_advantage_rows_gives_the_same_step(model_dir: Path, variant: str, agg: str) -> None:
    from schemas.config import AlgorithmConfig

    algo = AlgorithmConfig(pg_variant=variant, loss_agg_mode=agg)  # type: ignore[arg-type]
    samples = tied_groups()
    full = TorchStrategy(model_dir, lr=1e-2, micro_batch_size=3, algo=algo, max_len=8)
    skip = TorchStrategy(model_dir, lr=1e-2, micro_batch_size=3, algo=algo, max_len=8, skip_zero_advantage=True)
    before = params(full)
    for step in range(2):  # the second step's ratios are off 1: the clips take part
        mf, ms = full.train_step(samples), skip.train_step(samples)
        assert mf["train/skipped_rows"] == 0 and ms["train/skipped_rows"] == 6
        assert ms["actor/grad_norm"] == pytest.approx(mf["actor/grad_norm"], rel=1e-5)
        assert ms["loss/policy"] == pytest.approx(mf["loss/policy"], rel=1e-5, abs=1e-7)
        assert ms["loss/total"] == pytest.approx(mf["loss/total"], rel=1e-5, abs=1e-7)
        assert ms["train/tokens"] == mf["train/tokens"] and ms["train/samples"] == 12
        # the skipped rows' zeros leave the sums in another order: the updates agree to its rounding
        assert_same_update(before, params(full), params(skip), grad_terms(full, samples) * (step + 1))


def test_skipped_rows_diagnostics_cover_the_trained_rows(model_dir: Path) -> None:
    samples = tied_groups()
    kept = [s for i, s in enumerate(samples) if i // 2 not in (0, 2, 3)]
    skip = TorchStrategy(model_dir, micro_batch_size=4, skip_zero_advantage=True)
    alone = TorchStrategy(model_dir, micro_batch_size=4)  # the same weights, given only the rows that train
    ms, ma = skip.train_step(samples), alone.train_step(kept)
    for key in ("actor/entropy", "actor/ratio_mean", "actor/approx_kl", "loss/clipfrac", "actor/ratio_min"):
        assert ms[key] == pytest.approx(ma[key], rel=1e-5, abs=1e-7), key


def test_skipping_keeps_adams_step_when_no_row_has_gradient(model_dir: Path) -> None:
    tied = [dataclasses.replace(s, reward=1.0) for s in make_samples(6)]
    full = TorchStrategy(model_dir, lr=1e-2, micro_batch_size=2)
    skip = TorchStrategy(model_dir, lr=1e-2, micro_batch_size=2, skip_zero_advantage=True)
    for s in (full, skip):
        s.train_step(make_samples(6))  # Adam's moments are non-zero now
    before = params(skip)
    mf, ms = full.train_step(tied), skip.train_step(tied)
    assert ms["train/skipped_rows"] == 5 and mf["actor/grad_norm"] == ms["actor/grad_norm"] == 0.0
    pf, ps = params(full), params(skip)
    assert any(not torch.equal(before[k], ps[k]) for k in ps)  # the moments moved the weights
    assert_same_update(before, pf, ps, grad_terms(skip, tied))  # Adam's moments, summed alike up to rounding


@pytest.mark.parametrize("change", [{"entropy_loss_coef": 0.01}, {"use_kl_loss": True}])
def test_rows_are_not_skipped_when_another_loss_term_needs_them(model_dir: Path, change: dict[str, object]) -> None:
    from schemas.config import AlgorithmConfig

    strategy = TorchStrategy(model_dir, algo=AlgorithmConfig(**change), skip_zero_advantage=True)  # type: ignore[arg-type]
    if change.get("use_kl_loss"):
        strategy.init_reference()
    batch, _ = strategy.prepare(tied_groups())
    assert strategy.gradient_rows(batch) is batch
    assert strategy.train_step(tied_groups())["train/skipped_rows"] == 0


# --------------------------------------------------------------------------- chunked head, packing


def step_grads(strategy: TorchStrategy, samples: list[TrainSample]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The gradient of one step's loss (every micro-batch's backward, no optimizer step) and its metrics."""
    batch, _ = strategy.prepare(samples)
    _, micros = strategy.micro_batches(batch)
    metrics: dict[str, float] = {}
    for micro, share in micros:
        for k, v in strategy.backward(micro, share).items():
            metrics[k] = metrics.get(k, 0.0) + share * v
    grads = {k: p.grad.detach().clone() for k, p in strategy.model.named_parameters() if p.grad is not None}
    strategy.optimizer.zero_grad(set_to_none=True)
    return grads, metrics


def assert_same_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], terms: int) -> None:
    assert set(a) == set(b) and a
    for k in a:
        assert_close(a[k], b[k], terms)


def test_chunked_head_gives_the_whole_logits_step(model_dir: Path) -> None:
    """Logprobs, entropy (with an entropy bonus, so its gradient counts) and every parameter's
    gradient (the tied embedding / LM head included) equal the whole-logits path's, for chunks of
    positions that do and do not divide the trained positions."""
    samples = make_samples(6)
    algo = AlgorithmConfig(entropy_loss_coef=0.01)
    whole = TorchStrategy(model_dir, micro_batch_size=4, temperature=0.8, algo=algo)
    whole.chunked_head = False
    batch = collate(samples, whole.pad_id)
    m = batch.loss_mask > 0
    lp_w = whole.logprobs(batch)
    g_w, m_w = step_grads(whole, samples)
    for chunk in (1, 7, 1024):
        chunked = TorchStrategy(model_dir, micro_batch_size=4, temperature=0.8, algo=algo, logprob_chunk_tokens=chunk)
        lp_c = chunked.logprobs(batch)
        assert_close(lp_c[m], lp_w[m], hidden_size(whole))
        assert bool((lp_c[~m] == 0).all())  # untrained positions are not computed
        g_c, m_c = step_grads(chunked, samples)
        assert m_c["actor/entropy"] == pytest.approx(m_w["actor/entropy"], rel=rounding_tol(1.0, hidden_size(whole)))
        assert_same_grads(g_c, g_w, grad_terms(whole, samples))


def test_packed_micro_batches_equal_padded(model_dir: Path) -> None:
    """``micro_batch_tokens``: the samples of a micro-batch in one sequence without padding give the
    padded path's logprobs and gradient, whatever the token budget's grouping."""
    samples = make_samples(8)
    padded = TorchStrategy(model_dir, micro_batch_size=8, temperature=0.8, shared_prefix=False)
    packed = TorchStrategy(model_dir, micro_batch_tokens=10_000, temperature=0.8, shared_prefix=False)
    small = TorchStrategy(model_dir, micro_batch_tokens=20, temperature=0.8, shared_prefix=False)
    batch = collate(samples, padded.pad_id)
    m = batch.loss_mask > 0
    assert_close(packed.logprobs(batch)[m], padded.logprobs(batch)[m], hidden_size(padded))
    assert len(small.micro_batches(small.prepare(samples)[0])[1]) > 1
    g_pad, m_pad = step_grads(padded, samples)
    for s in (packed, small):
        g, mets = step_grads(s, samples)
        assert mets["loss/policy"] == pytest.approx(m_pad["loss/policy"], abs=rounding_tol(1.0, grad_terms(s, samples)))
        assert_same_grads(g, g_pad, grad_terms(padded, samples))


def grouped_samples(seed: int = 0) -> list[TrainSample]:
    """Groups of 1 to 4 samples of one prompt each, some answers starting alike."""
    rng = random.Random(seed)
    out = []
    for g in range(4):
        prompt = [1] + [rng.randrange(4, 60) for _ in range(rng.randrange(2, 8))]
        for i in range(1 if g == 1 else rng.randrange(2, 5)):
            resp = ([9, 10] if i % 2 else []) + [rng.randrange(4, 60) for _ in range(rng.randrange(1, 6))] + [2]
            out.append(TrainSample(prompt, resp, [-rng.random() * 3 for _ in resp], [1] * len(resp),
                                   rng.uniform(-1, 1), f"s{g}.{i}", group_id=f"g{g}"))
    rng.shuffle(out)
    return out


@pytest.mark.parametrize("sizing", [{"micro_batch_size": 3}, {"micro_batch_size": 16}, {"micro_batch_tokens": 30}])
def test_shared_prefixes_equal_the_padded_forward(model_dir: Path, sizing: dict[str, Any]) -> None:
    """``shared_prefix``: a group's prompt forwarded once gives the padded path's logprobs, entropy
    bonus and every parameter's gradient (micro-batches that split a group included), in fewer
    tokens through the model."""
    samples = grouped_samples()
    algo = AlgorithmConfig(entropy_loss_coef=0.01)
    padded = TorchStrategy(model_dir, micro_batch_size=16, temperature=0.8, algo=algo, shared_prefix=False)
    shared = TorchStrategy(model_dir, temperature=0.8, algo=algo, **sizing)
    batch = collate(samples, padded.pad_id)
    m = batch.loss_mask > 0
    assert_close(shared.logprobs(batch)[m], padded.logprobs(batch)[m], hidden_size(padded))
    micros = [micro for micro, _ in shared.micro_batches(shared.prepare(samples)[0])[1]]
    assert all(shared._shares_prefixes(micro) for micro in micros)
    decoder = shared._parts(shared.model)[0]  # type: ignore[index]
    with torch.no_grad():
        forwarded = sum(shared._hidden(shared.model, decoder, micro)[0].shape[0] for micro in micros)
    assert forwarded < sum(int(micro.attention_mask.sum()) for micro in micros)  # prompts forwarded once
    g_pad, m_pad = step_grads(padded, samples)
    g, mets = step_grads(shared, samples)
    assert mets["loss/policy"] == pytest.approx(m_pad["loss/policy"], abs=rounding_tol(1.0, grad_terms(shared, samples)))
    assert_same_grads(g, g_pad, grad_terms(padded, samples))


def test_token_budget_groups_consecutive_rows(model_dir: Path) -> None:
    s = TorchStrategy(model_dir, micro_batch_tokens=10)
    lens = [3, 4, 3, 12, 2, 9]
    attn = torch.tensor([[1] * n + [0] * (12 - n) for n in lens])
    batch = collate(make_samples(len(lens)), s.pad_id).replace(attention_mask=attn)
    assert s._groups(batch) == [(0, 3), (3, 4), (4, 5), (5, 6)]  # 3+4+3; 12 alone (over budget); 2 (+9 > 10); 9
