"""Token logprobs of a vision-language policy (Qwen2-VL / Qwen2.5-VL) on prompts with images.

The trainer's teacher-forced pass over ``prompt + response`` with the same pixels the engine
prefilled: image features replace the ``<|image_pad|>`` tokens, and positions are the model's
multimodal RoPE ones (``get_rope_index``: image tokens by (time, row, column), text counting on
from the largest). :func:`vlm_token_logprobs` gives the same ``(B, L - 1)`` as
:func:`trainer.logprobs.token_logprobs` on a text model; the engine's behaviour logprobs of the
same tokens agree within the text tolerance (``tests/trainer/test_vlm.py``).
:class:`ImageSource` gives the trainer a sample's pixels (from the run's blob store, or a warm-up
problem's bytes) and :func:`vlm_forward` runs a batch whose rows show them. Both passes see the
policy the engine samples from: the vision markers' logits suppressed (:func:`suppress_vision_markers`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from blobs import BlobError, BlobStore, decode_image, pixel_inputs, sha256_hex
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
    return token_logprobs(suppress_vision_markers(logits, model.config), input_ids, temperature)


SUPPRESSED_LOGIT = -1e9
"""The logit of a vision marker (as :data:`rollout.vlm.SUPPRESSED_LOGIT`: the engine never samples one)."""


def suppress_vision_markers(logits: torch.Tensor, config: Any) -> torch.Tensor:
    """``logits`` (..., V) with the image / video placeholders' and vision start / end markers' set to
    :data:`SUPPRESSED_LOGIT` (a new tensor): the policy the engine samples from
    (:func:`rollout.vlm.suppress_vision_markers`; this package may not import it)."""
    keys = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    ids = [int(v) for v in (getattr(config, k, None) for k in keys) if v is not None]
    banned = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)  # (V,)
    banned[ids] = True
    return logits.masked_fill(banned, SUPPRESSED_LOGIT)


VISION_TOWER = "visual"
"""The vision tower's module name in a Qwen2-VL / Qwen2.5-VL (``model.visual`` in transformers 5)."""
MERGER = "merger"
"""The tower's last part, which projects its features into the language model (trained with ``freeze_vision``)."""


def vision_tower_prefix(model: torch.nn.Module) -> str | None:
    """The module name of ``model``'s vision tower followed by a dot (``"model.visual."``); None: it has none."""
    names = [n for n, _ in model.named_modules() if n.rsplit(".", 1)[-1] == VISION_TOWER]
    return names[0] + "." if names else None


def vision_parameters(model: torch.nn.Module, with_merger: bool = False) -> dict[str, torch.nn.Parameter]:
    """The vision tower's parameters by name (its merger's only when ``with_merger``); empty: no tower."""
    prefix = vision_tower_prefix(model)
    if prefix is None:
        return {}
    merger = prefix + MERGER + "."
    return {n: p for n, p in model.named_parameters()
            if n.startswith(prefix) and (with_merger or not n.startswith(merger))}


VLM_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
"""``model_type`` of the vision-language models the trainer runs (as :mod:`rollout.vlm`)."""

RowImages = tuple[torch.Tensor, torch.Tensor]
"""One sample's images: pixel_values (patches, F) and grid_thw (images, 3)."""


def is_vlm(model_dir: str | Path) -> bool:
    """Whether ``model_dir``'s config.json names a Qwen2-VL / Qwen2.5-VL model."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text()).get("model_type") in VLM_MODEL_TYPES
    except (OSError, ValueError, AttributeError):
        return False


class ImageSource:
    """A VLM's images for the trainer: bytes (a warm-up problem's) or digests in the run's blob store
    (a sample's ``image_hashes``) through the model's image processor, the last ``keep`` kept."""

    def __init__(self, model_dir: str | Path, blob_dir: str | Path | None, keep: int = 256) -> None:
        import logging

        from transformers import AutoImageProcessor

        logging.getLogger("transformers").setLevel(logging.ERROR)  # its torchvision fallback notice
        self.processor = AutoImageProcessor.from_pretrained(str(model_dir), local_files_only=True)
        self.store = BlobStore(blob_dir) if blob_dir else None
        self.keep = keep
        self._cache: dict[tuple[str, ...], RowImages] = {}

    def of_bytes(self, images: Sequence[bytes]) -> RowImages:
        """``images`` (PNG, JPEG...) as the processor gives them; ``BlobError`` when one does not decode."""
        key = tuple(sha256_hex(b) for b in images)
        if key not in self._cache:
            got = pixel_inputs(self.processor, [decode_image(b, h) for b, h in zip(images, key, strict=True)])
            self._cache[key] = (got[0], got[1])
            if len(self._cache) > self.keep:
                del self._cache[next(iter(self._cache))]
        return self._cache[key]

    def of_hashes(self, hashes: Sequence[str]) -> RowImages:
        """The blobs ``hashes`` as the processor gives them; ``BlobError`` naming a missing/corrupt one."""
        if tuple(hashes) in self._cache:
            return self._cache[tuple(hashes)]
        if self.store is None:
            raise BlobError("a sample has images but the trainer has no blob store")
        return self.of_bytes([self.store.get(h) for h in hashes])


def vlm_forward(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, images: Sequence[RowImages | None],
                rope_model: Any = None, **kwargs: Any) -> Any:
    """The model's output on a right-padded batch whose row i shows ``images[i]`` (None: text only),
    at multimodal RoPE positions (of ``rope_model``: the HF model when ``model`` wraps it, e.g. a
    ``peft`` model). input_ids, attention_mask (B, L); ``kwargs`` go to the forward."""
    given = [im for im in images if im is not None]
    device = input_ids.device
    pixels = torch.cat([im[0] for im in given]).to(device) if given else None  # (patches, F)
    grid = torch.cat([im[1] for im in given]).to(device) if given else None  # (images, 3)
    pos = mrope_positions(rope_model if rope_model is not None else model, input_ids, attention_mask, grid)  # (3, B, L)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, pixel_values=pixels,
                image_grid_thw=grid, mm_token_type_ids=(input_ids == model.config.image_token_id).int(), **kwargs)
    out.logits = suppress_vision_markers(out.logits, model.config)  # (B, l, V) the policy the engine samples
    return out
