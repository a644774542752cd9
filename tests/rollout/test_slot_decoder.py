"""rollout.slot_decoder: its prefill, decode steps (eager, fixed-shape, CUDA graphs) and eviction
equal the model's own forward; fused projections follow in-place weight copies; shared prompt work
is computed once; what it cannot run is named, and the engine falls back or refuses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rollout import engine as engine_module
from rollout import slot_decoder
from rollout.engine import TorchEngine
from rollout.model_init import load_model
from rollout.slot_decoder import SlotDecoder, fuse_linears, slot_support
from tests.floats import assert_close
from weights import copy_weights_

VOCAB = 40


def llama(kv_heads: int = 4) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def qwen2() -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = Qwen2ForCausalLM(cfg).eval()
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # the biased projections are covered
    return model


def reference_logits(model: Any, seq: list[int]) -> torch.Tensor:
    """transformers' own forward over the whole sequence, unpadded: the last position's logits (V,).
    The slot decoder's logits equal them up to float32 rounding in another order (cache, padding,
    fused projections): ``tests.floats.assert_close`` with the hidden size as the number of terms."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([seq])).logits[0, -1]


@pytest.mark.parametrize("fixed", [False, True], ids=["eager", "fixed-shapes"])
@pytest.mark.parametrize("make", [llama, lambda: llama(kv_heads=2), qwen2], ids=["llama", "llama-gqa", "qwen2"])
def test_prefill_decode_and_eviction_equal_the_models_own_forward(
    make: Any, fixed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fixed``: the decode steps run over a CUDA graph's fixed shapes (rows padded to a power of two,
    every cache column), eagerly on the CPU: 3 rows run as 4, with a padding row in a free slot."""
    monkeypatch.setattr(slot_decoder, "MIN_CAPACITY", 4)  # the cache grows (and copies) several times
    model = make()
    dec = SlotDecoder(model, slots=4)
    dec._static_shapes = fixed
    g = torch.Generator().manual_seed(1)
    seqs: list[list[int]] = []

    def check(logits: torch.Tensor) -> None:
        assert logits.shape == (len(seqs), VOCAB)
        for row, seq in enumerate(seqs):
            assert_close(logits[row], reference_logits(model, seq), model.config.hidden_size)

    def admit(lengths: list[int]) -> None:
        prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]
        with torch.inference_mode():
            logits = dec.prefill(prompts)
        seqs.extend(prompts)
        for i, seq in enumerate(prompts):  # the new rows' logits after their last prompt token
            assert_close(logits[i], reference_logits(model, seq), model.config.hidden_size)

    def step() -> None:
        tokens = torch.randint(1, VOCAB, (len(seqs),), generator=g)
        with torch.inference_mode():
            logits = dec.decode(tokens)
        for seq, t in zip(seqs, tokens.tolist(), strict=True):
            seq.append(t)
        check(logits)

    admit([3, 7, 5])
    for _ in range(4):
        step()
    with torch.inference_mode():
        order = dec.keep([0, 2])  # row 1 leaves: row 2 moves into its slot
    assert order == [0, 2]
    seqs[:] = [seqs[i] for i in order]
    admit([9, 2])  # joining rows of other lengths, left-aligned in their own slots
    for _ in range(3):
        step()
    with torch.inference_mode():
        order = dec.keep([2, 3])  # the first two leave: rows 2 and 3 move into slots 0 and 1
    assert order == [2, 3]
    seqs[:] = [seqs[i] for i in order]
    for _ in range(20):
        step()
    assert dec.capacity >= max(len(s) for s in seqs)
    assert dec.rows == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_cuda_graph_steps_equal_eager_steps_through_growth_eviction_and_a_weight_swap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(slot_decoder, "MIN_CAPACITY", 8)  # the cache grows (and the graphs are recaptured)
    """The graphs against the same fixed-shape steps run eagerly on the GPU (the same kernels; the
    fixed-shape math itself is checked against transformers on the CPU above)."""
    model = llama(kv_heads=2).to("cuda")
    graphed, eager = SlotDecoder(model, slots=8), SlotDecoder(model, slots=8, cuda_graphs=False)
    eager._static_shapes = True
    assert graphed.cuda_graphs and not eager.cuda_graphs
    g = torch.Generator().manual_seed(3)

    def both(call: Any) -> None:
        with torch.inference_mode():
            got, want = call(graphed), call(eager)
        if isinstance(got, torch.Tensor):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:
            assert got == want

    def steps(n: int) -> None:
        for _ in range(n):
            tokens = torch.randint(1, VOCAB, (graphed.rows,), generator=g).cuda()
            both(lambda d, tokens=tokens: d.decode(tokens))

    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (3, 7, 5)]
    both(lambda d: d.prefill(prompts))
    steps(6)  # 3 rows run as 4; capacity 8 grows to 16
    both(lambda d: d.keep([0, 2]))
    more = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (9, 2, 4, 6)]
    both(lambda d: d.prefill(more))
    steps(5)  # 6 rows run as 8
    copy_weights_(model, {k: torch.randn_like(p) * 0.1 for k, p in model.named_parameters()})  # a swap, in place
    steps(30)  # the captured graphs read the new weights; capacity grows past 40
    assert graphed.graph_captures >= 3
    assert graphed.capacity >= 40


def test_a_failed_graph_capture_falls_back_to_eager_steps(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Simulated on the CPU: the capture raises, the step still returns the right logits (its eager
    warm-up already wrote the keys/values), and later steps run eagerly."""
    model = llama()
    dec = SlotDecoder(model, slots=4)
    dec.cuda_graphs = dec._static_shapes = True  # as on a CUDA device

    def broken(n: int) -> Any:
        dec._fixed_step(n)  # what the capture's warm-up does before the capture itself fails
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(dec, "_capture", broken)
    seqs = [[1, 2, 3], [4, 5, 6, 7, 8]]
    with torch.inference_mode():
        dec.prefill(seqs)
        for step in range(3):
            tokens = torch.tensor([7 + step, 9 + step])
            logits = dec.decode(tokens)
            for seq, t, row in zip(seqs, tokens.tolist(), logits, strict=True):
                seq.append(t)
                assert_close(row, reference_logits(model, seq), model.config.hidden_size)
    assert not dec.cuda_graphs and not dec._static_shapes
    assert [r.message for r in caplog.records if "capture failed" in r.message] != []


