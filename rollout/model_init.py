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


CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""The ChatML template the tiny models get with ``chat_template: true`` (SmolLM2 and Qwen use the same
markers)."""
CHAT_TOKENS: tuple[str, ...] = ("<|im_start|>", "<|im_end|>")


def _corpus(n: int = 4000, seed: int = 0) -> list[str]:
    """Generated text to train the tiny BPE tokenizer on: arithmetic with worked answers and short
    English sentences (no download)."""
    import random

    rng = random.Random(seed)
    words = ("the answer is what sum of and plus minus equals number result first then add subtract "
             "total step we get so check think final correct value question solve compute").split()
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        out.append(f"{a}+{b}={a + b}. What is {a} - {b}? " + " ".join(rng.choices(words, k=8)) + ".")
    return out


def build_bpe_tokenizer(vocab_size: int = 512, extra_specials: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2 style) trained on :func:`_corpus`, with ``<s>`` prepended
    to encoded text like the char tokenizer. Deterministic for a given vocabulary size."""
    from tokenizers import trainers

    specials = [*SPECIAL_TOKENS, *extra_specials]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK, padding_side="left"
    )


def build_tokenizer(spec: TinyModelSpec) -> PreTrainedTokenizerFast:
    """The tokenizer of a tiny model of shape ``spec`` (char or BPE; with ChatML when asked)."""
    extra = CHAT_TOKENS if spec.chat_template else ()
    if spec.tokenizer == "bpe":
        tokenizer = build_bpe_tokenizer(extra_specials=extra)
    else:
        tokenizer = build_char_tokenizer()
        if extra:  # appended after the characters: the ids of a char model without chat stay the same
            tokenizer.add_special_tokens({"additional_special_tokens": list(extra)})
    if spec.chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


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
    tokenizer = build_tokenizer(spec)
    config = tiny_llama_config(spec, vocab_size=len(tokenizer))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    eos: Any = config.eos_token_id
    if spec.chat_template:  # the end of an assistant turn ends generation too
        eos = [config.eos_token_id, tokenizer.convert_tokens_to_ids(CHAT_TOKENS[1])]
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=eos, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def init_tiny_reward_model(out_dir: str | Path, spec: TinyModelSpec | None = None, seed: int = 0) -> Path:
    """Write a freshly initialised tiny reward model (``LlamaForSequenceClassification``, one output,
    the tiny model's tokenizer) to ``out_dir``; return the dir. For tests and examples of
    ``judge.models.<name>.kind: reward_model``: its scores are random but deterministic (``seed``)."""
    from transformers import LlamaForSequenceClassification

    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec)
    config = tiny_llama_config(spec, vocab_size=len(tokenizer))
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(config)
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


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def use_chat_template(tokenizer: Any, mode: bool | str) -> bool:
    """``model.chat_template`` resolved for ``tokenizer``: ``True``/``False`` as given, ``"auto"`` =
    whether it has a template. ``True`` without a template is a ``ValueError`` naming the key."""
    if mode is True and not has_chat_template(tokenizer):
        raise ValueError("model.chat_template=true but the model's tokenizer has no chat template "
                         "(set model.chat_template: false, or add a chat_template to tokenizer_config.json)")
    if mode not in (True, False, "auto"):
        raise ValueError(f"model.chat_template={mode!r} must be true, false or 'auto'")
    return mode is True or (mode == "auto" and has_chat_template(tokenizer))


def encode_prompt(tokenizer: Any, prompt: str, *, chat: bool = False, system_prompt: str = "") -> list[int]:
    """Token ids of a prompt exactly as the engine and the trainer see them.

    ``chat=False``: the bare text with the tokenizer's special tokens (its BOS, if any).
    ``chat=True``: ``[system (when non-empty), user: prompt]`` rendered through the tokenizer's chat
    template with the assistant's generation prompt appended (the template's own default system
    turn applies when ``system_prompt`` is empty and the template has one).
    """
    if not chat:
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": prompt})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # the template writes its own BOS / role markers: no second BOS from the tokenizer
    return list(tokenizer(str(text), add_special_tokens=False)["input_ids"])


def eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """Every token id that ends a generation: ``generation_config.eos_token_id`` (an id or a list)
    together with the tokenizer's ``eos_token_id``."""
    ids: set[int] = set()
    for value in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                  getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
        elif value is not None:
            ids.add(int(value))
    return ids


def convert_gguf(src_dir: str | Path, gguf_file: str, out_dir: str | Path) -> Path:
    """De-quantise a GGUF checkpoint into a plain HF directory (safetensors, float32) at ``out_dir``.

    transformers' GGUF loader (it needs the ``gguf`` and ``accelerate`` packages) reads the model
    and its tokenizer (chat template included); the quantisation markers it leaves on the model
    are cleared so that ``save_pretrained`` writes ordinary weights. The directory is written
    under a temporary name and renamed at the end, so an interrupted conversion leaves nothing
    that looks like a model.
    """
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tokenizer = AutoTokenizer.from_pretrained(str(src_dir), gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(str(src_dir), gguf_file=gguf_file, dtype=torch.float32)
    marked: Any = model  # transformers marks a GGUF-loaded model quantised; plain attributes here
    marked.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    marked.is_quantized = False
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)
    return out
