"""Vision-language policies (Qwen2-VL / Qwen2.5-VL): the tiny one ``init-model --vlm`` creates,
loading any local one, and rendering a prompt with images into token ids.

:func:`init_tiny_vlm` writes a ``Qwen2VLForConditionalGeneration`` (a 2-block vision tower of
14-pixel patches merged 2x2 into the language model's width, and a Llama-shaped language model of
:class:`schemas.config.TinyModelSpec`) with the character tokenizer of :mod:`rollout.model_init`
plus Qwen's chat and vision markers, a ChatML template that renders ``{"type": "image"}`` content
as ``<|vision_start|><|image_pad|><|vision_end|>``, and a ``Qwen2VLImageProcessor``
(``preprocessor_config.json``) whose pixel bounds keep an image between :data:`TINY_MIN_PIXELS`
and :data:`TINY_MAX_PIXELS`. Nothing is downloaded.

A prompt's image becomes as many ``<|image_pad|>`` tokens as the vision tower gives it features
(``t * h * w / merge_size**2`` of its ``image_grid_thw``): :func:`expand_image_tokens` does it on
the ids the chat template produced, so the engine and the trainer see the same ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollout.model_init import DTYPES, SPECIAL_TOKENS, build_char_tokenizer
from schemas.config import TinyModelSpec

VLM_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
"""``model_type`` of the vision-language models the engine and the trainer run."""
VISION_TOKENS: tuple[str, ...] = (
    "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
)
IMAGE_PAD = "<|image_pad|>"
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH = 14, 2, 2
TINY_MIN_PIXELS = 56 * 56
"""Smallest image (pixels) the tiny VLM's processor keeps as is (4 image tokens); smaller ones are upscaled."""
TINY_MAX_PIXELS = 112 * 112
"""Largest image (pixels) the tiny VLM's processor keeps as is (16 image tokens); larger ones are downscaled."""

VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML with Qwen-VL's image placeholder; a message's content is a string or a list of
``{"type": "image"}`` / ``{"type": "text", "text": ...}`` parts."""


class VLMError(ValueError):
    """A model directory or image that the vision-language path cannot use (one line)."""


@dataclass(frozen=True)
class ImageInputs:
    """A prompt's images as the vision tower takes them."""

    pixel_values: torch.Tensor  # (patches, C * temporal * patch * patch)
    grid_thw: torch.Tensor  # (images, 3) long


def join_images(first: ImageInputs | None, then: ImageInputs) -> ImageInputs:
    """The images of ``first`` followed by those of ``then`` (a prompt showing both, in that order)."""
    if first is None:
        return then
    return ImageInputs(torch.cat([first.pixel_values, then.pixel_values]), torch.cat([first.grid_thw, then.grid_thw]))


def mrope_section(head_dim: int) -> list[int]:
    """Multimodal RoPE's split of ``head_dim / 2`` frequencies into (time, height, width), in Qwen2-VL's
    proportions (16, 24, 24 of 64)."""
    half = head_dim // 2
    hw = half * 3 // 8
    return [half - 2 * hw, hw, hw]


def init_tiny_vlm(out_dir: str | Path, spec: TinyModelSpec | None = None, seed: int = 0) -> Path:
    """Write a freshly initialised tiny Qwen2-VL with its tokenizer, chat template and image
    processor to ``out_dir`` (see the module doc); weights depend only on ``spec`` and ``seed``."""
    from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    spec = spec or TinyModelSpec()
    head_dim = spec.hidden_size // spec.num_heads
    if spec.hidden_size % spec.num_heads or head_dim % 2 or head_dim < 8:
        raise VLMError(f"hidden_size={spec.hidden_size} / num_heads={spec.num_heads} must give an even head "
                       "size of at least 8 (multimodal RoPE splits it three ways)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    ids: dict[str, int] = {t: int(tokenizer.convert_tokens_to_ids(t)) for t in VISION_TOKENS}  # type: ignore[arg-type]
    pad, bos, eos = (SPECIAL_TOKENS.index(t) for t in ("<pad>", "<s>", "</s>"))
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
            num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
            num_key_value_heads=spec.num_heads, max_position_embeddings=spec.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section(head_dim)},
            bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=True,
        ),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=spec.hidden_size, num_heads=2, mlp_ratio=2,
                           patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH),
        image_token_id=ids[IMAGE_PAD], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=[eos, ids["<|im_end|>"]],
                                               pad_token_id=pad)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    tiny_image_processor().save_pretrained(out)
    return out


def tiny_image_processor() -> Any:
    """The tiny VLM's ``Qwen2VLImageProcessor`` (Pillow backend when torchvision is absent)."""
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=TINY_MIN_PIXELS, max_pixels=TINY_MAX_PIXELS, patch_size=PATCH_SIZE,
                                    merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH)


SUPPRESSED_LOGIT = -1e9
"""The logit a vision-language policy's vision markers get: never sampled, and finite (an entropy
over the logits stays a number). The trainer (:mod:`trainer.vlm`) applies the same."""


def vision_marker_ids(config: Any) -> list[int]:
    """Token ids of a VLM's image / video placeholders and vision start / end markers: they belong to
    prompts only (a generated one would be taken for an image), so the policy never emits them."""
    keys = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return [int(v) for v in (getattr(config, k, None) for k in keys) if v is not None]


