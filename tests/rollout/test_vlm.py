"""The tiny vision-language model: created offline, loaded by transformers' Auto classes, prompts
with images rendered with one placeholder token per image feature; bad model dirs and image sizes
are one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from blobs import pixel_inputs
from rollout.model_init import load_tokenizer
from rollout.vlm import (
    TINY_MAX_PIXELS,
    VLMError,
    check_image_size,
    check_vlm_dir,
    encode_vlm_prompt,
    expand_image_tokens,
    init_tiny_vlm,
    is_vlm_dir,
    load_image_processor,
    load_vlm,
    mrope_section,
)
from schemas.config import TinyModelSpec


def test_the_tiny_vlm_loads_offline_and_sees_the_image(vlm_dir: Path) -> None:
    model, processor, tok = load_vlm(vlm_dir), load_image_processor(vlm_dir), load_tokenizer(vlm_dir)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration" and is_vlm_dir(vlm_dir)
    red, blue = Image.new("RGB", (56, 56), (255, 0, 0)), Image.new("RGB", (56, 56), (0, 0, 255))
    pv, grid = pixel_inputs(processor, [red])
    assert grid.tolist() == [[1, 4, 4]]  # 56 px / 14 px patches, merged 2x2 -> 4 image tokens
    ids = encode_vlm_prompt(tok, "Which quadrant?", grid, model.config.image_token_id)
    assert ids.count(model.config.image_token_id) == 4
    assert tok.decode(ids).startswith("<|im_start|>user\n<|vision_start|><|image_pad|>")
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = [model(input_ids=x, pixel_values=p, image_grid_thw=grid,
                        mm_token_type_ids=(x == model.config.image_token_id).int()).logits[0, -1]
                  for p in (pv, pixel_inputs(processor, [blue])[0])]
    assert not torch.allclose(logits[0], logits[1])  # the pixels reach the language model


def test_expand_image_tokens_counts_features_per_image() -> None:
    grid = torch.tensor([[1, 4, 4], [1, 2, 4]])
    assert expand_image_tokens([5, 9, 6, 9], grid, image_token_id=9) == [5, 9, 9, 9, 9, 6, 9, 9]
    with pytest.raises(VLMError, match="1 image placeholders for 2 images"):
        expand_image_tokens([5, 9], grid, image_token_id=9)
    assert mrope_section(32) == [4, 6, 6] and mrope_section(128) == [16, 24, 24]


def test_an_odd_head_size_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(VLMError, match="even head size"):
        init_tiny_vlm(tmp_path / "m", TinyModelSpec(hidden_size=60, num_heads=4))
    assert not (tmp_path / "m").exists()


def test_a_text_model_or_an_odd_image_size_is_one_clear_line(model_dir: Path, vlm_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(VLMError, match=r"is a 'llama' model, not a vision-language model.*init-model DIR --vlm"):
        check_vlm_dir(model_dir)
    with pytest.raises(VLMError, match=r"no readable config\.json"):
        check_vlm_dir(tmp_path)
    processor = load_image_processor(vlm_dir)
    check_image_size(processor, 64, 64)
    with pytest.raises(VLMError, match=rf"image size 200x200 \(40000 pixels\) is outside .*{TINY_MAX_PIXELS}\]"):
        check_image_size(processor, 200, 200)
