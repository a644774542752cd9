"""A tiny model shared by the rollout tests (created once per session, a few hundred kB)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from rollout.model_init import init_tiny_model
from schemas.config import TinyModelSpec

SPEC = TinyModelSpec(
    hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=64
)


@pytest.fixture(scope="session", autouse=True)
def _quiet() -> None:
    torch.set_num_threads(2)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("tiny") / "m", SPEC, seed=0)


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    """Same architecture, clearly different weights (``model_dir``'s plus N(0, 0.5) noise), so
    greedy outputs differ (two freshly initialised tiny models both just echo the last token)."""
    out = tmp_path_factory.mktemp("tiny") / "noisy"
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir, local_files_only=True).save_pretrained(out)
    return out
