"""The real pretrained model (SmolLM2-135M-Instruct, converted from its packaged GGUF) on CPU, fp32.

Run by ``make test-models`` (which converts the model once into ``models/smollm2-135m-instruct``;
``$ROLLSTREAM_REAL_MODEL`` points elsewhere). Deselected from ``make test`` (marker ``real_model``):
the conversion installs about 100 MB of packages that the main test run must not need.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from rollout.engine import GenerationRequest, TorchEngine, generate_all
from rollout.model_init import encode_prompt, eos_token_ids, load_tokenizer
from rollout.sampling import SamplingParams
from trainer.batch import TrainSample, collate
from trainer.strategy import TorchStrategy

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smol_dir() -> Path:
    from launch.models import ensure_model

    path = Path(os.environ.get("ROLLSTREAM_REAL_MODEL", ROOT / "models" / "smollm2-135m-instruct"))
    return ensure_model("smollm2-135m-instruct", path, progress=print)


PROMPTS = ["What is 12 + 7?", "Name a prime number larger than 10.", "Compute 3 * 4.", "What is 20 - 5?"]


def test_chat_template_renders(smol_dir: Path) -> None:
    tok = load_tokenizer(smol_dir)
    ids = encode_prompt(tok, "What is 2 + 2?", chat=True, system_prompt="Answer in <answer></answer> tags.")
    assert tok.decode(ids) == ("<|im_start|>system\nAnswer in <answer></answer> tags.<|im_end|>\n"
                               "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    # without a system prompt the template's own default system turn applies
    assert "You are a helpful AI assistant named SmolLM" in tok.decode(encode_prompt(tok, "hi", chat=True))
    assert tok.convert_tokens_to_ids("<|im_end|>") in eos_token_ids(None, tok)
    assert len(tok) == 49152


async def sample(engine: TorchEngine, temperature: float) -> list[TrainSample]:
    params = SamplingParams(max_new_tokens=24, temperature=temperature)
    done = await generate_all(engine, [GenerationRequest(str(i), engine.encode(p), params) for i, p in enumerate(PROMPTS)])
    return [TrainSample(c.prompt_ids, c.token_ids, c.logprobs, [1] * len(c.token_ids), float(i % 2), group_id="g")
            for i, c in enumerate(done)]


def max_logprob_gap(strategy: TorchStrategy, samples: list[TrainSample]) -> float:
    batch = collate(samples, strategy.pad_id)
    mask = batch.loss_mask.bool()
    return float((strategy.logprobs(batch)[mask] - batch.old_logprobs[mask]).abs().max())


async def test_engine_logprobs_match_trainer_then_train_and_hot_swap(smol_dir: Path, tmp_path: Path) -> None:
    engine = TorchEngine(smol_dir, max_batch=4, chat_template=True)
    strategy = TorchStrategy(smol_dir, lr=1e-4, temperature=0.9, micro_batch_size=4)
    samples = await sample(engine, 0.9)
    assert all(s.response_ids for s in samples)
    assert max_logprob_gap(strategy, samples) < 1e-4  # rollout and trainer see the same distribution

    metrics = strategy.train_step(samples)
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # on-policy
    path, _ = strategy.export_weights(tmp_path / "v1")
    await engine.load_weights(path, version=1)
    assert engine.policy_version == 1
    fresh = await sample(engine, 0.9)
    assert max_logprob_gap(strategy, fresh) < 1e-4  # the engine now runs the trained weights
    base = TorchStrategy(smol_dir, temperature=0.9)
    assert max_logprob_gap(base, fresh) > 1e-4  # ... which differ from the initial ones
    assert torch.isfinite(torch.tensor(list(metrics.values()))).all()
