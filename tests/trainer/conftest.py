"""A tiny HF model dir for the trainer tests (made with rollout's initialiser; tests may cross
package boundaries, the packages themselves may not)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
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