def test_fused_projections_follow_in_place_weight_copies() -> None:
    model = llama()
    attn = model.model.layers[0].self_attn
    weight, bias = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
    assert bias is None and weight.shape == (32 + 2 * 32, 32)
    new = {name: torch.randn_like(p) for name, p in model.named_parameters()}
    copy_weights_(model, new)  # what a weight swap does
    torch.testing.assert_close(weight[:32], new["model.layers.0.self_attn.q_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(weight[64:], new["model.layers.0.self_attn.v_proj.weight"], rtol=0, atol=0)


def test_two_decoders_on_one_model_both_follow_weight_copies() -> None:
    """A second decoder must not re-point the parameters away from the first one's fused weights
    (found on the GPU: the first decoder kept the old q/k/v and gate/up after a swap)."""
    model = llama(kv_heads=2)
    first, second = SlotDecoder(model, slots=2), SlotDecoder(model, slots=2)
    copy_weights_(model, {k: torch.randn_like(p) * 0.1 for k, p in model.named_parameters()})
    prompt = [1, 5, 9, 3, 7]
    with torch.inference_mode():
        got = [d.prefill([prompt])[0] for d in (first, second)]
    for logits in got:
        assert_close(logits, reference_logits(model, prompt), model.config.hidden_size)


def test_support_names_what_it_cannot_run() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen3Config, Qwen3ForCausalLM

    assert slot_support(llama()) == "" and slot_support(qwen2()) == ""
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2))
    assert "model_type 'gpt2'" in slot_support(gpt2)
    qwen3 = Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    assert "qwen3" in slot_support(qwen3)
    odd = llama()
    attn = odd.model.layers[1].self_attn
    attn.q_proj.bias = torch.nn.Parameter(torch.zeros(attn.q_proj.out_features))  # k and v have none
    assert "only some have a bias" in slot_support(odd)


