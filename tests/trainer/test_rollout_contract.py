"""The contract between rollout and trainer: the engine's behaviour logprobs are the trainer's
logprobs of the same weights at the same temperature, and exported weights load into the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollout.engine import GenerationRequest, TorchEngine, generate_all
from rollout.sampling import SamplingParams
from tests.floats import assert_close, rounding_tol
from trainer.batch import TrainSample, collate
from trainer.strategy import TorchStrategy

PROMPTS = ["12+34=", "7-3=", "99+1=", "5*6=", "123-45=", "8+8=", "1+1=", "40-2="]


async def sample(engine: TorchEngine, temperature: float) -> list[TrainSample]:
    params = SamplingParams(max_new_tokens=12, temperature=temperature)
    reqs = [GenerationRequest(str(i), engine.encode(p), params) for i, p in enumerate(PROMPTS)]
    done = await generate_all(engine, reqs)
    return [TrainSample(c.prompt_ids, c.token_ids, c.logprobs, [1] * len(c.token_ids), float(i % 2), group_id="g")
            for i, c in enumerate(done)]


def assert_same_logprobs(strategy: TorchStrategy, samples: list[TrainSample]) -> None:
    batch = collate(samples, strategy.pad_id)
    mask = batch.loss_mask.bool()
    # the engine's cached decode steps and the trainer's one pass round differently (terms: the hidden size)
    assert_close(strategy.logprobs(batch)[mask], batch.old_logprobs[mask], strategy.model.config.hidden_size)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
async def test_engine_logprobs_equal_trainer_logprobs(model_dir: Path, temperature: float) -> None:
    engine = TorchEngine(model_dir, max_batch=3)
    strategy = TorchStrategy(model_dir, temperature=temperature, micro_batch_size=4)
    assert_same_logprobs(strategy, await sample(engine, temperature))


async def test_exported_weights_hot_swap_into_engine(model_dir: Path, tmp_path: Path) -> None:
    engine = TorchEngine(model_dir, max_batch=8)
    strategy = TorchStrategy(model_dir, lr=3e-2, temperature=1.0)
    samples = await sample(engine, 1.0)
    metrics = strategy.train_step(samples)
    lp_size = max(abs(x) for s in samples for x in s.old_logprobs)  # on-policy: ratio 1 up to the logprobs' rounding
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=rounding_tol(lp_size, strategy.model.config.hidden_size))
    path, _ = strategy.export_weights(tmp_path / "v1")
    await engine.load_weights(path, version=1)
    fresh = await sample(engine, 1.0)
    assert_same_logprobs(strategy, fresh)  # the engine now runs the trained weights
    old = TorchStrategy(model_dir)
    batch = collate(fresh, old.pad_id)
    assert not torch.allclose(
        old.logprobs(batch)[batch.loss_mask.bool()], batch.old_logprobs[batch.loss_mask.bool()]
    )