def suppress_vision_markers(logits: torch.Tensor, marker_ids: list[int]) -> torch.Tensor:
    """``logits`` (..., V) with the vision markers' set to :data:`SUPPRESSED_LOGIT` (a new tensor)."""
    banned = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)  # (V,)
    banned[marker_ids] = True
    return logits.masked_fill(banned, SUPPRESSED_LOGIT)


def model_type_of(model_dir: str | Path) -> str:
    """``model_type`` of the HF model in ``model_dir`` ("" when there is no readable config.json)."""
    try:
        return str(json.loads((Path(model_dir) / "config.json").read_text()).get("model_type", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def is_vlm_dir(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` holds a vision-language model this package runs (:data:`VLM_MODEL_TYPES`)."""
    return model_type_of(model_dir) in VLM_MODEL_TYPES


def check_vlm_dir(model_dir: str | Path) -> None:
    """A one-line :class:`VLMError` when ``model_dir`` is not a Qwen2-VL / Qwen2.5-VL directory with
    an image processor (``preprocessor_config.json``)."""
    kind = model_type_of(model_dir)
    if not kind:
        raise VLMError(f"model.path {model_dir}: no readable config.json (not a Hugging Face model directory)")
    if kind not in VLM_MODEL_TYPES:
        raise VLMError(f"model.path {model_dir} is a {kind!r} model, not a vision-language model; visual tasks "
                       f"need one of {', '.join(VLM_MODEL_TYPES)} (rollstream init-model DIR --vlm creates a tiny one)")
    if not (Path(model_dir) / "preprocessor_config.json").is_file():
        raise VLMError(f"model.path {model_dir}: no preprocessor_config.json (the image processor)")


def load_vlm(model_dir: str | Path, dtype: str = "float32", device: str = "cpu") -> Any:
    """Load a local Qwen2-VL / Qwen2.5-VL (no network) in eval mode with SDPA attention."""
    from transformers import AutoModelForImageTextToText

    check_vlm_dir(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(
        str(model_dir), dtype=DTYPES[dtype], local_files_only=True, attn_implementation="sdpa")
    torch.nn.Module.to(model, torch.device(device))
    return model.eval()


def load_image_processor(model_dir: str | Path) -> Any:
    """The image processor of a local VLM dir (no network; Pillow backend without torchvision)."""
    import logging

    from transformers import AutoImageProcessor

    logging.getLogger("transformers").setLevel(logging.ERROR)  # its torchvision fallback notice
    return AutoImageProcessor.from_pretrained(str(model_dir), local_files_only=True)


def pixel_bounds(image_processor: Any) -> tuple[int, int]:
    """``(min_pixels, max_pixels)`` of a Qwen2-VL image processor (transformers 5 keeps them as
    ``size.shortest_edge`` / ``size.longest_edge``, earlier versions as attributes)."""
    lo, hi = getattr(image_processor, "min_pixels", None), getattr(image_processor, "max_pixels", None)
    size = getattr(image_processor, "size", None)
    if lo is None and size is not None:
        lo = size["shortest_edge"]
    if hi is None and size is not None:
        hi = size["longest_edge"]
    if lo is None or hi is None:
        raise VLMError(f"the image processor {type(image_processor).__name__} names no pixel bounds")
    return int(lo), int(hi)


def check_image_size(image_processor: Any, width: int, height: int) -> None:
    """A one-line :class:`VLMError` when a ``width`` x ``height`` image is outside the processor's pixel
    bounds (it would be rescaled, so the task's images are not what the model sees)."""
    lo, hi = pixel_bounds(image_processor)
    if not lo <= width * height <= hi:
        raise VLMError(f"image size {width}x{height} ({width * height} pixels) is outside the model's image "
                       f"processor bounds [{lo}, {hi}] pixels; pick a size within them")


def expand_image_tokens(ids: list[int], grid_thw: torch.Tensor, image_token_id: int,
                        merge_size: int = MERGE_SIZE) -> list[int]:
    """``ids`` with the i-th ``image_token_id`` repeated ``prod(grid_thw[i]) / merge_size**2`` times."""
    counts = [int(g.prod()) // merge_size**2 for g in grid_thw]
    out: list[int] = []
    seen = 0
    for t in ids:
        if t == image_token_id:
            if seen >= len(counts):
                raise VLMError(f"the prompt has more image placeholders than images ({len(counts)})")
            out += [t] * counts[seen]
            seen += 1
        else:
            out.append(t)
    if seen != len(counts):
        raise VLMError(f"the prompt has {seen} image placeholders for {len(counts)} images")
    return out


def encode_vlm_prompt(tokenizer: Any, prompt: str, grid_thw: torch.Tensor, image_token_id: int,
                      system_prompt: str = "", merge_size: int = MERGE_SIZE) -> list[int]:
    """Token ids of a user turn holding ``len(grid_thw)`` images then ``prompt`` (chat template,
    generation prompt appended), each image's placeholder expanded (:func:`expand_image_tokens`)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}] if system_prompt else []
    content: list[dict[str, str]] = [{"type": "image"} for _ in range(len(grid_thw))]
    messages.append({"role": "user", "content": [*content, {"type": "text", "text": prompt}]})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = list(tokenizer(str(text), add_special_tokens=False)["input_ids"])
    return expand_image_tokens(ids, grid_thw, image_token_id, merge_size)
