"""Token logprobs of a vision-language policy (Qwen2-VL / Qwen2.5-VL) on prompts with images.

The trainer's teacher-forced pass over ``prompt + response`` with the same pixels the engine
prefilled: image features replace the ``<|image_pad|>`` tokens, and positions are the model's
multimodal RoPE ones (``get_rope_index``: image tokens by (time, row, column), text counting on
from the largest). :func:`vlm_token_logprobs` gives the same ``(B, L - 1)`` as
:func:`trainer.logprobs.token_logprobs` on a text model; the engine's behaviour logprobs of the
same tokens agree within the text tolerance (``tests/trainer/test_vlm.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.logprobs import token_logprobs


def mrope_positions(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    grid_thw: torch.Tensor | None) -> torch.Tensor:
    """Multimodal RoPE position ids (3, B, L) of a padded batch (padding gets 0; masked anyway).

    input_ids, attention_mask (B, L); grid_thw (images, 3), the batch's images in row order."""
    image_token_id = model.config.image_token_id
    mm = (input_ids == image_token_id).int()  # (B, L) 1 = image feature
    pos, _ = model.model.get_rope_index(input_ids, mm_token_type_ids=mm, image_grid_thw=grid_thw,
                                        attention_mask=attention_mask)
    return pos  # (3, B, L)


def vlm_token_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       pixel_values: torch.Tensor | None, grid_thw: torch.Tensor | None,
                       temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits[:, :-1] / T)`` at ``input_ids[:, 1:]`` of a VLM with its images.

    input_ids, attention_mask (B, L); pixel_values (patches, F) and grid_thw (images, 3) of every
    row's images in row order (None: text only) -> (B, L - 1) float32."""
    pos = mrope_positions(model, input_ids, attention_mask, grid_thw)  # (3, B, L)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos,
                   pixel_values=pixel_values, image_grid_thw=grid_thw,
                   mm_token_type_ids=(input_ids == model.config.image_token_id).int()).logits  # (B, L, V)
    return token_logprobs(logits, input_ids, temperature)
