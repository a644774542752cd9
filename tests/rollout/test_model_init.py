from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from rollout.model_init import CHAR_VOCAB, SPECIAL_TOKENS, count_parameters, encode_prompt, init_tiny_model
from tests.conftest import TINY_SPEC as SPEC


def test_dir_loads_with_auto_classes(model_dir: Path) -> None:
    assert (model_dir / "model.safetensors").exists()
    assert (model_dir / "tokenizer.json").exists()
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert isinstance(model, LlamaForCausalLM)
    assert model.config.vocab_size == len(tok) == len(SPECIAL_TOKENS) + len(CHAR_VOCAB)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert model.config.eos_token_id == tok.eos_token_id


def test_char_tokenizer_round_trip(model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    text = "12+34=46; x*y (a-b)\nOK?"
    ids = encode_prompt(tok, text)
    assert ids[0] == tok.bos_token_id
    assert len(ids) == len(text) + 1  # one token per character, plus BOS
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode([*ids, tok.eos_token_id], skip_special_tokens=False) == "<s>" + text + "</s>"


def test_same_seed_same_weights_other_seed_differs(tmp_path: Path, model_dir: Path) -> None:
    again = init_tiny_model(tmp_path / "again", SPEC, seed=0)
    other = init_tiny_model(tmp_path / "other", SPEC, seed=1)
    a, b, c = (load_file(str(d / "model.safetensors")) for d in (model_dir, again, other))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_reload_gives_same_outputs(model_dir: Path) -> None:
    m1 = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    m2 = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    ids = torch.tensor([[1, 5, 6, 14, 7, 8, 18]])
    with torch.no_grad():
        assert torch.equal(m1(ids).logits, m2(ids).logits)
    assert 10_000 < count_parameters(m1) < 100_000