def test_engine_falls_back_or_refuses_when_the_model_is_not_supported(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert TorchEngine(model_dir).decoder == "slots"  # the tiny Llama runs on the fast path by default
    monkeypatch.setattr(engine_module, "slot_support", lambda model: "model_type 'gpt2' is not supported")
    assert TorchEngine(model_dir).decoder == "hf"
    with pytest.raises(ValueError, match="decoder='slots' cannot run this model: model_type 'gpt2'"):
        TorchEngine(model_dir, decoder="slots")
    with pytest.raises(ValueError, match="decoder must be"):
        TorchEngine(model_dir, decoder="fast")  # type: ignore[arg-type]


def test_a_dynamic_rope_is_computed_per_call(model_dir: Path) -> None:
    model = load_model(model_dir, dtype="float32", device="cpu")
    dec = SlotDecoder(model, slots=2)
    with torch.inference_mode():
        dec.prefill([[1, 5, 6]])
    assert dec._rope_table is not None  # the default RoPE: one table for every position
    model.model.rotary_emb.rope_type = "dynamic"
    dec = SlotDecoder(model, slots=2)
    with torch.inference_mode():
        logits = dec.prefill([[1, 5, 6]])
    assert dec._rope_table is None
    assert_close(logits[0], reference_logits(model, [1, 5, 6]), model.config.hidden_size)


@pytest.mark.parametrize("make", [llama, lambda: llama(kv_heads=2), qwen2], ids=["llama", "llama-gqa", "qwen2"])
def test_shared_prompt_work_is_computed_once_and_equals_the_models_own_forward(
        make: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slot_decoder, "MIN_SHARED_PREFIX", 3)
    model = make()
    dec = SlotDecoder(model, slots=12)
    g = torch.Generator().manual_seed(2)
    system = torch.randint(1, VOCAB, (6,), generator=g).tolist()  # a prefix every prompt of a batch shares
    a, b = [*system, 5, 9, 11], [*system, 7]
    batches = [
        [a, b, a, a, b],  # duplicates (a GRPO group) after a shared prefix; b's remainder is one token
        [[*system, 3], [*system, 4]],  # every remainder one token: the query block is a single column
        [[8, 8, 2, 6], [8, 8, 2, 6], [8, 8, 2, 6]],  # one distinct prompt, three copies
        [[1, 2, 3, 4, 5], [9, 2, 3]],  # nothing shared
    ]
    seqs: list[list[int]] = []
    calls: list[tuple[int, int]] = []
    layers = dec._layers

    def counting(ids: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(tuple(ids.shape))  # type: ignore[arg-type]
        return layers(ids, *args)

    monkeypatch.setattr(dec, "_layers", counting)
    for prompts in batches:
        calls.clear()
        with torch.inference_mode():
            logits = dec.prefill(prompts)
        for i, seq in enumerate(prompts):
            assert_close(logits[i], reference_logits(model, seq), model.config.hidden_size)
        seqs.extend(list(p) for p in prompts)
        if prompts[0] is a:
            assert calls == [(1, 6), (2, 3)]  # the prefix once, then a's and b's remainders (b's padded)
        if prompts[0] == [8, 8, 2, 6]:
            assert calls == [(1, 4)]
        if prompts[0] == [1, 2, 3, 4, 5]:
            assert calls == [(2, 5)]
    assert dec.shared_prefix_tokens == 6 * (2 - 1) + 6 * (2 - 1)  # batches 1 and 2: the second distinct prompt's
    assert dec.duplicate_tokens == 9 * 2 + 7 * 1 + 4 * 2  # every copy's tokens
    with torch.inference_mode():  # the copied keys/values carry the decode steps on, row by row
        for _ in range(3):
            tokens = torch.randint(1, VOCAB, (len(seqs),), generator=g)
            logits = dec.decode(tokens)
            for seq, t in zip(seqs, tokens.tolist(), strict=True):
                seq.append(t)
            for row, seq in enumerate(seqs):
                assert_close(logits[row], reference_logits(model, seq), model.config.hidden_size)


def test_shared_prefix_leaves_each_prompt_its_last_token_and_skips_short_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slot_decoder, "MIN_SHARED_PREFIX", 3)
    assert slot_decoder.shared_prefix([[1, 2, 3, 4, 5]]) == 0  # one prompt: nothing to share
    assert slot_decoder.shared_prefix([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]]) == 4
    assert slot_decoder.shared_prefix([[1, 2, 3, 4], [1, 2, 3, 4, 6]]) == 3  # the shorter keeps its last token
    assert slot_decoder.shared_prefix([[1, 2, 9], [1, 2, 8]]) == 0  # 2 shared tokens: under the minimum
    assert slot_decoder.shared_prefix([[7, 1, 2, 3], [1, 2, 3, 4]]) == 0
