"""A second tiny model for the rollout tests (``model_dir`` comes from tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


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
