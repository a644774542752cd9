"""Create the tiny policy model of the examples, and load any local Hugging Face model dir.

``init_tiny_model`` writes a standard ``LlamaForCausalLM`` (safetensors) plus its own
character-level tokenizer (``tokenizer.json``, wrapped as ``PreTrainedTokenizerFast``) into a
directory, so that ``AutoModelForCausalLM.from_pretrained(dir)`` and
``AutoTokenizer.from_pretrained(dir)`` load it like any other local HF model. Nothing is
downloaded: the vocabulary is an explicit list of characters (:data:`CHAR_VOCAB`).

The tokenizer maps every character to one token (unknown characters to ``<unk>``), prepends
``<s>`` to every encoded text (a ``TemplateProcessing`` post-processor, so
``tokenizer(prompt).input_ids`` starts with BOS, as for most HF chat models) and decodes by
concatenating the characters (``decoders.Fuse``), skipping the specials when asked.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from schemas.config import TinyModelSpec

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
"""Special tokens, ids 0..3 in this order."""

CHAR_VOCAB: tuple[str, ...] = tuple(
    string.digits + "+-*/=()., ^%:;?!'\"<>[]{}_#$&|~@\n" + string.ascii_lowercase + string.ascii_uppercase
)
"""Every ordinary token: one character each (digits, operators, punctuation, space, newline, letters)."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def build_char_tokenizer(chars: tuple[str, ...] = CHAR_VOCAB) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over ``SPECIAL_TOKENS + chars`` (one token per character)."""
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *chars))}
    if len(vocab) != len(SPECIAL_TOKENS) + len(chars):
        raise ValueError("tokenizer vocabulary has duplicate characters")
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK, padding_side="left"
    )


def tiny_llama_config(spec: TinyModelSpec, vocab_size: int) -> LlamaConfig:
    """The ``LlamaConfig`` of a tiny model of shape ``spec`` (tied embeddings, ids of the char tokenizer)."""
    if spec.hidden_size % spec.num_heads:
        raise ValueError(f"hidden_size={spec.hidden_size} is not a multiple of num_heads={spec.num_heads}")
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        tie_word_embeddings=True,
        initializer_range=0.02,
    )


def init_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None, seed: int = 0) -> Path:
    """Write a freshly initialised tiny Llama model + char tokenizer to ``out_dir``; return the dir.

    Weights depend only on ``spec`` and ``seed`` (``torch.manual_seed(seed)`` before init).
    """
    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    config = tiny_llama_config(spec, vocab_size=len(tokenizer))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def load_model(model_dir: str | Path, dtype: str = "float32", device: str = "cpu") -> PreTrainedModel:
    """Load a local HF causal LM (no network) in eval mode with SDPA attention."""
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=DTYPES[dtype], local_files_only=True, attn_implementation="sdpa"
    )
    torch.nn.Module.to(model, torch.device(device))  # (transformers' typed ``.to`` confuses mypy)
    return model.eval()


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a local HF model dir (no network)."""
    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of a prompt exactly as the engine and the trainer see them (with the tokenizer's BOS)."""
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
