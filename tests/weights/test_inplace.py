"""weights.inplace: copying a state into a live model in place (dtype conversion, tied parameters,
persistent buffers, views that follow), its one-line errors, loading a directory, and comparing
files with live tensors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from weights import copy_state_, copy_weights_, load_weights_into, read_weights, weights_match


class Tied(torch.nn.Module):
    """An embedding tied to the output head, a norm, a persistent and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.norm = torch.nn.Parameter(torch.ones(3))
        self.register_buffer("scale", torch.ones(2))
        self.register_buffer("cache", torch.zeros(2), persistent=False)


def values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_copies_in_place_converting_the_dtype_and_keeping_the_tie() -> None:
    model = Tied()
    embed = model.embed.weight
    ptr = embed.data_ptr()
    view = embed.data[1:3]  # like a fused projection's rows: a view must follow the copy
    new = {"embed.weight": torch.randn(5, 3, dtype=torch.float64), "norm": torch.full((3,), 2.0).bfloat16()}
    copy_weights_(model, new)  # head.weight is tied to embed.weight: it may be left out
    assert model.embed.weight is embed and embed.data_ptr() == ptr and embed.dtype == torch.float32
    assert torch.equal(embed, new["embed.weight"].float()) and model.head.weight is embed
    assert torch.equal(view, new["embed.weight"][1:3].float())
    assert model.norm.dtype == torch.float32 and torch.equal(model.norm, torch.full((3,), 2.0))
    assert torch.equal(model.scale, torch.ones(2))  # a buffer left out keeps its value


def test_a_persistent_buffer_may_be_given_but_not_a_non_persistent_one() -> None:
    model = Tied()
    state = {"embed.weight": torch.zeros(5, 3), "norm": torch.zeros(3), "scale": torch.full((2,), 3.0)}
    copy_weights_(model, state)
    assert torch.equal(model.scale, torch.full((2,), 3.0))
    with pytest.raises(KeyError, match=r"keys the model lacks \['cache'\]"):
        copy_weights_(model, {**state, "cache": torch.ones(2)})


@pytest.mark.parametrize("change,words", [
    ({"nonsense.weight": torch.zeros(2)}, r"keys the model lacks \['nonsense.weight'\]"),
    ({"norm": None}, r"missing \['norm'\]"),
    ({"embed.weight": None, "head.weight": torch.zeros(5, 3)}, None),  # the tie's other name: fine
    ({"embed.weight": None}, r"missing \['embed.weight', 'head.weight'\]"),
    ({"norm": torch.zeros(4)}, r"wrong shape \['norm'\]"),
], ids=["unknown", "missing", "other-tied-name", "missing-tied-pair", "wrong-shape"])
def test_weights_that_do_not_fit_are_one_line_and_copy_nothing(change: dict, words: str | None) -> None:
    model = Tied()
    before = values(model)
    state = {"embed.weight": torch.randn(5, 3), "norm": torch.randn(3)}
    for k, v in change.items():
        if v is None:
            del state[k]
        else:
            state[k] = v
    if words is None:
        copy_weights_(model, state)
        assert torch.equal(model.embed.weight, state["head.weight"])
        return
    with pytest.raises(KeyError, match=words) as err:
        copy_weights_(model, state, "weights at /w/v3")
    assert "\n" not in str(err.value) and "weights at /w/v3 do not fit the model" in str(err.value)
    for k, v in values(model).items():
        assert torch.equal(v, before[k]), f"{k} changed by a copy that failed"


def test_copy_state_into_named_tensors_requires_every_untied_one() -> None:
    a, b = torch.zeros(2), torch.zeros(3)
    copy_state_({"a": a, "b": b, "a_again": a}, {"a": torch.ones(2), "b": torch.ones(3)}, "adapters at x")
    assert torch.equal(a, torch.ones(2)) and torch.equal(b, torch.ones(3))
    with pytest.raises(KeyError, match=r"adapters at x do not fit the model: missing \['b'\]"):
        copy_state_({"a": a, "b": b}, {"a": torch.ones(2)}, "adapters at x")


def test_load_weights_into_restores_a_saved_model(model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    saved = read_weights(model_dir)
    assert "lm_head.weight" not in saved and model.lm_head.weight is model.model.embed_tokens.weight  # tied
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    load_weights_into(model, model_dir)
    for name, p in model.named_parameters(remove_duplicate=False):
        key = "model.embed_tokens.weight" if name == "lm_head.weight" else name
        assert torch.equal(p, saved[key]), name
    with pytest.raises(KeyError, match=re.escape(f"weights at {model_dir} do not fit")):
        load_weights_into(torch.nn.Linear(2, 2), model_dir)


def test_a_vlm_loads_the_files_save_pretrained_wrote_under_other_names(vlm_dir: Path, tmp_path: Path) -> None:
    """Qwen2-VL's files name ``model.embed_tokens`` what its modules call
    ``model.language_model.embed_tokens`` (and ``visual.`` its ``model.visual.``): a checkpoint the
    trainer wrote with ``save_pretrained`` loads back into a live model all the same."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, local_files_only=True)
    model.save_pretrained(tmp_path)
    on_disk = read_weights(tmp_path)
    assert "model.embed_tokens.weight" in on_disk and "model.embed_tokens.weight" not in model.state_dict()
    want = values(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    load_weights_into(model, tmp_path)
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


def test_weights_match_is_bitwise_with_ties_and_dtypes(tmp_path: Path) -> None:
    model = Tied()
    targets = {k: v.detach() for k, v in model.state_dict().items()}  # detached: ties by storage
    save_file({"embed.weight": targets["embed.weight"].clone(), "norm": targets["norm"].clone(),
               "scale": targets["scale"].clone()}, str(tmp_path / "model.safetensors"))
    assert weights_match(tmp_path, targets)  # head.weight is tied to embed.weight
    with torch.no_grad():
        model.norm.add_(1e-7)
    assert not weights_match(tmp_path, {k: v.detach() for k, v in model.state_dict().items()})
    assert not weights_match(tmp_path, {**targets, "norm": targets["norm"].double()})
    assert not weights_match(tmp_path, {**targets, "extra": torch.zeros(1)})  # untied, not in the files
    assert not weights_match(tmp_path, {k: v for k, v in targets.items() if k != "scale"})  # a file key it lacks
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files"):
        weights_match(tmp_path / "absent", targets)
