from __future__ import annotations

import pytest
import torch

from rollout.sampling import SamplingParams, draw_inverse_cdf, sample_next, tempered_logprobs, top_p_mask


def test_params_validate() -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


def test_top_p_keeps_smallest_nucleus() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]])
    keep = top_p_mask(probs.log(), torch.tensor([0.7, 0.01]))
    assert keep.tolist() == [[True, True, False, False], [False, False, False, True]]
    assert top_p_mask(probs.log(), torch.tensor([1.0, 1.0])).all()


def test_greedy_is_argmax_with_tempered_logprob() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    tok, lp = sample_next(logits, torch.tensor([0.5]), torch.tensor([1.0]), torch.tensor([True]))
    assert tok.tolist() == [1]
    assert lp.item() == pytest.approx(torch.log_softmax(logits / 0.5, -1)[0, 1].item())


def test_sampling_follows_the_nucleus_and_reports_untruncated_logprobs() -> None:
    logits = torch.tensor([[2.0, 1.5, -3.0, -4.0]]).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    tok, lp = sample_next(
        logits, torch.full((2000,), 1.0), torch.full((2000,), 0.8), torch.zeros(2000, dtype=torch.bool), g
    )
    assert set(tok.tolist()) <= {0, 1}  # tokens 2, 3 are outside the 0.8 nucleus
    full = tempered_logprobs(logits[:1], torch.tensor([1.0]))[0]
    assert torch.allclose(lp, full[tok])


def test_inverse_cdf_draws_follow_the_weights_and_never_pick_zero_weights() -> None:
    weights = torch.tensor([[0.0, 0.1, 0.0, 0.6, 0.3, 0.0], [2.0, 0.0, 0.0, 0.0, 0.0, 6.0]])  # unnormalised row 2
    g = torch.Generator().manual_seed(1)
    n = 40_000
    draws = torch.stack([draw_inverse_cdf(weights, g) for _ in range(n)])  # (n, 2)
    freq0 = torch.bincount(draws[:, 0], minlength=6).float() / n
    freq1 = torch.bincount(draws[:, 1], minlength=6).float() / n
    assert freq0[[0, 2, 5]].sum() == 0 and freq1[1:5].sum() == 0
    assert torch.allclose(freq0, weights[0] / weights[0].sum(), atol=0.01)
    assert torch.allclose(freq1, weights[1] / weights[1].sum(), atol=0.01)
